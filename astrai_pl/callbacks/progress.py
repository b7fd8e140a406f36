"""Plain progress lines instead of a progress bar: a few per run, each with tokens/s and an ETA.

A bar redraws one line in place, which a log file records as one endless line (or not at all, when the
bar is off); on a slow or shared machine a run can then be silent for many minutes. `ProgressLines` prints
one ordinary line at every `every_fraction` of the run's optimizer steps, and whenever `every_seconds`
have passed without a line, on rank 0:

    [pretrain] step 48/160 (30%) | train/loss 2.913 | 21.4k tokens/s | elapsed 0:22 | ETA 0:52

Tokens are the real (non-padding) tokens of every `*input_ids` tensor of a batch (both sides of a DPO
pair). Where batches hold prompts only, they are those of what the step trained on: the objective's
`trained_sequences` (Distill, OnlineDPO: the prompts with their sampled or given completions), or, for
GRPO and RLOO, each rollout's prompts and completions, counted once however many steps train on it; with
several ranks, rank 0's count times the world size. The ETA is the steps left at the rate since training
started (validation included, as it will be in the time left).

    trainer:
      enable_progress_bar: false
      callbacks:
        - class_path: astrai_pl.callbacks.progress.ProgressLines
          init_args: {name: pretrain, every_fraction: 0.1, every_seconds: 30, metrics: [train/loss]}
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch

from .throughput import real_token_mask


def batch_tokens(batch: Any, pad_id: int | None) -> torch.Tensor | None:
    """The real tokens of every `*input_ids` tensor of a batch (labels beside them mark trailing padding), as a
    0-d tensor on the batch's device; None when the batch has no such tensor."""
    if not isinstance(batch, dict):
        return None
    counts = []
    for key, ids in batch.items():
        if key.endswith("input_ids") and isinstance(ids, torch.Tensor):
            side = {"input_ids": ids}
            labels = batch.get(key[: -len("input_ids")] + "labels")
            if labels is not None:
                side["labels"] = labels
            counts.append(real_token_mask(side, pad_id).sum())
    return torch.stack(counts).sum() if counts else None


def clock(seconds: float) -> str:
    """0:07, 12:34, 1:02:03."""
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def rate(tokens_per_sec: float) -> str:
    """812, 21.4k, 1.25M."""
    for scale, unit in ((1e6, "M"), (1e3, "k")):
        if tokens_per_sec >= scale:
            return f"{tokens_per_sec / scale:.3g}{unit}"
    return f"{tokens_per_sec:.0f}"


@dataclass
class ProgressSummary:
    """What a finished run did: its optimizer steps, wall-clock seconds and real tokens."""

    steps: int
    seconds: float
    tokens: float

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class ProgressLines(L.Callback):
    """Print a progress line (step, metrics, tokens/s, elapsed, ETA) a few times per run, and one at its end.

    Args:
        name: Shown at the start of each line; None: the objective's class name.
        every_fraction: Print each time this share of the run's optimizer steps is done.
        every_seconds: Also print when this long has passed since the last line; None: only by fraction.
        metrics: Logged values to show (`trainer.callback_metrics`), those not logged yet left out.
    """

    def __init__(self, name: str | None = None, every_fraction: float = 0.1, every_seconds: float | None = 30.0,
                 metrics: list[str] | None = None):
        if not 0 < every_fraction <= 1:
            raise ValueError(f"ProgressLines.every_fraction={every_fraction}: give a share in (0, 1], e.g. 0.1")
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"ProgressLines.every_seconds={every_seconds}: give a positive number, or null")
        self.name, self.every_fraction, self.every_seconds = name, every_fraction, every_seconds
        self.metrics = ["train/loss"] if metrics is None else list(metrics)
        self.summary: ProgressSummary | None = None  # set when training ends

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._label = self.name or type(pl_module).__name__.lower()
        self._first_step, self._step_seen = trainer.global_step, trainer.global_step
        self._total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if self._total is None and math.isfinite(trainer.estimated_stepping_batches):
            self._total = int(trainer.estimated_stepping_batches)
        self._tokens: torch.Tensor | float = 0.0
        self._rollout: Any = None
        self._start = self._last_line = time.perf_counter()
        self._next_fraction = self.every_fraction
        self.summary = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._count(pl_module, batch)
        step = trainer.global_step
        if step == self._step_seen:
            return  # accumulating, or no optimizer step was taken
        self._step_seen = step
        now = time.perf_counter()
        done = (step - self._first_step) / max(1, (self._total or 0) - self._first_step)
        by_fraction = self._total is not None and done + 1e-9 >= self._next_fraction
        by_time = self.every_seconds is not None and now - self._last_line >= self.every_seconds
        if (by_fraction or by_time) and (self._total is None or step < self._total):
            while self._next_fraction <= done + 1e-9:
                self._next_fraction += self.every_fraction
            self._last_line = now
            if trainer.is_global_zero:
                print(self.line(trainer, now), flush=True)

    def _count(self, pl_module: L.LightningModule, batch: Any) -> None:
        pad_id = getattr(getattr(getattr(pl_module, "model", None), "config", None), "pad_token_id", None)
        tokens = batch_tokens(batch, pad_id)
        if tokens is None:  # a batch of prompts: the sequences the step built from them and trained on
            tokens = batch_tokens(getattr(pl_module, "trained_sequences", None), pad_id)
        rollout = getattr(pl_module, "rollout", None)  # GRPO: batches of prompts, trained on their rollouts
        if tokens is None and rollout is not None and rollout is not self._rollout:
            self._rollout = rollout
            counts = [batch_tokens(part, pad_id) for part in getattr(rollout, "micro_batches", [])]
            tokens = sum(c for c in counts if c is not None) if counts else None
        if tokens is not None:
            self._tokens = self._tokens + tokens  # a device tensor: no host sync until a line is printed

    def _totals(self, trainer: L.Trainer, now: float) -> tuple[int, float, float]:
        tokens = float(self._tokens) * trainer.world_size
        return trainer.global_step - self._first_step, max(now - self._start, 1e-9), tokens

    def line(self, trainer: L.Trainer, now: float) -> str:
        """One progress line for the state of `trainer` at time `now` (perf_counter seconds)."""
        steps, elapsed, tokens = self._totals(trainer, now)
        step = trainer.global_step
        parts = [f"[{self._label}] step {step}" + (f"/{self._total} ({step / self._total:.0%})" if self._total else "")]
        for name in self.metrics:
            value = trainer.callback_metrics.get(name)
            if value is not None:
                parts.append(f"{name} {float(value):.4g}")
        parts.append(f"{rate(tokens / elapsed)} tokens/s")
        parts.append(f"elapsed {clock(elapsed)}")
        if self._total:
            left = (self._total - step) * elapsed / steps if steps else math.inf
            parts.append(f"ETA {clock(left)}")
        return " | ".join(parts)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps, elapsed, tokens = self._totals(trainer, time.perf_counter())
        self.summary = ProgressSummary(steps, elapsed, tokens)
        if trainer.is_global_zero:
            print(f"[{self._label}] done: {steps} steps in {clock(elapsed)}, {rate(self.summary.tokens_per_sec)} "
                  "tokens/s", flush=True)
