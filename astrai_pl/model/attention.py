"""Grouped-query self-attention with RoPE, optional q/k norm and qkv bias, block-causal over packed documents,
a sliding window on the layers the config names, causal within the branches of a prefix tree (one shared
prompt, several continuations), and optional soft-capping of the scores (Gemma 2).

The one seam for inference: when a `cache` object is passed, the rotated q/k/v go to
`cache.attend(layer_idx, q, k, v)` (which stores K/V and attends over the stored context);
otherwise attention is plain `scaled_dot_product_attention` (an explicit softmax when the scores are
soft-capped, which SDPA cannot do). The cache also gets the layer's `window`, `scale` and `softcap`.
Layout of q/k/v is (B, T, H, D).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .gemma import norm_for, softcap
from .layers import Linear, apply_rotary, pick_rows, project
from .packed_attention import PackedRows, packed_backend


class KVCacheView(Protocol):
    """What the attention layer needs from an inference cache: store new K/V, attend over the context."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               window: int | None = None, scale: float | None = None, softcap: float | None = None
               ) -> torch.Tensor: ...


@dataclass
class AttentionMask:
    """How tokens may attend: plain causal (mask is None), block-causal within documents, or causal within
    branches of a prefix tree (`branch_ids`); `for_window` narrows any of them to a sliding window (key j
    visible from query i when i - j < window in positions, as transformers)."""

    mask: torch.Tensor | None  # (B, 1, T, T) bool, True = may attend; None = causal
    seq_len: int = 0
    device: torch.device | None = None
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # built once per forward and window
    position_ids: torch.Tensor | None = None  # (B, T), where row distance is not position distance (branches)

    packed: PackedRows | None = None  # documents for a kernel without a dense mask (the mask is built on demand)

    @classmethod
    def build(cls, document_ids: torch.Tensor | None, seq_len: int, device: torch.device | None = None,
              branch_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, *,
              dtype: torch.dtype | None = None, windows: set[int | None] | None = None) -> AttentionMask:
        """`branch_ids` (B, T): 0 for a row's trunk (a shared prefix), b > 0 for the tokens of branch b, each
        branch following the trunk in positions (`position_ids`, needed with branches) but not the other
        branches: a token sees the trunk before it and its own branch, causally. Packed rows without branches
        go to FlexAttention or flash-attn's varlen entry where `packed_backend` picks one (`dtype`: the dtype
        attention computes in; `windows`: the sliding windows of the layers, None for full attention, whose
        block masks are built here once), and to a dense mask otherwise."""
        if branch_ids is None and document_ids is not None:
            backend = packed_backend(document_ids.device, dtype or torch.float32, torch.is_grad_enabled())
            if backend != "sdpa":  # no check for one document per row: that would read the ids on the host
                rows = PackedRows(document_ids, backend).prepare(windows if windows is not None else {None})
                return cls(None, seq_len, document_ids.device, packed=rows)
        # One document per row is plain causal: no (B, T, T) mask, and SDPA takes its causal kernel.
        if branch_ids is None and (document_ids is None or bool((document_ids == document_ids[:, :1]).all())):
            return cls(None, seq_len, device)
        ids = branch_ids if branch_ids is not None else document_ids
        visible = dense_visibility(document_ids, branch_ids, seq_len)
        return cls(visible, seq_len, ids.device, position_ids=None if branch_ids is None else position_ids)

    def for_window(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer seeing the last `window` tokens (None: the whole context); None means causal.
        Within a packed row the documents are contiguous, so row distance is position distance; across the
        branches of a tree it is not, and the positions decide."""
        if self.mask is None and self.packed is not None:  # a caller the packed kernel does not serve
            self.mask = dense_visibility(self.packed.document_ids, None, self.seq_len)
        if window is None or window >= self.seq_len:
            return self.mask
        if window not in self.windowed:
            if self.position_ids is not None:  # visible keys never lie ahead of their query in positions
                pos = self.position_ids
                self.windowed[window] = self.mask & (pos[:, None, :, None] - pos[:, None, None, :] < window)
            else:
                i = torch.arange(self.seq_len, device=self.device)
                near = (i[:, None] - i[None, :] < window) & (i[:, None] >= i[None, :])  # (T, T) causal band
                self.windowed[window] = near if self.mask is None else self.mask & near
        return self.windowed[window]


def dense_visibility(document_ids: torch.Tensor | None, branch_ids: torch.Tensor | None,
                     seq_len: int) -> torch.Tensor:
    """(B, 1, T, T) bool, True = may attend: causal, within a document, and within a branch or its trunk."""
    ids = branch_ids if branch_ids is not None else document_ids
    visible = torch.ones(seq_len, seq_len, dtype=torch.bool, device=ids.device).tril()
    if document_ids is not None:
        visible = visible & (document_ids[:, :, None] == document_ids[:, None, :])  # (B, T, T)
    if branch_ids is not None:
        keys = branch_ids[:, None, :]
        visible = visible & ((keys == 0) | (keys == branch_ids[:, :, None]))
    return visible.unsqueeze(1)


def query_rows_mask(mask: torch.Tensor | None, rows: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The rows (B, k) of an attention mask (None: causal; (T, T) or (B, 1, T, T)), as (B, 1, k, T) bool."""
    if mask is None:
        return (torch.arange(seq_len, device=rows.device) <= rows[..., None]).unsqueeze(1)
    if mask.dim() == 2:
        return mask[rows].unsqueeze(1)
    return mask.gather(2, rows[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[-1]))


def document_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document index of each token, counting a new document wherever positions restart at 0.

    Returns None when no row restarts after its first token (one document per row: plain causal).
    """
    restarts = position_ids[:, 1:] == 0
    if not bool(restarts.any()):
        return None
    return torch.cumsum(position_ids == 0, dim=1)


@functools.cache
def _cpu_has_amx() -> bool:
    """Whether this CPU multiplies bf16 in AMX tiles (unknown to this torch: assume it does)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return True if probe is None else bool(probe())


def sdpa_in_float32(x: torch.Tensor) -> bool:
    """Whether attention runs in float32 although autocast asks for bf16/fp16: on a CPU without AMX, where
    PyTorch's 16-bit flash attention is the slower one (forward and backward of one layer of the `small`
    preset, 4 × 256 tokens: 27.7 ms in bf16, 14.4 ms in float32 with the casts). The projections around
    it keep autocast's dtype; attention itself is then more precise, never less."""
    return (
        x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") in (torch.bfloat16, torch.float16) and not _cpu_has_amx()
    )  # fmt: skip


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     cap: float | None) -> torch.Tensor:
    """softmax(mask(cap·tanh(scale·q·kᵀ / cap)))·v, the softmax in float32 (as transformers' eager attention).

    q (B, Hq, T, D), k and v (B, Hkv, S, D) with query head h·G + g reading kv head h; mask bool,
    (T, S) or (B, 1, T, S), True = may attend, or None: causal with the queries on the last keys.
    """
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scores = softcap((q.view(B, Hkv, Hq // Hkv, T, D) @ k[:, :, None].transpose(-1, -2)) * scale, cap)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    elif mask.dim() == 4:
        mask = mask[:, :, None]  # (B, 1, 1, T, S) against scores (B, Hkv, G, T, S)
    probs = scores.masked_fill(~mask, float("-inf")).float().softmax(-1).to(v.dtype)
    return (probs @ v[:, :, None]).view(B, Hq, T, D)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.wide_qk_norm = cfg.wide_qk_norm  # OLMo 2: each q/k norm spans all heads' channels
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size
        h, d = cfg.hidden_size, self.head_dim
        self.q_proj = Linear(h, self.n_heads * d, bias=cfg.attention_bias)
        self.k_proj = Linear(h, self.n_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = Linear(h, self.n_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.n_heads * d, h, bias=False)
        if cfg.qk_norm:
            widths = (self.n_heads * d, self.n_kv_heads * d) if self.wide_qk_norm else (d, d)
            self.q_norm, self.k_norm = norm_for(cfg, widths[0]), norm_for(cfg, widths[1])
        else:
            self.q_norm = self.k_norm = None
        self.window = cfg.layer_window(layer_idx)
        self.scale = None if cfg.query_pre_attn_scalar is None else cfg.attention_scale  # None: SDPA's 1/sqrt(D)
        self.softcap = cfg.attn_logit_softcapping

    def forward(
        self,
        x: torch.Tensor,  # (B, T, hidden)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: (B, T, D)
        mask: AttentionMask,
        cache: KVCacheView | None = None,
        queries: torch.Tensor | None = None,  # (B, k): only these rows' outputs, (B, k, hidden)
    ) -> torch.Tensor:
        B, T, _ = x.shape
        if queries is None:
            q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        else:  # every row's keys and values, the queries of a few
            q, (k, v) = self.q_proj(pick_rows(x, queries)), project(x, self.k_proj, self.v_proj)
        Tq = T if queries is None else queries.shape[1]
        upcast = cache is None and sdpa_in_float32(x)
        if upcast:  # before RoPE, which promotes q and k to float32 under autocast anyway
            q, k, v = q.float(), k.float(), v.float()
        q = q.view(B, Tq, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if self.wide_qk_norm:
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE before any cache write: cached keys keep the rotation of their own position.
        q_rope = rope if queries is None else [pick_rows(t, queries) for t in rope]
        q, k = apply_rotary(q, *q_rope), apply_rotary(k, *rope)
        if cache is not None:  # (B, T, H, D)
            out = cache.attend(self.layer_idx, q, k, v, window=self.window, scale=self.scale, softcap=self.softcap)
        elif mask.packed is not None and queries is None:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            out = mask.packed.attend(q, k, v, window=self.window, scale=self.scale, softcap=self.softcap)
            out = out.transpose(1, 2)
        else:
            attn_mask = mask.for_window(self.window)
            if queries is not None:
                attn_mask = query_rows_mask(attn_mask, queries, T)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            with torch.autocast("cpu", enabled=False) if upcast else contextlib.nullcontext():
                if self.softcap is not None:
                    out = capped_attention(q, k, v, attn_mask, self.scale or self.head_dim**-0.5, self.softcap)
                else:
                    out = F.scaled_dot_product_attention(
                        q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None, scale=self.scale,
                        enable_gqa=self.n_kv_heads != self.n_heads,
                    )
            out = out.transpose(1, 2)
        return self.o_proj(out.reshape(B, Tq, self.n_heads * self.head_dim))
