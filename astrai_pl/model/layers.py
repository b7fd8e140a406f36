"""The small building blocks of the decoder: Linear, RMSNorm, rotary position embedding, SwiGLU."""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import cpu as cpu_ops
from .config import ModelConfig


class InputMajorWeights:
    """Copies of Linear weights in a layout made for the few rows of a decode step, made on first use and
    remade when a weight changes.

    On CPU, a matmul of a few rows (a decode step: one row per running request) against a weight laid
    out (in, out) runs 1.5-1.8x faster than `F.linear` against the (out, in) layout it is stored in, and
    projections that read the same input (q/k/v, gate/up) go faster still as one matmul against their
    joined copy (see docs/benchmarks.md). Where the fused CPU kernels run (`astrai_pl.ops.cpu`), float32
    copies are packed in 64-column panels instead, for `panel_matmul`, which streams the weights while
    it multiplies (up to 64 rows; more rows go to PyTorch's matmul on the weights as stored). The
    inference engine keeps one of these for its model and activates it around its forwards
    (`Linear.input_major`); training never does. A copy is keyed by the weight's data pointer and
    version counter, so an optimizer step or a `load_state_dict` (in-place updates) makes the next
    forward copy the new values. Fused optimizers (`AdamW(fused=True)`) and writes through `param.data`
    update weights without bumping the counter: whoever changes weights that way calls `clear()` (the
    engine's `weights_changed` does). The copies cost one more float of memory per weight, held by this
    object.
    """

    def __init__(self) -> None:
        # id(weights) -> (weak references to the weights, their (data pointer, version) keys, the copy).
        # A weight's death removes its entry (`_forget`), so an id here always names a live weight.
        self._copies: dict[tuple[int, ...], tuple[tuple[weakref.ref, ...], tuple, torch.Tensor]] = {}

    def get(self, *weights: torch.Tensor) -> torch.Tensor | None:
        """The copy of `weights` joined along their outputs: (in, Σ out), or panels (⌈Σ out / 64⌉, in, 64)
        (a 3-d tensor) where the CPU kernel takes them; None when one of the weights tracks no version (an
        inference tensor, whose copy could go stale unseen)."""
        try:
            key = tuple([(w.data_ptr(), w._version) for w in weights])
        except RuntimeError:
            return None
        name = tuple([id(w) for w in weights])
        entry = self._copies.get(name)
        if entry is not None and entry[1] == key:
            return entry[2]
        copy = entry[2] if entry is not None else None
        w0, out_features = weights[0], sum(w.shape[0] for w in weights)
        panels = all(cpu_ops.panels_usable(w) and w.shape[1] == w0.shape[1] for w in weights)
        shape = cpu_ops.panels_shape(out_features, w0.shape[1]) if panels else (w0.shape[1], out_features)
        if (copy is None or copy.shape != shape or copy.dtype != w0.dtype or copy.device != w0.device
                or copy.is_inference() and not torch.is_inference_mode_enabled()):
            copy = w0.new_zeros(shape)  # zeros: a panel's padding columns are multiplied, never kept
        # Written in place: a fresh tensor of the same size costs more in page faults than the copy itself.
        with torch.no_grad():
            if panels:
                cpu_ops.pack_panels(list(weights), copy)
            else:
                for w, out in zip(weights, copy.split([w.shape[0] for w in weights], dim=1)):
                    out.copy_(w.t())
        refs = entry[0] if entry is not None else tuple(weakref.ref(w, self._forget(name)) for w in weights)
        self._copies[name] = (refs, key, copy)
        return copy

    def _forget(self, name: tuple[int, ...]):
        """A weakref callback: when one of the weights dies (a model moved or reloaded), its copy goes."""
        owner = weakref.ref(self)

        def forget(dead: weakref.ref) -> None:
            weights = owner()
            entry = weights._copies.get(name) if weights is not None else None
            if entry is not None and dead in entry[0]:
                del weights._copies[name]

        return forget

    def clear(self) -> None:
        """Treat every copy as stale: each is copied again, into its own memory, on its next use."""
        for name, (refs, _, copy) in self._copies.items():
            self._copies[name] = (refs, None, copy)


_INPUT_MAJOR: ContextVar[InputMajorWeights | None] = ContextVar("astrai_pl_input_major", default=None)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) that can multiply by an (in, out) copy of its weight.

    Inside `with Linear.input_major(weights):` and with autograd off, `x @ copy` replaces
    `F.linear(x, weight)`: the same product, summed in another order by the matmul library. Everywhere
    else it is exactly nn.Linear.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        copy = _joined_copy((self,))
        if copy is not None:
            return _through_copy(x, copy, (self,))[0]
        out, delta = F.linear(x, self.weight, self.bias), self.delta(x)
        return out if delta is None else out + delta

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        """What an adapter adds to this projection's output (lora.py's LoraLinear); a plain Linear adds nothing."""
        return None

    @staticmethod
    @contextlib.contextmanager
    def input_major(weights: InputMajorWeights | None) -> Iterator[None]:
        """Use `weights`' (in, out) copies in every Linear forward of this thread (None: no change)."""
        token = _INPUT_MAJOR.set(weights) if weights is not None else None
        try:
            yield
        finally:
            if token is not None:
                _INPUT_MAJOR.reset(token)


def pick_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x (B, T, ...) at rows (B, k) of each batch row → (B, k, ...)."""
    index = rows.view(*rows.shape, *([1] * (x.dim() - 2))).expand(*rows.shape, *x.shape[2:])
    return x.gather(1, index)


def keep_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """A block's residual stream at the rows its attention answered for (all of them when `rows` is None)."""
    return x if rows is None else pick_rows(x, rows)


def project(x: torch.Tensor, *linears: Linear) -> list[torch.Tensor]:
    """`[linear(x) for linear in linears]`; under `Linear.input_major` (autograd off) one matmul against
    the linears' joined (in, Σ out) copy, split back. Outside it each module is called as usual, so
    hooks on the modules (tensor parallelism, activation checkpointing) still run."""
    copy = _joined_copy(linears)
    return [linear(x) for linear in linears] if copy is None else _through_copy(x, copy, linears)


def _joined_copy(linears: tuple[Linear, ...]) -> torch.Tensor | None:
    weights = _INPUT_MAJOR.get()
    if weights is None or torch.is_grad_enabled():
        return None
    stored = [linear.weight for linear in linears]
    for weight in stored:
        if type(weight) not in (torch.Tensor, nn.Parameter):
            return None  # a quantised (NF4) or distributed weight multiplies as stored
    return weights.get(*stored)


def _through_copy(x: torch.Tensor, copy: torch.Tensor, linears: tuple[Linear, ...]) -> list[torch.Tensor]:
    sizes = [linear.out_features for linear in linears]
    if copy.dim() == 3:  # panels for the CPU kernel: a few rows; a prefill's many go to the weights as stored
        if x.numel() > cpu_ops.PANEL_MAX_ROWS * x.shape[-1] or not cpu_ops.panel_matmul_usable(x):
            out = [_as_stored(x, linear) for linear in linears]
        else:
            out = _with_bias(cpu_ops.panel_matmul(x, copy, sum(sizes)).split_with_sizes(sizes, dim=-1), linears)
    else:
        out = _with_bias((x @ copy).split_with_sizes(sizes, dim=-1), linears)
    deltas = [linear.delta(x) for linear in linears]  # adapters stay outside the copies: they change every step
    return [o if d is None else o + d for o, d in zip(out, deltas)]


# oneDNN's matmul, for the many rows of a prefill chunk (_as_stored): where this PyTorch build has it
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN matmul of `rows` rows runs at: rounded up to a multiple of an eighth of its octave
    (16 at least), so at most 1/8 of the rows are padding and a server's prefill chunks reach oneDNN in a few
    dozen shapes. oneDNN keeps what it builds for each shape; with every chunk length its own shape, a server's
    memory grew by 20-50 MiB a load round (docs/serving.md, Memory across load)."""
    step = max(16, 1 << max(0, rows.bit_length() - 4))
    return -(-rows // step) * step


def _as_stored(x: torch.Tensor, linear: Linear) -> torch.Tensor:
    """linear(x) on the weight as stored, for the many rows of a prefill chunk (float32 CPU weights, autograd
    off). oneDNN's matmul where PyTorch has it and autocast is off: for the `small` preset's projections it took
    less time than `F.linear` (MKL's sgemm) at 65-1024 rows (benchmarks/bench_layout.py, docs/inference.md); the
    sums come in another order, within float32 round-off of `F.linear`'s. The rows go in padded to
    `onednn_rows`, and the padding's rows are dropped."""
    if _ONEDNN and torch._C._get_mkldnn_enabled() and not torch.is_autocast_enabled("cpu") and type(x) is torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n, padded = rows.shape[0], onednn_rows(rows.shape[0])
        if padded != n:
            rows = torch.cat([rows, rows.new_zeros(padded - n, rows.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(rows, linear.weight, linear.bias, "none", [], "")
        return out[:n].reshape(*x.shape[:-1], out.shape[-1])
    return F.linear(x, linear.weight, linear.bias)


def _with_bias(outputs, linears: tuple[Linear, ...]) -> list[torch.Tensor]:
    return [o if linear.bias is None else o + linear.bias for o, linear in zip(outputs, linears)]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · weight, computed in float32 (Zhang & Sennrich, 2019).

    Unlike LayerNorm it does not subtract the mean: a constant shift of x changes the output.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.rms_norm_usable(x, self.weight):  # one fused pass each way (astrai_pl/ops/cpu_kernels.c)
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)) (Shazeer, 2020)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(*project(x, self.gate_proj, self.up_proj)))

    @staticmethod
    def activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up."""
        if cpu_ops.swiglu_usable(gate, up):  # one fused pass each way (astrai_pl/ops/cpu_kernels.c)
            return cpu_ops.swiglu(gate, up)
        return F.silu(gate) * up


# -- rotary embedding -------------------------------------------------------------------------------------
def _yarn_inv_freq(cfg: ModelConfig, dim: int, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): interpolate low frequencies, keep high ones, rescale attention."""
    base, factor = cfg.rope_theta, float(scaling["factor"])
    original = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: divide long wavelengths by `factor`, keep short ones, blend smoothly in between."""
    factor, low, high = float(scaling["factor"]), scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _longrope_inv_freq(cfg: ModelConfig, dim: int, scaling: dict) -> tuple[torch.Tensor, float]:
    """LongRoPE (Ding et al., 2024; Phi-3): one divisor per frequency, `short_factor` for sequences up to
    original_max_position_embeddings and `long_factor` beyond; both rows (2, dim/2), short first. The attention
    factor sqrt(1 + ln(factor) / ln(original)) (factor by default max_position_embeddings / original) scales
    both."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or cfg.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    divisors = torch.tensor([scaling["short_factor"], scaling["long_factor"]], dtype=torch.float32)
    return 1.0 / (divisors * cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), attention_factor


def rope_frequencies(cfg: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim/2,) and the attention scaling factor for cfg.rope_scaling; for longrope
    the short and the long set, (2, head_dim/2).

    `seq_len` matters only for dynamic NTK scaling, which grows the base once the context
    exceeds max_position_embeddings.
    """
    dim, base, scaling = cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling or {}
    kind = cfg.rope_type
    if kind == "yarn":
        return _yarn_inv_freq(cfg, dim, scaling)
    if kind == "longrope":
        return _longrope_inv_freq(cfg, dim, scaling)
    if kind == "dynamic" and seq_len is not None and seq_len > cfg.max_position_embeddings:
        factor = float(scaling["factor"])
        base = base * ((factor * seq_len / cfg.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the given position ids, in the rotate-half layout that HF checkpoints use."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        inv_freq, self.attention_factor = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def per_sequence(self) -> bool:
        """Whether a token's angles depend on how long its sequence is (longrope): callers then tell the sequences
        of a packed row apart (`document_ids`) or give each token's sequence length (`lengths`, (B, T))."""
        return self.cfg.rope_type == "longrope"

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype, document_ids: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if self.cfg.rope_type == "dynamic":
            longest = int(position_ids.max()) + 1
            if longest > self.cfg.max_position_embeddings:
                inv_freq = rope_frequencies(self.cfg, longest)[0].to(inv_freq.device)
        if self.per_sequence:  # the long set for every token of a sequence that reaches past the original length
            lengths = sequence_lengths(position_ids, document_ids) if lengths is None else lengths
            inv_freq = inv_freq[(lengths > long_rope_after(self.cfg)).long()]  # (B, T, D/2)
        freqs = position_ids.to(torch.float32)[..., None] * inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def long_rope_after(cfg: ModelConfig) -> int | None:
    """The original length of a longrope model, past which a sequence takes the long factors; else None."""
    return cfg.rope_scaling["original_max_position_embeddings"] if cfg.rope_type == "longrope" else None


def sequence_lengths(position_ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """For each token, 1 + the largest position of its sequence in this forward: (B, T), or (B, 1) when each row
    is one sequence (`document_ids` None). A sequence is a row, or a (row, document id) pair."""
    if document_ids is None:
        return position_ids.amax(dim=1, keepdim=True) + 1
    B, T = position_ids.shape
    docs = torch.unique(document_ids, return_inverse=True)[1]  # (B, T) in 0..n-1
    n = int(docs.max()) + 1
    key = docs + n * torch.arange(B, device=docs.device)[:, None]
    top = position_ids.new_full((B * n,), -1).scatter_reduce(0, key.flatten(), position_ids.flatten(), "amax")
    return top[key] + 1


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by the angles in cos/sin (B, T, D): x·cos + rotate_half(x)·sin. With fewer angles
    (R < D, a partial rotary factor) the first R channels of each head turn and the others pass unchanged."""
    if cos.shape[-1] != x.shape[-1]:
        turned = cos.shape[-1]
        return torch.cat((apply_rotary(x[..., :turned].contiguous(), cos, sin), x[..., turned:]), dim=-1)
    if cpu_ops.rotary_usable(x, cos, sin):  # one fused pass each way (astrai_pl/ops/cpu_kernels.c)
        return cpu_ops.rotary(x, cos, sin)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin
