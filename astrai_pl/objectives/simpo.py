"""Simple Preference Optimization (Meng et al., 2024): a margin between the length-normalised log-likelihoods of
the chosen and the rejected response, with no reference model (`losses.simpo_loss`)."""

from __future__ import annotations

from typing import Any

import torch

from .options import check_simpo_options
from .orpo import PairObjective, mean_pair_logps
from .preference_losses import simpo_loss


class SimPO(PairObjective):
    """L = mean over pairs of −log σ(β · (p_c − p_r) − γ)  (label_smoothing 0; see `simpo_loss`).

    p: mean token log-probability of a response; prompts and padding are never scored. Both sides of every pair go
    through the model in one forward, the prompt they share computed once (`shared_prompt`). Metrics, with TRL's
    names, under train/ and val/: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
    logps/chosen, logps/rejected.
    """

    def __init__(self, *args: Any, beta: float = 2.0, gamma: float = 0.5, label_smoothing: float = 0.0,
                 **kwargs: Any):
        """
        Args:
            beta: β, the scale of the reward β·p (p: a response's mean token log-probability). The paper uses 2.0
                to 2.5; TRL's CPOConfig defaults to 0.1.
            gamma: γ, the target reward margin between chosen and rejected (TRL's simpo_gamma, default 0.5); the
                paper tunes γ/β around 0.5.
            label_smoothing: ε, the assumed probability that a pair's labels are flipped (as in cDPO); 0 = trust
                every pair.
        """
        check_simpo_options(beta, gamma, label_smoothing)
        super().__init__(*args, **kwargs)  # the options of every objective: arch, init_from, … (Objective)
        self.beta, self.gamma, self.label_smoothing = beta, gamma, label_smoothing

    def _shared_step(self, batch: dict[str, torch.Tensor], stage: str):
        chosen, rejected, _ = mean_pair_logps(self.model, batch)
        loss, metrics = simpo_loss(chosen, rejected, beta=self.beta, gamma=self.gamma,
                                   label_smoothing=self.label_smoothing)
        return self._per_pair(loss, batch), metrics
