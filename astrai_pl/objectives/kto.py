"""Kahneman–Tversky Optimization (Ethayarajh et al., 2024): learn from unpaired completions labelled desirable or
undesirable, against a frozen reference policy.

The loss (`losses.kto_loss`) rewards a desirable completion for being more likely under the policy than under
the reference, by more than a reference point z₀, and an undesirable one for being less likely. z₀ estimates
KL(π ‖ π_ref) from mismatched pairs: each prompt of the batch with another example's completion (`KTOData`
pairs each example's prompt with the completion of the example before it in its split), scored by both models without
gradients, averaged and clamped at 0 — as TRL's KTOTrainer does; with several devices the mismatched pairs of
every rank are gathered first, so every rank uses the same z₀.

The reference is a frozen copy of the initial policy held outside the module tree (not in `state_dict()`, the
optimizer or checkpoints; a fingerprint of its weights in the checkpoint refuses a resume against other ones),
or, when training a LoRA adapter, the base with the adapter switched off. With precompute_ref_log_probs, the
reference scores every example and its mismatched pair (fixed per example by `KTOData`) once before the first
step, as DPO's does (`reference_tables`), and no reference model is kept or run during training.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..checkpoint.loading import weights_fingerprint
from ..model.config import ConfigError
from .base import Objective, frozen_copy, reference_scope
from .logprobs import sequence_logprobs, token_logprobs
from .options import check_kto_options
from .preference_losses import kto_loss
from .reference_tables import load_reference, prepared_tables, save_reference, table_rows


def example_logps(model: nn.Module, batch: dict[str, torch.Tensor], kl: bool) -> tuple[torch.Tensor, ...]:
    """Summed completion log-probabilities of the examples (B,) and, with `kl`, of their mismatched pairs (B,),
    in one forward."""
    if not kl:
        return (sequence_logprobs(token_logprobs(model, batch["input_ids"], batch["labels"])),)
    ids = torch.cat([batch["input_ids"], batch["KL_input_ids"]])  # (2B, T)
    labels = torch.cat([batch["labels"], batch["KL_labels"]])  # (2B, T)
    return tuple(sequence_logprobs(token_logprobs(model, ids, labels)).chunk(2))


class KTO(Objective):
    """L = mean over examples of λ_D·(1 − σ(β(r − z₀))) (desirable) or λ_U·(1 − σ(β(z₀ − r))) (undesirable).

    r = π − π_ref, the summed completion log-probabilities under the policy and the frozen reference; z₀ the
    clamped KL estimate from mismatched pairs (see `kto_loss`). Prompts and padding are never scored. The
    per-example mean is exact under gradient accumulation (KTOData tags batches with `window_examples`).
    Metrics, with TRL's names, under train/ and val/: kl, rewards/chosen, rewards/rejected, rewards/margins,
    logps/chosen, logps/rejected (chosen: desirable, rejected: undesirable).
    """

    def __init__(
        self,
        *args: Any,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        loss_type: str = "kto",
        precompute_ref_log_probs: bool = False,
        **kwargs: Any,
    ):
        """
        Args:
            beta: β, the scale of the implied reward β·log(π/π_ref): larger trusts the labels more, smaller keeps
                the policy nearer the reference (TRL default 0.1).
            desirable_weight: λ_D, the weight of each desirable example's loss. With unequal counts, the paper
                (Eq. 8) wants λ_D·n_D / (λ_U·n_U) in [1, 4/3]; KTOData logs the counts.
            undesirable_weight: λ_U, the weight of each undesirable example's loss.
            loss_type: 'kto' (the paper's loss, with the KL reference point) or 'apo_zero_unpaired' (APO-zero on
                unpaired data: no reference point, no mismatched pairs scored).
            precompute_ref_log_probs: Score every example (and its mismatched pair) under the initial policy once
                before training and keep no reference model (half the weights in memory, one extra pass over the
                data) instead of a live frozen copy. Needs a data module with `indexed_loaders()` (KTOData).
        """
        check_kto_options(beta, desirable_weight, undesirable_weight, loss_type)
        super().__init__(*args, **kwargs)  # the options of every objective: arch, init_from, … (Objective)
        self.beta, self.loss_type = beta, loss_type
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight
        # With LoRA the base, adapter switched off, is the reference (base.reference_scope): no copy is kept.
        live = not precompute_ref_log_probs and self.model.lora_config is None
        reference = frozen_copy(self.model) if live else None
        # In __dict__, not a submodule: outside state_dict(), parameters(), the optimizer and checkpoints.
        self.__dict__["reference"] = reference
        self.reference_fingerprint = None if reference is None else weights_fingerprint(reference)
        self.reference_logps: dict[str, torch.Tensor] | None = None  # split -> (N, 1 or 2), when precomputed

    def setup(self, stage: str) -> None:
        super().setup(stage)
        batch_size = getattr(self.trainer.datamodule, "hparams", {}).get("batch_size")
        if self.loss_type == "kto" and batch_size is not None and batch_size < 2:
            raise ConfigError(f"data.init_args.batch_size={batch_size}: KTO estimates its KL reference point from "
                              "each prompt paired with another example's completion of the same batch; use at "
                              "least 2 (TRL refuses 1 too), or loss_type apo_zero_unpaired")

    # -- the reference ------------------------------------------------------------------------------------
    def _example_scores(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A row of the precomputed table: the example's and, for 'kto', its mismatched pair's log-probability."""
        return torch.stack(example_logps(model, batch, self.loss_type == "kto"), dim=1)  # (B, 1 or 2)

    def prepare_reference(self) -> None:
        if self.hparams.precompute_ref_log_probs:
            self.reference_logps = prepared_tables(self, self.reference_logps, self._example_scores)

    @torch.no_grad()
    def _reference_logps(self, batch: dict[str, torch.Tensor], kl: bool, stage: str) -> tuple[torch.Tensor, ...]:
        if self.hparams.precompute_ref_log_probs:
            return table_rows(self.reference_logps, batch, stage, "KTO", batch["input_ids"].device).unbind(1)
        if self.reference is None:
            with reference_scope(self.model):
                return example_logps(self.model, batch, kl)
        policy, ref = next(self.model.parameters()), next(self.reference.parameters())
        if (ref.device, ref.dtype) != (policy.device, policy.dtype):  # Lightning moves only the module tree
            self.reference.to(device=policy.device, dtype=policy.dtype)
        return example_logps(self.reference, batch, kl)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        save_reference(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        load_reference(self, checkpoint)

    def _log_eval_loss(self, stage: str) -> None:
        self.log(f"{stage}/loss", self.val_loss.compute(), prog_bar=True)  # a per-example loss: no perplexity

    # -- the step -----------------------------------------------------------------------------------------
    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (B,) of every rank, concatenated (itself on one device)."""
        if self._trainer is None or self.trainer.world_size == 1:
            return x
        return self.all_gather(x).reshape(-1)

    def _shared_step(self, batch: dict[str, torch.Tensor], stage: str):
        kl = self.loss_type == "kto"
        policy = sequence_logprobs(token_logprobs(self.model, batch["input_ids"], batch["labels"]))  # (B,)
        ref = self._reference_logps(batch, kl, stage)  # (B,) and, with kl, the mismatched pairs' (B,)
        policy_kl = ref_kl = None
        if kl:
            with torch.no_grad():  # z₀ is a constant: the mismatched pairs take no gradient
                policy_kl = sequence_logprobs(token_logprobs(self.model, batch["KL_input_ids"], batch["KL_labels"]))
            policy_kl, ref_kl = self._gathered(policy_kl), self._gathered(ref[1])
        loss, metrics = kto_loss(policy, ref[0], batch["label"], policy_kl, ref_kl, beta=self.beta,
                                 desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight,
                                 loss_type=self.loss_type)
        examples = torch.tensor(policy.numel(), device=loss.device)
        return loss * examples / self.accumulation_scale(batch, examples, key="window_examples"), metrics
