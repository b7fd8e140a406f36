"""The lm_head and the cross-entropy in one pass, chunk by chunk, without (N, V) logits.

Two kernels compute `Σ CE(hidden @ weightᵀ, targets)` and its gradients:

    chunked  ours (`LinearCrossEntropy`): matmuls in cuBLAS / oneDNN, softmax and sums in float32, each
             chunk's logit gradient spent at once on the two backward matmuls
    liger    Liger-Kernel's fused linear cross-entropy (Triton), when the optional `gpu` extra is installed
             and the tensors are on CUDA

and three ways accumulate the weight gradient (V, H) over the chunks, in float32:

    sum       a 16-bit product per chunk added into the float32 buffer (two (V, H) passes of elementwise
              work a chunk: the cast and the add); the CPU path
    out_dtype one GEMM per chunk that reads and writes the float32 buffer itself (cuBLAS beta = 1 with
              16-bit inputs, `torch.addmm(…, out_dtype=float32, out=buffer)`); the CUDA path where the
              installed torch has it, probed once per device
    upcast    the chunk's operands cast to float32 and `addmm_` in place: the same numbers as out_dtype
              on any device (its stand-in in the CPU tests), slower on a GPU

Chunks are 256 rows on CPU (the measured best there) and, on CUDA, as many rows as keep one float32
(rows, V) block within 1 GiB (2,048 at a 128k vocabulary): fewer, larger GEMMs, and at most 8 passes over
the (V, H) accumulator for a batch of 16k tokens instead of 64.

`override_lm_head_loss` and `override_weight_grad_accumulation` force a choice (tests, benchmarks); a
forced choice that cannot run falls back with one log line.
"""

from __future__ import annotations

import functools

import torch

from .choice import Choice

LOSS_KERNELS = ("chunked", "liger")
ACCUMULATIONS = ("sum", "out_dtype", "upcast")
CPU_CHUNK_ROWS = 256
CUDA_CHUNK_BYTES = 1 << 30  # one float32 (rows, V) block
_logged: set[str] = set()


def chunk_rows(device: torch.device, vocab: int) -> int:
    """Rows per chunk: 256 on CPU; on CUDA the most (a multiple of 256) whose float32 logits fit 1 GiB."""
    if device.type != "cuda":
        return CPU_CHUNK_ROWS
    return max(CPU_CHUNK_ROWS, CUDA_CHUNK_BYTES // (4 * vocab) // 256 * 256)


@functools.cache
def liger_available() -> bool:
    """Whether Liger-Kernel's fused linear cross-entropy imports (the optional `gpu` extra)."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # noqa: F401
    except Exception:  # ImportError, or a Triton that fails to load
        return False
    return True


def liger_runs_on(device: torch.device) -> bool:
    """Whether Liger-Kernel's Triton kernel can run on `device`."""
    return device.type == "cuda" and liger_available()


def _liger_loss():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy


def _liger_why_not(device: torch.device, label_smoothing: float) -> str | None:
    if not liger_runs_on(device):
        return "Liger-Kernel needs CUDA and the `gpu` extra"
    if label_smoothing:
        return "with label smoothing its unsmoothed nll metric needs the chunked kernel"
    return None


_KERNEL = Choice("lm_head loss", {"chunked": None, "liger": _liger_why_not}, {"*": ("chunked",)},
                 logged=lambda: _logged)  # fmt: skip
override_lm_head_loss = _KERNEL.force  # force "chunked" or "liger"; None: the run-time choice


def loss_kernel(device: torch.device, label_smoothing: float) -> str:
    """The kernel a call runs: a forced "liger" where it can run, else ours (the default until a GPU run
    measures Liger's faster: `benchmarks/gpu_train.py` prints both)."""
    return _KERNEL.choose(device, label_smoothing)


def liger_cross_entropy_sum(rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            dtype: torch.dtype | None) -> torch.Tensor:
    """Σ CE(rows @ weightᵀ, targets) by Liger-Kernel, its matmuls in `dtype` (autocast's, or the inputs')."""
    low = dtype or rows.dtype
    out = _liger_loss()(rows.to(low), weight.to(low), targets, reduction="sum")
    loss = out[0] if isinstance(out, tuple) else out
    return loss.float()


@functools.cache
def _out_dtype_works(device_index: int) -> bool:
    """Whether cuBLAS accumulates 16-bit products into a float32 buffer in place here (probed once per device)."""
    device = torch.device("cuda", device_index)
    a = torch.randn(64, 32, device=device, dtype=torch.bfloat16)
    b = torch.randn(32, 48, device=device, dtype=torch.bfloat16)
    acc = torch.randn(64, 48, device=device)
    want = acc + a.float() @ b.float()
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError) as err:
        _ACCUMULATION.log_once("lm_head loss out_dtype accumulation", f"{type(err).__name__}: {err}".splitlines()[0])
        return False
    return bool(torch.allclose(acc, want, atol=1e-2, rtol=1e-3))


def _out_dtype_why_not(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "out_dtype matmuls run on CUDA only"
    if not _out_dtype_works(device.index if device.index is not None else 0):
        return "this torch / cuBLAS does not accumulate 16-bit products into float32 in place"
    return None


_ACCUMULATION = Choice("weight gradient accumulation", {"sum": None, "out_dtype": _out_dtype_why_not, "upcast": None},
                       {"cuda": ("out_dtype", "sum"), "*": ("sum",)}, stand_ins={"out_dtype": "upcast"},
                       labels={"out_dtype": "lm_head loss out_dtype accumulation"}, logged=lambda: _logged)  # fmt: skip
override_weight_grad_accumulation = _ACCUMULATION.force  # force "sum", "out_dtype" or "upcast"; None: run-time


def accumulation(device: torch.device) -> str:
    """How the weight gradient accumulates on `device` (see the module docstring)."""
    return _ACCUMULATION.choose(device)


def matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mode: str, *, add: bool) -> None:
    """out (+)= a @ b, out in float32 and a, b maybe 16-bit, by `mode` (see the module docstring)."""
    if a.dtype == out.dtype:
        torch.addmm(out, a, b, beta=1 if add else 0, out=out)
    elif mode == "out_dtype":
        torch.addmm(out, a, b, beta=1 if add else 0, out_dtype=out.dtype, out=out)
    elif mode == "upcast":
        torch.addmm(out, a.to(out.dtype), b.to(out.dtype), beta=1 if add else 0, out=out)
    elif add:
        out += a @ b
    else:
        out.copy_(a @ b)


class LinearCrossEntropy(torch.autograd.Function):
    """Summed (smoothed) cross-entropy of `hidden @ weightᵀ`, chunk by chunk, with its gradient.

    The loss is a sum, so its gradient with respect to the logits of a row is known in the forward
    pass: softmax − (1 − ε)·onehot(target) − ε/V. Each chunk's logits become that gradient in place
    and are spent at once on the two matmuls of the backward pass (into the hidden rows and into the
    weight, accumulated as `accumulation` says), so no (N, V) tensor is ever alive and nothing is
    recomputed; `backward` only scales the stored gradients by the incoming one.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, label_smoothing: float, chunk_size: int, need_grad: bool,
                matmul_dtype: torch.dtype | None):
        # Matmuls in `matmul_dtype` (autocast's, or the inputs'); softmax, sums and gradients in `acc`,
        # so the returned gradients need no cast back to the float32 parameters. Under fp16 autocast the
        # two gradient matmuls stay in float32: without the GradScaler's factor (applied only in
        # backward) the small softmax entries would underflow in fp16.
        acc = torch.promote_types(hidden.dtype, torch.float32)
        low = matmul_dtype or hidden.dtype
        grad_low = acc if low == torch.float16 else low
        hidden_low, weight_low = hidden.to(low), weight.to(low)
        hidden_g, weight_g = (hidden_low, weight_low) if grad_low == low else (hidden.to(grad_low), weight.to(grad_low))
        want_hidden = need_grad and ctx.needs_input_grad[0]
        want_weight = need_grad and ctx.needs_input_grad[1]
        mode = accumulation(hidden.device)
        eps, vocab = label_smoothing, weight.shape[0]
        loss_sum = torch.zeros((), dtype=acc, device=hidden.device)
        nll_sum = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if want_hidden else None
        grad_weight = torch.empty(weight.shape, dtype=acc, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], chunk_size):
            h, t = hidden_low[start:start + chunk_size], targets[start:start + chunk_size, None]
            logp = torch.log_softmax((h @ weight_low.t()).to(acc), dim=-1)  # (C, V)
            nll = -logp.gather(1, t).sum()
            nll_sum += nll
            loss_sum += (1 - eps) * nll - eps * logp.mean(-1).sum() if eps else nll
            if not (want_hidden or want_weight):
                continue
            grad = logp.exp_()  # softmax, in place
            grad.scatter_add_(1, t, grad.new_full(t.shape, eps - 1.0))
            if eps:
                grad.sub_(eps / vocab)
            grad = grad.to(grad_low)
            if want_hidden:
                matmul_into(grad_hidden[start:start + chunk_size], grad, weight_g, mode, add=False)
            if want_weight:  # the first chunk writes the accumulator: no zero-filled (V, H)
                matmul_into(grad_weight, grad.t(), hidden_g[start:start + chunk_size], mode, add=start > 0)
        ctx.mark_non_differentiable(nll_sum)
        ctx.dtypes, ctx.spent = (hidden.dtype, weight.dtype), False
        if want_weight and hidden.shape[0] == 0:  # no trained token
            grad_weight.zero_()
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss_sum, nll_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_nll):
        # The stored gradients are scaled in place (no second (V, H) tensor), so they serve one backward.
        if ctx.spent:
            raise RuntimeError("linear_cross_entropy's gradient was already used by a backward pass; "
                               "backward through it twice (retain_graph=True) is not supported")
        ctx.spent = True
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_loss).to(ctx.dtypes[0])
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(ctx.dtypes[1])
        return grad_hidden, grad_weight, None, None, None, None, None
