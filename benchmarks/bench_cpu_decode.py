"""The one-call decode layer (astrai_pl/inference/attention/cpu_decode.py) against the module path, in one process.

One engine on random weights of a preset (`small` by default), the ragged workload of bench_serve.py (16
prompts of 16-200 tokens x 64 new, greedy), rounds alternating between the two paths (the runner's
`cpu_decode` set or None), ABBA. Reported: the median time of the decode steps (every request decoding one
token) and of the whole run for each path, the median per-round ratio of the decode steps, and whether the
two paths generated the same tokens. Not a comparison with a peer: it says what the one-call layer saves.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_cpu_decode.py [--preset small] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import astrai_pl  # noqa: F401  (before torch: OMP_WAIT_POLICY as the package sets it)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import workloads, write_model  # noqa: E402
from harness import setup  # noqa: E402

from astrai_pl.inference import Engine, SamplingParams  # noqa: E402
from astrai_pl.inference import runner as runner_module  # noqa: E402
from astrai_pl.model import Transformer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    setup(2)
    with tempfile.TemporaryDirectory() as tmp:
        vocab = write_model(args.preset, Path(tmp))
        engine = Engine(Transformer.from_pretrained(tmp).eval(), page_size=16)
    one_call = engine.runner.cpu_decode
    if one_call is None:
        raise SystemExit(f"{args.preset}: the one-call decode layer does not apply to this model")
    prompts = workloads(vocab)["ragged"]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    forward = runner_module.ModelRunner.forward
    decode = [0.0]

    def timed(self, plan):
        start = time.perf_counter()
        out = forward(self, plan)
        if all(n == 1 for _, n in plan):
            decode[0] += time.perf_counter() - start
        return out

    runner_module.ModelRunner.forward = timed
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    tokens: dict[bool, list] = {}
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            engine.runner.cpu_decode = one_call if on else None
            engine.reset_prefix_cache()
            decode[0] = 0.0
            start = time.perf_counter()
            tokens[on] = [o.token_ids for o in engine.generate(prompts, params)]
            runs[on].append((time.perf_counter() - start, decode[0]))
    for on, name in ((True, "one call per layer"), (False, "modules")):
        total, steps = (statistics.median(x[i] for x in runs[on]) for i in (0, 1))
        print(f"{args.preset}, {name}: decode steps {steps:.3f} s, whole run {total:.3f} s")
    ratio = statistics.median(b[1] / a[1] for a, b in zip(runs[True], runs[False]))
    print(f"decode steps, modules / one call: {ratio:.2f}x (median of {args.rounds} rounds); "
          f"same tokens: {tokens[True] == tokens[False]}")


if __name__ == "__main__":
    main()
