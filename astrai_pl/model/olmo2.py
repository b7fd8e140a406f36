"""OLMo 2's decoder block (OLMo et al., 2024, "2 OLMo 2 Furious"): the norms sit on the branches' outputs.

Each block is `x + norm(attn(x))` then `x + norm(mlp(x))`: nothing normalises a branch's input, and the
residual stream itself is normalised only once, by the final norm. The q/k RMSNorms of its attention span
all heads' channels at once (`ModelConfig.wide_qk_norm`, attention.py). Module names are transformers', so
checkpoints load key for key.
"""

from __future__ import annotations

from torch import nn

from .attention import Attention, AttentionMask, KVCacheView
from .config import ModelConfig
from .layers import RMSNorm, SwiGLU, keep_rows


class PostNormBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, mask: AttentionMask, cache: KVCacheView | None = None, queries=None):
        x = keep_rows(x, queries) + self.post_attention_layernorm(self.self_attn(x, rope, mask, cache, queries))
        return x + self.post_feedforward_layernorm(self.mlp(x)), None
