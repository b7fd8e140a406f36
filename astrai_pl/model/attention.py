"""Grouped-query self-attention with RoPE, optional q/k norm and qkv bias, block-causal over packed documents.

The one seam for inference: when a `cache` object is passed, the rotated q/k/v go to
`cache.attend(layer_idx, q, k, v)` (which stores K/V and attends over the stored context);
otherwise attention is plain `scaled_dot_product_attention`. Layout of q/k/v is (B, T, H, D).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import Linear, RMSNorm, apply_rotary, project


class KVCacheView(Protocol):
    """What the attention layer needs from an inference cache: store new K/V, attend over the context."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass
class AttentionMask:
    """How tokens may attend: plain causal (mask is None) or block-causal within documents."""

    mask: torch.Tensor | None  # (B, 1, T, T) bool, True = may attend; None = causal

    @classmethod
    def build(cls, document_ids: torch.Tensor | None, seq_len: int) -> AttentionMask:
        # One document per row is plain causal: no (B, T, T) mask, and SDPA takes its causal kernel.
        if document_ids is None or bool((document_ids == document_ids[:, :1]).all()):
            return cls(None)
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
        same_doc = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
        return cls((same_doc & causal).unsqueeze(1))


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
            self.q_norm, self.k_norm = RMSNorm(widths[0], cfg.rms_norm_eps), RMSNorm(widths[1], cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,  # (B, T, hidden)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: (B, T, D)
        mask: AttentionMask,
        cache: KVCacheView | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        upcast = cache is None and sdpa_in_float32(x)
        if upcast:  # before RoPE, which promotes q and k to float32 under autocast anyway
            q, k, v = q.float(), k.float(), v.float()
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if self.wide_qk_norm:
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # RoPE before any cache write: cached keys keep the rotation of their own position.
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            out = cache.attend(self.layer_idx, q, k, v)  # (B, T, H, D)
        else:
            with torch.autocast("cpu", enabled=False) if upcast else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    attn_mask=mask.mask, is_causal=mask.mask is None,
                    enable_gqa=self.n_kv_heads != self.n_heads,
                ).transpose(1, 2)
        return self.o_proj(out.reshape(B, T, self.n_heads * self.head_dim))
