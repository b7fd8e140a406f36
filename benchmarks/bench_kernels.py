"""Ablations of our own training step: the same step with one of our CPU choices off and on, interleaved,
on two copies of the same model.

- `--toggle kernels` (default): the fused CPU kernels (astrai_pl/ops/cpu_kernels.c: RMSNorm, rotary
  embedding, SwiGLU) against the eager PyTorch code;
- `--toggle float32-attention`: under bf16-mixed, attention in float32 (what the model does on a CPU
  without AMX) against autocast's bf16 attention.

The `small` preset, batch 4 x 256, 2 threads, torch's fused AdamW, as in bench_step.py. Prints the median
step time of each side and the median of the per-step ratios off / on (above 1: the choice helps), and the
first loss of each side. No peer here: these are ablations of ours.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_kernels.py [--precision bf16-mixed]
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_kernels.py --toggle float32-attention --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import setup, small_model  # noqa: E402

from astrai_pl.model import attention  # noqa: E402
from astrai_pl.objectives import Pretrain  # noqa: E402
from astrai_pl.ops import cpu  # noqa: E402


def step_fn(args):
    model = small_model().train()
    objective = Pretrain(arch=model.config)
    objective.model = model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len),
                        generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")

    def step() -> float:
        with autocast:
            loss = objective.next_token_loss(batch)[0]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--toggle", default="kernels", choices=["kernels", "float32-attention"])
    args = parser.parse_args()
    setup()
    if args.toggle == "kernels":
        if not cpu.available():
            sys.exit(f"the fused CPU kernels do not run here: {cpu.unavailable_reason()}")

        def switched(on: bool):
            return cpu.override_available(None if on else False)
    else:
        if args.precision != "bf16-mixed":
            sys.exit("float32 attention is a bf16-mixed choice: add --precision bf16-mixed")

        @contextlib.contextmanager
        def switched(on: bool):
            previous = attention._cpu_has_amx
            attention._cpu_has_amx = lambda: not on  # float32 attention where there is no AMX
            try:
                yield
            finally:
                attention._cpu_has_amx = previous

    sides = {False: step_fn(args), True: step_fn(args)}
    first = {}
    for on, step in sides.items():
        with switched(on):
            first[on] = step()
            step()
    times: dict = {False: [], True: []}
    for rep in range(args.reps):
        for on in (False, True) if rep % 2 == 0 else (True, False):
            with switched(on):
                start = time.perf_counter()
                sides[on]()
                times[on].append(time.perf_counter() - start)
    ratios = [off / on for off, on in zip(times[False], times[True])]
    print(f"{args.toggle}, {args.precision}, batch {args.batch} x {args.seq_len}, {torch.get_num_threads()} "
          f"threads, {args.reps} interleaved steps each")
    print(f"  off: {statistics.median(times[False]):.3f} s/step, first loss {first[False]:.6f}")
    print(f"  on:  {statistics.median(times[True]):.3f} s/step, first loss {first[True]:.6f}")
    print(f"  off / on: {statistics.median(ratios):.3f}x (per-step {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
