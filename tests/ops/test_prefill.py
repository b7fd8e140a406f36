"""The prefill implementations over the paged pool (sdpa, flex) against the reference, on CPU.

FlexAttention runs eagerly on CPU (dense scores, exact masking by the element mask), so its block lists
are checked on their own: every (query, slot) pair the mask allows lies in a listed block, with no block
listed twice.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import paged_case, relative_error

from astrai_pl.ops import paged_prefill_ref
from astrai_pl.ops.prefill import (
    PagedBatch,
    batch_from_indptr,
    flex_block_lists,
    flex_block_mask,
    flex_prefill,
    override_prefill,
    prefill_choice,
    sdpa_prefill,
)

IMPLS = {"sdpa": sdpa_prefill, "flex": flex_prefill}


def shared_prefix_pool(page_size: int = 4, seed: int = 0):
    """Three requests over a pool of pages; the first two share their first two pages (a cached prefix)."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(20, generator=g)
    kv_lens, q_lens = [13, 11, 6], [5, 3, 6]
    own = {0: [0, 1, 2, 3], 1: [0, 1, 4], 2: [5, 6]}  # indices into `pages`
    table = torch.zeros(3, 16, dtype=torch.int32)
    for r, n in enumerate(kv_lens):
        for j in range(n):
            table[r, j] = pages[own[r][j // page_size]] * page_size + j % page_size
    k_pool, v_pool = (torch.randn(20 * page_size, 2, 16, generator=g) for _ in range(2))
    q = torch.randn(sum(q_lens), 4, 16, generator=g)
    return q, k_pool, v_pool, PagedBatch(q_lens, kv_lens, table, page_size)


def reference(q, k_pool, v_pool, batch: PagedBatch, **kw) -> torch.Tensor:
    qo = torch.tensor([0, *torch.tensor(batch.q_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv = torch.tensor([0, *torch.tensor(batch.kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    rows = torch.arange(len(batch.q_lens))
    return paged_prefill_ref(q, k_pool, v_pool, qo, kv, req_to_token=batch.table, rows=rows, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("features", [{}, {"window": 4}, {"softcap": 5.0}, {"window": 3, "softcap": 2.0}])
def test_prefill_matches_the_reference_over_shared_pages(impl, features):
    q, k_pool, v_pool, batch = shared_prefix_pool()
    out = IMPLS[impl](q, k_pool, v_pool, batch, q_block=4, kv_block=4, **features) if impl == "flex" else (
        IMPLS[impl](q, k_pool, v_pool, batch, **features))  # fmt: skip
    assert relative_error(out, reference(q, k_pool, v_pool, batch, **features)) <= 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_on_scattered_single_token_slots(impl):
    case = paged_case([1, 7, 12, 3], [9, 7, 30, 3], 8, 2, 32, seed=4)
    batch = batch_from_indptr(case.qo_indptr, case.kv_indptr, case.kv_indices, None, None)
    out = IMPLS[impl](case.q, case.k_pool, case.v_pool, batch, scale=0.3)
    ref = paged_prefill_ref(case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices,
                            scale=0.3)  # fmt: skip
    assert relative_error(out, ref) <= 1e-5
    by_table = batch_from_indptr(case.qo_indptr, case.kv_indptr, None, case.req_to_token, case.rows)
    assert relative_error(IMPLS[impl](case.q, case.k_pool, case.v_pool, by_table, scale=0.3), ref) <= 1e-5


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("q_block,kv_block", [(4, 4), (8, 16), (3, 2)])
def test_flex_block_lists_cover_every_visible_slot_once(window, q_block, kv_block):
    q, k_pool, _, batch = shared_prefix_pool()
    counts, indices = flex_block_lists(batch, q_block, kv_block, window)
    for qb in range(counts.shape[0]):
        listed = indices[qb, : counts[qb]].tolist()
        assert len(listed) == len(set(listed))
    mask = flex_block_mask(batch, k_pool.shape[0], q_block=q_block, kv_block=kv_block, window=window)
    allowed = mask.mask_mod(0, 0, torch.arange(q.shape[0])[:, None], torch.arange(k_pool.shape[0])[None])
    for i, slot in allowed.nonzero().tolist():
        assert slot // kv_block in indices[i // q_block, : counts[i // q_block]].tolist()
    assert int(allowed.sum()) == sum(  # each query sees exactly its visible positions
        min(pos + 1, window or pos + 1) for n, k in zip(batch.q_lens, batch.kv_lens) for pos in range(k - n, k)
    )


def test_choice_follows_override_environment_and_falls_back_from_flash(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert prefill_choice(cpu, torch.float32) == "sdpa"
    monkeypatch.setenv("ASTRAI_PREFILL", "flex")
    assert prefill_choice(cpu, torch.float32) == "flex"
    with override_prefill("sdpa"):
        assert prefill_choice(cpu, torch.float32) == "sdpa"
    with override_prefill("flash"), caplog.at_level("INFO", logger="astrai_pl.ops"):
        assert prefill_choice(cpu, torch.bfloat16) == "sdpa"  # flash-attn runs on CUDA only
    monkeypatch.setenv("ASTRAI_PREFILL", "fastest")
    with pytest.raises(ValueError, match="ASTRAI_PREFILL='fastest'"):
        prefill_choice(cpu, torch.float32)


def test_decode_libraries_fall_back_to_the_kernel_where_they_cannot_run(monkeypatch, caplog):
    from astrai_pl.ops.decode_libs import decode_choice, override_decode, why_not

    cpu = torch.device("cpu")
    assert decode_choice(cpu, torch.bfloat16, 16) == "kernel"
    for name in ("flashinfer", "flash"):
        with override_decode(name), caplog.at_level("INFO", logger="astrai_pl.ops"):
            assert decode_choice(cpu, torch.bfloat16, 16) == "kernel"
        assert why_not(name, cpu, torch.bfloat16, 16) is not None
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # as if both were installed
    assert why_not("flash", torch.device("cuda"), torch.bfloat16, 16).startswith("flash-attn's paged decode")
    assert why_not("flashinfer", torch.device("cuda"), torch.float32, 16).endswith("not torch.float32")
    assert why_not("flashinfer", torch.device("cuda"), torch.bfloat16, 16) is None
    monkeypatch.setenv("ASTRAI_DECODE", "fastest")
    with pytest.raises(ValueError, match="ASTRAI_DECODE='fastest'"):
        decode_choice(cpu, torch.float32, 16)


def test_library_page_lists_follow_the_table():
    from astrai_pl.ops.decode_libs import _pages

    _, _, _, batch = shared_prefix_pool(page_size=4)
    indptr, pages, last = _pages(PagedBatch([1, 1, 1], batch.kv_lens, batch.table, 4))
    assert indptr.tolist() == [0, 4, 7, 9] and last.tolist() == [1, 3, 2]
    for r, (start, end) in enumerate(zip(indptr[:-1].tolist(), indptr[1:].tolist())):
        slots = torch.cat([torch.arange(p * 4, p * 4 + 4) for p in pages[start:end].tolist()])
        assert torch.equal(slots[: batch.kv_lens[r]], batch.table[r, : batch.kv_lens[r]].long())
