"""The PyTorch references of astrai_pl.ops against naive per-request attention, and the ops' fallback."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from paged_cases import paged_case, relative_error

from astrai_pl import ops
from astrai_pl.model import ModelConfig
from astrai_pl.model.layers import RotaryEmbedding, apply_rotary
from astrai_pl.ops import build

ROOT = Path(__file__).resolve().parents[2]


def naive_attention(case, causal: bool = True) -> torch.Tensor:
    """Per request: gather K/V slot by slot, repeat heads for GQA, scaled_dot_product_attention in float32."""
    group = case.q.shape[1] // case.k_pool.shape[1]
    qo, kv = case.qo_indptr.tolist(), case.kv_indptr.tolist()
    out = torch.empty(case.q.shape, dtype=torch.float32)
    for b in range(case.num_requests):
        slots = [int(s) for s in case.kv_indices[kv[b] : kv[b + 1]]]
        k = torch.stack([case.k_pool[s] for s in slots]).float().transpose(0, 1).repeat_interleave(group, 0)
        v = torch.stack([case.v_pool[s] for s in slots]).float().transpose(0, 1).repeat_interleave(group, 0)
        q = case.q[qo[b] : qo[b + 1]].float().transpose(0, 1)  # (Hq, E, D)
        n_q, n_kv = q.shape[1], k.shape[1]
        mask = torch.ones(n_q, n_kv, dtype=torch.bool)
        if causal:
            mask = mask.tril(n_kv - n_q)
        out[qo[b] : qo[b + 1]] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)
    return out


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


HEADS = [(4, 4), (8, 2), (6, 1), (12, 4)]


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_ref_matches_naive_sdpa(num_q_heads, num_kv_heads, dtype):
    case = paged_case([5, 1, 17, 3], [9, 1, 40, 3], num_q_heads, num_kv_heads, 64, dtype, seed=1)
    out = ops.paged_prefill_ref(
        case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices
    )
    assert out.dtype == dtype and out.shape == case.q.shape
    assert relative_error(out, naive_attention(case)) <= tolerance(dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_ref_matches_naive_sdpa(head_dim):
    kv_lens = [1, 7, 300, 64, 2]
    case = paged_case([1] * len(kv_lens), kv_lens, 8, 2, head_dim, seed=2)
    out = ops.paged_decode_ref(case.q, case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices)
    assert relative_error(out, naive_attention(case)) <= 1e-5


def test_req_to_token_addressing_matches_kv_indices():
    case = paged_case([3, 1, 6], [10, 4, 6], 4, 2, 64, seed=3)
    by_indices = ops.paged_prefill_ref(
        case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices.to(torch.int32)
    )
    by_table = ops.paged_prefill_ref(
        case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr,
        req_to_token=case.req_to_token, rows=case.rows,
    )  # fmt: skip
    torch.testing.assert_close(by_table, by_indices, rtol=0, atol=0)
    decode = paged_case([1, 1, 1], [5, 9, 2], 4, 2, 64, seed=4)
    torch.testing.assert_close(
        ops.paged_decode_ref(decode.q, decode.k_pool, decode.v_pool, decode.kv_indptr, req_to_token=decode.req_to_token, rows=decode.rows),
        ops.paged_decode_ref(decode.q, decode.k_pool, decode.v_pool, decode.kv_indptr, decode.kv_indices),
    )  # fmt: skip


def test_non_causal_prefill_and_explicit_scale():
    case = paged_case([4, 2], [4, 9], 4, 4, 64, seed=5)
    out = ops.paged_prefill_ref(
        case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices, causal=False
    )
    assert relative_error(out, naive_attention(case, causal=False)) <= 1e-5
    doubled = ops.paged_prefill_ref(
        case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices,
        scale=2 / math.sqrt(64),
    )  # fmt: skip
    case.q = case.q * 2
    assert relative_error(doubled, naive_attention(case)) <= 1e-5


def test_attention_ref_on_a_mixed_step_and_out_argument():
    case = paged_case([1, 1, 8, 3], [12, 30, 8, 20], 8, 4, 128, seed=6)  # two decodes first, then prefills
    out = ops.paged_attention_ref(
        case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices
    )
    assert relative_error(out, naive_attention(case)) <= 1e-5
    buffer = torch.full_like(case.q, float("nan"))
    returned = ops.paged_prefill_ref(
        case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices, out=buffer
    )
    assert returned is buffer and torch.equal(buffer, out)


def test_reference_rejects_bad_addressing_and_overlong_queries():
    case = paged_case([3], [5], 4, 2, 64)
    args = (case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr)
    with pytest.raises(ValueError, match="kv_indices, or with req_to_token and rows"):
        ops.paged_prefill_ref(*args, case.kv_indices, req_to_token=case.req_to_token, rows=case.rows)
    with pytest.raises(ValueError, match="kv_indices, or with req_to_token and rows"):
        ops.paged_prefill_ref(*args, req_to_token=case.req_to_token)
    too_many = paged_case([6], [5], 4, 2, 64)
    with pytest.raises(ValueError, match="6 queries but a context of 5"):
        ops.paged_prefill_ref(
            too_many.q,
            too_many.k_pool,
            too_many.v_pool,
            too_many.qo_indptr,
            too_many.kv_indptr,
            too_many.kv_indices,
        )
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.paged_prefill_ref(
            case.q[:, :3], case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_ref_matches_the_model(dtype):
    cfg = ModelConfig.from_name("debug")
    rope = RotaryEmbedding(cfg)
    B, T, D = 2, 5, cfg.head_size
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    cos, sin = rope(positions, torch.float32)  # (B, T, D)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, 4, D, generator=g).to(dtype)
    k = torch.randn(B, T, 2, D, generator=g).to(dtype)
    expected_q, expected_k = apply_rotary(q.float(), cos, sin), apply_rotary(k.float(), cos, sin)
    q2, k2 = q.clone(), k.clone()
    returned = ops.rotary_emb_ref(q2, k2, cos, sin)
    assert returned[0] is q2 and returned[1] is k2
    assert relative_error(q2, expected_q) <= tolerance(dtype) and relative_error(k2, expected_k) <= tolerance(
        dtype
    )
    table_cos, table_sin = rope(torch.arange(16)[None], torch.float32)  # a (P, D) table indexed by position
    q3, k3 = q.clone().view(B * T, 4, D), k.clone().view(B * T, 2, D)
    ops.rotary_emb_ref(q3, k3, table_cos[0], table_sin[0], positions.reshape(-1))
    torch.testing.assert_close(q3.view_as(q), q2, rtol=0, atol=0)
    torch.testing.assert_close(k3.view_as(k), k2, rtol=0, atol=0)


def test_store_kv_ref_writes_the_slots():
    k_pool, v_pool = torch.zeros(10, 2, 64), torch.zeros(10, 2, 64)
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    ops.store_kv_ref(k_pool, v_pool, torch.tensor([7, 0, 4], dtype=torch.int32), k, v)
    assert torch.equal(k_pool[[7, 0, 4]], k) and torch.equal(v_pool[[7, 0, 4]], v)
    assert k_pool[[1, 2, 3, 5, 6, 8, 9]].abs().sum() == 0


def test_decode_splits_cover_the_context_and_fill_the_gpu():
    for blocks in (1, 8, 64, 512, 4096):
        for max_kv in (1, 100, 256, 257, 4096, 100_000):
            splits, size = ops.decode_splits(blocks, max_kv, num_sms=132)
            assert 1 <= splits <= 64 and splits * size >= max_kv and (splits - 1) * size < max_kv
            assert splits == 1 or size >= 256
    assert ops.decode_splits(512, 4096, 132)[0] == 1  # batch 64 × 8 kv heads already fills 132 SMs
    assert ops.decode_splits(8, 4096, 132)[0] == 16  # one request: 256-token splits


@pytest.fixture
def fresh_fallback_log(monkeypatch):
    monkeypatch.setattr(build, "_fallback_logged", False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_flag_is_false_on_cpu_and_load_says_why():
    assert ops.available() is False
    assert "no CUDA device" in ops.unavailable_reason()
    with pytest.raises(ops.KernelsUnavailable, match="torch.cuda.is_available\\(\\) is False"):
        ops.load()


def test_fallback_runs_the_reference_and_logs_once(fresh_fallback_log, caplog):
    case = paged_case([1, 1], [6, 3], 4, 2, 64, seed=7)
    with caplog.at_level(logging.INFO, logger="astrai_pl.ops"):
        out = ops.paged_decode(case.q, case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices)
        ops.paged_attention(case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices)
        q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
        cos, sin = torch.randn(3, 64), torch.randn(3, 64)
        ops.rotary_emb(q.clone(), k.clone(), cos, sin)
    lines = [r for r in caplog.records if r.name == "astrai_pl.ops"]
    assert len(lines) == 1 and "PyTorch reference" in lines[0].getMessage()
    assert torch.equal(
        out, ops.paged_decode_ref(case.q, case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices)
    )


def test_override_forces_either_way(fresh_fallback_log, caplog):
    case = paged_case([1], [4], 4, 2, 64)
    with ops.override_available(True):
        assert ops.available() is True
        with pytest.raises(ops.KernelsUnavailable, match="forced on, but its inputs are on cpu"):
            ops.paged_decode(case.q, case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices)
    with caplog.at_level(logging.INFO, logger="astrai_pl.ops"), ops.override_available(False):
        assert ops.available() is False
        ops.paged_decode(case.q, case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices)
    assert not [r for r in caplog.records if r.name == "astrai_pl.ops"]  # asked for, so not a fallback
    assert build.forced() is None


HEAVY = [
    "lightning",
    "wandb",
    "jsonargparse",
    "datasets",
    "astrai_pl.data",
    "astrai_pl.objectives",
    "astrai_pl.cli",
]


def test_ops_and_the_gpu_check_import_nothing_heavy():
    """The GPU machine has torch but not wandb, jsonargparse or datasets."""
    code = (
        "import runpy, sys\n"
        "import astrai_pl.ops\n"
        f"heavy = {HEAVY!r}\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "try:\n"
        "    runpy.run_path('benchmarks/gpu_check.py', run_name='__main__')\n"
        "except SystemExit as stop:\n"
        "    print('exit', stop.code)\n"
        "print('heavy', loaded + [m for m in heavy if m in sys.modules])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "heavy []" in done.stdout, done.stdout
    if not torch.cuda.is_available():
        assert "needs a CUDA device" in done.stdout + done.stderr and "exit 2" in done.stdout


def test_reference_window_and_softcap_by_hand():
    """window 1: each query sees only its own position (out = its V row); a soft-cap c bounds scores in
    (-c, c), so with a tiny c every visible key weighs the same (out = the mean of the visible V rows)."""
    case = paged_case([3, 2], [5, 4], 4, 2, 64, seed=11)
    args = (case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices)
    own = torch.cat([case.kv_indices[2:5], case.kv_indices[7:9]]).long()  # each query's own slot
    expected = case.v_pool[own].repeat_interleave(2, dim=1)  # (T, Hq, D): kv head h // 2
    torch.testing.assert_close(ops.paged_prefill_ref(*args, window=1), expected)
    out = ops.paged_prefill_ref(*args, softcap=1e-6, window=2)
    previous = torch.cat([case.kv_indices[1:4], case.kv_indices[6:8]]).long()
    torch.testing.assert_close(out, (case.v_pool[own] + case.v_pool[previous]).repeat_interleave(2, dim=1) / 2)
    decode = ops.paged_decode_ref(case.q[[2, 4]], case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices,
                                  window=1)  # fmt: skip
    torch.testing.assert_close(decode, expected[[2, 4]])
