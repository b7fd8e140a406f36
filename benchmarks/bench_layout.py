"""Why the engine multiplies by (in, out) weight copies on CPU: the small preset's projections, timed.

For a decode step's few rows (M = 8, 16, 32) and a prefill chunk (M = 1024), each projection of the
`small` preset is timed three ways: `F.linear(x, W)` against the stored (out, in) weight, `x @ Wt`
against a contiguous (in, out) copy, and, for q/k/v and gate/up, one `x @ [Wq Wk Wv]t` against the
joined copy. Medians of interleaved repetitions, 2 threads. The inference docs quote this script.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_layout.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import setup, small_model  # noqa: E402


def median_us(fns: dict, reps: int) -> dict[str, float]:
    """Median microseconds of each function, the functions interleaved within every repetition."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def layouts(rows: int, linears: list) -> dict:
    """The three ways of computing `[lin(x) for lin in linears]` for an x of `rows` rows."""
    x = torch.randn(rows, linears[0].in_features)
    copies = [lin.weight.t().contiguous() for lin in linears]
    joined = torch.cat([lin.weight for lin in linears]).t().contiguous()
    return {"linear": lambda: [F.linear(x, lin.weight) for lin in linears],
            "copy": lambda: [x @ c for c in copies],
            "joined": lambda: x @ joined}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 1024])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    setup()
    block = small_model().layers[0]
    attn, mlp = block.self_attn, block.mlp
    groups = {"q/k/v": [attn.q_proj, attn.k_proj, attn.v_proj], "o": [attn.o_proj],
              "gate/up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}
    print(f"{'rows':>5} {'projection':>10} {'F.linear (out, in)':>19} {'x @ (in, out)':>14} {'joined':>8} {'speed-up':>9}")
    with torch.no_grad():
        for m in args.rows:
            for name, linears in groups.items():
                t = median_us(layouts(m, linears), args.reps if m < 1024 else max(5, args.reps // 10))
                best = min(t["copy"], t["joined"])
                print(f"{m:>5} {name:>10} {t['linear']:>16.0f} us {t['copy']:>11.0f} us "
                      f"{t['joined'] if len(linears) > 1 else float('nan'):>5.0f} us {t['linear'] / best:>8.2f}x")


if __name__ == "__main__":
    main()
