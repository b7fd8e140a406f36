"""Decode attention on maintained libraries, as alternatives to our paged_decode kernel.

`ASTRAI_DECODE=kernel|flashinfer|flash` (or `with override_decode(name):`) picks the implementation the
cuda backend runs for a step's decodes; the default is our kernel until a GPU run shows a library faster
(`benchmarks/gpu_engine.py`). A library that cannot run here (not installed, not CUDA, float32, or for
flash-attn a page size that is not a multiple of 256, which its paged path needs) falls back to the
kernel with one log line.

- `flashinfer`: FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` over the pool seen as pages
  (NHD: (num_pages, page_size, Hkv, D), K and V apart), planned once per step and window;
- `flash`: flash-attn's `flash_attn_with_kvcache` with a block table over the same pages.

Both take the page table of a `PagedBatch` (`astrai_pl.ops.prefill`) whose queries are one per request.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from .choice import Choice
from .prefill import PagedBatch

DECODE_CHOICES = ("kernel", "flashinfer", "flash")
_PACKAGES = {"flashinfer": "flashinfer", "flash": "flash_attn"}
_WORKSPACE_BYTES = 128 * 1024**2


def why_not(name: str, device: torch.device, dtype: torch.dtype, page_size: int) -> str | None:
    """Why library `name` cannot decode here, or None."""
    if name == "kernel":
        return None
    if importlib.util.find_spec(_PACKAGES[name]) is None:
        return f"the {_PACKAGES[name]} package is not installed (pip install 'astrai_pl[gpu]')"
    if torch.device(device).type != "cuda":
        return f"{name} runs on CUDA only"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{name} needs float16 or bfloat16, not {dtype}"
    if name == "flash" and page_size % 256:
        return f"flash-attn's paged decode needs pages of a multiple of 256 tokens, not {page_size}"
    return None


_CHOICE = Choice("decode", {name: functools.partial(why_not, name) for name in DECODE_CHOICES}, {"*": ("kernel",)},
                 env="ASTRAI_DECODE")  # fmt: skip
override_decode = _CHOICE.override  # `with override_decode(name):` (None: back to ASTRAI_DECODE / `kernel`)


def decode_choice(device: torch.device, dtype: torch.dtype, page_size: int) -> str:
    """The override, else ASTRAI_DECODE, else `kernel`; a library that cannot run falls back (logged once)."""
    return _CHOICE.choose(device, dtype, page_size)


def _pages(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page indptr, page ids, last page lengths), int32, of a PagedBatch over aligned pages."""
    ps, device = batch.page_size, batch.table.device
    counts = torch.tensor([-(-n // ps) for n in batch.kv_lens], device=device)
    heads = batch.table[:, ::ps]  # (n, W / ps) slot of each page's first position
    valid = torch.arange(heads.shape[1], device=device)[None] < counts[:, None]
    indptr = torch.zeros(len(batch.kv_lens) + 1, dtype=torch.int32, device=device)
    indptr[1:] = counts.cumsum(0)
    last = torch.tensor([n - (-(-n // ps) - 1) * ps for n in batch.kv_lens], dtype=torch.int32, device=device)
    return indptr, (heads[valid] // ps).to(torch.int32), last


def flashinfer_decode(q, k_pool, v_pool, batch: PagedBatch, *, scale=None, window=None, softcap=None):
    """q (B, Hq, D) over the pool's pages with FlashInfer; its plan is made once per step and window."""
    import flashinfer

    ps, (_, hkv, d) = batch.page_size, k_pool.shape
    key = ("flashinfer", window, softcap, scale)
    if key not in batch.plans:
        workspace = batch.plans.setdefault("workspace", torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8,
                                                                     device=q.device))  # fmt: skip
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(*_pages(batch), q.shape[1], hkv, d, ps, window_left=-1 if window is None else window - 1,
                     logits_soft_cap=softcap, sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_pool.dtype)  # fmt: skip
        batch.plans[key] = wrapper
    cache = (k_pool.view(-1, ps, hkv, d), v_pool.view(-1, ps, hkv, d))
    return batch.plans[key].run(q, cache)


def flash_decode(q, k_pool, v_pool, batch: PagedBatch, *, scale=None, window=None, softcap=None):
    """q (B, Hq, D) over the pool's pages with flash-attn's `flash_attn_with_kvcache` and a block table."""
    from flash_attn import flash_attn_with_kvcache

    ps, (_, hkv, d) = batch.page_size, k_pool.shape
    width = -(-max(batch.kv_lens) // ps)
    block_table = (batch.table[:, ::ps][:, :width] // ps).to(torch.int32)
    extra = {} if window is None else {"window_size": (window - 1, 0)}
    if softcap is not None:
        extra["softcap"] = softcap
    lens = torch.tensor(batch.kv_lens, dtype=torch.int32, device=q.device)
    out = flash_attn_with_kvcache(q[:, None], k_pool.view(-1, ps, hkv, d), v_pool.view(-1, ps, hkv, d),
                                  cache_seqlens=lens, block_table=block_table, softmax_scale=scale, causal=True,
                                  **extra)  # fmt: skip
    return out[:, 0]


DECODE_LIBS = {"flashinfer": flashinfer_decode, "flash": flash_decode}
