"""Fused CPU kernels (`cpu_kernels.c`), built on first use by the host C compiler and called through ctypes.

    rms_norm   RMSNorm forward and backward in one pass each over the rows (float32)
    rotary     rotary embedding (rotate-half layout) forward and backward in one pass (float32)
    swiglu     silu(gate) · up forward and backward in one pass (float32; its own vectorized exp)
    panel_matmul  a few rows times a weight packed in 64-column panels (`pack_panels`): the inference
               engine's projections on CPU, bound by reading the weights (float32, no autograd)
    paged_decode_attention  one query per request over its K/V where they lie in the paged pool: the
               inference engine's decode attention on CPU, nothing gathered (float32, no autograd)
    decode_layers  a decode step's whole stack of Llama blocks, through the kernels above in one OpenMP
               region (the inference engine's CPU decode steps; `inference/attention/cpu_decode.py` is its face)
    wkv        RWKV-4's recurrence over a sequence, forward and backward (float32; `wkv.py` is its face)

Eager PyTorch runs RMSNorm as five ops forward and about ten backward, and the rotary embedding as five
each way, every one a pass over the activations into a fresh tensor; the kernels read the rows once each
way (forward and backward of a 4 x 256 x 512 batch: RMSNorm 2.5 ms eager, 0.7 ms fused; rotary on the
query heads 1.7 ms, 0.55 ms). The library is compiled with `cc -O3 -march=native -fopenmp` (a fraction of
a second; no PyTorch headers, no ninja) into `ASTRAI_CACHE_DIR` (default `~/.cache/astrai_pl`), named by a
hash of the source, the flags, the compiler and the CPU's feature flags, and written atomically. OpenMP
binds to the runtime PyTorch already loaded (the same soname), and a call uses `torch.get_num_threads()`
threads, or one for small inputs (a decode step's rows).

The backward passes are not themselves differentiable: a double backward (`create_graph=True`, e.g. a
gradient penalty) through them raises; run such code with `ASTRAI_CPU_KERNELS=0`. Under `torch.func`
transforms, inside `torch.compile`, for tensor subclasses (DTensor) and, for `panel_matmul`, under autocast,
the callers take their eager PyTorch code.

`available()` says whether the kernels run here: a C compiler (`CC`, else cc/gcc/clang) is found and
the build loads. `ASTRAI_CPU_KERNELS=0` turns them off; `override_available(False)` does so in a
block (tests compare both paths). Where they cannot run, the callers use their eager PyTorch code and
the reason is logged once.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from .build import Override

log = logging.getLogger("astrai_pl.ops")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -fno-trapping-math: without it GCC keeps a float compare-and-select (exp's clamp) as a branch, and the
# loops around it (SwiGLU, softmax) stay scalar; no kernel relies on floating-point traps.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-trapping-math", "-shared", "-fPIC",
         "-std=c11")

_lib: ctypes.CDLL | None = None
_error: str | None = None
_override = Override()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    return Path(os.environ.get("ASTRAI_CACHE_DIR") or Path.home() / ".cache" / "astrai_pl")


def _build() -> ctypes.CDLL:
    if os.environ.get("ASTRAI_CPU_KERNELS", "1") == "0":
        raise RuntimeError("turned off by ASTRAI_CPU_KERNELS=0")
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, errors="replace",
                             timeout=60).stdout.splitlines()[:1]
    # -march=native code may not run on another CPU: a cache shared between machines keeps one per CPU.
    digest = hashlib.sha256(source + " ".join([*FLAGS, *version, _cpu_flags()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{digest}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"],
                                  capture_output=True, text=True, errors="replace", timeout=300)
            if done.returncode != 0:
                first = (done.stderr.strip().splitlines() or ["unknown error"])[0][:300]
                raise RuntimeError(f"compiling {SOURCE.name} with {compiler} failed: {first}")
            os.replace(built, target)  # atomic: a concurrent build never leaves half a library
    lib = ctypes.CDLL(str(target))
    f32, long, c_float, c_int = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
    lib.rms_norm_forward.argtypes = [f32, f32, f32, f32, long, long, c_float, c_int]
    lib.rms_norm_backward.argtypes = [f32, f32, f32, f32, f32, f32, long, long, c_int]
    lib.rotary.argtypes = [f32, long, f32, f32, f32, long, long, long, c_int, c_int]
    lib.panel_matmul.argtypes = [f32, long, f32, f32, long, long, long, c_int]
    lib.pack_panels.argtypes = [f32, long, long, f32, long, c_int]
    lib.swiglu_forward.argtypes = [f32, long, f32, long, f32, long, long, c_int]
    lib.swiglu_backward.argtypes = [f32, f32, f32, f32, f32, long, long, c_int]
    lib.paged_decode_attention.argtypes = [f32, f32, f32, f32, long, f32, f32, f32, long, long, long, long,
                                           c_float, long, long, c_float, c_int]
    lib.decode_layers.argtypes = [f32, long, long, long, f32, c_float, long, long, long, long, f32, f32, f32, f32,
                                  long, f32, f32, long, c_float, f32, c_int]
    lib.wkv_forward.argtypes = [f32, f32, f32, f32, f32, f32, f32, long, long, long, c_int]
    lib.wkv_backward.argtypes = [f32] * 12 + [long, long, long, c_int]
    for fn in (lib.rms_norm_forward, lib.rms_norm_backward, lib.rotary, lib.panel_matmul, lib.pack_panels,
               lib.swiglu_forward, lib.swiglu_backward, lib.paged_decode_attention, lib.decode_layers, lib.wkv_forward,
               lib.wkv_backward):
        fn.restype = None
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled library, or None (once per process it tries, logging why)."""
    global _lib, _error
    if _lib is None and _error is None:
        try:
            _lib = _build()
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            _error = str(err)
            log.info("astrai_pl.ops: the fused CPU kernels do not run here (%s); eager PyTorch instead", err)
    return _lib


def available() -> bool:
    if _override.value is not None:
        return _override.value and load() is not None
    return load() is not None


def unavailable_reason() -> str | None:
    if _override.value is False:
        return "turned off by override_available(False)"
    return None if load() is not None else _error


@contextlib.contextmanager
def override_available(value: bool | None) -> Iterator[None]:
    """False: the eager PyTorch path everywhere inside the block; None: detection as usual."""
    with _override(value):
        yield


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not DTensor, FakeTensor or any other subclass
_F32 = torch.float32
_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", lambda t: False)


def _takes(*tensors: torch.Tensor) -> bool:
    """What every kernel asks of its tensors: float32 on CPU with storage the C code can read (no subclass
    such as DTensor, no torch.func wrapper), not while torch.compile traces, and the library built.
    A plain loop, cheapest tests first: a decode step asks this about a hundred times."""
    for t in tensors:
        if type(t) not in _PLAIN or t.dtype != _F32 or not t.is_cpu or _functorch_wrapped(t):
            return False
    return not torch.compiler.is_compiling() and available()


def rms_norm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes these: see `_takes`, and the weight one vector of the last dimension's size."""
    return weight.dim() == 1 and x.shape[-1] == weight.shape[0] and x.numel() > 0 and _takes(x, weight)


def _threads(numel: int) -> int:
    """One thread below 64K elements: starting the others costs more than they save (a decode step's rows)."""
    return torch.get_num_threads() if numel >= 65536 else 1


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    x2 = x.detach().reshape(-1, x.shape[-1]).contiguous()
    w = weight.detach().contiguous()
    y = x2.new_empty(x.shape)  # its final shape: a view returned by an autograd.Function could not be
    rstd = x2.new_empty(x2.shape[0])  # modified in place
    load().rms_norm_forward(_ptr(x2), _ptr(w), _ptr(y), _ptr(rstd), x2.shape[0], x2.shape[1], eps,
                            _threads(x2.numel()))
    return y, x2, w, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, x2, w, rstd = _rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x2, w, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x2, w, rstd = ctx.saved_tensors
        g = grad.reshape(-1, x2.shape[1]).contiguous()
        threads = _threads(x2.numel())
        gx = torch.empty_like(x2)
        parts = x2.new_empty(threads, x2.shape[1])
        load().rms_norm_backward(_ptr(x2), _ptr(w), _ptr(rstd), _ptr(g), _ptr(gx), _ptr(parts),
                                 x2.shape[0], x2.shape[1], threads)
        grad_w = parts.sum(0) if ctx.needs_input_grad[1] else None
        return gx.view(grad.shape), grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x², -1) + eps) · weight, float32 on CPU (check `rms_norm_usable` first)."""
    if not _needs_grad(x, weight):  # inference: no autograd node, nothing saved
        if x.is_contiguous() and weight.is_contiguous():  # a decode step's rows: no copies, no detach
            rows = x.numel() // x.shape[-1]
            y, rstd = torch.empty_like(x), x.new_empty(rows)  # both held until the kernel returns
            load().rms_norm_forward(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows,
                                    x.shape[-1], eps, _threads(x.numel()))
            return y
        return _rms_norm_forward(x, weight, eps)[0]
    return _RMSNorm.apply(x, weight, eps)


def rotary_usable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary` takes these: see `_takes`; x (B, T, H, D) whose rows are dense, cos/sin (B, T, D)."""
    return (
        x.dim() == 4 and cos.shape == sin.shape == (*x.shape[:2], x.shape[3]) and x.shape[3] % 2 == 0
        and x.stride(3) == 1 and x.stride(2) == x.shape[3] and x.stride(0) == x.shape[1] * x.stride(1)
        and x.numel() > 0 and _takes(x, cos, sin)
    )  # fmt: skip


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    B, T, H, D = x.shape
    out = x.new_empty(B, T, H, D)
    load().rotary(_ptr(x), x.stride(1), _ptr(cos), _ptr(sin), _ptr(out), B * T, H, D, int(backward),
                  _threads(out.numel()))
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.detach().contiguous(), sin.detach().contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(x.detach(), cos, sin, backward=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad.contiguous(), cos, sin, backward=True), None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin for x (B, T, H, D), cos/sin (B, T, D); float32 on CPU (check
    `rotary_usable` first). No gradient flows to cos and sin (they come from positions)."""
    if not _needs_grad(x):
        return _rotate(x, cos.contiguous(), sin.contiguous(), backward=False)
    return _Rotary.apply(x, cos, sin)


def swiglu_usable(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `swiglu` takes these: see `_takes`; one shape, each row dense."""
    return (
        gate.shape == up.shape and gate.numel() > 0 and _rows(gate) is not None and _rows(up) is not None
        and _takes(gate, up)
    )  # fmt: skip


def _rows(t: torch.Tensor) -> int | None:
    """How far apart the rows of t seen as (-1, cols) are, when each row is dense and they are evenly
    spaced (a column slice of a wider matrix qualifies); else None."""
    if t.stride(-1) != 1:
        return None
    try:
        flat = t.view(-1, t.shape[-1])
    except RuntimeError:
        return None
    return flat.stride(0) if flat.shape[0] > 1 else t.shape[-1]


def _swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    cols = gate.shape[-1]
    g, u = gate.detach().view(-1, cols), up.detach().view(-1, cols)
    out = g.new_empty(gate.shape)  # its final shape, not a view (see _rms_norm_forward)
    load().swiglu_forward(_ptr(g), _rows(gate), _ptr(u), _rows(up), _ptr(out), g.shape[0], cols,
                          _threads(out.numel()))
    return out


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _swiglu_forward(gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        gate, up = (t.detach().contiguous() for t in ctx.saved_tensors)
        grad = grad.contiguous()
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        load().swiglu_backward(_ptr(gate), _ptr(up), _ptr(grad), _ptr(d_gate), _ptr(d_up), 1, gate.numel(),
                               _threads(gate.numel()))
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, float32 on CPU (check `swiglu_usable` first); e^x to within 1e-7 relative."""
    if not _needs_grad(gate, up):
        return _swiglu_forward(gate, up)
    return _SwiGLU.apply(gate, up)


PANEL = 64  # columns per panel (cpu_kernels.c)
PANEL_MAX_ROWS = 64  # above this many rows PyTorch's own matmul is as fast (see docs/inference.md)


def panels_usable(weight: torch.Tensor) -> bool:
    """Whether `pack_panels` takes this weight: see `_takes`, a matrix."""
    return weight.dim() == 2 and _takes(weight)


def panel_matmul_usable(x: torch.Tensor) -> bool:
    """Whether `panel_matmul` takes this input: see `_takes`, outside autocast (which would have the matmul
    in its own dtype)."""
    return not torch.is_autocast_enabled("cpu") and _takes(x)


def panels_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    return (-(-out_features // PANEL), in_features, PANEL)


def pack_panels(weights: list[torch.Tensor], panels: torch.Tensor) -> torch.Tensor:
    """Write the (out, in) `weights`, joined along their outputs, into `panels` (of `panels_shape`); the
    padding columns of the last panel are left as they are (never read into a result)."""
    col = 0
    for w in weights:
        w = w.detach().contiguous()
        load().pack_panels(_ptr(w), w.shape[0], w.shape[1], _ptr(panels), col, _threads(w.numel()))
        col += w.shape[0]
    return panels


def panel_matmul(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (..., in) @ Wᵀ → (..., out_features), W packed by `pack_panels`; float32 CPU, no autograd."""
    K = panels.shape[1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = x2.new_empty(x2.shape[0], out_features)
    if x2.shape[0]:
        load().panel_matmul(_ptr(x2), x2.stride(0), _ptr(panels), _ptr(y), x2.shape[0], K, out_features,
                            torch.get_num_threads())
    return y.view(*x.shape[:-1], out_features)


def paged_decode_attention_usable(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` takes these: see `_takes`; q (n, Hq, D) and pools (slots, Hkv, D)
    dense, Hq a multiple of Hkv, D a multiple of 8."""
    return (
        q.dim() == 3 and k_pool.dim() == 3 and k_pool.shape == v_pool.shape and q.shape[2] == k_pool.shape[2]
        and q.shape[2] % 8 == 0
        and q.shape[1] % k_pool.shape[1] == 0 and k_pool.is_contiguous() and v_pool.is_contiguous()
        and _takes(q, k_pool, v_pool)
    )  # fmt: skip


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, req_to_token: torch.Tensor,
                           rows: torch.Tensor, kv_lens: torch.Tensor, max_len: int,
                           out: torch.Tensor | None = None, window: int | None = None, scale: float | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """softmax(q·Kᵀ/√D)·V for q (n, Hq, D), one query per row i (a request's decode, or one token of a prompt
    chunk) over its request's positions 0 … kv_lens[i]-1 (only the last `window` of them when given; `scale`
    replaces 1/√D; `softcap` caps the scores first),
    whose slots are req_to_token[rows[i]] in k_pool / v_pool (slots, Hkv, D); query head h·G+g uses kv
    head h. Float32 CPU, no autograd (check `paged_decode_attention_usable` first); `out` (n, Hq, D)
    dense, or a new tensor. rows int64, kv_lens int32 (n,), each in [1, max_len]; req_to_token int32."""
    n, Hq, D = q.shape
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
    assert rows.dtype == torch.int64 and kv_lens.dtype == torch.int32 and rows.is_contiguous()
    q = q.contiguous()
    out = q.new_empty(n, Hq, D) if out is None else out
    assert out.is_contiguous() and out.shape == q.shape
    work = int(n) * k_pool.shape[1] * max_len * D  # elements of K read, about
    threads = min(torch.get_num_threads(), n * k_pool.shape[1]) if work >= 32768 else 1
    if n:
        load().paged_decode_attention(_ptr(q), _ptr(k_pool), _ptr(v_pool), _ptr(req_to_token),
                                      req_to_token.stride(0), _ptr(rows), _ptr(kv_lens.contiguous()), _ptr(out),
                                      n, Hq, k_pool.shape[1], D, 1.0 / D**0.5 if scale is None else scale, max_len,
                                      window or 0, softcap or 0.0, threads)
    return out


def decode_layer_work(n: int, hidden: int, q_heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    """Floats of scratch `decode_layers` needs for n rows."""
    return n * (3 * hidden + (3 * q_heads + 3 * kv_heads) * head_dim + 3 * intermediate)


def decode_layer_pointers(layers: list[tuple]) -> torch.Tensor:
    """The (layers, 8) int64 addresses `decode_layers` reads, from each layer's (norm1, norm2, q/k/v panels,
    o panels, gate/up panels, down panels, K pool, V pool). The caller keeps the tensors alive."""
    return torch.tensor([[t.data_ptr() for t in layer] for layer in layers], dtype=torch.int64)


def decode_layers(x: torch.Tensor, pointers: torch.Tensor, eps: float, heads: tuple[int, int], head_dim: int,
                  intermediate: int, cos: torch.Tensor, sin: torch.Tensor, out_slots: torch.Tensor,
                  req_to_token: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor, max_len: int,
                  work: torch.Tensor) -> None:
    """The Llama blocks (no biases, no q/k norm, no window or soft-cap) of `pointers` (`decode_layer_pointers`)
    one after another on the rows of x (n, hidden), in place: each row one request's newest token, its K/V
    stored at `out_slots` of each layer's pools and attended over its request's kv_lens[i] positions (as
    `paged_decode_attention`). The panels are the joined q/k/v, o, joined gate/up and down weights packed by
    `pack_panels`; cos/sin (n, head_dim); `work` at least `decode_layer_work` floats. Float32 CPU, no autograd;
    every tensor dense and every pool (slots, kv_heads, head_dim) (the caller checks)."""
    n, hidden = x.shape
    hq, hkv = heads
    assert x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and rows.dtype == torch.int64
    assert kv_lens.dtype == torch.int32 and req_to_token.dtype == torch.int32 and out_slots.dtype == torch.int64
    assert pointers.dtype == torch.int64 and pointers.is_contiguous() and pointers.shape[1:] == (8,)
    assert work.numel() >= decode_layer_work(n, hidden, hq, hkv, head_dim, intermediate)
    load().decode_layers(_ptr(x), n, hidden, pointers.shape[0], _ptr(pointers), eps, hq, hkv, head_dim, intermediate,
                         _ptr(cos), _ptr(sin), _ptr(out_slots), _ptr(req_to_token), req_to_token.stride(0),
                         _ptr(rows), _ptr(kv_lens), max_len, 1.0 / head_dim**0.5, _ptr(work), torch.get_num_threads())
