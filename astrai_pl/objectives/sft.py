"""Supervised fine-tuning: next-token cross-entropy over the trained tokens only, exact under accumulation."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from ..model import ModelConfig
from ..parallel import ActivationCheckpointing
from .base import Objective


class SFT(Objective):
    """L = Σ_window Σ_t m_t · −log p(y_t | y_<t) / Σ_window Σ_t m_t  (+ router_aux_loss_coef · aux for MoE).

    m_t = 1 where the data's loss mask trains token t (labels != -100: assistant turns and their
    end-of-turn token, by default), so prompts, system turns and padding never contribute. The mean is
    over every trained token of the accumulation window — not a mean of per-micro-batch means — when the
    train loader tags batches with `window_tokens` (SFTData does; see `Objective.accumulation_scale`
    and docs/objectives.md). Validation reports the token mean over the whole held-out set.
    """

    def __init__(
        self,
        arch: ModelConfig | None = None,
        init_from: str | None = None,
        tokenizer: Any = None,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        label_smoothing: float = 0.0,
        activation_checkpointing: ActivationCheckpointing = "none",
        compile: bool = False,
    ):
        """
        Args:
            arch: Shape of a freshly initialised model (ignored when init_from is set).
            init_from: Start from these weights: a Hugging Face directory or an astrai-pl .ckpt
                (e.g. the pretraining run's last.ckpt).
            tokenizer: Set from the data module; used by export callbacks and sample generation.
            optimizer: Optimizer class and arguments (default AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1);
                its weight decay applies to matrices and embeddings, never to norms and biases.
            scheduler: Learning-rate schedule stepped per optimizer step (e.g. WarmupCosine).
            label_smoothing: ε of the smoothed cross-entropy over the trained tokens (0 = plain cross-entropy).
            activation_checkpointing: Recompute activations in the backward pass instead of keeping them:
                "none", "full" (each whole block) or "selective". Less memory for more compute.
            compile: torch.compile each block (the first steps are slower while it compiles).
        """
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"SFT.label_smoothing={label_smoothing}: must lie in [0, 1)")
        super().__init__(arch, init_from, tokenizer, optimizer, scheduler, activation_checkpointing, compile)
        self.label_smoothing = label_smoothing
        self.save_hyperparameters(ignore=["tokenizer", "optimizer", "scheduler"])

    def _shared_step(self, batch: dict[str, torch.Tensor], stage: str):
        loss, metrics = self.next_token_loss(batch, self.label_smoothing)
        metrics["trained_fraction"] = metrics["tokens"] / batch["input_ids"].numel()
        return loss, metrics
