"""`make demo`: the main job on the embedded defaults, end to end on a CPU.

Stage 1 pretrains the `tiny` preset on the CPython documentation with exactly what
`astrai-pl fit --config configs/pretrain/tiny.yaml` runs, and prints the held-out loss before and after.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from .cli import lightning_main

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


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    t0 = time.perf_counter()
    ckpt = pretrain_stage(quiet)
    print(f"demo finished in {time.perf_counter() - t0:.0f} s; last checkpoint: {ckpt}")


if __name__ == "__main__":
    main()
