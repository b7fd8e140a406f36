"""Prefill attention over the paged pool on library kernels: FlexAttention, SDPA, flash-attn.

A prefill (or mixed) step is a ragged batch: request b has `q_lens[b]` new tokens, the last of its
`kv_lens[b]`-token context, whose slots are `table[b, :kv_lens[b]]` (a view of req_to_token's rows).
Query i of request b sits at position kv_lens[b] − q_lens[b] + i and sees positions up to its own (and
with a `window`, only the last `window` of them); a `softcap` c maps each scaled score s to c·tanh(s/c).

Three ways to compute it, chosen by `prefill_choice` (`ASTRAI_PREFILL=sdpa|flex|flash`, or
`with override_prefill(name):`):

- `sdpa`: per request, K/V gathered through its slots and PyTorch's `scaled_dot_product_attention` with a
  lower-right causal bias, which runs cuDNN/flash kernels on a GPU. The default: the first GPU run of the
  engine measured gather + SDPA at 22 ms against 448 ms for the hand-written prefill kernel at 64 × 4,096
  tokens (which is why that kernel is gone), and none of the others has been timed yet.
- `flex`: FlexAttention over the pool in place, nothing gathered: q is one sequence of all the step's
  tokens, K/V the whole pool, and a block mask built from the page table lists, for each block of
  `q_block` queries, the `kv_block`-slot blocks of the pool holding the positions they see; the element
  mask checks that a slot is at a visible position of the query's own request (`table[row, pos] == slot`),
  so blocks shared through the prefix cache or holding other requests' slots are safe. Compiled with
  `torch.compile` on CUDA; on CPU it runs eagerly (dense scores: tests only).
- `flash`: flash-attn's `flash_attn_varlen_func` over gathered K/V (its block table is used when the
  page size is a multiple of 256, which flash-attn's paged path needs); falls back to `sdpa` with one log
  line when the package is absent or the dtype is float32.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .choice import Choice

PREFILL_CHOICES = ("sdpa", "flex", "flash")
DEFAULT_PREFILL = "sdpa"
FLASH_ATTN_AVAILABLE = importlib.util.find_spec("flash_attn") is not None


def flash_attn_why_not(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why flash-attn cannot run on `device` in `dtype`, or None (the prefill choice and the engine's `flash`
    attention backend both ask this)."""
    if torch.device(device).type != "cuda":
        return f"flash-attn runs on CUDA only, not {torch.device(device).type}"
    if not FLASH_ATTN_AVAILABLE:
        return "the flash_attn package is not installed (pip install 'astrai_pl[flash]')"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16 or bfloat16, not {dtype}"
    return None


_CHOICE = Choice("prefill", {"sdpa": None, "flex": None, "flash": flash_attn_why_not},
                 {"*": (DEFAULT_PREFILL,)}, env="ASTRAI_PREFILL")  # fmt: skip
override_prefill = _CHOICE.override  # `with override_prefill(name):` (None: back to ASTRAI_PREFILL / default)


def prefill_choice(device: torch.device, dtype: torch.dtype) -> str:
    """The prefill implementation for this device and dtype: the override, ASTRAI_PREFILL, or the default;
    `flash` where flash-attn cannot run falls back to `sdpa` (logged once)."""
    return _CHOICE.choose(device, dtype)


@dataclass
class PagedBatch:
    """A step's requests as the prefill implementations read them (lengths known on the host)."""

    q_lens: list[int]
    kv_lens: list[int]
    table: torch.Tensor  # (n, W) slots: table[b, j] holds position j of request b, j < kv_lens[b]
    page_size: int = 1
    plans: dict = field(default_factory=dict)  # per-step caches (block masks by window, gather indices)

    @property
    def starts(self) -> list[int]:
        out, total = [], 0
        for n in self.q_lens:
            out.append(total)
            total += n
        return out


def batch_from_indptr(
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor | None,
    req_to_token: torch.Tensor | None, rows: torch.Tensor | None,
) -> PagedBatch:  # fmt: skip
    """A PagedBatch from the ops' indptr form (reads the lengths back to the host)."""
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
    if kv_indices is None:
        return PagedBatch(q_lens, kv_lens, req_to_token[rows.long(), : max(kv_lens, default=0)])
    width = max(kv_lens, default=0)
    starts = kv_indptr[:-1].long()
    pos = torch.arange(width, device=kv_indices.device)
    valid = pos[None] < torch.tensor(kv_lens, device=kv_indices.device)[:, None]
    index = torch.where(valid, starts[:, None] + pos[None], 0)
    return PagedBatch(q_lens, kv_lens, kv_indices[index] if kv_indices.numel() else index)


# -- sdpa --------------------------------------------------------------------------------------------------
def sdpa_prefill(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: PagedBatch, *,
    scale: float | None = None, window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Per request: K/V gathered through its slots, SDPA with the causal diagonal at the bottom right."""
    from torch.nn.attention.bias import causal_lower_right

    out = torch.empty_like(q)
    group = q.shape[1] // k_pool.shape[1]
    for b, (start, n, kv_len) in enumerate(zip(batch.starts, batch.q_lens, batch.kv_lens)):
        if n == 0:
            continue
        slots = batch.table[b, :kv_len].long()
        qb = q[start : start + n].transpose(0, 1)[None]  # (1, Hq, n, D)
        kb, vb = (pool[slots].transpose(0, 1)[None] for pool in (k_pool, v_pool))  # (1, Hkv, C, D)
        if window is None and softcap is None:
            o = F.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=causal_lower_right(n, kv_len), scale=scale, enable_gqa=group > 1
            )
        else:
            o = _masked_attention(qb, kb, vb, kv_len, scale, window, softcap)
        out[start : start + n] = o[0].transpose(0, 1)
    return out


def _masked_attention(q, k, v, kv_len: int, scale, window, softcap) -> torch.Tensor:
    """Explicit softmax for windows and soft-caps: q (1, Hq, n, D) over k, v (1, Hkv, C, D), float32 math."""
    n, group = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = kv_len - n + torch.arange(n, device=q.device)[:, None]
    k_pos = torch.arange(kv_len, device=q.device)[None]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window if window is not None else True)
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).to(q.dtype)


# -- flex --------------------------------------------------------------------------------------------------
def flex_block_lists(batch: PagedBatch, q_block: int, kv_block: int, window: int | None):
    """(kv_num_blocks (Q,), kv_indices (Q, M)) int32: for each block of q_block queries, the sorted, distinct
    kv_block-slot blocks of the pool that hold a position one of its queries sees."""
    device = batch.table.device
    pairs = []  # (q block, request, first position, last position)
    for b, (start, n, kv_len) in enumerate(zip(batch.starts, batch.q_lens, batch.kv_lens)):
        for qb in range(start // q_block, (start + n - 1) // q_block + 1) if n else ():
            first_q, last_q = max(start, qb * q_block) - start, min(start + n, (qb + 1) * q_block) - 1 - start
            lo = kv_len - n + first_q - window + 1 if window is not None else 0
            pairs.append((qb, b, max(lo, 0), kv_len - n + last_q))
    num_q_blocks = -(-sum(batch.q_lens) // q_block)
    # pages start at multiples of page_size: an aligned run of gcd(page_size, kv_block) positions lies in one block
    stride = math.gcd(batch.page_size, kv_block)
    p = torch.tensor(pairs, device=device, dtype=torch.int64).view(-1, 4)
    lo = p[:, 2] // stride * stride
    width = int(((p[:, 3] - lo) // stride).max()) + 1 if len(pairs) else 1
    pos = lo[:, None] + stride * torch.arange(width, device=device)  # (P, width)
    valid = pos <= p[:, 3:4]
    slots = batch.table[p[:, 1:2], pos.clamp(max=batch.table.shape[1] - 1)].long()
    big = torch.iinfo(torch.int32).max
    blocks = torch.where(valid, slots // kv_block, big)
    first_pair = torch.searchsorted(p[:, 0].contiguous(), torch.arange(num_q_blocks, device=device))
    column = (torch.arange(len(pairs), device=device) - first_pair[p[:, 0]])  # pair's place in its block
    per_block = int(column.max()) + 1 if len(pairs) else 1
    rows = torch.full((num_q_blocks, per_block * width), big, dtype=torch.int64, device=device)
    at = column[:, None] * width + torch.arange(width, device=device)
    rows[p[:, 0:1].expand_as(at), at] = blocks
    rows = rows.sort(-1).values
    repeat = torch.zeros_like(rows, dtype=torch.bool)
    repeat[:, 1:] = rows[:, 1:] == rows[:, :-1]
    rows = rows.masked_fill(repeat, big).sort(-1).values
    counts = (rows < big).sum(-1)
    keep = max(int(counts.max()), 1) if num_q_blocks else 1
    return counts.to(torch.int32), rows[:, :keep].masked_fill(rows[:, :keep] == big, 0).to(torch.int32)


def flex_block_mask(batch: PagedBatch, num_slots: int, *, q_block: int = 128, kv_block: int = 64,
                    window: int | None = None):  # fmt: skip
    """The BlockMask of a step over the pool (queries: the step's tokens; keys: every slot)."""
    from torch.nn.attention.flex_attention import BlockMask

    device, table = batch.table.device, batch.table
    q_row = torch.repeat_interleave(torch.arange(len(batch.q_lens), device=device),
                                    torch.tensor(batch.q_lens, device=device))  # fmt: skip
    q_pos = torch.cat([torch.arange(k - n, k, device=device) for n, k in zip(batch.q_lens, batch.kv_lens)])
    width = table.shape[1]
    valid = torch.arange(width, device=device)[None] < torch.tensor(batch.kv_lens, device=device)[:, None]
    slot_pos = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
    slot_pos[table[valid].long()] = torch.arange(width, device=device).expand_as(table)[valid]

    def mask_mod(b, h, q_idx, kv_idx):
        pos, own = slot_pos[kv_idx], q_pos[q_idx]
        seen = (pos >= 0) & (pos <= own) & (table[q_row[q_idx], pos.clamp(min=0)] == kv_idx)
        return seen & (pos > own - window) if window is not None else seen

    counts, listed = flex_block_lists(batch, q_block, kv_block, window)
    indices = listed.new_zeros(listed.shape[0], -(-num_slots // kv_block))  # BlockMask wants every column
    indices[:, : listed.shape[1]] = listed
    return BlockMask.from_kv_blocks(counts[None, None], indices[None, None], BLOCK_SIZE=(q_block, kv_block),
                                    mask_mod=mask_mod, seq_lengths=(len(q_pos), num_slots))  # fmt: skip


_compiled_flex = None


def _flex_attention():
    """flex_attention, compiled once per process on CUDA (its fused kernel); eager elsewhere."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None and torch.cuda.is_available():
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex or flex_attention


def flex_prefill(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: PagedBatch, *,
    scale: float | None = None, window: int | None = None, softcap: float | None = None, q_block: int = 128,
    kv_block: int = 64,
) -> torch.Tensor:  # fmt: skip
    """FlexAttention of the step's queries q (T, Hq, D) over the pool in place; returns (T, Hq, D).

    The pool is cut into blocks of `kv_block` slots (a multiple of 16 on CUDA, where the kernel's key tile
    is set to divide it): a smaller block wastes less on other requests' slots, a larger one runs bigger tiles.
    """
    key = ("flex", window, q_block, kv_block)
    if key not in batch.plans:
        batch.plans[key] = flex_block_mask(batch, k_pool.shape[0], q_block=q_block, kv_block=kv_block,
                                           window=window)  # fmt: skip
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)
    group = q.shape[1] // k_pool.shape[1]
    with warnings.catch_warnings():  # eager (CPU) flex warns that it is unfused: known, it is the test path
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = _flex_attention()(
            q.transpose(0, 1)[None], k_pool.permute(1, 0, 2)[None], v_pool.permute(1, 0, 2)[None],
            score_mod=score_mod, block_mask=batch.plans[key], scale=scale, enable_gqa=group > 1,
            kernel_options={"BLOCK_N": min(kv_block, 64)} if q.is_cuda else None,
        )  # (1, Hq, T, D)
    return out[0].transpose(0, 1)


# -- flash-attn --------------------------------------------------------------------------------------------
def flash_prefill(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: PagedBatch, *,
    scale: float | None = None, window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """flash-attn's varlen kernel: over the pool's pages (block table) when the page size is a multiple of
    256, else over K/V gathered into one ragged sequence."""
    from flash_attn import flash_attn_varlen_func

    device = q.device
    cu_q = torch.tensor([0, *torch.tensor(batch.q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(batch.kv_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    extra = {} if window is None else {"window_size": (window - 1, 0)}
    if softcap is not None:
        extra["softcap"] = softcap
    ps = batch.page_size
    if ps % 256 == 0:
        k, v = (pool.view(-1, ps, *pool.shape[1:]) for pool in (k_pool, v_pool))
        extra["block_table"] = (batch.table[:, ::ps] // ps).to(torch.int32)
    else:
        width = batch.table.shape[1]
        valid = torch.arange(width, device=device)[None] < torch.tensor(batch.kv_lens, device=device)[:, None]
        slots = batch.table[valid].long()
        k, v = k_pool[slots], v_pool[slots]
    return flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(batch.q_lens), max(batch.kv_lens), causal=True, softmax_scale=scale, **extra
    )


PREFILL = {"sdpa": sdpa_prefill, "flex": flex_prefill, "flash": flash_prefill}


def prefill(q, k_pool, v_pool, batch: PagedBatch, *, choice: str | None = None, **kwargs) -> torch.Tensor:
    """The step's prefill attention with the implementation `choice` (default: `prefill_choice`)."""
    return PREFILL[choice or prefill_choice(q.device, q.dtype)](q, k_pool, v_pool, batch, **kwargs)
