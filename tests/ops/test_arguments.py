"""The fused ops' argument checks run in Python before any launch; on CPU they are called with
device_type="cpu" so that every other check can be exercised here."""

from __future__ import annotations

import pytest
import torch
from paged_cases import paged_case

from astrai_pl.ops import arguments
from astrai_pl.ops.arguments import KernelArgumentError


def attention(q, k_pool, v_pool, out=None, **kw):
    arguments.check_attention("paged_decode", q, k_pool, v_pool, out, device_type="cpu", **kw)


def test_head_dim_outside_the_kernels_set_is_refused_by_name():
    case = paged_case([1], [4], 4, 2, 64, torch.bfloat16)
    narrow = [t[..., :32].contiguous() for t in (case.q, case.k_pool, case.v_pool)]
    with pytest.raises(RuntimeError, match="paged_decode: head_dim must be 64, 128 or 256, got 32"):
        attention(*narrow)
    attention(case.q, case.k_pool, case.v_pool)  # the same call at head_dim 64 passes


@pytest.mark.parametrize(
    "bad,message",
    [
        (lambda c: dict(v_pool=c.v_pool.float()), "v_pool is Float but q is BFloat16"),
        (lambda c: dict(q=c.q.to(torch.float64), k_pool=c.k_pool.double(), v_pool=c.v_pool.double()),
         "q must be float32, float16 or bfloat16, got Double"),
        (lambda c: dict(q=c.q[0]), r"q must be \(tokens, num_q_heads, head_dim\)"),
        (lambda c: dict(k_pool=c.k_pool.transpose(0, 1).contiguous().transpose(0, 1)), "k_pool must be contiguous"),
        (lambda c: dict(v_pool=c.v_pool[:-1]), "v_pool has shape"),
        (lambda c: dict(out=torch.empty(2, 4, 64, dtype=torch.bfloat16)), "out has shape"),
        (lambda c: dict(k_pool=c.k_pool.repeat(1, 2, 1)[:, :3].contiguous(),
                        v_pool=c.v_pool.repeat(1, 2, 1)[:, :3].contiguous()),
         r"num_q_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        (lambda c: dict(k_pool=torch.cat([c.k_pool.view(-1), c.k_pool.new_zeros(4)])[4:].view(c.k_pool.shape)),
         "k_pool must start on a 16-byte boundary"),
    ],
)
def test_attention_arguments_name_what_is_wrong(bad, message):
    case = paged_case([1], [4], 4, 2, 64, torch.bfloat16)
    args = dict(q=case.q, k_pool=case.k_pool, v_pool=case.v_pool, out=None) | bad(case)
    with pytest.raises(KernelArgumentError, match=message):
        attention(**args)


def test_tensors_off_the_device_are_refused():
    case = paged_case([1], [4], 4, 2, 64)
    with pytest.raises(KernelArgumentError, match="q must be a CUDA tensor, got one on cpu"):
        arguments.check_attention("paged_decode", case.q, case.k_pool, case.v_pool, None)


def page_table(case, **kw):
    return dict(batch=case.num_requests, kv_indptr=case.kv_indptr, indices=case.kv_indices, rows=None) | kw


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda c: dict(kv_indptr=c.kv_indptr.long()), "kv_indptr must be int32, got Long"),
        (lambda c: dict(kv_indptr=c.kv_indptr[:-1]), "kv_indptr must have batch \\+ 1 = 3 entries, got 2"),
        (lambda c: dict(indices=c.kv_indices.float()), "kv_indices must be int32 or int64, got Float"),
        (lambda c: dict(indices=c.kv_indices[::2]), "kv_indices must be contiguous"),
        (lambda c: dict(indices=c.req_to_token, rows=c.rows), "rows must be int32, got Long"),
        (lambda c: dict(indices=c.req_to_token, rows=c.rows.int()[:1]), r"rows must be a contiguous \(2,\)"),
        (lambda c: dict(indices=c.req_to_token.view(-1), rows=c.rows.int()), r"req_to_token must be \(rows, max"),
    ],
)
def test_page_table_arguments_name_what_is_wrong(change, message):
    case = paged_case([1, 1], [6, 3], 4, 2, 64)
    with pytest.raises(KernelArgumentError, match=message):
        arguments.check_page_table("paged_decode", case.q, **page_table(case, **change(case)), device_type="cpu")


def test_index_ranges_are_checked_against_the_pool():
    case = paged_case([1, 1], [6, 3], 4, 2, 64)
    slots, indptr = case.k_pool.shape[0], case.kv_indptr
    arguments.check_index_ranges("paged_decode", slots, indptr, case.kv_indices, None)
    arguments.check_index_ranges("paged_decode", slots, indptr, case.req_to_token, case.rows.int())
    bad = case.kv_indices.clone()
    bad[4] = slots
    with pytest.raises(KernelArgumentError, match=f"kv_indices holds slots outside the pool's \\[0, {slots}\\)"):
        arguments.check_index_ranges("paged_decode", slots, indptr, bad, None)
    with pytest.raises(KernelArgumentError, match="rows must lie in"):
        arguments.check_index_ranges("paged_decode", slots, indptr, case.req_to_token, case.rows.int() + 100)
    long_context = torch.tensor([0, 6, 6 + case.req_to_token.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(KernelArgumentError, match="exceeds req_to_token's width"):
        arguments.check_index_ranges("paged_decode", slots, long_context, case.req_to_token, case.rows.int())
    with pytest.raises(KernelArgumentError, match="kv_indptr must start at 0 and never decrease"):
        arguments.check_index_ranges("paged_decode", slots, indptr.flip(0), case.kv_indices, None)
    with pytest.raises(KernelArgumentError, match="more queries than context tokens"):
        arguments.check_index_ranges("paged_prefill", slots, indptr, case.kv_indices, None,
                                     torch.tensor([0, 7, 8], dtype=torch.int32))  # fmt: skip


def test_range_checks_follow_the_flag(monkeypatch):
    assert not arguments.checking_indices()
    with arguments.check_indices():
        assert arguments.checking_indices()
    monkeypatch.setenv("ASTRAI_CHECK_INDICES", "1")
    assert arguments.checking_indices()
    with arguments.check_indices(False):
        assert not arguments.checking_indices()


def test_store_kv_arguments():
    pool = torch.zeros(10, 2, 64)
    k = torch.randn(3, 2, 64)
    slots = torch.tensor([1, 2, 3])
    arguments.check_store_kv(pool, pool.clone(), slots, k, k, device_type="cpu")
    with pytest.raises(KernelArgumentError, match="slots must be int32 or int64, got Float"):
        arguments.check_store_kv(pool, pool.clone(), slots.float(), k, k, device_type="cpu")
    with pytest.raises(KernelArgumentError, match=r"v must be \(3, 2, 64\)"):
        arguments.check_store_kv(pool, pool.clone(), slots, k, k[:, :1], device_type="cpu")
    with arguments.check_indices(), pytest.raises(KernelArgumentError, match=r"slots must lie in \[0, 10\)"):
        arguments.check_store_kv(pool, pool.clone(), slots + 8, k, k, device_type="cpu")
