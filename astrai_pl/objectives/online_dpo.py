"""Online DPO: DPO on preference pairs made during training, two completions per prompt sampled from the
live policy by the inference engine and ranked by reward functions or a reward model."""

from __future__ import annotations

from typing import Any

import torch

from ..inference import SamplingParams
from .base import Objective, frozen_copy
from .global_counts import rank_share
from .logprobs import sequence_logprobs, token_logprobs
from .losses import dpo_loss
from .on_policy import (
    check_whole_model,
    completion_rewards,
    held_out_rewards,
    log_held_out_rewards,
    longest_prompted_sequence,
    missing_eos,
    policy_engine,
    reference_logps,
    require_prompts,
    sample_packed,
)
from .on_policy_losses import preference_pairs
from .options import require
from .rewards import RewardSpec, load_reward_funcs, spec_name

DEFAULT_REWARDS = ("astrai_pl.objectives.rewards.exact_match_reward",)
ONLINE_DPO_LOSS_TYPES = ("sigmoid", "ipo")


class OnlineDPO(Objective):
    """Online DPO (Guo et al., 2024, "Direct Language Model Alignment from Online AI Feedback") as TRL's
    OnlineDPOTrainer: for each prompt x of the batch, two completions y_1, y_2 ~ π_θ(· | x) from the engine,
    scored R(x, y) by the reward functions (minus `missing_eos_penalty` for a completion cut at max_new_tokens);
    the higher one is chosen (y_1 on a tie), the other rejected, and the loss is DPO's on those pairs:

        h = (log π_θ(y_c|x) − log π_ref(y_c|x)) − (log π_θ(y_r|x) − log π_ref(y_r|x))
        sigmoid  −log σ(β·h)            ipo  (h − 1/(2β))²

    averaged over the batch's pairs, log-probabilities summed over the completion tokens (`losses.dpo_loss`).
    The reference is the initial policy, frozen (with LoRA: the base, adapters off).
    """

    def __init__(
        self,
        *args: Any,
        reward_funcs: list[RewardSpec] | None = None,
        reward_weights: list[float] | None = None,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        max_new_tokens: int = 64,
        temperature: float = 0.9,
        top_p: float = 1.0,
        top_k: int = 0,
        missing_eos_penalty: float | None = None,
        engine_page_size: int = 16,
        engine_max_total_tokens: int | None = None,
        **kwargs: Any,
    ):
        """
        Args:
            reward_funcs: Reward functions or reward-model directories that rank the two completions, as GRPO's
                (TRL's signature); None = exact_match_reward.
            reward_weights: One weight per reward function; None = all 1.0.
            beta: DPO's β (the inverse temperature of the implicit reward); TRL's default is 0.1.
            loss_type: 'sigmoid' (DPO) or 'ipo', TRL's OnlineDPOConfig names.
            max_new_tokens: Most tokens per sampled completion (the stop token included).
            temperature: Sampling temperature of the two completions (TRL's default 0.9); log-probabilities
                are scored at temperature 1, as TRL does.
            top_p: Nucleus sampling (1.0 = off).
            top_k: Top-k sampling (0 = off).
            missing_eos_penalty: Subtracted from the reward of a completion that ends without its stop token;
                None = no penalty.
            engine_page_size: Tokens per KV page of the sampling engine.
            engine_max_total_tokens: KV pool of the sampling engine in tokens; None = room for a whole batch.
        """
        require(beta > 0, "OnlineDPO.beta", beta, "must be > 0; TRL's default is 0.1")
        require(loss_type in ONLINE_DPO_LOSS_TYPES, "OnlineDPO.loss_type", loss_type,
                f"use one of {', '.join(ONLINE_DPO_LOSS_TYPES)}")
        require(max_new_tokens >= 1, "OnlineDPO.max_new_tokens", max_new_tokens, "must be >= 1")
        require(temperature > 0, "OnlineDPO.temperature", temperature,
                "must be > 0: two greedy completions would be the same and make no pair; TRL's default is 0.9")
        require(0 < top_p <= 1, "OnlineDPO.top_p", top_p, "must lie in (0, 1]; use 1.0 for the full distribution")
        require(top_k >= 0, "OnlineDPO.top_k", top_k, "must be >= 0; use 0 for no top-k")
        require(missing_eos_penalty is None or missing_eos_penalty >= 0, "OnlineDPO.missing_eos_penalty",
                missing_eos_penalty, "must be >= 0, or null for none")
        require(engine_page_size >= 1, "OnlineDPO.engine_page_size", engine_page_size, "must be >= 1")
        specs = list(DEFAULT_REWARDS if reward_funcs is None else reward_funcs)
        self.reward_funcs, self.reward_weights = load_reward_funcs(specs, reward_weights, owner="OnlineDPO")
        super().__init__(*args, **kwargs)
        self.hparams["reward_funcs"] = [spec_name(s) for s in specs]
        self.ref_model = frozen_copy(self.model) if self.model.lora_config is None else None
        self._engine = None
        self.trained_sequences: dict[str, Any] | None = None  # the last training step's sampled pairs, packed

    def configure_model(self) -> None:
        check_whole_model("OnlineDPO", self.trainer if self._trainer is not None else None)
        super().configure_model()

    def longest_sequence(self, datamodule: Any) -> tuple[str, int] | None:
        return longest_prompted_sequence(datamodule, "max_new_tokens", self.hparams.max_new_tokens)

    def engine(self, prompt_ids: list[list[int]], group_size: int):
        hp = self.hparams
        self._engine = policy_engine(self._engine, self.model, self.tokenizer, prompt_ids, group_size,
                                     hp.max_new_tokens, hp.engine_page_size, hp.engine_max_total_tokens, "OnlineDPO")
        return self._engine

    @torch.no_grad()
    def sample_pairs(self, batch: dict[str, list]) -> dict[str, Any]:
        """Two completions per prompt, packed (grouped by prompt), their rewards (2P,), and the indices of each
        prompt's chosen and rejected one."""
        require_prompts("OnlineDPO", batch)
        hp = self.hparams
        params = SamplingParams(max_tokens=hp.max_new_tokens, temperature=hp.temperature, top_p=hp.top_p,
                                top_k=hp.top_k, n=2)
        completions, packed, metrics = sample_packed(self.engine(batch["prompt_ids"], 2), batch["prompt_ids"], params,
                                                     self.tokenizer.pad_token_id, self.device)
        _, rewards = completion_rewards(self.reward_funcs, self.reward_weights, batch, completions, 2)
        cut = missing_eos(completions)
        if hp.missing_eos_penalty is not None:
            rewards = rewards - hp.missing_eos_penalty * cut
        chosen, rejected = preference_pairs(rewards.to(self.device))
        return {**packed, "rewards": rewards.to(self.device), "chosen": chosen, "rejected": rejected,
                "sampling": {**metrics, "contain_eos_token": 1.0 - float(cut.mean())}}

    def _shared_step(self, batch: dict[str, Any], stage: str):
        pairs = self.sample_pairs(batch)
        if self.training:
            self.trained_sequences = pairs  # what ProgressLines counts as this step's tokens
        logps = token_logprobs(self.model, pairs["input_ids"], pairs["labels"])  # (2P, T), gradients flow here
        ref = reference_logps(self.ref_model, self.model, pairs)  # (2P, T)
        policy, reference = sequence_logprobs(logps, pairs["mask"]), sequence_logprobs(ref, pairs["mask"])
        c, r = pairs["chosen"], pairs["rejected"]
        loss, metrics = dpo_loss(policy[c], policy[r], reference[c], reference[r], beta=self.hparams.beta,
                                 loss_type=self.hparams.loss_type)
        rewards = pairs["rewards"]
        metrics.update({"objective/scores": rewards.mean(), "objective/scores_margin": (rewards[c] - rewards[r]).mean(),
                        "objective/kl": (policy - reference).detach().mean()})
        metrics.update({k: torch.tensor(v) for k, v in pairs["sampling"].items()})
        if self.training:  # a mean over every rank's pairs (`global_counts`)
            loss = loss * rank_share(len(c), loss.device, self._trainer)
        return loss, metrics

    # -- evaluation: greedy completions of held-out prompts, scored by the same reward functions ------------
    def _evaluate(self, batch, stage: str) -> None:
        per_func, total = held_out_rewards(self.engine(batch["prompt_ids"], 1), batch, self.reward_funcs,
                                           self.reward_weights, self.hparams.max_new_tokens)
        log_held_out_rewards(self, stage, [name for name, _ in self.reward_funcs], per_func, total)

    def _log_eval_loss(self, stage: str) -> None:
        """Online DPO has no held-out loss; `_evaluate` logs held-out rewards instead."""
