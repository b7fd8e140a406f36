"""Pretraining: next-token cross-entropy over every token, plus the MoE load-balancing loss."""

from __future__ import annotations

from typing import Any

import torch

from .base import Objective
from .options import check_label_smoothing


class Pretrain(Objective):
    """Causal language modelling: L = CE(next token) + router_aux_loss_coef · aux (MoE only)."""

    def __init__(self, *args: Any, label_smoothing: float = 0.0, **kwargs: Any):
        """
        Args:
            label_smoothing: ε of the smoothed cross-entropy (0 = plain cross-entropy).
        """
        check_label_smoothing("Pretrain", label_smoothing)
        super().__init__(*args, **kwargs)  # the options of every objective: arch, init_from, … (Objective)
        self.label_smoothing = label_smoothing

    def _shared_step(self, batch: dict[str, torch.Tensor], stage: str):
        return self.next_token_loss(batch, self.label_smoothing)
