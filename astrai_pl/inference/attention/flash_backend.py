"""The `flash` attention backend: flash-attn's varlen kernel over K/V gathered through the request table
(CUDA, float16/bfloat16, the `flash` extra)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops.prefill import flash_attn_why_not
from .view import FEATURES, StepView


@dataclass
class _Ragged:
    kv_indices: torch.Tensor  # (sum of kv lens,) slots, requests concatenated
    max_q: int
    max_kv: int


def _ragged(view: StepView) -> _Ragged:
    kv_lens = view.kv_lens
    width = max(kv_lens)
    table = view.req_to_token[view.rows, :width]
    lens = torch.tensor(kv_lens, device=table.device)
    valid = torch.arange(width, device=table.device)[None] < lens[:, None]
    return _Ragged(table[valid].to(torch.int64), max(view.extend_lens), width)



class FlashBackend:
    name = "flash"
    features = frozenset(FEATURES)

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return flash_attn_why_not(device, dtype)

    def prepare(self, view: StepView, num_q_heads: int) -> _Ragged:
        return _ragged(view)

    def attend(self, view: StepView, layer_idx: int, q: torch.Tensor, k_new, v_new, *, window=None, scale=None,
               softcap=None) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        meta: _Ragged = view.meta
        k = view.storage.k[layer_idx][meta.kv_indices]
        v = view.storage.v[layer_idx][meta.kv_indices]
        # causal with more keys than queries aligns the queries with the last keys (flash-attn >= 2.1)
        extra = {} if window is None else {"window_size": (window - 1, 0)}  # flash-attn >= 2.3
        if softcap is not None:
            extra["softcap"] = softcap  # flash-attn >= 2.6; older versions raise naming the argument
        return flash_attn_varlen_func(
            q, k, v, view.qo_indptr, view.kv_indptr, meta.max_q, meta.max_kv, causal=True, softmax_scale=scale,
            **extra,
        )
