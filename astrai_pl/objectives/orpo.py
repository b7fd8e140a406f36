"""Odds Ratio Preference Optimization (Hong et al., 2024): supervised fine-tuning on the chosen responses and a
preference term in one stage, with no reference model.

The preference term (`losses.orpo_loss`) raises the odds of the chosen response over the rejected one, each
scored by its mean token log-probability; the NLL term is the token mean over the chosen responses.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import Objective
from .dpo import pair_logps, response_lengths, window_pair_loss
from .options import check_orpo_options
from .preference_losses import orpo_loss


def mean_pair_logps(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Mean token log-probabilities of the chosen and the rejected responses (B,), (B,), and the chosen
    responses' token-mean negative log-likelihood (), from one forward."""
    (chosen, rejected), (n_chosen, n_rejected) = pair_logps(model, batch), response_lengths(batch)
    return chosen / n_chosen, rejected / n_rejected, -chosen.sum() / n_chosen.sum()


class PairObjective(Objective):
    """What the reference-free pair objectives share: a per-pair loss made exact under gradient accumulation
    (DPOData tags batches with `window_pairs`) and across data-parallel ranks, and a validation loss without
    perplexity."""

    def _per_pair(self, loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return window_pair_loss(self, loss, batch)

    def _log_eval_loss(self, stage: str) -> None:
        self.log(f"{stage}/loss", self.val_loss.compute(), prog_bar=True)  # a per-pair loss: no perplexity


class ORPO(PairObjective):
    """L = NLL(chosen) − β · mean over pairs of log σ(log odds(p_c) − log odds(p_r))  (see `orpo_loss`).

    p: mean token log-probability of a response; prompts and padding are never scored. Both sides of every pair go
    through the model in one forward, the prompt they share computed once (`shared_prompt`). Metrics, with TRL's
    names, under train/ and val/: nll_loss, log_odds_ratio, log_odds_chosen, rewards/chosen, rewards/rejected,
    rewards/accuracies, rewards/margins, logps/chosen, logps/rejected. In training the NLL is the mean over every
    data-parallel rank's chosen tokens and the odds-ratio term the mean over every rank's pairs, both over the
    whole accumulation window (DPOData tags batches with `window_chosen_tokens` and `window_pairs`).
    """

    def __init__(self, *args: Any, beta: float = 0.1, **kwargs: Any):
        """
        Args:
            beta: λ of the paper (TRL's `beta`, default 0.1): the weight of the odds-ratio term against the
                chosen responses' negative log-likelihood.
        """
        check_orpo_options(beta)
        super().__init__(*args, **kwargs)  # the options of every objective: arch, init_from, … (Objective)
        self.beta = beta

    def _shared_step(self, batch: dict[str, torch.Tensor], stage: str):
        chosen, rejected, nll = mean_pair_logps(self.model, batch)
        loss, metrics = orpo_loss(chosen, rejected, nll, beta=self.beta)
        if not self.training:
            return loss, metrics
        # Two means, each over every rank's items: the NLL over chosen tokens, the odds-ratio term over pairs.
        return window_pair_loss(self, loss, batch, nll, 1.0, response_lengths(batch)[0].sum()), metrics
