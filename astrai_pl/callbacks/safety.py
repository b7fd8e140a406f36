"""The protections `astrai-pl fit` adds to every trainer, on which the guarantees of docs/distributed.md rest,
and the `safety:` section of a config that turns each one off.

A protection the config already names (a CheckpointIO in `trainer.plugins`, a NonFiniteGuard, RNGState,
StopOnSignal or FinalCheckpoint in `trainer.callbacks`) is used as configured and not added a second time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning.fabric.plugins import CheckpointIO

from ..checkpoint import AtomicCheckpointIO
from .metrics import NonFiniteGuard
from .resume import FinalCheckpoint, RNGState, StopOnSignal


@dataclasses.dataclass
class SafetyConfig:
    """`safety:` in a config: what `astrai-pl fit|validate|test` adds to the trainer unless turned off here."""

    atomic_checkpoints: bool = True
    """Checkpoint files written atomically beside their target and read back verified (AtomicCheckpointIO in
    `trainer.plugins`); false leaves Lightning's own writer, which a kill during a save can leave truncated."""
    nonfinite_guard: bool = True
    """Stop before a NaN or infinite loss, gradient or weight is stepped on or saved (NonFiniteGuard)."""
    rng_state: bool = True
    """Random states saved in every checkpoint and restored on resume, for exact resumes (RNGState)."""
    stop_on_signal: bool = True
    """SIGTERM or SIGINT: finish the optimizer step, save last.ckpt and stop cleanly (StopOnSignal)."""
    final_checkpoint: bool = True
    """last.ckpt written at the end of fit when the final step is not in it yet, as when max_steps is not a
    multiple of every_n_train_steps (FinalCheckpoint)."""


CALLBACKS = {"nonfinite_guard": NonFiniteGuard, "rng_state": RNGState, "stop_on_signal": StopOnSignal,
             "final_checkpoint": FinalCheckpoint}


def as_list(value: Any) -> list[Any]:
    """A trainer argument that takes one item or a list of them, as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def safety_callbacks(settings: SafetyConfig, callbacks: list[Any]) -> list[Any]:
    """`callbacks` plus each protection switched on in `settings` that is not among them yet."""
    added = [kind() for field, kind in CALLBACKS.items()
             if getattr(settings, field) and not any(isinstance(c, kind) for c in callbacks)]
    return [*callbacks, *added]


def safety_plugins(settings: SafetyConfig, plugins: list[Any]) -> list[Any]:
    """`plugins` plus AtomicCheckpointIO, unless switched off or another CheckpointIO is named."""
    if not settings.atomic_checkpoints or any(isinstance(p, CheckpointIO) for p in plugins):
        return plugins
    return [*plugins, AtomicCheckpointIO()]
