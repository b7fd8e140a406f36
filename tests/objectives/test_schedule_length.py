"""The learning-rate schedule's length: the trainer's unless the config names one (objectives/schedules.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fit_runs import write_corpus

from astrai_pl.cli import lightning_main
from astrai_pl.model import ConfigError
from astrai_pl.objectives.schedules import WarmupCosine, WarmupStableDecay, fit_schedule_length

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
         "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0",
         "--trainer.val_check_interval", "null", "--trainer.log_every_n_steps", "1"]
SCHEDULE = "--model.init_args.scheduler.init_args."


def fitted(tmp_path: Path, *overrides: str):
    """Fit the shipped pretrain debug config on a small corpus with `overrides`; return the objective, its
    optimizer and scheduler."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    cli = lightning_main(["--config", str(ROOT / "configs/pretrain/debug.yaml"), *QUIET,
                          "--data.init_args.path", str(corpus), "--trainer.default_root_dir", str(tmp_path),
                          *overrides], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    (optimizer,), (scheduler,) = cli.trainer.optimizers, [c.scheduler for c in cli.trainer.lr_scheduler_configs]
    return cli.model, optimizer, scheduler


@pytest.mark.parametrize("schedule", [WarmupCosine, WarmupStableDecay])
def test_a_schedule_without_max_steps_takes_the_trainers_length(schedule):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = schedule(optimizer, warmup_steps=1, min_lr_ratio=0.25)
    fit_schedule_length(scheduler, SimpleNamespace(estimated_stepping_batches=4))
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert scheduler.max_steps == 4 and optimizer.param_groups[0]["lr"] == pytest.approx(0.25)


def test_a_trainer_without_a_length_is_refused():
    scheduler = WarmupCosine(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), warmup_steps=0)
    with pytest.raises(ConfigError, match=r"max_steps=None takes the trainer's length.*set trainer\.max_steps"):
        fit_schedule_length(scheduler, SimpleNamespace(estimated_stepping_batches=float("inf")))


@pytest.mark.slow
def test_a_shorter_trainer_run_ends_with_the_schedule_decayed(tmp_path, caplog):
    """The shipped debug config's trainer runs 8 steps; --trainer.max_steps 3 ends at min_lr_ratio·lr."""
    with caplog.at_level(logging.INFO):
        model, optimizer, scheduler = fitted(tmp_path, "--trainer.max_steps", "3")
    peak = optimizer.defaults["lr"]
    assert scheduler.max_steps == 3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(scheduler.min_lr_ratio * peak)
    assert "decays over 3 steps, the trainer's length" in caplog.text


@pytest.mark.slow
def test_an_explicit_schedule_length_is_kept(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        _, optimizer, scheduler = fitted(tmp_path, "--trainer.max_steps", "3", f"{SCHEDULE}max_steps", "30",
                                         f"{SCHEDULE}warmup_steps", "0")
    assert scheduler.max_steps == 30
    assert optimizer.param_groups[0]["lr"] > 0.9 * optimizer.defaults["lr"]  # 3 of 30 steps: near the peak
    assert "decays over 30 steps" in caplog.text and "as configured" in caplog.text


def test_a_warmup_longer_than_a_short_trainer_run_takes_all_of_it(caplog):
    """`--trainer.max_steps 1` on a config whose warmup is 2 steps is a trial run, not a config error."""
    scheduler = WarmupCosine(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), warmup_steps=2)
    with caplog.at_level(logging.INFO):
        fit_schedule_length(scheduler, SimpleNamespace(estimated_stepping_batches=1))
    assert (scheduler.warmup_steps, scheduler.max_steps) == (1, 1)
    assert "warmup_steps=2 is longer than the trainer's 1 steps" in caplog.text


@pytest.mark.parametrize("schedule", [WarmupCosine, WarmupStableDecay])
def test_a_resumed_schedule_decays_over_this_runs_length(schedule):
    """A checkpoint's schedule state (its step, its base rates) is restored, its length is not: the run decays
    over the length its own log names."""
    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)

    saved = schedule(optimizer(), warmup_steps=0, max_steps=2)
    for _ in range(2):
        saved.step()
    resumed = schedule(optimizer(), warmup_steps=0)
    fit_schedule_length(resumed, SimpleNamespace(estimated_stepping_batches=10))
    resumed.load_state_dict(saved.state_dict())
    assert resumed.last_epoch == 2 and resumed.max_steps == 10
    assert resumed.factor(2) > resumed.min_lr_ratio  # 2 of 10 steps: far from the end
