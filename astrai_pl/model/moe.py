"""Mixture-of-experts feed-forward: softmax router, top-k routing, optional shared experts.

The load-balancing loss (Fedus et al., 2021, Switch Transformer; the top-k form of Mixtral/HF):
    aux = E · Σ_e f_e · P_e
with f_e the fraction of tokens that picked expert e among their top-k and P_e the mean router
probability of e. It is returned next to the output, never added to it; objectives weight it by
`router_aux_loss_coef`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import Linear, SwiGLU


def load_balancing_loss(probs: torch.Tensor, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E · Σ_e f_e · P_e for router probabilities (N, E) and chosen experts (N, k)."""
    counts = F.one_hot(topk_idx, num_experts).sum(dim=1).float()  # (N, E)
    f = counts.mean(dim=0)  # (E,)
    p = probs.mean(dim=0)  # (E,)
    return num_experts * (f * p).sum()


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = SwiGLU(cfg.hidden_size, shared) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if shared and cfg.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, H)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (N, E)
        weights, idx = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            rows, slot = (idx == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.view(shape), load_balancing_loss(probs, idx, self.num_experts)
