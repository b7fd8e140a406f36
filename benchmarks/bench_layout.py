"""Why the engine multiplies by copies of the weights on CPU: the small preset's projections, timed.

For a decode step's few rows (M = 8, 16, 32, 64) and prefill chunks (M = 200, 1024), each projection of the
`small` preset is timed five ways: `F.linear(x, W)` against the stored (out, in) weight, `x @ Wt`
against a contiguous (in, out) copy, one `x @ [Wq Wk Wv]t` against the joined copy (q/k/v, gate/up),
the fused CPU kernel `panel_matmul` against the joined copy packed in 64-column panels (where the
kernels build; `astrai_pl.ops.cpu`), and oneDNN's matmul on the stored weight (where PyTorch has it: what
the engine runs for a prefill chunk's rows). Each repetition runs the projection of all 8 layers in turn, as a
forward does, so the weights come from memory rather than from a cache that one layer's weights would
fit in; the time is per projection. Medians of interleaved repetitions, 2 threads. The inference docs
quote this script.

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

from astrai_pl.model import layers as layers_module  # noqa: E402
from astrai_pl.ops import cpu  # noqa: E402


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


def layouts(rows: int, per_layer: list[list]) -> dict:
    """The ways of computing `[lin(x) for lin in linears]` for an x of `rows` rows, each over every layer."""
    x = torch.randn(rows, per_layer[0][0].in_features)
    copies = [[lin.weight.t().contiguous() for lin in linears] for linears in per_layer]
    joined = [torch.cat([lin.weight for lin in linears]).t().contiguous() for linears in per_layer]
    ways = {"linear": lambda: [[F.linear(x, lin.weight) for lin in linears] for linears in per_layer],
            "copy": lambda: [[x @ c for c in cs] for cs in copies],
            "joined": lambda: [x @ j for j in joined]}
    if layers_module._ONEDNN:  # what the engine uses for a prefill chunk's rows (layers._as_stored)
        ways["onednn"] = lambda: [[torch.ops.mkldnn._linear_pointwise(x, lin.weight, None, "none", [], "")
                                   for lin in linears] for linears in per_layer]
    if cpu.available():
        out = sum(lin.out_features for lin in per_layer[0])
        panels = [cpu.pack_panels([lin.weight for lin in linears],
                                  torch.zeros(cpu.panels_shape(out, linears[0].in_features))) for linears in per_layer]
        ways["panels"] = lambda: [cpu.panel_matmul(x, p, out) for p in panels]
    return ways


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 200, 1024])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    setup()
    layers = small_model().layers
    groups = {
        "q/k/v": [[b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj] for b in layers],
        "o": [[b.self_attn.o_proj] for b in layers],
        "gate/up": [[b.mlp.gate_proj, b.mlp.up_proj] for b in layers],
        "down": [[b.mlp.down_proj] for b in layers],
    }
    if not cpu.available():
        print(f"(no panel kernel here: {cpu.unavailable_reason()})")
    print(f"{'rows':>5} {'projection':>10} {'F.linear (out, in)':>19} {'x @ (in, out)':>14} {'joined':>8} "
          f"{'panels':>8} {'oneDNN':>8} {'best vs F.linear':>17}")
    with torch.no_grad():
        for m in args.rows:
            for name, per_layer in groups.items():
                ways = layouts(m, per_layer)
                t = {k: v / len(layers) for k, v in
                     median_us(ways, args.reps if m < 1024 else max(5, args.reps // 10)).items()}
                joined = t["joined"] if len(per_layer[0]) > 1 else float("nan")
                best = min(v for k, v in t.items() if k != "linear" and (k != "joined" or len(per_layer[0]) > 1))
                print(f"{m:>5} {name:>10} {t['linear']:>16.0f} us {t['copy']:>11.0f} us {joined:>5.0f} us "
                      f"{t.get('panels', float('nan')):>5.0f} us {t.get('onednn', float('nan')):>5.0f} us "
                      f"{t['linear'] / best:>16.2f}x")


if __name__ == "__main__":
    main()
