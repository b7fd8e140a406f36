"""RWKV-4 blocks: a recurrent token mixer in place of attention, for `ModelConfig(model_type="rwkv")`.

Peng et al., 2023, "RWKV: Reinventing RNNs for the Transformer Era". With the token shift
`mix(x, μ)_t = x_t·μ + x_{t-1}·(1 − μ)` (x_{-1} is the state's last input, zero at a document start):

Time mix (`TimeMix`, one μ each for key, value and receptance):
    r_t = sigmoid(W_r mix(x, μ_r)_t),  k_t = W_k mix(x, μ_k)_t,  v_t = W_v mix(x, μ_v)_t
    wkv_t = (e^{u + k_t}·v_t + a_t) / (e^{u + k_t} + b_t)                u = time_first
    a_{t+1} = e^{w}·a_t + e^{k_t}·v_t,   b_{t+1} = e^{w}·b_t + e^{k_t}   w = −exp(time_decay) < 0
    out_t = W_o (r_t · wkv_t)
Channel mix (`ChannelMix`): out_t = sigmoid(W_r mix(x, μ_r)_t) · W_v relu(W_k mix(x, μ_k)_t)².

Block: x = pre_ln(x) in block 0 only; x = x + time_mix(ln1(x)); x = x + channel_mix(ln2(x)); LayerNorms with
bias. The sums a, b overflow float32 within a few tokens of large k, so `wkv` keeps them as aa = a·e^{−pp},
bb = b·e^{−pp} with pp the running maximum exponent, in float32 whatever the activations' dtype.

State of one layer (`LayerState`), in the order and dtypes of transformers' `RwkvForCausalLM` `state` (whose
five tensors are these stacked over layers, (B, H, L): `RwkvState.to_hf`):
    0 ffn_shift  (B, H)  last input of the channel mix (ln2's output)         activations' dtype
    1 att_shift  (B, H)  last input of the time mix (ln1's output)            activations' dtype
    2 aa         (B, H)  numerator  Σ e^{k_i + (t−1−i)·w}·v_i, scaled by e^{−pp}   float32
    3 bb         (B, H)  denominator Σ e^{k_i + (t−1−i)·w},    scaled by e^{−pp}   float32
    4 pp         (B, H)  the exponent of that scale (−1e38 before any token)      float32

Eval mode applies transformers' `rescale_every`: block i's output projections (time mix W_o, channel mix W_v)
are divided by 2^(i // rescale_every) and the residual stream halved after every rescale_every-th block.
Both are exact powers of two, so only the LayerNorm epsilons see the difference; training never rescales.

The inference engine serves it from a pool of these states (`inference/recurrent/runner.py`), not from K/V pages
(`check_engine_support` keeps it out of a K/V pool). The recurrence runs as a fused CPU kernel each way in float32 on CPU
(`astrai_pl.ops.wkv`), elsewhere as a loop over time in PyTorch (kept out of `torch.compile`'s graph).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from ..ops import wkv as wkv_kernel
from .attention import document_ids_from_positions
from .config import ModelConfig
from .layers import Linear

NO_EXPONENT = -1e38  # pp before any token: e^{pp − anything} is 0, and it stays finite in float32
FINAL_NORM_EPS = 1e-5  # transformers builds ln_out with LayerNorm's default epsilon, not layer_norm_epsilon


class UnsupportedMixerError(NotImplementedError):
    """A recurrent (RWKV) model reached code that only serves attention models."""


class LayerState(NamedTuple):
    """One layer's recurrent state, each (B, H); see the module docstring for the layout."""

    ffn_shift: torch.Tensor
    att_shift: torch.Tensor
    aa: torch.Tensor
    bb: torch.Tensor
    pp: torch.Tensor


@dataclass
class RwkvState:
    """The state of every layer for a batch of rows. Pass it as `cache=` to `Transformer.forward`: the forward
    starts from `layers` (zeros when empty) and replaces them with the state after its last token.

    `at`: positions t (1 ≤ t ≤ the chunk's length) where the same forward also records the state after the
    chunk's first t tokens, into `snapshots` (per layer, each component (B, len(at), H)): the inference engine
    snapshots every page boundary of a prompt in one forward per chunk. Inference only (no gradient through
    the wkv sums between positions)."""

    layers: list[LayerState] = field(default_factory=list)
    at: tuple[int, ...] = ()
    snapshots: list[LayerState] = field(default_factory=list)

    def to_hf(self) -> list[torch.Tensor]:
        """transformers' layout: five tensors (B, H, num_layers)."""
        return [torch.stack(tensors, dim=-1) for tensors in zip(*self.layers)]

    @classmethod
    def from_hf(cls, state: list[torch.Tensor]) -> RwkvState:
        return cls([LayerState(*(s[..., i] for s in state)) for i in range(state[0].shape[-1])])


def check_engine_support(config: ModelConfig) -> None:
    """Raise UnsupportedMixerError for a model the K/V pool cannot hold (RWKV: its pages have no place for a
    recurrent state). Called where a K/V pool is built; the Engine itself serves RWKV from a state pool
    (inference/recurrent/runner.py) and never builds one. An RWKV forward given a KV cache raises the same error."""
    if config.mixer == "rwkv":
        raise UnsupportedMixerError(
            f"ModelConfig.model_type={config.model_type!r}: a K/V pool pages attention keys and values, and "
            "a recurrent RWKV model has none. Fix: serve it with Engine(model), which keeps one recurrent "
            "state per request in a state pool, or call the model with `cache=RwkvState()`.")


# -- the recurrence -----------------------------------------------------------------------------------------
# A Python loop over time: compiling it would unroll every step into the graph. torch._disable_dynamo is
# torch.compiler.disable importing torch._dynamo on the first call instead of at import (2.6 s of start-up).
@torch._disable_dynamo
def wkv(
    w: torch.Tensor,  # (H,) decay, −exp(time_decay)
    u: torch.Tensor,  # (H,) bonus of the current token, time_first
    k: torch.Tensor,  # (B, T, H)
    v: torch.Tensor,  # (B, T, H)
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # (aa, bb, pp), each (B, H)
    resets: torch.Tensor | None = None,  # (B, T) bool: the state restarts before these tokens
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """wkv_t for every t (B, T, H) in v's dtype, and the state after the last token (float32).

    Numerically stable: with p = max(pp, u + k_t), wkv_t = (e^{pp−p}·aa + e^{u+k_t−p}·v_t) / (e^{pp−p}·bb +
    e^{u+k_t−p}); then with q = max(pp + w, k_t): aa ← e^{pp+w−q}·aa + e^{k_t−q}·v_t, bb likewise, pp ← q."""
    B, T, H = k.shape
    w, u, k32, v32 = w.float(), u.float(), k.float(), v.float()
    start = None if state is None else tuple(s.float() for s in state)
    if wkv_kernel.usable(w, u, k32, v32, start):  # float32 on CPU: the fused kernel, forward and backward
        y, end = wkv_kernel.wkv(w, u, k32, v32, start, resets)
        return y.to(v.dtype), end
    if state is None:
        aa = k32.new_zeros(B, H)
        bb = k32.new_zeros(B, H)
        pp = k32.new_full((B, H), NO_EXPONENT)
    else:
        aa, bb, pp = start
    restart = set() if resets is None else set(resets.any(0).nonzero().flatten().tolist())  # one sync
    out = []
    for t in range(T):
        if t in restart:
            keep = ~resets[:, t, None]  # (B, 1)
            aa, bb, pp = aa * keep, bb * keep, pp.masked_fill(~keep, NO_EXPONENT)
        kt, vt = k32[:, t], v32[:, t]
        bonus = u + kt
        p = torch.maximum(pp, bonus)
        e_state, e_token = torch.exp(pp - p), torch.exp(bonus - p)
        out.append((e_state * aa + e_token * vt) / (e_state * bb + e_token))
        decayed = pp + w
        q = torch.maximum(decayed, kt)
        e_state, e_token = torch.exp(decayed - q), torch.exp(kt - q)
        aa, bb, pp = e_state * aa + e_token * vt, e_state * bb + e_token, q
    return torch.stack(out, dim=1).to(v.dtype), (aa, bb, pp)


def wkv_at(w, u, k, v, state, resets, at: tuple[int, ...]):
    """`wkv` run segment by segment between the positions `at`, carrying (aa, bb, pp) across: its outputs, its
    end state and the sums after each of the first t tokens, t in `at` (three (B, len(at), H), None when `at` is
    empty). The recurrence is the same, step for step, so the outputs are those of one `wkv` call."""
    if not at:
        out, end = wkv(w, u, k, v, state, resets)
        return out, end, None
    outs, points, lo = [], [], 0
    for hi in (*at, k.shape[1]):
        if hi > lo:
            out, state = wkv(w, u, k[:, lo:hi], v[:, lo:hi], state, None if resets is None else resets[:, lo:hi])
            outs.append(out)
        lo = hi
        if len(points) < len(at):
            points.append(state)
    stacked = tuple(torch.stack([p[c] for p in points], dim=1) for c in range(3))
    return torch.cat(outs, dim=1), state, stacked


def wkv_reference(w, u, k, v, state=None):
    """The recurrence as written, in float64, with a and b unscaled (no running maximum): what `wkv` is tested
    against. Returns wkv (B, T, H) and the state in `wkv`'s form (aa, bb, pp) with pp = 0, so aa = a, bb = b."""
    w, u, k, v = (x.double() for x in (w, u, k, v))
    if state is None:
        a, b = torch.zeros_like(k[:, 0]), torch.zeros_like(k[:, 0])
    else:
        a, b = (s.double() * state[2].double().exp() for s in state[:2])
    out = []
    for t in range(k.shape[1]):
        now = torch.exp(u + k[:, t])
        out.append((now * v[:, t] + a) / (now + b))
        a = torch.exp(w) * a + torch.exp(k[:, t]) * v[:, t]
        b = torch.exp(w) * b + torch.exp(k[:, t])
    return torch.stack(out, dim=1), (a, b, torch.zeros_like(a))


def token_shift(x: torch.Tensor, last: torch.Tensor | None, resets: torch.Tensor | None) -> torch.Tensor:
    """x_{t-1} for every t (B, T, H): `last` (B, H) before the first token (zeros if None), zero at resets."""
    before = x.new_zeros(x[:, :1].shape) if last is None else last[:, None].to(x.dtype)
    shifted = torch.cat([before, x[:, :-1]], dim=1)
    return shifted if resets is None else shifted.masked_fill(resets[..., None], 0.0)


def _mix(x: torch.Tensor, shifted: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    return x * mu + shifted * (1 - mu)


def local(param: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter: under tensor parallelism (parallel.py) the DTensor's local tensor,
    time_decay and time_first the channels of this rank's key/value shard, the μ whole; else the parameter."""
    return param.to_local() if hasattr(param, "to_local") else param


# -- modules ------------------------------------------------------------------------------------------------
class TimeMix(nn.Module):
    """The time mix: token shift, receptance gate, the wkv recurrence. Parameter names are transformers'
    (the μ are 1-D here, (1, 1, H) in its files), so they need no decay in the optimizer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.time_decay = nn.Parameter(torch.empty(h))
        self.time_first = nn.Parameter(torch.empty(h))
        self.time_mix_key = nn.Parameter(torch.empty(h))
        self.time_mix_value = nn.Parameter(torch.empty(h))
        self.time_mix_receptance = nn.Parameter(torch.empty(h))
        self.key, self.value = Linear(h, h, bias=False), Linear(h, h, bias=False)
        self.receptance, self.output = Linear(h, h, bias=False), Linear(h, h, bias=False)

    def forward(self, x, state: LayerState | None, resets, at: tuple[int, ...] = ()):
        """(output (B, T, H), last input (B, H), (aa, bb, pp), the sums after each of the first t tokens for t
        in `at`, each (B, len(at), H)) for x (B, T, H)."""
        shifted = token_shift(x, None if state is None else state.att_shift, resets)
        k = self.key(_mix(x, shifted, local(self.time_mix_key)))
        v = self.value(_mix(x, shifted, local(self.time_mix_value)))
        r = torch.sigmoid(self.receptance(_mix(x, shifted, local(self.time_mix_receptance))))
        out, recurrent, points = wkv_at(-torch.exp(local(self.time_decay).float()), local(self.time_first), k, v,
                                        None if state is None else state[2:], resets, at)
        return self.output(r * out), x[:, -1], recurrent, points


class ChannelMix(nn.Module):
    """The channel mix: token shift, squared-ReLU key, receptance gate."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.time_mix_key = nn.Parameter(torch.empty(h))
        self.time_mix_receptance = nn.Parameter(torch.empty(h))
        self.key, self.value = Linear(h, i, bias=False), Linear(i, h, bias=False)
        self.receptance = Linear(h, h, bias=False)

    def forward(self, x, state: LayerState | None, resets):
        """(output (B, T, H), last input (B, H)) for x (B, T, H)."""
        shifted = token_shift(x, None if state is None else state.ffn_shift, resets)
        k = torch.square(torch.relu(self.key(_mix(x, shifted, local(self.time_mix_key)))))
        r = torch.sigmoid(self.receptance(_mix(x, shifted, local(self.time_mix_receptance))))
        return r * self.value(k), x[:, -1]


class RwkvBlock(nn.Module):
    """ln1 → time mix → residual, ln2 → channel mix → residual; block 0 first normalises the embeddings."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.rescale_every = layer_idx, cfg.rescale_every
        if layer_idx == 0:
            self.pre_ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon)
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon)
        self.attention = TimeMix(cfg)
        self.feed_forward = ChannelMix(cfg)

    def forward(self, x, resets=None, state: LayerState | None = None, at: tuple[int, ...] = (),
                before: torch.Tensor | None = None):
        """The block's output (B, T, H), its state after the last token (`state` is not changed) and, for each
        t in `at`, its state after the first t tokens (a LayerState of (B, len(at), H); None without `at`): the
        sums from the recurrence run up to t, the shifts the ln1 / ln2 outputs at t − 1. `before`: `at` − 1 as
        a tensor on x's device, when the caller made it once for every block."""
        if self.layer_idx == 0:
            x = self.pre_ln(x)
        rescaled = not self.training and self.rescale_every > 0
        scale = 0.5 ** (self.layer_idx // self.rescale_every) if rescaled else 1.0
        mixed = self.ln1(x)
        att, att_shift, (aa, bb, pp), points = self.attention(mixed, state, resets, at)
        x = x + (att if scale == 1.0 else att * scale)
        channel = self.ln2(x)
        ffn, ffn_shift = self.feed_forward(channel, state, resets)
        x = x + (ffn if scale == 1.0 else ffn * scale)
        if rescaled and (self.layer_idx + 1) % self.rescale_every == 0:
            x = x / 2
        snapshot = None
        if at:
            before = torch.tensor(at, device=x.device) - 1 if before is None else before
            snapshot = LayerState(channel.index_select(1, before), mixed.index_select(1, before), *points)
        return x, LayerState(ffn_shift, att_shift, aa, bb, pp), snapshot


def final_norm(cfg: ModelConfig) -> nn.LayerNorm:
    """transformers' `ln_out`."""
    return nn.LayerNorm(cfg.hidden_size, eps=FINAL_NORM_EPS)


def document_starts(document_ids: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T) bool, True where a token begins a new document after the row's first; None when none does."""
    if document_ids is None:
        return None
    starts = torch.zeros_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts if bool(starts.any()) else None


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, position_ids, document_ids, cache) -> torch.Tensor:
    """The residual stream after every RwkvBlock, for `Transformer`. Packed rows: each document starts from a
    zero state (document_ids, or position ids restarting at 0, as attention's block-causal mask). `cache`: an
    RwkvState to start from and update, or None."""
    if cache is not None and not isinstance(cache, RwkvState):
        raise UnsupportedMixerError(
            f"an RWKV model was given a {type(cache).__name__} as cache; it keeps an RwkvState, not attention's "
            "keys and values. Fix: pass cache=RwkvState(), or serve the model with Engine(model).")
    if document_ids is None and position_ids is not None and cache is None:
        document_ids = document_ids_from_positions(position_ids)
    resets = document_starts(document_ids)
    start = cache.layers if cache is not None and cache.layers else [None] * len(blocks)
    expected = (len(blocks), (x.shape[0], x.shape[-1]))
    if start[0] is not None and (len(start), tuple(start[0].aa.shape)) != expected:
        raise ValueError(
            f"the RwkvState holds {len(start)} layers of {tuple(start[0].aa.shape)}; this model has {expected[0]} "
            f"layers and the batch is {expected[1]} (rows, hidden). Fix: pass a fresh RwkvState(), or the one this "
            "model left for the same rows.")
    at = () if cache is None else tuple(cache.at)
    if at and not (all(isinstance(t, int) for t in at) and list(at) == sorted(set(at))
                   and 1 <= at[0] and at[-1] <= x.shape[1]):
        raise ValueError(f"RwkvState.at={at!r}: snapshot positions must be increasing token counts in 1.."
                         f"{x.shape[1]} (this chunk's length)")
    after, points = [], []
    before = torch.tensor(at, device=x.device) - 1 if at else None  # one host-to-device copy for every block
    for block, state in zip(blocks, start):
        x, state, snapshot = block(x, resets, state, at, before)
        after.append(state)
        points.append(snapshot)
    if cache is not None:
        cache.layers, cache.snapshots = after, points if at else []
    return x


# -- initialisation -----------------------------------------------------------------------------------------
@torch.no_grad()
def reset_rwkv_parameters(blocks: nn.ModuleList, residual_std: float) -> None:
    """RWKV-4's schedule over depth for the time parameters (with r = i/(L−1), s = 1 − i/L for layer i of L
    and c = j/H for channel j): decay −5 + 8·(j/(H−1))^(0.7+1.3r), time_first ln 0.3 ± 0.5 (zigzag),
    μ_k = c^s, μ_v = c^s + 0.3r, μ_r = c^(s/2) (time mix), μ_k = μ_r = c^s (channel mix). LayerNorms at (1, 0);
    the residual projections (time mix output, channel mix value) at Normal(0, residual_std)."""
    layers = len(blocks)
    for block in blocks:
        att, ffn, i = block.attention, block.feed_forward, block.layer_idx
        h = att.time_decay.numel()
        r, s = i / max(layers - 1, 1), 1.0 - i / layers
        channel = torch.arange(h, dtype=torch.float32, device=att.time_decay.device)
        ramp = channel / h
        att.time_decay.copy_(-5 + 8 * (channel / max(h - 1, 1)) ** (0.7 + 1.3 * r))
        att.time_first.copy_(math.log(0.3) + 0.5 * ((channel + 1) % 3 - 1))
        att.time_mix_key.copy_(ramp**s)
        att.time_mix_value.copy_(ramp**s + 0.3 * r)
        att.time_mix_receptance.copy_(ramp ** (0.5 * s))
        ffn.time_mix_key.copy_(ramp**s)
        ffn.time_mix_receptance.copy_(ramp**s)
        for proj in (att.output, ffn.value):
            nn.init.normal_(proj.weight, 0.0, residual_std)
        for norm in (m for m in block.modules() if isinstance(m, nn.LayerNorm)):
            nn.init.ones_(norm.weight)
            nn.init.zeros_(norm.bias)
