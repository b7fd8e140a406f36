"""Later stages of `make demo`, each a function that runs one shipped config and returns its figures.

    run_grpo_stage("runs/dpo-tiny/checkpoints/last.ckpt", ["--trainer.enable_progress_bar", "false"])
"""

from __future__ import annotations

import time
from pathlib import Path
from statistics import fmean

from .cli import lightning_main
from .objectives import greedy_accuracy

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def run_grpo_stage(init_from: str, quiet_args: list[str]) -> dict:
    """GRPO on the arithmetic task from `init_from` (`configs/grpo/tiny.yaml`).

    Returns the mean rollout reward over the first and the last fifth of the rollouts (`reward_start`,
    `reward_end`), the exact-match accuracy of greedy answers to the held-out problems before and after
    (`accuracy_before`, `accuracy_after`; before is the previous stage's), `steps`, `seconds` (training
    only) and the last `checkpoint`.
    """
    config = CONFIGS / "grpo" / "tiny.yaml"
    print(f"== grpo: astrai-pl fit --config {config.relative_to(CONFIGS.parent)} "
          f"--model.init_args.init_from {init_from}", flush=True)
    cli = lightning_main(["--config", str(config), "--model.init_args.init_from", str(init_from), *quiet_args],
                         run=False)
    data, model = cli.datamodule, cli.model
    problems = data.held_out_problems()
    before = greedy_accuracy(model.model, data.tokenizer, problems)
    start = time.perf_counter()
    cli.trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    after = greedy_accuracy(model.model, data.tokenizer, problems)
    rewards = model.reward_history
    window = max(1, len(rewards) // 5)
    result = {
        "reward_start": fmean(rewards[:window]),
        "reward_end": fmean(rewards[-window:]),
        "accuracy_before": before,
        "accuracy_after": after,
        "steps": cli.trainer.global_step,
        "seconds": seconds,
        "checkpoint": Path(cli.trainer.checkpoint_callback.last_model_path),
    }
    print(f"grpo: mean rollout reward {result['reward_start']:.3f} -> {result['reward_end']:.3f} (first and last "
          f"{window} of {len(rewards)} rollouts); held-out exact-match accuracy {before:.1%} -> {after:.1%} on "
          f"{len(problems)} problems, after {result['steps']} steps in {seconds:.0f} s", flush=True)
    return result
