"""The parts of Gemma 2 and Gemma 3 (text) that the other families do not share.

- `GemmaRMSNorm`: x / sqrt(mean(x²) + eps) · (1 + w), all in float32 and cast once at the end; w starts at 0.
- `GemmaBlock`: sandwich norms, `x + post_norm(attn(pre_norm(x)))` then `x + post_norm(mlp(pre_norm(x)))`.
- `GeGLU`: down(gelu_tanh(gate(x)) · up(x)), the gated MLP of `hidden_act="gelu_pytorch_tanh"`.
- `softcap`: cap · tanh(x / cap), on attention scores (attention.py) and on the output logits (`CappedLinear`).

The embedding scale sqrt(hidden_size) (rounded to the weights' dtype, as transformers does) and the dual
RoPE base of Gemma 3 (`rope_local_base_freq` for the sliding layers) live in transformer.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import Linear, RMSNorm, SwiGLU, keep_rows, project


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap · tanh(x / cap): bounds x to (-cap, cap), close to identity for |x| ≪ cap; `cap=None` returns x."""
    return x if cap is None else torch.tanh(x / cap) * cap


class GemmaRMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · (1 + weight), in float32, cast to x's dtype after the product."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GeGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) · up(x)) (Shazeer, 2020), Gemma's MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


def dense_mlp(cfg: ModelConfig) -> SwiGLU:
    """The dense gated MLP that cfg.hidden_act names."""
    mlp = GeGLU if cfg.hidden_act == "gelu_pytorch_tanh" else SwiGLU
    return mlp(cfg.hidden_size, cfg.intermediate_size)


def norm_for(cfg: ModelConfig, dim: int) -> nn.Module:
    """The RMSNorm of cfg's family over `dim` channels: (1 + w) for Gemma, w for the others."""
    return (GemmaRMSNorm if cfg.is_gemma else RMSNorm)(dim, cfg.rms_norm_eps)


class CappedLinear(Linear):
    """The output layer with final-logit soft-capping: softcap(x · Wᵀ, cap). Same parameters as a Linear."""

    def __init__(self, in_features: int, out_features: int, cap: float):
        super().__init__(in_features, out_features, bias=False)
        self.softcap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softcap(super().forward(x), self.softcap)


def output_layer(cfg: ModelConfig) -> Linear:
    """lm_head: a Linear, soft-capped when cfg.final_logit_softcapping is set."""
    if cfg.final_logit_softcapping is None:
        return Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    return CappedLinear(cfg.hidden_size, cfg.vocab_size, cfg.final_logit_softcapping)


class GemmaBlock(nn.Module):
    """Gemma's decoder block: every sublayer's input and output normed (four (1 + w) RMSNorms)."""

    def __init__(self, cfg: ModelConfig, attention: nn.Module):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps)
        self.mlp = dense_mlp(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps)

    def forward(self, x, rope, mask, cache=None, queries=None):
        attended = self.self_attn(self.input_layernorm(x), rope, mask, cache, queries)
        x = keep_rows(x, queries) + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), None
