"""One-command GPU check of the fused kernels: build, correctness, engine parity, timings.

    python benchmarks/gpu_check.py [--quick] [--out FILE]

On a CUDA machine it
1. builds astrai_pl.ops (just-in-time, with ninja; cached afterwards);
2. checks every kernel against its PyTorch reference on fresh random inputs, the output filled with NaN
   beforehand so that an element the kernel never writes shows (relative error max|out − ref| / max|ref|:
   at most 1e-2 for bfloat16 / float16, 1e-5 for float32);
3. checks that greedy decoding through astrai_pl.inference.Engine gives the same tokens with the cuda
   backend as with the torch backend, on a random model (skipped, with a note, if there is no Engine);
4. times decode and prefill at batch 1 / 8 / 64 and context 512 / 4096 (32 query heads, 8 kv heads,
   head_dim 128, bfloat16) against gather + SDPA (what the torch backend does) and against SDPA on K/V
   that is already contiguous, and prints a markdown table (also written to --out).

Exit status: 0 when every correctness check passes, 1 when one fails, 2 without a CUDA device.
Needs only torch, plus nvcc and ninja to build; no Lightning, wandb, jsonargparse or datasets.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "ops")]

from paged_cases import paged_case, relative_error  # noqa: E402

from astrai_pl import ops  # noqa: E402
from astrai_pl.ops.prefill import PREFILL_CHOICES, override_prefill  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HEADS = [(32, 8), (28, 4), (16, 16), (8, 1), (12, 2)]  # (Hq, Hkv): group sizes 4, 7, 1, 8, 6


def limit(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


class Report:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.count = 0

    def check(self, name: str, err: float, bound: float) -> None:
        self.count += 1
        ok = err <= bound
        if not ok:
            self.failures.append(name)
        if not ok or self.count % 25 == 1:
            print(
                f"  {'ok  ' if ok else 'FAIL'} {name}: relative error {err:.2e} (limit {bound:.0e})",
                flush=True,
            )


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


# -- correctness --------------------------------------------------------------------------------------------
def check_rotary(report: Report, device: str) -> None:
    for dtype, table32, head_dim, use_positions in itertools.product(
        DTYPES, (False, True), (64, 96, 128, 256), (False, True)
    ):
        n, hq, hk = 37, 6, 2
        qkv = torch.randn(n, hq + 2 * hk, head_dim, device=device).to(dtype)  # q, k, v heads side by side
        rows = 50 if use_positions else n
        angles = torch.rand(rows, head_dim // 2, device=device) * 100
        cos = torch.cat([angles.cos()] * 2, -1).to(torch.float32 if table32 else dtype)
        sin = torch.cat([angles.sin()] * 2, -1).to(torch.float32 if table32 else dtype)
        positions = torch.randint(0, rows, (n,), device=device) if use_positions else None
        expected = qkv.clone()
        ops.rotary_emb_ref(expected[:, :hq], expected[:, hq : hq + hk], cos, sin, positions)
        with ops.override_available(True):
            ops.rotary_emb(qkv[:, :hq], qkv[:, hq : hq + hk], cos, sin, positions)  # strided views, in place
        name = f"rotary {dtype} D={head_dim} table={'fp32' if table32 else 'same'} positions={use_positions}"
        report.check(name, relative_error(qkv, expected), limit(dtype))


FEATURES = ({}, {"window": 300}, {"softcap": 30.0}, {"window": 9, "softcap": 5.0})  # Mistral, Gemma 2


def decode_cases(quick: bool):
    dims = (64, 128) if quick else (64, 128, 256)
    for dtype, head_dim, (hq, hkv) in itertools.product(DTYPES, dims, HEADS):
        for i, (addressing, num_splits) in enumerate((("kv_indices", None), ("int32", 1), ("req_to_token", 7))):
            yield dtype, head_dim, hq, hkv, addressing, num_splits, FEATURES[(i + head_dim // 64) % len(FEATURES)]


def check_decode(report: Report, device: str, quick: bool) -> None:
    for seed, (dtype, head_dim, hq, hkv, addressing, num_splits, features) in enumerate(decode_cases(quick)):
        kv_lens = [1, 3000, 17, 256, 257, 900]
        case = paged_case([1] * len(kv_lens), kv_lens, hq, hkv, head_dim, dtype, device, seed)
        ref = ops.paged_decode_ref(case.q, case.k_pool, case.v_pool, case.kv_indptr, case.kv_indices, **features)
        address = dict(req_to_token=case.req_to_token, rows=case.rows) if addressing == "req_to_token" else {}
        indices = (
            None if address else case.kv_indices.to(torch.int32 if addressing == "int32" else torch.int64)
        )
        out = nan_like(case.q)
        with ops.override_available(True):
            ops.paged_decode(
                case.q,
                case.k_pool,
                case.v_pool,
                case.kv_indptr,
                indices,
                num_splits=num_splits,
                out=out,
                **address,
                **features,
            )
        name = f"decode {dtype} D={head_dim} Hq={hq} Hkv={hkv} {addressing} splits={num_splits or 'auto'} {features}"
        report.check(name, relative_error(out, ref), limit(dtype))


def check_prefill(report: Report, device: str, quick: bool) -> None:
    dims = (64, 128) if quick else (64, 128, 256)
    shapes = [([1, 40, 7, 100], [1, 40, 30, 333]), ([33], [33]), ([5, 64, 1], [5, 200, 1000])]
    for seed, (dtype, head_dim, (hq, hkv)) in enumerate(itertools.product(DTYPES, dims, HEADS)):
        q_lens, kv_lens = shapes[seed % len(shapes)]
        case = paged_case(q_lens, kv_lens, hq, hkv, head_dim, dtype, device, seed)
        for choice, addressing in itertools.product(PREFILL_CHOICES, ("kv_indices", "req_to_token")):
            features = FEATURES[(seed + len(choice)) % len(FEATURES)]
            address = (
                dict(req_to_token=case.req_to_token, rows=case.rows) if addressing == "req_to_token" else {}
            )
            indices = None if address else case.kv_indices
            args = (case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, indices)
            ref = ops.paged_prefill_ref(*args, **address, **features)
            out = nan_like(case.q)
            with override_prefill(choice):
                ops.paged_prefill(*args, out=out, **address, **features)
            name = f"prefill {choice} {dtype} D={head_dim} Hq={hq} Hkv={hkv} {addressing} q={q_lens} {features}"
            report.check(name, relative_error(out, ref), limit(dtype))


def check_step_and_store(report: Report, device: str) -> None:
    for dtype in DTYPES:
        case = paged_case([1, 1, 1, 9, 40], [70, 1, 5000, 9, 45], 32, 8, 128, dtype, device, seed=99)
        args = (case.q, case.k_pool, case.v_pool, case.qo_indptr, case.kv_indptr, case.kv_indices)
        with ops.override_available(True):
            out = ops.paged_attention(*args)
        report.check(
            f"paged_attention mixed step {dtype}",
            relative_error(out, ops.paged_attention_ref(*args)),
            limit(dtype),
        )
        for slots_dtype in (torch.int32, torch.int64):
            k_pool, v_pool = nan_like(case.k_pool), nan_like(case.v_pool)
            slots = torch.randperm(k_pool.shape[0], device=device)[:50].to(slots_dtype)
            k, v = torch.randn(2, 50, 8, 128, device=device).to(dtype)
            with ops.override_available(True):
                ops.store_kv(k_pool, v_pool, slots, k, v)
            err = max(relative_error(k_pool[slots.long()], k), relative_error(v_pool[slots.long()], v))
            untouched = torch.ones(k_pool.shape[0], dtype=torch.bool, device=device)
            untouched[slots.long()] = False
            err = (
                err
                if bool(k_pool[untouched].isnan().all() and v_pool[untouched].isnan().all())
                else float("inf")
            )
            report.check(f"store_kv {dtype} slots {slots_dtype}", err, 0.0)


def check_engine(device: str) -> bool | None:
    """Greedy tokens with the cuda backend == with the torch backend; None when there is no Engine."""
    try:
        from astrai_pl.inference import Engine, SamplingParams
        from astrai_pl.inference.attention.backends import attn_backend
    except ImportError as err:
        print(f"  note: engine check skipped, astrai_pl.inference has no Engine yet ({err})")
        return None
    from astrai_pl.model import ModelConfig, Transformer

    torch.manual_seed(0)
    cfg = ModelConfig.from_name("small", num_hidden_layers=2)  # head_dim 64, 8 query / 2 kv heads
    prompts = [torch.randint(3, cfg.vocab_size, (n,)).tolist() for n in (5, 40, 130, 1)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = Transformer(cfg).to(device=device, dtype=dtype).eval()
        tokens = {}
        for backend in ("torch", "cuda"):
            engine = Engine(model, page_size=16, max_total_tokens=4096)
            with attn_backend(backend), torch.no_grad():
                tokens[backend] = [c.token_ids for c in engine.generate(prompts, params)]
        same = tokens["torch"] == tokens["cuda"]
        verdict = "ok  " if same else "FAIL" if dtype == torch.float32 else "note"
        print(
            f"  {verdict} engine greedy {dtype}: cuda backend {'equals' if same else 'differs from'} torch backend"
        )
        if dtype == torch.float32:
            ok = ok and same
    return ok


# -- timings ------------------------------------------------------------------------------------------------
def timed(fn, min_reps: int = 10, min_seconds: float = 0.2) -> float:
    """Median milliseconds of fn() on the current stream, after two warm-up calls."""
    for _ in range(2):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_seconds:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
        if len(times) >= 200:
            break
    return statistics.median(times)


def bench_attention(batch: int, ctx: int, prefill: bool, device: str) -> tuple[float, float, float]:
    """Milliseconds of ours, gather + SDPA, and SDPA on K/V already laid out for it (no gather)."""
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    group = hq // hkv
    slots = torch.randperm(batch * ctx * 2, device=device)[: batch * ctx]
    k_pool = torch.randn(batch * ctx * 2, hkv, d, device=device, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    table = slots.view(batch, ctx)
    kv_indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * ctx
    q_len = ctx if prefill else 1
    q = torch.randn(batch * q_len, hq, d, device=device, dtype=dtype)
    qo_indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * q_len

    if prefill:  # ours: the default prefill implementation (astrai_pl.ops.prefill); the peer flash SDPA, causal,
        # with the kv heads repeated for each query head of their group

        def ours():
            return ops.paged_prefill(q, k_pool, v_pool, qo_indptr, kv_indptr, slots, max_q_len=q_len)

        def layout(pool: torch.Tensor) -> torch.Tensor:  # (B, Hq, C, D)
            return pool[table].transpose(1, 2).repeat_interleave(group, dim=1)

        def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qb = q.view(batch, q_len, hq, d).transpose(1, 2)
            return F.scaled_dot_product_attention(qb, k, v, is_causal=True)
    else:  # the torch backend's decode: each kv head's query group attends as a length-G query

        def ours():
            return ops.paged_decode(q, k_pool, v_pool, kv_indptr, slots, max_kv_len=ctx)

        def layout(pool: torch.Tensor) -> torch.Tensor:  # (B, Hkv, C, D)
            return pool[table].transpose(1, 2)

        def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q.view(batch, hkv, group, d), k, v)

    k_dense, v_dense = layout(k_pool).contiguous(), layout(v_pool).contiguous()
    with ops.override_available(True):
        mine = timed(ours)
    gathered = timed(lambda: sdpa(layout(k_pool), layout(v_pool)))
    dense = timed(lambda: sdpa(k_dense, v_dense))
    return mine, gathered, dense


def bench_store_kv(n: int, device: str) -> str:
    k_pool = torch.zeros(4 * n, 8, 128, device=device, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    slots = torch.randperm(4 * n, device=device)[:n]
    k, v = torch.randn(2, n, 8, 128, device=device, dtype=torch.bfloat16)
    with ops.override_available(True):
        ours = timed(lambda: ops.store_kv(k_pool, v_pool, slots, k, v))
    peer = timed(lambda: (k_pool.index_copy_(0, slots, k), v_pool.index_copy_(0, slots, v)))
    return f"| store_kv | {n} tokens | {ours:.4f} | {peer:.4f} (two index_copy_) | | {peer / ours:.2f}× |"


def bench_rotary(n: int, device: str) -> str:
    q = torch.randn(n, 32, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(n, 8, 128, device=device, dtype=torch.bfloat16)
    cos, sin = torch.randn(2, n, 128, device=device, dtype=torch.bfloat16)
    with ops.override_available(True):
        ours = timed(lambda: ops.rotary_emb(q, k, cos, sin))

    def rotate(
        x: torch.Tensor,
    ) -> torch.Tensor:  # what the model runs: x·cos + rotate_half(x)·sin in bfloat16
        return x * cos[:, None] + torch.cat((-x[..., 64:], x[..., :64]), -1) * sin[:, None]

    peer = timed(lambda: (rotate(q), rotate(k)))
    return f"| rotary_emb | {n} tokens | {ours:.4f} | {peer:.4f} (the model's torch ops) | | {peer / ours:.2f}× |"


def timing_table(device: str, quick: bool) -> tuple[list[str], float | None]:
    lines = [
        "| op | batch × context | ours (ms) | gather + SDPA (ms) | SDPA, K/V contiguous (ms) | gather + SDPA / ours |",
        "|---|---|---|---|---|---|",
    ]
    target = None
    for prefill, batch, ctx in itertools.product((False, True), (1, 8, 64), (512, 4096)):
        if quick and batch * ctx > 8 * 4096:
            continue
        ours, gathered, dense = bench_attention(batch, ctx, prefill, device)
        op = "prefill" if prefill else "decode"
        lines.append(
            f"| {op} | {batch} × {ctx} | {ours:.4f} | {gathered:.4f} | {dense:.4f} | {gathered / ours:.2f}× |"
        )
        print("  " + lines[-1], flush=True)
        if not prefill and batch == 64 and ctx == 4096:
            target = gathered / ours
    lines += [bench(n, device) for bench in (bench_store_kv, bench_rotary) for n in (64, 8192)]
    return lines, target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer shapes (head_dim 256 and the largest timings off)"
    )
    parser.add_argument("--out", type=Path, help="also write the timing table (markdown) here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA device; torch.cuda.is_available() is False here")
        return 2
    device = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references must be float32
    torch.backends.cudnn.allow_tf32 = False
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}",
        flush=True,
    )
    start = time.perf_counter()
    try:
        ops.load()
    except ops.KernelsUnavailable as err:
        print(f"FAILED to build the kernels: {err}\n{err.__cause__ or ''}")
        return 1
    print(f"built/loaded the kernels in {time.perf_counter() - start:.0f} s", flush=True)

    report = Report()
    for title, check in (
        ("rotary_emb", lambda: check_rotary(report, device)),
        ("paged_decode", lambda: check_decode(report, device, args.quick)),
        ("paged_prefill", lambda: check_prefill(report, device, args.quick)),
        ("paged_attention and store_kv", lambda: check_step_and_store(report, device)),
    ):
        print(f"{title}:", flush=True)
        try:
            check()
            torch.cuda.synchronize()
        except Exception as err:  # a launch or memory error leaves the CUDA context unusable: stop here
            print(f"  FAIL {title} raised {type(err).__name__}: {err}")
            print("FAILED: " + ", ".join([*report.failures, title]))
            return 1
    print(f"kernels: {report.count - len(report.failures)} of {report.count} checks passed")
    print("engine:", flush=True)
    engine_ok = check_engine(device)

    print(
        "timings (32 query heads, 8 kv heads, head_dim 128, bfloat16; decode q_len 1, prefill q_len = context):"
    )
    lines, target = timing_table(device, args.quick)
    table = "\n".join(lines)
    print(table)
    if target is not None:
        print(
            f"decode at batch 64, context 4096: {target:.2f}× gather + SDPA (target ≥ 2×): {'met' if target >= 2 else 'NOT met'}"
        )
    if args.out:
        args.out.write_text(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n{table}\n")
    failed = report.failures + ([] if engine_ok in (True, None) else ["engine greedy parity"])
    print("FAILED: " + ", ".join(failed) if failed else "all correctness checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
