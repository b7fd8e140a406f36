"""Learning-rate schedules stepped once per optimizer step: warmup + cosine, and warmup-stable-decay."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine(LambdaLR):
    """Linear warmup from 0 over `warmup_steps`, then cosine decay to `min_lr_ratio`·lr at `max_steps`."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 100, max_steps: int = 1000,
                 min_lr_ratio: float = 0.1):
        if not 0 <= warmup_steps <= max_steps:
            raise ValueError(f"WarmupCosine: warmup_steps={warmup_steps} must lie in 0..max_steps={max_steps}")
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
            raise ValueError(f"WarmupStableDecay: decay_fraction={decay_fraction} must lie in (0, 1]")
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
