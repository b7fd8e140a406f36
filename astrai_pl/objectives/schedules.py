"""Learning-rate schedules stepped once per optimizer step: warmup + cosine, and warmup-stable-decay.

Both refuse, when built (before step 1), a schedule that cannot be meant: `max_steps` below 1, `warmup_steps`
outside 0..max_steps, `min_lr_ratio` outside [0, 1] (a negative rate climbs the loss). Steps past `max_steps`
keep the final rate `min_lr_ratio`·lr, so a scheduler `max_steps` below the trainer's is allowed.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from ..model.config import ConfigError


def check_schedule(name: str, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> None:
    """ConfigError naming the config field, the value and the fix, for a schedule no run can mean."""

    def fail(field: str, value: object, why: str, fix: str) -> None:
        raise ConfigError(f"{name}: model.init_args.scheduler.init_args.{field}={value!r}: {why}; {fix}")

    if not max_steps >= 1:
        fail("max_steps", max_steps, "must be >= 1 (the step at which the decay ends)",
             "set it to the trainer's max_steps")
    if not 0 <= warmup_steps <= max_steps:
        fail("warmup_steps", warmup_steps, f"must lie in 0..max_steps={max_steps}",
             "use a warmup of a few percent of max_steps, or 0 for none")
    if not 0 <= min_lr_ratio <= 1:
        fail("min_lr_ratio", min_lr_ratio, "must lie in [0, 1] (the final learning rate as a fraction of the "
             "peak; a negative rate climbs the loss)", "use e.g. 0.1, or 0 to decay to zero")


class WarmupCosine(LambdaLR):
    """Linear warmup from 0 over `warmup_steps`, then cosine decay to `min_lr_ratio`·lr at `max_steps`."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 100, max_steps: int = 1000,
                 min_lr_ratio: float = 0.1):
        check_schedule(type(self).__name__, warmup_steps, max_steps, min_lr_ratio)
        self.warmup_steps, self.max_steps, self.min_lr_ratio = warmup_steps, max_steps, min_lr_ratio
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WarmupStableDecay(LambdaLR):
    """Warmup, a constant plateau, then a linear decay over the last `decay_fraction` of `max_steps` (Hu et al., 2024)."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 100, max_steps: int = 1000,
                 decay_fraction: float = 0.2, min_lr_ratio: float = 0.0):
        if not 0 < decay_fraction <= 1:
            raise ConfigError(f"WarmupStableDecay: model.init_args.scheduler.init_args.decay_fraction="
                              f"{decay_fraction!r}: must lie in (0, 1]; use e.g. 0.2 (the last 20% of max_steps)")
        check_schedule(type(self).__name__, warmup_steps, max_steps, min_lr_ratio)
        self.warmup_steps, self.max_steps, self.min_lr_ratio = warmup_steps, max_steps, min_lr_ratio
        self.decay_start = max(warmup_steps, int(max_steps * (1 - decay_fraction)))
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if step < self.decay_start:
            return 1.0
        progress = min(1.0, (step - self.decay_start) / max(1, self.max_steps - self.decay_start))
        return 1.0 - (1.0 - self.min_lr_ratio) * progress
