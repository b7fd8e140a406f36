"""Learning-rate schedules stepped once per optimizer step: warmup + cosine, and warmup-stable-decay.

`max_steps` left None (as the shipped configs leave it) is the trainer's length,
`trainer.estimated_stepping_batches` (trainer.max_steps, or the optimizer steps of max_epochs), given by the
objective before step 1 (`fit_schedule_length`): `--trainer.max_steps 20` decays over those 20 steps (a longer
warmup takes all of them); a number is kept as written. One log line says which length the schedule uses and
where it came from; a resumed run uses that length too (its own config's or trainer's) and takes the rest of the
schedule's state from the checkpoint.

Both refuse, before step 1, a schedule that cannot be meant: `max_steps` below 1, `warmup_steps` outside
0..max_steps, `min_lr_ratio` outside [0, 1] (a negative rate climbs the loss). Steps past `max_steps` keep the
final rate `min_lr_ratio`·lr, so a scheduler `max_steps` below the trainer's is allowed.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from ..model.config import ConfigError

FIELD = "model.init_args.scheduler.init_args"


def check_schedule(name: str, warmup_steps: int, max_steps: int | None, min_lr_ratio: float) -> None:
    """ConfigError naming the config field, the value and the fix, for a schedule no run can mean; max_steps
    None (the trainer's, not known yet) bounds nothing."""

    def fail(field: str, value: object, why: str, fix: str) -> None:
        raise ConfigError(f"{name}: {FIELD}.{field}={value!r}: {why}; {fix}")

    if max_steps is not None and not max_steps >= 1:
        fail("max_steps", max_steps, "must be >= 1 (the step at which the decay ends)",
             "set it to the trainer's max_steps, or null to take the trainer's")
    if not 0 <= warmup_steps <= (math.inf if max_steps is None else max_steps):
        fail("warmup_steps", warmup_steps, f"must lie in 0..max_steps={max_steps}",
             "use a warmup of a few percent of max_steps, or 0 for none")
    if not 0 <= min_lr_ratio <= 1:
        fail("min_lr_ratio", min_lr_ratio, "must lie in [0, 1] (the final learning rate as a fraction of the "
             "peak; a negative rate climbs the loss)", "use e.g. 0.1, or 0 to decay to zero")


def fit_schedule_length(scheduler: Any, trainer: Any) -> None:
    """Give a schedule whose max_steps is None the trainer's length, and log which length it uses and why.

    Before step 1 every factor is 1 or a warmup fraction, whatever the length, so the rates already set stay."""
    if not hasattr(scheduler, "set_max_steps"):
        return
    name = type(scheduler).__name__
    if scheduler.max_steps is not None:
        rank_zero_info(f"{name}: decays over {scheduler.max_steps} steps ({FIELD}.max_steps, as configured; "
                       "null takes the trainer's length)")
        return
    steps = trainer.estimated_stepping_batches
    if not math.isfinite(steps):
        raise ConfigError(f"{name}: {FIELD}.max_steps=None takes the trainer's length, but the trainer has "
                          "none (trainer.max_steps=-1 and no max_epochs); set trainer.max_steps, or the "
                          "schedule's max_steps")
    steps = int(steps)
    if scheduler.warmup_steps > steps:  # a short trial run (--trainer.max_steps 1) of a config: not an error
        rank_zero_info(f"{name}: {FIELD}.warmup_steps={scheduler.warmup_steps} is longer than the trainer's "
                       f"{steps} steps; the warmup takes all {steps}")
        scheduler.warmup_steps = steps
    scheduler.set_max_steps(steps)
    rank_zero_info(f"{name}: decays over {steps} steps, the trainer's length "
                   f"(trainer.estimated_stepping_batches; {FIELD}.max_steps is null)")


def _load_keeping_length(schedule: LambdaLR, state_dict: dict[str, Any]) -> None:
    """LambdaLR.load_state_dict, except the length: a resumed run decays over its own (the one its log names)."""
    length = {k: v for k, v in vars(schedule).items() if k in ("max_steps", "decay_start")}
    LambdaLR.load_state_dict(schedule, state_dict)
    vars(schedule).update(length)


class WarmupCosine(LambdaLR):
    """Linear warmup from 0 over `warmup_steps`, then cosine decay to `min_lr_ratio`·lr at `max_steps` (None: the
    trainer's length)."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 100, max_steps: int | None = None,
                 min_lr_ratio: float = 0.1):
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self.set_max_steps(max_steps)
        super().__init__(optimizer, self.factor)

    load_state_dict = _load_keeping_length

    def set_max_steps(self, max_steps: int | None) -> None:
        check_schedule(type(self).__name__, self.warmup_steps, max_steps, self.min_lr_ratio)
        self.max_steps = max_steps

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        end = self.warmup_steps if self.max_steps is None else self.max_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, end - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WarmupStableDecay(LambdaLR):
    """Warmup, a constant plateau, then a linear decay over the last `decay_fraction` of `max_steps` (None: the
    trainer's length) (Hu et al., 2024)."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 100, max_steps: int | None = None,
                 decay_fraction: float = 0.2, min_lr_ratio: float = 0.0):
        if not 0 < decay_fraction <= 1:
            raise ConfigError(f"WarmupStableDecay: {FIELD}.decay_fraction={decay_fraction!r}: must lie in (0, 1]; "
                              "use e.g. 0.2 (the last 20% of max_steps)")
        self.warmup_steps, self.decay_fraction, self.min_lr_ratio = warmup_steps, decay_fraction, min_lr_ratio
        self.set_max_steps(max_steps)
        super().__init__(optimizer, self.factor)

    load_state_dict = _load_keeping_length

    def set_max_steps(self, max_steps: int | None) -> None:
        check_schedule(type(self).__name__, self.warmup_steps, max_steps, self.min_lr_ratio)
        self.max_steps = max_steps
        self.decay_start = None if max_steps is None else max(
            self.warmup_steps, int(max_steps * (1 - self.decay_fraction)))

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.decay_start is None or step < self.decay_start:
            return 1.0
        progress = min(1.0, (step - self.decay_start) / max(1, self.max_steps - self.decay_start))
        return 1.0 - (1.0 - self.min_lr_ratio) * progress
