"""The fused ops: the CUDA kernel where it can run, else the PyTorch reference of the same signature.

A call runs the kernel when its tensors are on a CUDA device and `available()` is True; otherwise it
runs the reference, and the first such fallback in a process logs one line. `override_available(False)`
forces the references; `override_available(True)` forces the kernels and raises `KernelsUnavailable`
where they cannot run.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch

from .arguments import (
    KernelArgumentError,
    check_attention,
    check_index,
    check_index_ranges,
    check_page_table,
    check_store_kv,
    checking_indices,
)
from .build import KernelsUnavailable, available, forced, load, log_fallback, unavailable_reason
from .prefill import batch_from_indptr, prefill
from .reference import paged_decode_ref, paged_prefill_ref, rotary_emb_ref, store_kv_ref

_DECODE_MIN_SPLIT = 256  # tokens: shorter chunks cost more in merging than they gain in parallelism
_DECODE_MAX_SPLITS = 64
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # astrai::DType


def _kernels(op: str, t: torch.Tensor) -> ModuleType | None:
    """The extension when this call should run the kernel, else None (and the fallback is logged once)."""
    forcing = forced()
    if forcing is False:
        return None
    if t.is_cuda and (forcing or available()):
        return load()  # raises KernelsUnavailable when forced on but unable to load
    if forcing:
        raise KernelsUnavailable(f"{op}: the fused kernels were forced on, but its inputs are on {t.device}")
    reason = f"inputs on {t.device}" if not t.is_cuda else unavailable_reason()
    log_fallback(op, reason or "unknown")
    return None


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_head_chunk(group_size: int) -> int:
    """Query heads one decode block scores per key row (the kernel's GC): the group rounded up to 1/2/4/8."""
    return 8 if group_size >= 5 else 4 if group_size >= 3 else group_size


@functools.cache
def _blocks_per_sm(device_index: int, dtype: torch.dtype, head_dim: int, group: int) -> int:
    """How many decode blocks of this shape one SM holds at once (the kernel's occupancy)."""
    del device_index  # the cache key: occupancy is per device
    return load().paged_decode_blocks_per_sm(_DTYPE_CODES[dtype], head_dim, group)


def decode_splits(num_blocks: int, max_kv_len: int, num_sms: int, blocks_per_sm: int = 2) -> tuple[int, int]:
    """(num_splits, split_size) for paged decode: cut contexts so that one wave fills every SM.

    `num_blocks` is the grid without splitting (batch × kv heads × head chunks); `blocks_per_sm` the
    kernel's occupancy (`paged_decode_blocks_per_sm`), so a full wave is num_sms × blocks_per_sm blocks.
    Splits are at least 256 tokens and at most 64; split_size × num_splits covers max_kv_len.
    """
    if max_kv_len <= _DECODE_MIN_SPLIT:
        return 1, max(max_kv_len, 1)
    wanted = math.ceil(max(blocks_per_sm, 1) * num_sms / max(num_blocks, 1))
    splits = max(1, min(wanted, max_kv_len // _DECODE_MIN_SPLIT, _DECODE_MAX_SPLITS))
    size = math.ceil(max_kv_len / splits)
    return math.ceil(max_kv_len / size), size


def _longest(indptr: torch.Tensor) -> int:
    """Longest segment of a prefix-sum array (reads it on the host: one synchronisation on CUDA)."""
    return int((indptr[1:] - indptr[:-1]).max()) if indptr.numel() > 1 else 0


def _int32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.int32).contiguous()


def _page_table(
    op: str, kv_indices: torch.Tensor | None, req_to_token: torch.Tensor | None, rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if (kv_indices is None) == (req_to_token is None) or (req_to_token is None) != (rows is None):
        raise ValueError(f"{op}: address the pool with kv_indices, or with req_to_token and rows (not both)")
    return (kv_indices, None) if kv_indices is not None else (req_to_token, _int32(rows))


def rotary_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (..., Hq, D) and k (..., Hk, D) in place; see `reference.rotary_emb_ref`. Returns (q, k)."""
    ext = _kernels("rotary_emb", q)
    if ext is None:
        return rotary_emb_ref(q, k, cos, sin, positions)
    head_dim = q.shape[-1]
    try:
        q3, k3 = q.view(-1, q.shape[-2], head_dim), k.view(-1, k.shape[-2], head_dim)
    except RuntimeError as err:
        raise ValueError(
            f"rotary_emb rotates in place, so q {tuple(q.shape)} and k {tuple(k.shape)} must be viewable as "
            "(tokens, heads, head_dim) with a contiguous last dimension"
        ) from err
    if positions is not None:
        positions = positions.reshape(-1).to(torch.int64).contiguous()
    else:
        cos, sin = cos.reshape(-1, head_dim), sin.reshape(-1, head_dim)
    ext.rotary_emb(q3, k3, cos, sin, positions, _stream(q))
    return q, k


def _checked_page_table(op, q, batch, kv_indptr, kv_indices, req_to_token, rows, k_pool, qo_indptr=None):
    """(indptr32, indices, rows32) after every host-side check (and the range check when it is on)."""
    indices, rows32 = _page_table(op, kv_indices, req_to_token, rows)
    indptr = _int32(kv_indptr)
    check_page_table(op, q, batch, indptr, indices, rows32)
    if checking_indices():
        check_index_ranges(op, k_pool.shape[0], indptr, indices, rows32, qo_indptr)
    return indptr, indices, rows32


def paged_decode(
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
    """One query per request, q (B, Hq, D), over its context in the pool; see `reference.paged_decode_ref`.

    `window` keeps the last `window` positions, `softcap` caps the scores (c·tanh(s/c)). `max_kv_len`
    (the longest context) saves a device→host read; `num_splits` overrides the split-KV choice
    (`decode_splits` with the kernel's occupancy). Every argument is checked before the launch
    (`arguments`); a bad one raises `KernelArgumentError` naming it. Returns out (B, Hq, D).
    """
    ext = _kernels("paged_decode", q)
    if ext is None:
        return paged_decode_ref(
            q, k_pool, v_pool, kv_indptr, kv_indices, req_to_token=req_to_token, rows=rows, scale=scale,
            out=out, window=window, softcap=softcap,
        )  # fmt: skip
    q = q.contiguous()
    check_attention("paged_decode", q, k_pool, v_pool, out)
    batch, num_q_heads, head_dim = q.shape
    indptr, indices, rows32 = _checked_page_table(
        "paged_decode", q, batch, kv_indptr, kv_indices, req_to_token, rows, k_pool
    )
    if window is not None and window < 1 or softcap is not None and softcap <= 0:
        raise KernelArgumentError(f"paged_decode: window ({window}) and softcap ({softcap}) must be positive")
    max_kv_len = _longest(kv_indptr) if max_kv_len is None else max_kv_len
    span = max_kv_len if window is None else min(max_kv_len, window)
    if num_splits is None:
        group = num_q_heads // k_pool.shape[1]
        blocks = batch * k_pool.shape[1] * math.ceil(group / decode_head_chunk(group))
        device = _device_index(q)
        occupancy = _blocks_per_sm(device, q.dtype, head_dim, group)
        num_splits, split_size = decode_splits(blocks, span, _num_sms(device), occupancy)
    else:
        split_size = max(1, math.ceil(span / num_splits))
    out = torch.empty_like(q) if out is None else out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    ext.paged_decode(
        q, k_pool, v_pool, indptr, indices, rows32, out, num_splits, split_size, scale, window or 0,
        softcap or 0.0, _stream(q),
    )  # fmt: skip
    return out


def paged_prefill(
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
    """A ragged batch of queries q (T, Hq, D) over the pool; see `reference.paged_prefill_ref`.

    On CUDA (causal) it runs the library kernel `prefill.prefill_choice` picks (SDPA over gathered K/V by
    default, FlexAttention over the pool, or flash-attn), reading the lengths back once; elsewhere, or
    non-causal, the reference. `max_q_len` is accepted for signature parity. Returns out (T, Hq, D).
    """
    del max_q_len
    reference = dict(req_to_token=req_to_token, rows=rows, causal=causal, scale=scale, window=window,
                     softcap=softcap)  # fmt: skip
    if not q.is_cuda or not causal:
        return paged_prefill_ref(q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, out=out, **reference)
    check_attention("paged_prefill", q, k_pool, v_pool, out, head_dims=(q.shape[-1],))
    check_index("paged_prefill", "qo_indptr", qo_indptr, q, dims=1, layout="(batch + 1,)",
                          allow_int64=True)  # fmt: skip
    indptr, indices, rows32 = _checked_page_table(
        "paged_prefill", q, qo_indptr.shape[0] - 1, kv_indptr, kv_indices, req_to_token, rows, k_pool, qo_indptr
    )
    batch = batch_from_indptr(qo_indptr, indptr, kv_indices, req_to_token, rows32)
    o = prefill(q, k_pool, v_pool, batch, scale=scale, window=window, softcap=softcap)
    return o if out is None else out.copy_(o)


def paged_attention(
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
    """An engine step's causal attention: q (T, Hq, D) ragged by qo_indptr over kv_indices → (T, Hq, D).

    Every request has at least one query; when each has exactly one (T == batch) the decode kernel runs,
    otherwise the prefill path (`paged_prefill`).
    """
    if q.shape[0] == qo_indptr.shape[0] - 1 and max_q_len in (None, 1):
        return paged_decode(q, k_pool, v_pool, kv_indptr, kv_indices, max_kv_len=max_kv_len, scale=scale)
    return paged_prefill(
        q, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, max_q_len=max_q_len, scale=scale
    )


def store_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_pool[slots] = k and v_pool[slots] = v in one kernel; see `reference.store_kv_ref`."""
    ext = _kernels("store_kv", k_pool)
    if ext is None:
        store_kv_ref(k_pool, v_pool, slots, k, v)
        return
    check_store_kv(k_pool, v_pool, slots, k, v)
    ext.store_kv(k_pool, v_pool, slots.contiguous(), k, v, _stream(k_pool))
