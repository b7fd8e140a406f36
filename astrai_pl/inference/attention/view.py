"""The per-step view of the KV pool that every attention layer calls, and what a backend provides to it.

All tensors are (tokens, heads, head_dim) inside the view; a step's tokens are the requests' new tokens
concatenated, decodes (one token each) first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..cache import KVStorage


@dataclass
class StepView:
    """One forward step's view of the pool, built once and shared by every layer (the model's `cache=`)."""

    storage: KVStorage
    req_to_token: torch.Tensor  # (rows, max_context) int32
    backend: AttentionBackend
    rows: torch.Tensor  # (B,) request rows in req_to_token
    prefix_lens: list[int]  # K/V already in the pool, per request
    extend_lens: list[int]  # new tokens this step, per request
    out_slots: torch.Tensor  # (T,) int64 slot of every new token, requests concatenated
    qo_indptr: torch.Tensor  # (B+1,) prefix sums of extend_lens
    kv_indptr: torch.Tensor  # (B+1,) prefix sums of prefix_lens + extend_lens
    num_decode: int  # the first num_decode requests add exactly one token
    page_size: int = 1  # slots p·page_size … (p+1)·page_size-1 form page p
    keys: tuple[str, ...] = ()  # request ids, in step order: lets a backend recognise requests across steps
    step: int = 0  # the engine's step counter
    scratch: dict | None = None  # the engine's, for backend state kept between steps
    meta: Any = None  # the backend's per-step metadata, made by the first layer, reused by the rest

    @classmethod
    def build(
        cls,
        storage: KVStorage,
        req_to_token: torch.Tensor,
        backend: AttentionBackend,
        rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_slots: list[int],
        page_size: int = 1,
        **extra: Any,
    ) -> StepView:
        device = storage.k.device
        num_decode = 0
        while num_decode < len(extend_lens) and extend_lens[num_decode] == 1:
            num_decode += 1
        kv_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        return cls(
            storage,
            req_to_token,
            backend,
            rows=torch.tensor(rows, device=device),
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            out_slots=torch.tensor(out_slots, dtype=torch.int64, device=device),
            qo_indptr=_indptr(extend_lens, device),
            kv_indptr=_indptr(kv_lens, device),
            num_decode=num_decode,
            page_size=page_size,
            **extra,
        )

    @property
    def kv_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               window: int | None = None, scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
        """Store k, v (B, T, Hkv, D) at this step's slots; attend q (B, T, Hq, D) over each request's context
        (its last `window` positions for a sliding layer; `scale` None is 1/sqrt(D); `softcap` caps the scores)."""
        B, T, Hq, D = q.shape
        k, v = k.reshape(B * T, -1, D), v.reshape(B * T, -1, D)
        self.storage.write(layer_idx, self.out_slots, k, v)
        if self.meta is None:
            self.meta = self.backend.prepare(self, Hq)
        shape = dict(window=window, scale=scale, softcap=softcap)
        return self.backend.attend(self, layer_idx, q.reshape(B * T, Hq, D), k, v, **shape).view(B, T, Hq, D)


def _indptr(lengths: list[int], device: torch.device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


# What a model's attention may ask of a backend beyond causal attention at 1/sqrt(head_dim) (backends.model_features)
FEATURES = ("sliding_window", "softcap", "scale")

class AttentionBackend(Protocol):
    name: str

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when the backend can run here, else why not (shown to the user)."""

    def prepare(self, view: StepView, num_q_heads: int) -> Any:
        """Per-step metadata shared by every layer."""

    def attend(
        self, view: StepView, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
        window: int | None = None, scale: float | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        """q (T, Hq, D) → (T, Hq, D) over K/V already in the pool; k, v (T, Hkv, D) are this step's; a query at
        position i sees keys j with i - window < j <= i (all j <= i when window is None)."""
