"""The CPU decode kernel on a sliding-window layer: a window of W over a long context against the same context
at full attention, and against a context of W, in one run. The kernel reads only the window's slots, so the
windowed call should cost what a W-token context costs, whatever the context's length. No peer: an ablation.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_sliding_decode.py [--context 4096] [--window 256]

One thread: on a shared machine a descheduled OpenMP thread stalls the whole call and swamps the difference.
"""

from __future__ import annotations

import argparse
import time

import torch

from astrai_pl.ops import cpu as cpu_ops


def best_ms(call, repeats: int = 5, inner: int = 20) -> float:
    """The best of `repeats` means over `inner` calls, in ms (the machine is shared: the minimum is the signal)."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            call()
        best = min(best, (time.perf_counter() - start) / inner * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    if not cpu_ops.available():
        raise SystemExit(f"the fused CPU kernels do not run here: {cpu_ops.unavailable_reason()}")
    n, hq, hkv, d, length = args.requests, 8, 2, 64, args.context
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(n * length, hkv, d, generator=gen), torch.randn(n * length, hkv, d, generator=gen)
    q = torch.randn(n, hq, d, generator=gen)
    table = torch.arange(n * length, dtype=torch.int32).view(n, length).contiguous()
    rows = torch.arange(n)

    def run(kv_len: int, window: int | None):
        lens = torch.full((n,), kv_len, dtype=torch.int32)
        return lambda: cpu_ops.paged_decode_attention(q, k, v, table, rows, lens, kv_len, window=window)

    full = best_ms(run(length, None))
    windowed = best_ms(run(length, args.window))
    short = best_ms(run(args.window, None))
    print(f"{n} requests, {hq}/{hkv} heads, head_dim {d}, {torch.get_num_threads()} threads")
    print(f"context {length}, full attention:   {full:8.3f} ms")
    print(f"context {length}, window {args.window}:    {windowed:8.3f} ms  ({full / windowed:.1f}x faster)")
    print(f"context {args.window}, full attention:    {short:8.3f} ms  (windowed / this: {windowed / short:.2f})")


if __name__ == "__main__":
    main()
