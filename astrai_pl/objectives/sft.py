"""Supervised fine-tuning: next-token cross-entropy over the trained tokens only, exact under accumulation."""

from __future__ import annotations

from typing import Any

import torch

from .base import Objective
from .options import check_label_smoothing


class SFT(Objective):
    """L = Σ_window Σ_t m_t · −log p(y_t | y_<t) / Σ_window Σ_t m_t  (+ router_aux_loss_coef · aux for MoE).

    m_t = 1 where the data's loss mask trains token t (labels != -100: assistant turns and their
    end-of-turn token, by default), so prompts, system turns and padding never contribute. The mean is
    over every trained token of the accumulation window — not a mean of per-micro-batch means — when the
    train loader tags batches with `window_tokens` (SFTData does; see `Objective.accumulation_scale`
    and docs/objectives.md). Validation reports the token mean over the whole held-out set.
    """

    def __init__(self, *args: Any, label_smoothing: float = 0.0, **kwargs: Any):
        """
        Args:
            label_smoothing: ε of the smoothed cross-entropy over the trained tokens (0 = plain cross-entropy).
        """
        check_label_smoothing("SFT", label_smoothing)
        super().__init__(*args, **kwargs)  # the options of every objective: arch, init_from, … (Objective)
        self.label_smoothing = label_smoothing

    def _shared_step(self, batch: dict[str, torch.Tensor], stage: str):
        loss, metrics = self.next_token_loss(batch, self.label_smoothing)
        metrics["trained_fraction"] = metrics["tokens"] / batch["input_ids"].numel()
        return loss, metrics
