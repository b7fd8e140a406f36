"""Metrics as JSON lines, and a guard that stops a run whose loss stops being a number.

`JSONLLogger` is a Lightning logger used beside W&B or CSV (`trainer.logger: [...]`): one JSON object per
logged step, `{"step": 12, "time": …, "train/loss": 2.31, …}`, on global rank 0 only. Values logged at
the same step by different hooks (train, validation, learning rate) share one line, so a step's line is
written when the next step is logged, and the last one when training ends. A resumed run appends to the
same file, so steps after the resumed checkpoint can appear twice: `read_jsonl` keeps the last of each.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only


def _plain(value: Any) -> Any:
    """A JSON-ready number: tensors become floats; NaN and ±inf become strings JSON can carry."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _jsonable(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else str(value)


class JSONLLogger(Logger):
    """Append one JSON line per logged step to `save_dir/filename` (rank 0).

    Args:
        save_dir: Folder of the file (created if missing).
        filename: Name of the file.
    """

    def __init__(self, save_dir: str = "runs", filename: str = "metrics.jsonl"):
        super().__init__()
        self._save_dir, self._name = Path(save_dir), filename
        self._pending: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self._save_dir)

    @property
    def log_dir(self) -> str:
        return str(self._save_dir)

    @property
    def path(self) -> Path:
        return self._save_dir / self._name

    @property
    @rank_zero_experiment
    def experiment(self) -> Path:
        return self.path

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        params = vars(params) if isinstance(params, Namespace) else dict(params)
        self._save_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(params, indent=2, sort_keys=True, default=_jsonable)
        (self._save_dir / "hparams.json").write_text(text + "\n")

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self._pending is not None and self._pending["step"] != step:
            self._write()
        if self._pending is None:
            self._pending = {"step": step, "time": round(time.time(), 3)}
        self._pending.update({key: _plain(value) for key, value in metrics.items()})

    def _write(self) -> None:
        if self._pending is None:
            return
        self._save_dir.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(self._pending) + "\n")
        self._pending = None

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self._write()


def read_jsonl(path: str | Path) -> dict[int, dict[str, Any]]:
    """The metrics of each step, the last line of a step winning (as after a resume)."""
    steps: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], {}).update(row)
    return steps


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


class NonFiniteGuard(L.Callback):
    """Before each backward pass: if the loss is NaN or ±inf on any rank, stop with an error naming the
    step, the batch and every logged loss term that is not finite, instead of stepping on garbage."""

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        bad = not bool(torch.isfinite(loss.detach()).all())
        if not trainer.strategy.reduce_boolean_decision(bad, all=False):
            return
        terms = {
            k: float(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith("train/") and isinstance(v, torch.Tensor) and v.numel() == 1
        }
        broken = [f"{k} = {v}" for k, v in terms.items() if not math.isfinite(v)]
        fine = [f"{k} = {v:.4g}" for k, v in terms.items() if math.isfinite(v)]
        where = (
            f"optimizer step {trainer.global_step}, epoch {trainer.current_epoch}, "
            f"batch {trainer.fit_loop.epoch_loop.batch_idx}"
        )
        culprit = ", ".join(broken) if broken else f"the loss returned by training_step = {float(loss)}"
        if not bad:
            culprit = "on another rank"
        raise NonFiniteLossError(
            f"non-finite training loss at {where}: {culprit}"
            + (f" (finite terms: {', '.join(fine)})" if fine else "")
            + ". Nothing was stepped with it. Fixes: lower the learning rate or its warmup, keep "
            "gradient_clip_val set, use bf16 rather than fp16, and check this batch's data (resume from the "
            "last checkpoint to reproduce it)."
        )
