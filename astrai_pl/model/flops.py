"""What a forward and backward pass of the model multiplies: the matmul weights one token goes through and the
FLOPs of a step. The throughput callback reports MFU from them; the pair objectives weigh layouts with them."""

from __future__ import annotations

from .config import ModelConfig


def active_matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies through in a forward pass (routed experts: only the top-k)."""
    h, d = cfg.hidden_size, cfg.head_size
    attn = h * d * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + cfg.num_attention_heads * d * h
    dense = 3 * h * cfg.intermediate_size
    moe = (
        cfg.num_experts * h
        + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
        + 3 * h * cfg.shared_expert_intermediate_size
        + (h if cfg.shared_expert_gate else 0)
    )
    blocks = sum(attn + (moe if cfg.is_moe_layer(i) else dense) for i in range(cfg.num_hidden_layers))
    return blocks + h * cfg.vocab_size


def training_flops(cfg: ModelConfig, tokens, pairs):
    """Forward + backward FLOPs for `tokens` real tokens attending over `pairs` (query, key) pairs."""
    attention = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_size * pairs
    return 6.0 * active_matmul_params(cfg) * tokens + attention
