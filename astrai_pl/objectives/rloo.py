"""REINFORCE Leave-One-Out: online RL on groups of completions the inference engine samples from the live
policy, with the KL to a frozen reference in the reward and each completion's baseline the mean reward of
its siblings."""

from __future__ import annotations

from typing import Any

import torch

from ..inference import SamplingParams
from .base import Objective, frozen_copy
from .global_counts import rank_share
from .logprobs import token_logprobs
from .on_policy import (
    check_whole_model,
    completion_rewards,
    held_out_rewards,
    log_held_out_rewards,
    longest_prompted_sequence,
    policy_engine,
    reference_logps,
    require_prompts,
)
from .on_policy_losses import kl_penalised_rewards, rloo_advantages, rloo_loss
from .options import require
from .rewards import RewardSpec, load_reward_funcs, reward_metrics, spec_name
from .rollout import Rollout, completion_metrics, micro_batches, sample

DEFAULT_REWARDS = ("astrai_pl.objectives.rewards.exact_match_reward",)


class RLOO(Objective):
    """RLOO (Ahmadian et al., 2024; Kool et al., 2019) as TRL's RLOOTrainer: per prompt, G completions o_1..o_G
    from π_old, rewards R_i from the reward functions,

        r_i = R_i − β · Σ_t (log π_old(o_{i,t}) − log π_ref(o_{i,t}))        (KL in the reward)
        A_i = r_i − mean_{j ≠ i} r_j                                          (leave-one-out baseline)
        L = −Σ_i min(ρ_i·A_i, clip(ρ_i, 1 − ε_low, 1 + ε_high)·A_i) / N,   ρ_i = π_θ(o_i | q) / π_old(o_i | q)

    ρ is the ratio of whole-sequence probabilities (1 on the first pass over a rollout: plain REINFORCE with
    the baseline); N the sequences of the rollout batch, however many micro-batches the Trainer accumulates.
    Rollouts, their schedule (`num_iterations`) and micro-batches are GRPO's (rollout.py). Losses:
    on_policy_losses.py.
    """

    def __init__(
        self,
        *args: Any,
        reward_funcs: list[RewardSpec] | None = None,
        reward_weights: list[float] | None = None,
        num_generations: int = 2,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        num_iterations: int = 1,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.05,
        normalize_advantages: bool = False,
        engine_page_size: int = 16,
        engine_max_total_tokens: int | None = None,
        **kwargs: Any,
    ):
        """
        Args:
            reward_funcs: Reward functions or reward-model directories, as GRPO's (TRL's signature); None =
                exact_match_reward.
            reward_weights: One weight per reward function; None = all 1.0.
            num_generations: Completions sampled per prompt (G >= 2: the baseline is the siblings' mean reward);
                TRL's default is 2.
            max_completion_length: Most tokens per completion (the stop token included).
            temperature: Sampling temperature; training scores tokens at the same temperature.
            top_p: Nucleus sampling of the rollouts (1.0 = off).
            top_k: Top-k sampling of the rollouts (0 = off).
            num_iterations: Optimizer steps (passes over the rollout batch) per rollout.
            epsilon: Lower clip ε_low of the sequence ratio.
            epsilon_high: Upper clip ε_high; None = epsilon.
            beta: Weight of the KL to the frozen reference (the initial policy) in the reward; 0 keeps no reference.
            normalize_advantages: Standardise the advantages over the rollout batch (TRL's normalize_advantages).
            engine_page_size: Tokens per KV page of the rollout engine.
            engine_max_total_tokens: KV pool of the rollout engine in tokens; None = room for a whole rollout batch.
        """
        require(num_generations >= 2, "RLOO.num_generations", num_generations,
                "must be >= 2: a completion's baseline is the mean reward of its siblings; TRL's default is 2")
        require(max_completion_length >= 1, "RLOO.max_completion_length", max_completion_length, "must be >= 1")
        require(temperature > 0, "RLOO.temperature", temperature, "must be > 0: RLOO needs sampled completions")
        require(0 < top_p <= 1, "RLOO.top_p", top_p, "must lie in (0, 1]; use 1.0 for the full distribution")
        require(top_k >= 0, "RLOO.top_k", top_k, "must be >= 0; use 0 for no top-k")
        require(num_iterations >= 1, "RLOO.num_iterations", num_iterations, "must be >= 1")
        require(epsilon > 0, "RLOO.epsilon", epsilon, "must be > 0; TRL's default is 0.2")
        require(epsilon_high is None or epsilon_high > 0, "RLOO.epsilon_high", epsilon_high,
                "must be > 0, or null for epsilon's value")
        require(beta >= 0, "RLOO.beta", beta, "must be >= 0; 0 drops the reference model")
        require(engine_page_size >= 1, "RLOO.engine_page_size", engine_page_size, "must be >= 1")
        specs = list(DEFAULT_REWARDS if reward_funcs is None else reward_funcs)
        self.reward_funcs, self.reward_weights = load_reward_funcs(specs, reward_weights, owner="RLOO")
        super().__init__(*args, **kwargs)
        self.hparams["reward_funcs"] = [spec_name(s) for s in specs]
        self.ref_model = frozen_copy(self.model) if beta > 0 and self.model.lora_config is None else None
        self.rollout: Rollout | None = None
        self._engine = None

    def configure_model(self) -> None:
        check_whole_model("RLOO", self.trainer if self._trainer is not None else None)
        super().configure_model()

    def longest_sequence(self, datamodule: Any) -> tuple[str, int] | None:
        return longest_prompted_sequence(datamodule, "max_completion_length", self.hparams.max_completion_length)

    def engine(self, prompt_ids: list[list[int]], group_size: int):
        hp = self.hparams
        self._engine = policy_engine(self._engine, self.model, self.tokenizer, prompt_ids, group_size,
                                     hp.max_completion_length, hp.engine_page_size, hp.engine_max_total_tokens, "RLOO")
        return self._engine

    # -- rollouts ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def roll_out(self, batch: dict[str, list], num_micro_batches: int = 1) -> Rollout:
        """Sample num_generations completions per prompt, score them, put the KL in the rewards, and pack the
        micro-batches with their leave-one-out advantages."""
        require_prompts("RLOO", batch)
        hp, prompt_ids, G = self.hparams, batch["prompt_ids"], self.hparams.num_generations
        params = SamplingParams(max_tokens=hp.max_completion_length, temperature=hp.temperature, top_p=hp.top_p,
                                top_k=hp.top_k, n=G, logprobs=True)
        completions, seconds = sample(self.engine(prompt_ids, G), prompt_ids, params)
        per_func, total = completion_rewards(self.reward_funcs, self.reward_weights, batch, completions, G)
        total = total.to(self.device, torch.float32)
        parts = micro_batches(prompt_ids, completions, torch.zeros_like(total), num_micro_batches,
                              self.tokenizer.pad_token_id, "grpo")  # "grpo": weights for a mean over sequences
        rewards, kls, start = [], [], 0
        for part in parts:
            part["old_logps"] = self._logps(self.model, part)
            ref = reference_logps(self.ref_model, self.model, part, hp.temperature) if hp.beta > 0 else None
            r, kl = kl_penalised_rewards(total[start:start + len(part["input_ids"])], part["old_logps"], ref,
                                         part["mask"], hp.beta)
            rewards.append(r)
            kls.append(kl)
            start += len(part["input_ids"])
        advantages = rloo_advantages(torch.cat(rewards), G, hp.normalize_advantages)
        start, share = 0, rank_share(len(advantages), self.device, self._trainer)  # uneven rollouts across ranks
        for part in parts:
            part["weight"] = part["weight"] * share
            part["advantages"], start = advantages[start:start + len(part["input_ids"])], start + len(part["input_ids"])
        metrics = {**completion_metrics(completions, seconds), **reward_metrics(self.reward_names, per_func, total, G),
                   "kl": float(torch.cat(kls).mean())}
        return Rollout(parts, metrics, self.trainer.global_step if self._trainer is not None else 0)

    @property
    def reward_names(self) -> list[str]:
        return [name for name, _ in self.reward_funcs]

    def _logps(self, model: torch.nn.Module, part: dict[str, Any]) -> torch.Tensor:
        return token_logprobs(model, part["input_ids"], part["labels"], temperature=self.hparams.temperature)

    # -- training ----------------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        k = self.accumulation_steps()
        position = batch_idx % (self.hparams.num_iterations * k)  # μ·k micro-steps per rollout
        if self.rollout is None or position == 0:
            self.rollout = self.roll_out(batch, k)
            n = sum(len(p["advantages"]) for p in self.rollout.micro_batches)
            self.log_dict({f"train/{key}": v for key, v in self.rollout.metrics.items()}, on_step=True,
                          on_epoch=False, batch_size=n)
        part = self.rollout.micro_batches[position % k]
        loss, metrics = self._shared_step(part, "train")
        n = len(part["advantages"])
        self.log_dict({f"train/{key}": v for key, v in metrics.items()}, on_step=True, on_epoch=False, batch_size=n)
        self.log("train/loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=False, batch_size=n)
        return loss

    def _shared_step(self, batch: dict[str, Any], stage: str):
        """RLOO's loss on one micro-batch of a rollout, weighted so the accumulated gradient is the rollout's."""
        hp = self.hparams
        logps = self._logps(self.model, batch)  # (B, T), gradients flow here only
        old = batch["old_logps"] if hp.num_iterations > 1 else None  # one pass: ρ = 1 exactly
        loss, metrics = rloo_loss(logps, old, batch["advantages"], batch["mask"], hp.epsilon, hp.epsilon_high)
        return loss * batch["weight"], metrics

    # -- evaluation: greedy completions of held-out prompts, scored by the same reward functions ------------
    def _evaluate(self, batch, stage: str) -> None:
        engine = self.engine(batch["prompt_ids"], 1)
        per_func, total = held_out_rewards(engine, batch, self.reward_funcs, self.reward_weights,
                                           self.hparams.max_completion_length)
        log_held_out_rewards(self, stage, self.reward_names, per_func, total)

    def _log_eval_loss(self, stage: str) -> None:
        """RLOO has no held-out loss; `_evaluate` logs held-out rewards instead."""
