"""Pretraining: next-token cross-entropy over every token, plus the MoE load-balancing loss."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from ..model import ModelConfig
from ..parallel import ActivationCheckpointing
from .base import Objective


class Pretrain(Objective):
    """Causal language modelling: L = CE(next token) + router_aux_loss_coef · aux (MoE only)."""

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
            init_from: Start from these weights: a Hugging Face directory or an astrai-pl .ckpt.
            tokenizer: Set from the data module; used by export callbacks and sample generation.
            optimizer: Optimizer class and arguments (default AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1);
                its weight decay applies to matrices and embeddings, never to norms and biases.
            scheduler: Learning-rate schedule stepped per optimizer step (e.g. WarmupCosine).
            label_smoothing: ε of the smoothed cross-entropy (0 = plain cross-entropy).
            activation_checkpointing: Recompute activations in the backward pass instead of keeping them:
                "none", "full" (each whole block) or "selective" (keep matmul and attention outputs,
                recompute the pointwise ops between them). Less memory for more compute.
            compile: torch.compile each block (the first steps are slower while it compiles).
        """
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"Pretrain.label_smoothing={label_smoothing}: must lie in [0, 1)")
        super().__init__(arch, init_from, tokenizer, optimizer, scheduler, activation_checkpointing, compile)
        self.label_smoothing = label_smoothing
        self.save_hyperparameters(ignore=["tokenizer", "optimizer", "scheduler"])

    def _shared_step(self, batch: dict[str, torch.Tensor], stage: str):
        return self.next_token_loss(batch, self.label_smoothing)
