"""`make demo`: the main job on the embedded defaults, end to end on a CPU.

Stage 1 pretrains the `tiny` preset on the CPython documentation with exactly what
`astrai-pl fit --config configs/pretrain/tiny.yaml` runs, and prints the held-out loss before and after.
Stage 2 fine-tunes that checkpoint on the built-in arithmetic task (`configs/sft/tiny.yaml`) and prints
the exact-match accuracy of greedy answers to held-out problems before and after.

    python -m astrai_pl.demo                                   # every stage
    python -m astrai_pl.demo --pretrained runs/pretrain-tiny/checkpoints/last.ckpt   # skip stage 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .cli import lightning_main
from .objectives import greedy_accuracy

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def held_out_loss(cli) -> float:
    (metrics,) = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    return float(metrics["val/loss"])


def pretrain_stage(quiet: list[str]) -> Path:
    config = CONFIGS / "pretrain" / "tiny.yaml"
    print(f"== pretrain: astrai-pl fit --config {config.relative_to(CONFIGS.parent)}", flush=True)
    cli = lightning_main(["--config", str(config), *quiet], run=False)
    start = held_out_loss(cli)
    t0 = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    seconds = time.perf_counter() - t0
    end = held_out_loss(cli)
    print(f"pretrain: held-out loss {start:.3f} -> {end:.3f} (ppl {torch.exp(torch.tensor(start)):.1f} -> "
          f"{torch.exp(torch.tensor(end)):.1f}) after {cli.trainer.global_step} steps in {seconds:.0f} s",
          flush=True)
    if not end < start - 1.0:
        raise SystemExit("pretrain: the held-out loss did not fall clearly; something is wrong")
    return Path(cli.trainer.checkpoint_callback.last_model_path)


def sft_stage(quiet: list[str], pretrained: Path) -> Path:
    config = CONFIGS / "sft" / "tiny.yaml"
    print(f"== sft: astrai-pl fit --config {config.relative_to(CONFIGS.parent)} "
          f"--model.init_args.init_from {pretrained}", flush=True)
    cli = lightning_main(["--config", str(config), "--model.init_args.init_from", str(pretrained), *quiet],
                         run=False)
    data, model = cli.datamodule, cli.model
    problems = data.held_out_problems()
    t0 = time.perf_counter()
    before = greedy_accuracy(model.model, data.tokenizer, problems)
    cli.trainer.fit(model, datamodule=data)
    after = greedy_accuracy(model.model, data.tokenizer, problems)
    seconds = time.perf_counter() - t0
    print(f"sft: held-out exact-match accuracy {before:.1%} -> {after:.1%} on {len(problems)} problems never "
          f"seen in training, after {cli.trainer.global_step} steps; {seconds:.0f} s with evaluation", flush=True)
    if not after > before + 0.1:
        raise SystemExit("sft: held-out accuracy did not rise clearly; something is wrong")
    return Path(cli.trainer.checkpoint_callback.last_model_path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m astrai_pl.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--pretrained", type=Path, default=None,
                        help="a pretraining checkpoint to start stage 2 from (stage 1 is skipped)")
    args = parser.parse_args(argv)
    sys.argv = sys.argv[:1]  # consumed: the stages pass their own arguments to LightningCLI
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    t0 = time.perf_counter()
    pretrained = args.pretrained or pretrain_stage(quiet)
    ckpt = sft_stage(quiet, pretrained)
    print(f"demo finished in {time.perf_counter() - t0:.0f} s; last checkpoint: {ckpt}")


if __name__ == "__main__":
    main()
