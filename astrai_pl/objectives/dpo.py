"""Direct Preference Optimization (Rafailov et al., 2023): learn from pairs, no reward model, no sampling.

The loss (`losses.dpo_loss`) compares how much more likely the policy makes the chosen response than
the rejected one, against the same margin under a frozen reference policy — the policy as training
found it. The reference comes in one of two forms:

- live (default): a frozen copy of the initial policy, in eval mode, whose parameters never require a
  gradient. It is held outside the module tree, so it is not in `state_dict()`, `parameters()`, the
  optimizer or the checkpoint (checkpoints stay the policy's size); it follows the policy's device and
  dtype on first use. A resumed run rebuilds it from `init_from` (or from the seeded initialisation) when
  the objective is constructed, and a fingerprint of its weights in the checkpoint stops the resume
  with an error if those weights are no longer the same. Costs a second model in memory, unsharded.
- precompute_ref_log_probs: the policy scores every pair of the train and val splits once, before the
  first step (`on_fit_start`), and no second model is kept. The table, keyed by each batch's
  `row_index`, is saved in checkpoints so a resumed run uses the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..checkpoint.loading import weights_fingerprint
from .base import Objective, frozen_copy, reference_scope
from .logprobs import IGNORE_INDEX, hidden_logprobs, sequence_logprobs
from .losses import dpo_loss
from .options import check_dpo_options
from .reference_tables import load_reference, prepared_tables, save_reference, table_rows
from .shared_prompt import pair_hidden_states

SIDES = ("chosen", "rejected")


def pair_logps(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probabilities of the chosen and the rejected sides, in one forward (each shared
    prompt computed once where that pays: `shared_prompt.pair_hidden_states`).  (B,), (B,)"""
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])  # (2B, T)
    token_lp = hidden_logprobs(model.lm_head, pair_hidden_states(model, batch), labels)
    chosen, rejected = sequence_logprobs(token_lp).chunk(2)  # (B,) each
    return chosen, rejected


def response_lengths(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scored tokens of each response (labels are unshifted: position 0 is never a target).  (B,), (B,)"""
    return tuple((batch[f"{side}_labels"][:, 1:] != IGNORE_INDEX).sum(1).clamp(min=1) for side in SIDES)


def window_pair_loss(objective: Objective, loss: torch.Tensor, batch: dict[str, Any], nll: torch.Tensor | None = None,
                     nll_weight: float = 0.0, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """`loss` (a per-pair mean, plus nll_weight · nll: the chosen responses' token-mean NLL over their `tokens`)
    made exact over the accumulation window and every data-parallel rank: its per-pair part a mean over the
    window's pairs (`window_pairs`), its NLL part a mean over the window's chosen tokens (`window_chosen_tokens`)."""
    pairs = torch.tensor(batch["chosen_input_ids"].shape[0], device=loss.device)
    per_pair = loss - nll_weight * nll if nll_weight else loss
    exact = per_pair * pairs / objective.accumulation_scale(batch, pairs, key="window_pairs")
    if nll_weight:
        window_tokens = objective.accumulation_scale(batch, tokens, key="window_chosen_tokens")
        exact = exact + nll_weight * nll * tokens / window_tokens
    return exact


def pair_scores(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(chosen, rejected) summed log-probabilities of each pair: a row of the precomputed table.  (B, 2)"""
    return torch.stack(pair_logps(model, batch), dim=1)


class DPO(Objective):
    """L = mean over pairs of −log σ(β · ((πc − πr) − (rc − rr)))  (loss_type 'sigmoid'; see `dpo_loss`).

    π·/r· are the summed log-probabilities of the chosen (c) and rejected (r) responses under the policy and the
    frozen reference; prompts and padding are never scored. Both sides of every pair go through the model in one
    forward, the prompt they share computed once (`shared_prompt`). The per-pair mean, and the chosen-token mean
    of an NLL term (rpo_alpha, 'sft'), are exact under gradient accumulation and across data-parallel ranks
    (DPOData tags batches with `window_pairs` and `window_chosen_tokens`). Metrics, with TRL's names, under train/ and val/:
    rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected.
    """

    def __init__(
        self,
        *args: Any,
        beta: float = 0.1,
        loss_type: str | list[str] = "sigmoid",
        label_smoothing: float = 0.0,
        precompute_ref_log_probs: bool = False,
        rpo_alpha: float | None = None,
        loss_weights: list[float] | None = None,
        discopop_tau: float = 0.05,
        **kwargs: Any,
    ):
        """
        Args:
            beta: β, the inverse temperature of the implicit reward β·log(π/π_ref): larger trusts the pairs
                more, smaller keeps the policy nearer the reference (TRL default 0.1).
            loss_type: One of TRL's names — 'sigmoid' (DPO), 'robust' (rDPO), 'ipo' (IPO, on mean token
                log-probabilities), 'hinge' (SLiC-HF), 'exo_pair', 'nca_pair', 'bco_pair', 'sppo_hard', 'aot',
                'aot_unpaired', 'apo_zero', 'apo_down', 'discopop', 'sft', 'sigmoid_norm' — or a list of them,
                summed with `loss_weights` (MPO). Equations: `losses.dpo_loss`, docs/objectives.md.
            label_smoothing: ε, the assumed probability that a pair's labels are flipped (cDPO for 'sigmoid',
                rDPO for 'robust', also 'aot' and 'aot_unpaired'; 'exo_pair' needs ε > 0, e.g. 1e-3); 0 = trust
                every pair.
            precompute_ref_log_probs: Score every pair under the initial policy once before training and keep
                no reference model (half the weights in memory, one extra pass over the data) instead of a
                live frozen copy. Needs a data module with `indexed_loaders()` (DPOData).
            rpo_alpha: α of RPO (Pang et al., 2024): add α · the chosen responses' token-mean negative
                log-likelihood to the loss, which keeps the chosen likelihood from falling; null = plain DPO.
            loss_weights: One weight per entry of a list `loss_type`; null = 1.0 each.
            discopop_tau: τ of 'discopop', the temperature of its blend of logistic and exponential losses.
        """
        check_dpo_options(beta, loss_type, label_smoothing, rpo_alpha, loss_weights, discopop_tau)
        super().__init__(*args, **kwargs)  # the options of every objective: arch, init_from, … (Objective)
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.rpo_alpha = rpo_alpha
        # With LoRA the base, adapter switched off, is the reference (base.reference_scope): no copy is kept.
        live = not precompute_ref_log_probs and self.model.lora_config is None
        reference = frozen_copy(self.model) if live else None
        # In __dict__, not a submodule: outside state_dict(), parameters(), the optimizer and checkpoints.
        self.__dict__["reference"] = reference
        self.reference_fingerprint = None if reference is None else weights_fingerprint(reference)
        self.reference_logps: dict[str, torch.Tensor] | None = None  # split -> (N, 2), when precomputed

    # -- the reference ------------------------------------------------------------------------------------
    def _reference_pair_logps(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, ...]:
        if self.reference is not None:
            self._place_reference()
            with torch.no_grad():
                return pair_logps(self.reference, batch)
        if self.model.lora_config is not None and not self.hparams.precompute_ref_log_probs:
            with torch.no_grad(), reference_scope(self.model):
                return pair_logps(self.model, batch)
        rows = table_rows(self.reference_logps, batch, stage, "DPO", batch["chosen_input_ids"].device)  # (B, 2)
        return rows[:, 0], rows[:, 1]

    def _place_reference(self) -> None:
        """The reference on the policy's device and in its dtype (Lightning moves only the module tree)."""
        policy, ref = next(self.model.parameters()), next(self.reference.parameters())
        if (ref.device, ref.dtype) != (policy.device, policy.dtype):
            self.reference.to(device=policy.device, dtype=policy.dtype)

    def prepare_reference(self) -> None:
        if self.hparams.precompute_ref_log_probs:
            self.reference_logps = prepared_tables(self, self.reference_logps, pair_scores)

    # -- checkpoints --------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        save_reference(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)  # a LoRA run's adapter and base (the base is its reference)
        load_reference(self, checkpoint)

    def _log_eval_loss(self, stage: str) -> None:
        self.log(f"{stage}/loss", self.val_loss.compute(), prog_bar=True)  # a per-pair loss: no perplexity

    # -- the step -----------------------------------------------------------------------------------------
    def _shared_step(self, batch: dict[str, torch.Tensor], stage: str):
        policy = pair_logps(self.model, batch)
        reference = self._reference_pair_logps(batch, stage)
        lengths = response_lengths(batch)
        nll = -policy[0].sum() / lengths[0].sum()  # token mean over the chosen responses
        hp = self.hparams  # ipo and sigmoid_norm score responses by their mean token log-probability
        loss, metrics = dpo_loss(*policy, *reference, beta=self.beta, loss_type=self.loss_type,
                                 label_smoothing=self.label_smoothing, loss_weights=hp.loss_weights,
                                 chosen_lengths=lengths[0], rejected_lengths=lengths[1], chosen_nll=nll,
                                 discopop_tau=hp.discopop_tau)
        if self.rpo_alpha is not None:
            loss = loss + self.rpo_alpha * nll
            metrics["nll_loss"] = nll.detach()
        return window_pair_loss(self, loss, batch, nll, self._nll_weight(), lengths[0].sum()), metrics

    def _nll_weight(self) -> float:
        """The weight of the chosen responses' token-mean NLL in the loss: rpo_alpha plus each 'sft' loss weight."""
        types = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        weights = self.hparams.loss_weights or [1.0] * len(types)
        return (self.rpo_alpha or 0.0) + sum(w for t, w in zip(types, weights) if t == "sft")
