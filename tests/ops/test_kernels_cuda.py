"""The CUDA kernels against their PyTorch references (needs a CUDA device; skipped elsewhere).

Outputs are NaN-filled first, so an element a kernel never writes fails the comparison. The full sweep
with timings is benchmarks/gpu_check.py.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import paged_case, relative_error

from astrai_pl import ops

pytestmark = pytest.mark.cuda

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def limit(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.fixture(autouse=True)
def kernels_on():
    torch.backends.cuda.matmul.allow_tf32 = False
    with ops.override_available(True):
        yield


def test_flag_is_true_with_a_gpu():
    assert ops.available(), ops.unavailable_reason()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads", [(32, 8), (28, 4), (8, 8), (8, 1)])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_paged_decode(dtype, head_dim, heads, num_splits):
    kv_lens = [1, 2100, 33, 700]
    case = paged_case([1] * 4, kv_lens, *heads, head_dim, dtype, "cuda", seed=head_dim + heads[0])
    ref = ops.paged_decode_ref(case.q, case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices)
    out = torch.full_like(case.q, float("nan"))
    ops.paged_decode(
        case.q, case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices, num_splits=num_splits, out=out
    )
    assert relative_error(out, ref) <= limit(dtype)
    by_table = ops.paged_decode(
        case.q, case.k_pool, case.v_pool, case.kv_indptr, req_to_token=case.req_to_token, rows=case.rows
    )
    assert relative_error(by_table, ref) <= limit(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("features", [{}, {"window": 100}, {"softcap": 30.0}, {"window": 7, "softcap": 5.0}])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_paged_decode_windows_and_softcaps(dtype, head_dim, features, num_splits):
    case = paged_case([1] * 4, [1, 2100, 33, 700], 32, 8, head_dim, dtype, "cuda", seed=head_dim)
    ref = ops.paged_decode_ref(case.q, case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices, **features)
    out = torch.full_like(case.q, float("nan"))
    ops.paged_decode(case.q, case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices, out=out,
                     num_splits=num_splits, **features)  # fmt: skip
    assert relative_error(out, ref) <= limit(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("choice", ["sdpa", "flex", "flash"])
@pytest.mark.parametrize("features", [{}, {"window": 50}, {"softcap": 20.0}])
def test_paged_prefill(dtype, head_dim, choice, features):
    from astrai_pl.ops.prefill import override_prefill

    case = paged_case([1, 40, 70, 5], [1, 40, 300, 900], 12, 4, head_dim, dtype, "cuda", seed=head_dim)
    args = (case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices)
    out = torch.full_like(case.q, float("nan"))
    with override_prefill(choice):
        ops.paged_prefill(*args, out=out, **features)
    assert relative_error(out, ops.paged_prefill_ref(*args, **features)) <= limit(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_mixed_step(dtype):
    case = paged_case([1, 1, 17, 3], [50, 3000, 17, 90], 32, 8, 128, dtype, "cuda", seed=3)
    args = (case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices)
    assert relative_error(ops.paged_attention(*args), ops.paged_attention_ref(*args)) <= limit(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", ["same", "float32"])
def test_rotary_emb_in_place_on_strided_views(dtype, table_dtype):
    n, hq, hk, d = 21, 8, 2, 128
    qkv = torch.randn(n, hq + 2 * hk, d, device="cuda").to(dtype)
    angles = torch.rand(n, d // 2, device="cuda") * 50
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype if table_dtype == "same" else torch.float32)
    sin = torch.cat([angles.sin()] * 2, -1).to(cos.dtype)
    expected = qkv.clone()
    ops.rotary_emb_ref(expected[:, :hq], expected[:, hq : hq + hk], cos, sin)
    ops.rotary_emb(qkv[:, :hq], qkv[:, hq : hq + hk], cos, sin)
    assert relative_error(qkv, expected) <= limit(dtype)  # v heads (last hk) untouched too


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype):
    k_pool = torch.full((64, 4, 64), float("nan"), device="cuda", dtype=dtype)
    v_pool = k_pool.clone()
    slots = torch.randperm(64, device="cuda")[:10]
    k, v = torch.randn(2, 10, 4, 64, device="cuda").to(dtype)
    ops.store_kv(k_pool, v_pool, slots, k, v)
    assert torch.equal(k_pool[slots], k) and torch.equal(v_pool[slots], v)
    assert k_pool.isnan().sum() == (64 - 10) * 4 * 64


def test_binding_errors_name_the_argument():
    case = paged_case([1], [4], 4, 2, 64, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="head_dim must be 64, 128 or 256"):
        ops.paged_decode(case.q[..., :32].contiguous(), case.k_pool[..., :32].contiguous(),
                         case.v_pool[..., :32].contiguous(), case.kv_indptr, case.kv_indices)  # fmt: skip
    with pytest.raises(RuntimeError, match="v_pool is Float but q is BFloat16"):
        ops.paged_decode(case.q, case.k_pool, case.v_pool.float(), case.kv_indptr, case.kv_indices)
    bad = case.kv_indices.clone()
    bad[0] = case.k_pool.shape[0] + 1000
    with ops.check_indices(), pytest.raises(RuntimeError, match="kv_indices holds slots outside"):
        ops.paged_decode(case.q, case.k_pool, case.v_pool, case.kv_indptr, bad)
    ops.paged_decode(case.q, case.k_pool, case.v_pool, case.kv_indptr, bad)  # unchecked: skipped, never read
    torch.cuda.synchronize()


def test_decode_occupancy_is_positive():
    for dtype in DTYPES:
        for head_dim in (64, 128, 256):
            assert ops.load().paged_decode_blocks_per_sm({torch.float32: 0, torch.float16: 1,
                                                          torch.bfloat16: 2}[dtype], head_dim, 4) >= 1  # fmt: skip


BINDING_CALL = """
import torch, sys
sys.path.insert(0, "tests/ops")
from paged_cases import paged_case
from astrai_pl import ops
case = paged_case([1], [4], 4, 2, 64, torch.bfloat16, "cuda")
narrow = [t[..., :32].contiguous() for t in (case.q, case.k_pool, case.v_pool)]
for args in [(*narrow, case.kv_indptr), (case.q, case.k_pool, case.v_pool, case.kv_indptr.float())]:
    try:
        ops.load().paged_decode(*args, case.kv_indices, None, torch.empty_like(args[0]), 1, 4, 0.1, 0, 0.0, 0)
    except RuntimeError as err:
        print("raised:", str(err).splitlines()[0])
"""


def test_the_binding_raises_its_own_checks_without_crashing():
    """The extension called directly (no Python checks in front): in a child process, so a crash in the
    C++ exception path shows as a failed test instead of ending the session."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", BINDING_CALL], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raised: paged_decode: head_dim must be 64, 128 or 256, got 32" in done.stdout
    assert "raised: paged_decode: kv_indptr must be int32, got Float" in done.stdout


@pytest.mark.parametrize("name,page_size", [("flashinfer", 16), ("flash", 256)])
@pytest.mark.parametrize("features", [{}, {"window": 100, "softcap": 30.0}])
def test_library_decode_equals_the_reference(name, page_size, features):
    from astrai_pl.ops.decode_libs import DECODE_LIBS, why_not
    from astrai_pl.ops.prefill import PagedBatch

    if why_not(name, torch.device("cuda"), torch.bfloat16, page_size):
        pytest.skip(why_not(name, torch.device("cuda"), torch.bfloat16, page_size))
    kv_lens, pages = [1, 700, 33], torch.randperm(64)
    table = torch.zeros(3, 4 * page_size, dtype=torch.int32)
    for r, n in enumerate(kv_lens):
        for j in range(n):
            table[r, j] = pages[r * 4 + j // page_size] * page_size + j % page_size
    k_pool, v_pool = (torch.randn(64 * page_size, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    table = table.cuda()
    kv_indptr = torch.tensor([0, 1, 701, 734], dtype=torch.int32, device="cuda")
    rows = torch.arange(3, device="cuda")
    ref = ops.paged_decode_ref(q, k_pool, v_pool, kv_indptr, req_to_token=table, rows=rows, **features)
    out = DECODE_LIBS[name](q, k_pool, v_pool, PagedBatch([1] * 3, kv_lens, table, page_size), **features)
    assert relative_error(out, ref) <= limit(torch.bfloat16)
