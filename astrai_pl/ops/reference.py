"""PyTorch references of the fused ops: the same signatures as the kernels, any device, float32 math.

They define what the kernels compute and are what `astrai_pl.ops` runs when the kernels cannot. Layouts:

    q, out          (tokens, num_q_heads, head_dim); decode: one token per request, (batch, Hq, D)
    k_pool, v_pool  (num_slots, num_kv_heads, head_dim): one layer of the flat token pool
    qo_indptr       (batch + 1,) prefix sums of each request's query count
    kv_indptr       (batch + 1,) prefix sums of each request's context length (its queries included)
    kv_indices      (kv_indptr[-1],) slots of every context, requests concatenated; or instead
    req_to_token    (rows, max_context) the request → slot table, with rows (batch,) naming each request's row

Query head h reads key/value head h // (Hq / Hkv). Causal attention puts a request's q_len queries at
the end of its kv_len-token context: query i sees keys 0 … kv_len − q_len + i. The default scale is
1/sqrt(head_dim). A sliding `window` keeps the last `window` positions up to each query (its own included);
a `softcap` c maps every scaled score s to c·tanh(s / c) before the softmax (Gemma 2).
"""

from __future__ import annotations

import math

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_emb_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (..., Hq, D) and k (..., Hk, D) in place: x·cos + rotate_half(x)·sin, in float32.

    cos/sin hold one row (D,) per token, laid out like q without the head dimension — (N, D) for q of
    (N, H, D), (B, T, D) for (B, T, H, D) — or, with `positions` (int64, q's leading shape), are a table
    (P, D) indexed by position. The layout is the model's (rotate-half, frequencies duplicated across the
    two halves). Returns (q, k).
    """
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    cos, sin = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)  # (..., 1, D)
    for x in (q, k):
        x32 = x.float()
        x.copy_(x32 * cos + rotate_half(x32) * sin)
    return q, k


def context_slots(
    b: int,
    kv_indptr: list[int],
    kv_indices: torch.Tensor | None,
    req_to_token: torch.Tensor | None,
    rows: torch.Tensor | None,
) -> torch.Tensor:
    """Slots (kv_len,) of request b's context, from kv_indices or from req_to_token[rows[b]]."""
    start, end = kv_indptr[b], kv_indptr[b + 1]
    if (kv_indices is None) == (req_to_token is None) or (req_to_token is None) != (rows is None):
        raise ValueError("address the pool with kv_indices, or with req_to_token and rows (not both)")
    if kv_indices is not None:
        return kv_indices[start:end].long()
    return req_to_token[int(rows[b]), : end - start].long()


def paged_prefill_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor | None = None,
    *,
    req_to_token: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of a ragged batch of queries q (T, Hq, D) over each request's context in the pool.

    Request b owns queries qo_indptr[b] … qo_indptr[b+1]−1, the last q_len positions of its context.
    Returns out (T, Hq, D) in q's dtype (written into `out` when given). `max_q_len` is accepted for
    signature parity with the kernel and not needed here.
    """
    del max_q_len
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    result = torch.empty(q.shape, dtype=torch.float32, device=q.device) if out is None else out
    for b in range(len(qo) - 1):
        q_len, kv_len = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        if q_len > kv_len:
            raise ValueError(
                f"request {b} has {q_len} queries but a context of {kv_len} tokens; the context includes the queries"
            )
        if q_len == 0:
            continue
        slots = context_slots(b, kv, kv_indices, req_to_token, rows)
        k = k_pool[slots].float().transpose(0, 1)[:, None]  # (Hkv, 1, C, D)
        v = v_pool[slots].float().transpose(0, 1)[:, None]
        qb = q[qo[b] : qo[b + 1]].float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = (qb @ k.transpose(-1, -2)) * scale  # (Hkv, G, E, C)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        keys = torch.arange(kv_len, device=q.device)
        query_pos = (kv_len - q_len) + torch.arange(q_len, device=q.device)[:, None]  # (E, 1)
        visible = keys[None, :] <= query_pos if causal else torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
        if window is not None:
            visible = visible & (keys[None, :] > query_pos - window)  # (E, C)
        if causal or window is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v  # (Hkv, G, E, D)
        result[qo[b] : qo[b + 1]] = (
            o.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_dim).to(result.dtype)
        )
    return result.to(q.dtype) if out is None else out


def paged_decode_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor | None = None,
    *,
    req_to_token: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    scale: float | None = None,
    max_kv_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per request, q (B, Hq, D), against its whole context; returns (B, Hq, D).

    `max_kv_len` and `num_splits` tune the kernel and are accepted here for signature parity only.
    """
    del max_kv_len, num_splits
    qo_indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_ref(
        q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices,
        req_to_token=req_to_token, rows=rows, causal=True, scale=scale, out=out, window=window, softcap=softcap,
    )  # fmt: skip


def paged_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The engine's entry point: causal attention of a step's ragged queries (T, Hq, D) over kv_indices."""
    del max_kv_len
    return paged_prefill_ref(
        q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, scale=scale, max_q_len=max_q_len
    )


def store_kv_ref(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_pool[slots] = k and v_pool[slots] = v: k, v (N, Hkv, D) into one layer's pool (slots, Hkv, D)."""
    k_pool.index_copy_(0, slots.long(), k)
    v_pool.index_copy_(0, slots.long(), v)
