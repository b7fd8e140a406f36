"""Metrics as JSON lines, and a guard that stops a run before anything NaN or infinite is stepped on or saved.

`JSONLLogger` is a Lightning logger used beside W&B or CSV (`trainer.logger: [...]`): one JSON object per
logged step, `{"step": 12, "time": …, "train/loss": 2.31, …}`, on global rank 0 only. Values logged at
the same step by different hooks (train, validation, learning rate) share one line: a step's line is
written as soon as its first value is logged and rewritten in place as more arrive, so a kill loses
nothing that was logged. A resumed run appends to the same file, so steps after the resumed checkpoint
can appear twice: `read_jsonl` keeps the last of each.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from ..model.hf import nonfinite_tensors
from .resume import last_checkpoint_path


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
        self._line: tuple[int, bytes, int] | None = None  # the pending step's line: offset, prefix, length

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
            self._pending, self._line = None, None
        if self._pending is None:
            self._pending = {"step": step, "time": round(time.time(), 3)}
        self._pending.update({key: _plain(value) for key, value in metrics.items()})
        self._write()

    def _write(self) -> None:
        """Write the pending step's line, over its earlier version, in one system call."""
        self._save_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            if self._line is None:
                end = os.lseek(fd, 0, os.SEEK_END)
                cut_off = end > 0 and os.pread(fd, 1, end - 1) != b"\n"  # a line a killed writer left unfinished
                self._line = (end, b"\n" if cut_off else b"", 0)
            offset, prefix, length = self._line
            text = json.dumps(self._pending).encode()
            data = prefix + text.ljust(length - len(prefix) - 1) + b"\n"  # spaces cover a longer earlier version
            os.pwrite(fd, data, offset)
            self._line = (offset, prefix, len(data))
        finally:
            os.close(fd)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self._pending, self._line = None, None


def read_jsonl(path: str | Path) -> dict[int, dict[str, Any]]:
    """The metrics of each step, the last line of a step winning (as after a resume)."""
    steps: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], {}).update(row)
    return steps


class NonFiniteLossError(RuntimeError):
    """The training loss, a gradient or a weight became NaN or infinite."""


class NonFiniteGradientError(NonFiniteLossError):
    """A gradient became NaN or infinite although the loss was finite."""


class NonFiniteStepError(NonFiniteLossError):
    """An optimizer step turned weights NaN or infinite."""


FIXES = ("Fixes: lower the learning rate or its warmup, keep gradient_clip_val set, use bf16 rather than fp16, "
         "and check this batch's data")


def _where(trainer: L.Trainer) -> str:
    return (f"optimizer step {trainer.global_step}, epoch {trainer.current_epoch}, "
            f"batch {trainer.fit_loop.epoch_loop.batch_idx}")


def _last_checkpoint(trainer: L.Trainer) -> str:
    path = last_checkpoint_path(trainer)
    if path.exists():
        return f"{path} holds the weights from before (resume from it to reproduce this)"
    return "no checkpoint was written before it"


def _names(bad: list[str]) -> str:
    return ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "") if bad else "on another rank"


class NonFiniteGuard(L.Callback):
    """Stops the run, with an error naming the step and what went wrong, before a NaN or ±inf is stepped
    on or saved: a non-finite loss before its backward pass (NonFiniteLossError, naming each logged loss
    term); a non-finite gradient before the optimizer step, after accumulation and before clipping
    (NonFiniteGradientError, naming the parameters; the step is not taken); weights a step made non-finite,
    inside that step, before any forward pass, export or checkpoint sees them (NonFiniteStepError).

    Every rank takes the same decision. Under fp16 with a gradient scaler, inf gradients are left to the
    scaler, which skips those steps by design."""

    def __init__(self) -> None:
        self._hooks: list[Any] = []

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
        culprit = ", ".join(broken) if broken else f"the loss returned by training_step = {float(loss)}"
        if not bad:
            culprit = "on another rank"
        raise NonFiniteLossError(
            f"non-finite training loss at {_where(trainer)}: {culprit}"
            + (f" (finite terms: {', '.join(fine)})" if fine else "")
            + f". Nothing was stepped with it; {_last_checkpoint(trainer)}. {FIXES}."
        )

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            return  # fp16: the scaler skips a step with inf gradients and lowers its scale
        bad = nonfinite_tensors((name, p.grad) for name, p in pl_module.named_parameters())
        if trainer.strategy.reduce_boolean_decision(bool(bad), all=False):
            raise NonFiniteGradientError(
                f"non-finite gradients at {_where(trainer)}, with a finite loss: {_names(bad)}. The optimizer "
                f"did not step with them; {_last_checkpoint(trainer)}. {FIXES}."
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def check_weights(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            bad = nonfinite_tensors((name, p) for name, p in pl_module.named_parameters() if p.requires_grad)
            if trainer.strategy.reduce_boolean_decision(bool(bad), all=False):
                raise NonFiniteStepError(
                    f"the optimizer step at {_where(trainer)} turned weights non-finite: {_names(bad)}. The run "
                    f"stopped inside that step, before any forward pass, export or checkpoint used them; "
                    f"{_last_checkpoint(trainer)}. {FIXES}."
                )

        self._remove_hooks()
        self._hooks = [opt.register_step_post_hook(check_weights) for opt in trainer.optimizers]

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_hooks()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._remove_hooks()
