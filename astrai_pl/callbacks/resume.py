"""What makes an interrupted run resumable exactly: a clean stop on SIGTERM / SIGINT, and RNG states
in every checkpoint.

`StopOnSignal` replaces Lightning's SIGTERM handling during fit: Lightning would stop after the current
micro-batch, possibly in the middle of a gradient-accumulation window, and save nothing. Here the signal
only sets a flag; at the next optimizer-step boundary every rank agrees to stop, `last.ckpt` is written in
the ModelCheckpoint folder and the trainer stops, so `--ckpt_path last` continues from that step.

`place_outputs` puts a run's files in its run directory (checkpoint/runs.py), which is how `--ckpt_path last`
finds the checkpoint of the run it continues.
"""

from __future__ import annotations

import importlib
import random
import signal
import threading
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from ..checkpoint.runs import latest_run_dir, shared_run_dir
from .export import HFExport

CSV_LOGGER = "lightning.pytorch.loggers.CSVLogger"


def last_checkpoint_path(trainer: L.Trainer) -> Path:
    """Where `--ckpt_path last` looks: `last.ckpt` in the ModelCheckpoint folder (or default_root_dir/checkpoints)."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
    return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"


def _class_of(entry: Any) -> type | None:
    """The class a config entry (`class_path` + `init_args`) names; jsonargparse has imported it already."""
    path = entry.get("class_path") if hasattr(entry, "get") else None
    if not isinstance(path, str) or "." not in path:
        return None
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name, None)


def place_outputs(trainer: Any, subcommand: str | None, ckpt_path: str | None) -> Path | None:
    """Put the outputs a trainer config leaves unplaced in this run's directory, `default_root_dir/version_N`:
    `logger: true` becomes a CSVLogger writing metrics.csv there, a ModelCheckpoint's `dirpath: null` its
    checkpoints/, an HFExport's `dirpath: null` its hf/. Paths a config names are used as written (and shared
    by every run that names them). `validate` / `test` with `--ckpt_path last` read the last.ckpt of the run
    `latest` names, and log into a directory of their own. Returns the run directory, or None when nothing was
    placed (no directory is made)."""
    callbacks = [c for c in (trainer.get("callbacks") or []) if _class_of(c) is not None]
    unplaced = [c for c in callbacks if issubclass(_class_of(c), (ModelCheckpoint, HFExport))
                and c.get("init_args") is not None and c.init_args.get("dirpath") is None]
    if trainer.get("logger") is not True and not unplaced:
        return None
    root = Path(trainer.get("default_root_dir") or ".")
    evaluated = latest_run_dir(root) if subcommand not in (None, "fit") and ckpt_path == "last" else None
    run_dir = shared_run_dir(root, subcommand, ckpt_path)
    rank_zero_info(f"run directory: {run_dir} (metrics, checkpoints, exports; {root / 'latest'} names the "
                   "newest run)")
    if trainer.get("logger") is True:
        trainer.logger = type(trainer)(class_path=CSV_LOGGER, init_args=type(trainer)(
            save_dir=str(run_dir.parent), name="", version=run_dir.name, prefix="", flush_logs_every_n_steps=100))
    for entry in unplaced:
        if issubclass(_class_of(entry), HFExport):
            entry.init_args.dirpath = str(run_dir / "hf")
        else:
            entry.init_args.dirpath = str((evaluated or run_dir) / "checkpoints")
    return run_dir


class StopOnSignal(L.Callback):
    """On SIGTERM or SIGINT: finish the optimizer step in progress, save last.ckpt, stop training.

    A second SIGINT interrupts at once (KeyboardInterrupt), without saving.

    Args:
        signals: Names of the signals that ask for a clean stop.
    """

    def __init__(self, signals: tuple[str, ...] = ("SIGTERM", "SIGINT")):
        unknown = [name for name in signals if not hasattr(signal, name)]
        if unknown:
            raise ValueError(
                f"StopOnSignal.signals: {unknown} are not signals on this platform; use e.g. SIGTERM"
            )
        self.signals = tuple(signals)
        self.received: str | None = None
        self._previous: dict[int, Any] = {}
        self._step_seen = -1

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received == "SIGINT" and name == "SIGINT":
            raise KeyboardInterrupt
        self.received = name

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received, self._step_seen = None, trainer.global_step
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for name in self.signals:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._handle)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._step_seen:
            return  # inside an accumulation window: not a step boundary
        self._step_seen = trainer.global_step
        stop = trainer.strategy.reduce_boolean_decision(self.received is not None, all=False)
        if not stop:
            return
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        trainer.should_stop = True
        rank_zero_info(
            f"{self.received or 'a signal on another rank'}: stopped after step {trainer.global_step}; "
            f"saved {path}. Continue with --ckpt_path last (or --ckpt_path {path})."
        )

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore()


class FinalCheckpoint(L.Callback):
    """Writes last.ckpt at the end of `fit` when the run's final step is not in it yet.

    Lightning's ModelCheckpoint writes last.ckpt at its own triggers (`every_n_train_steps`, validation, epoch
    ends) and at the end of training only when it wrote none during the run. A run whose `max_steps` is not a
    multiple of the interval (every_n_train_steps 40, max_steps 199) would end with a last.ckpt of step 160:
    the last steps trained would be lost to `--ckpt_path last`, `convert` and the next stage's `init_from`.
    Nothing is written when the last save was of the final step, when no step was taken in this `fit`, or
    when no ModelCheckpoint has `save_last`.
    """

    def __init__(self) -> None:
        self._started_at: int | None = None
        self._saved_at: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started_at, self._saved_at = trainer.global_step, None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._saved_at = trainer.global_step

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after every callback's on_train_end, ModelCheckpoint's own end-of-training save included
        keepers = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.save_last]
        if (not keepers or trainer.fast_dev_run or self._started_at in (None, trainer.global_step)
                or self._saved_at == trainer.global_step):
            return
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        for callback in keepers:
            if callback.dirpath and Path(callback.dirpath) == path.parent:
                callback.last_model_path = str(path)
        rank_zero_info(f"saved {path} at the final step {trainer.global_step}")


class RNGState(L.Callback):
    """Saves Python's, NumPy's and torch's random states (CPU and CUDA) in every checkpoint and restores
    them on resume, so sampling, dropout and anything else drawing random numbers continues its sequence.
    The states of global rank 0 are saved; on resume every rank takes them, as after seed_everything."""

    def state_dict(self) -> dict[str, Any]:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
        state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        name, keys, pos, has_gauss, gauss = state["numpy"]  # plain types: checkpoints load with weights_only
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
