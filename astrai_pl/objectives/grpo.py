"""Group Relative Policy Optimization: online RL on completions the inference engine samples from the policy
being trained, scored by reward functions, with group-relative advantages and a clipped surrogate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from ..inference import Engine, SamplingParams
from .base import Objective, frozen_copy, reference_scope
from .logprobs import token_logprobs
from .losses import group_advantages, grpo_loss
from .options import check_advantage_options, check_grpo_loss_options, require
from .rewards import RewardSpec, load_reward_funcs, reward_metrics, score, spec_name
from .rollout import Rollout, completion_metrics, micro_batches, pool_tokens, reward_inputs, sample

DEFAULT_REWARDS = ("astrai_pl.objectives.rewards.exact_match_reward",)


class GRPO(Objective):
    """GRPO (Shao et al., 2024, DeepSeekMath): per prompt, G completions o_1..o_G from π_old, rewards R_i,

        A_i = (R_i − mean_g R) / (std_g R + ε)                       (scale_rewards="group")
        L = Σ_{i,t} −min(ρ_{i,t}·A_i, clip(ρ_{i,t}, 1 − ε_c, 1 + ε_c)·A_i) / Σ_i |o_i|
            + kl_coef · Σ_{i,t} (r_{i,t} − log r_{i,t} − 1) / Σ_i |o_i|
        ρ = π_θ(o_t | q, o_<t) / π_old(o_t | q, o_<t),   r = π_ref(o_t | …) / π_θ(o_t | …)

    over the completion tokens of one rollout batch, however many micro-batches the Trainer accumulates
    (see `losses.grpo_loss` for the reductions and `rollout.accumulation_weights` for the exactness).
    Rollouts: one per `num_iterations` optimizer steps, on the live policy with the inference engine;
    the rollout batch is `batch_size` prompts × `group_size` completions, cut into `accumulate_grad_batches`
    micro-batches; each optimizer step is one pass over all of them. docs/objectives.md has the schedule.
    """

    def __init__(
        self,
        *args: Any,
        reward_funcs: list[RewardSpec] | None = None,
        reward_weights: list[float] | None = None,
        group_size: int = 4,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        num_iterations: int = 1,
        clip_eps: float = 0.2,
        kl_coef: float = 0.01,
        loss_type: str = "token",
        scale_rewards: str = "group",
        mask_truncated_completions: bool = False,
        zero_std_patience: int = 3,
        engine_page_size: int = 16,
        engine_max_total_tokens: int | None = None,
        **kwargs: Any,
    ):
        """
        Args:
            reward_funcs: Import paths of reward functions `f(prompts, completions, **columns) -> list[float | None]`
                (TRL's signature), or `{path: …, kwargs: {…}}`; see astrai_pl/objectives/rewards.py.
            reward_weights: One weight per reward function; None = all 1.0.
            group_size: Completions sampled per prompt (G); advantages compare siblings, so at least 2.
            max_completion_length: Most tokens per completion (the stop token included).
            temperature: Sampling temperature of the rollouts; training scores tokens at the same temperature.
            top_p: Nucleus sampling of the rollouts (1.0 = off).
            top_k: Top-k sampling of the rollouts (0 = off).
            num_iterations: Optimizer steps (passes over the rollout batch) per rollout (μ); the old policy's
                log-probabilities are taken when the rollout is sampled.
            clip_eps: ε of the clipped ratio clip(ρ, 1 − ε, 1 + ε).
            kl_coef: Weight of the k3 KL penalty to the frozen reference (the initial policy); 0 = no reference
                model is kept at all.
            loss_type: How token losses are averaged: 'token' (over all completion tokens of the rollout),
                'grpo' (per completion, then over completions) or 'dr_grpo' (over completions × max_completion_length).
            scale_rewards: Advantage scale: 'group' (group std), 'batch' (rollout std) or 'none' (Dr. GRPO).
            mask_truncated_completions: Leave completions cut at max_completion_length out of the loss.
            zero_std_patience: Warn once this many rollouts in a row had equal rewards within every group
                (frac_reward_zero_std = 1: all advantages are 0 and nothing is learned).
            engine_page_size: Tokens per KV page of the rollout engine.
            engine_max_total_tokens: KV pool of the rollout engine in tokens; None = room for a whole rollout batch.
        """
        check_advantage_options(group_size, scale_rewards)
        require(max_completion_length >= 1, "GRPO.max_completion_length", max_completion_length, "must be >= 1")
        require(temperature > 0, "GRPO.temperature", temperature, "must be > 0: GRPO needs sampled, varied "
                "completions; use 1.0")
        require(0 < top_p <= 1, "GRPO.top_p", top_p, "must lie in (0, 1]; use 1.0 to sample from the full distribution")
        require(top_k >= 0, "GRPO.top_k", top_k, "must be >= 0; use 0 for no top-k")
        require(num_iterations >= 1, "GRPO.num_iterations", num_iterations, "must be >= 1")
        check_grpo_loss_options(loss_type, clip_eps, kl_coef)
        require(zero_std_patience >= 1, "GRPO.zero_std_patience", zero_std_patience, "must be >= 1")
        require(engine_page_size >= 1, "GRPO.engine_page_size", engine_page_size, "must be >= 1")
        specs: list[RewardSpec | Callable] = list(DEFAULT_REWARDS if reward_funcs is None else reward_funcs)
        # an unknown import path fails here, before any weights are loaded
        self.reward_funcs, self.reward_weights = load_reward_funcs(specs, reward_weights)
        super().__init__(*args, **kwargs)  # the options of every objective: arch, init_from, … (Objective)
        self.hparams["reward_funcs"] = [spec_name(s) for s in specs]  # plain values: checkpoints load weights_only
        # With LoRA the base, adapter switched off, is the KL reference (base.reference_scope): no copy.
        self.ref_model = frozen_copy(self.model) if kl_coef > 0 and self.model.lora_config is None else None
        self.rollout: Rollout | None = None
        self.reward_history: list[float] = []  # mean reward of every rollout so far
        self._engine: Engine | None = None
        self._zero_std_streak = 0

    def train(self, mode: bool = True):
        super().train(mode)
        if self.ref_model is not None:
            self.ref_model.eval()
        return self

    # -- rollouts --------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

        strategy = self.trainer.strategy if self._trainer is not None else None
        whole = isinstance(strategy, SingleDeviceStrategy) or (
            isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy))
        if strategy is not None and not whole:
            raise ValueError(
                f"GRPO does not run under trainer.strategy={type(strategy).__name__}, which shards the model "
                "(FSDP, tensor parallel, DeepSpeed): its rollouts decode on the whole model, step by step, on "
                "each rank. Use trainer.strategy: ddp, or a single device")
        super().configure_model()

    def rollout_engine(self, prompt_ids: list[list[int]]) -> Engine:
        """The engine on the live policy (self.model itself, not a copy), built on first use."""
        param = next(self.model.parameters())
        if self._engine is None or (self._engine.device, self._engine.dtype) != (param.device, param.dtype):
            if self.tokenizer is None:
                raise ValueError("GRPO.tokenizer is None: completions must be decoded for the reward functions; "
                                 "pass tokenizer= (astrai-pl fit links it from the data module)")
            hp = self.hparams
            tokens = hp.engine_max_total_tokens or pool_tokens(prompt_ids, hp.group_size, hp.max_completion_length,
                                                               hp.engine_page_size)
            with torch.inference_mode(False):
                self._engine = Engine(self.model, self.tokenizer, page_size=hp.engine_page_size,
                                      max_total_tokens=tokens)
        return self._engine

    @torch.no_grad()
    def roll_out(self, batch: dict[str, list], num_micro_batches: int = 1, seed: int | None = None) -> Rollout:
        """Sample group_size completions per prompt of `batch`, score them, and pack the micro-batches.

        With a `seed`, sample j of prompt i draws from its own generator seeded seed + i · group_size + j, so
        two calls on the same batch use the same random numbers (a paired comparison of two policies).
        """
        if "prompt_ids" not in batch:
            raise ValueError(f"GRPO expects batches of prompts with a 'prompt_ids' column (GRPOData makes them), "
                             f"got the keys {sorted(batch)}; use data.class_path: astrai_pl.data.GRPOData")
        hp, prompt_ids = self.hparams, batch["prompt_ids"]
        params = SamplingParams(max_tokens=hp.max_completion_length, temperature=hp.temperature, top_p=hp.top_p,
                                top_k=hp.top_k, n=hp.group_size, logprobs=True)
        if seed is not None:
            params = [replace(params, seed=seed + i * hp.group_size) for i in range(len(prompt_ids))]
        completions, seconds = sample(self.rollout_engine(prompt_ids), prompt_ids, params)
        per_func, total = score(self.reward_funcs, self.reward_weights,
                                *reward_inputs(batch, completions, hp.group_size))
        advantages = group_advantages(total.to(self.device), hp.group_size, scale=hp.scale_rewards)
        parts = micro_batches(prompt_ids, completions, advantages, num_micro_batches, self.tokenizer.pad_token_id,
                              hp.loss_type, hp.mask_truncated_completions)
        for part in parts:  # both fixed for the whole rollout: scored once, not once per iteration
            if self.ref_model is not None:
                part["ref_logps"] = self._logps(self.ref_model, part)
            elif hp.kl_coef > 0:  # a LoRA run: its base is the reference
                with reference_scope(self.model):
                    part["ref_logps"] = self._logps(self.model, part)
            if hp.num_iterations > 1:
                part["old_logps"] = self._logps(self.model, part)
        metrics = {**reward_metrics([n for n, _ in self.reward_funcs], per_func, total, hp.group_size),
                   **completion_metrics(completions, seconds)}
        return Rollout(parts, metrics, self.trainer.global_step if self._trainer is not None else 0)

    def _logps(self, model, part: dict[str, Any], temperature: float | None = None) -> torch.Tensor:
        t = self.hparams.temperature if temperature is None else temperature
        return token_logprobs(model, part["input_ids"], part["labels"], temperature=t)  # (B, T)

    def _note_rollout(self, rollout: Rollout) -> None:
        """Log the rollout's metrics, remember its reward, and warn while no group has any reward spread."""
        n = sum(len(p["advantages"]) for p in rollout.micro_batches)
        self.log_dict({f"train/{k}": float(v) for k, v in rollout.metrics.items()}, on_step=True, on_epoch=False,
                      batch_size=n)
        self.reward_history.append(rollout.metrics["reward"])
        self._zero_std_streak = self._zero_std_streak + 1 if rollout.metrics["frac_reward_zero_std"] == 1.0 else 0
        if self._zero_std_streak == self.hparams.zero_std_patience:
            rank_zero_warn(
                f"GRPO: NOTHING IS BEING LEARNED. In each of the last {self._zero_std_streak} rollouts every group "
                "of completions got identical rewards (frac_reward_zero_std = 1.0), so every advantage is 0. "
                "Check the reward functions (train/rewards/*/mean), make the task easier for this model (or "
                "fine-tune it first), or raise group_size or temperature.")

    def longest_sequence(self, datamodule: Any) -> tuple[str, int] | None:
        """A prompt of max_prompt_len tokens and its longest completion."""
        prompt = getattr(datamodule, "hparams", {}).get("max_prompt_len")
        if prompt is None:
            return "model.init_args.max_completion_length", self.hparams.max_completion_length
        return ("data.init_args.max_prompt_len + model.init_args.max_completion_length",
                int(prompt) + self.hparams.max_completion_length)

    # -- training ----------------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        k = self.accumulation_steps()
        position = batch_idx % (self.hparams.num_iterations * k)  # μ·k micro-steps per rollout
        if self.rollout is None or position == 0:
            self.rollout = self.roll_out(batch, k)
            self._note_rollout(self.rollout)
        part = self.rollout.micro_batches[position % k]
        first_pass = self.trainer.global_step == self.rollout.step  # weights still those that sampled
        loss, metrics = self._shared_step({**part, "first_pass": first_pass}, "train")
        n = len(part["advantages"])
        self.log_dict({f"train/{key}": v for key, v in metrics.items()}, on_step=True, on_epoch=False, batch_size=n)
        self.log("train/loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=False, batch_size=n)
        return loss

    def _shared_step(self, batch: dict[str, Any], stage: str):
        """The GRPO loss on one micro-batch of a rollout, weighted so the accumulated gradient is exact."""
        hp = self.hparams
        logps = self._logps(self.model, batch)  # (B, T), gradients flow here only
        loss, metrics = grpo_loss(logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"],
                                  batch["mask"], hp.clip_eps, hp.kl_coef, hp.loss_type, hp.max_completion_length)
        if batch.get("first_pass"):
            metrics["logprob_gap"] = self._logprob_gap(batch, logps)
        return loss * batch["weight"], metrics

    @torch.no_grad()
    def _logprob_gap(self, batch: dict[str, Any], logps: torch.Tensor) -> torch.Tensor:
        """Mean |log π_train − log π_engine| over the completion tokens, under the weights that sampled them.

        The engine reports log-probabilities before temperature; at another temperature the tokens are
        scored once more at temperature 1, so like is compared with like.
        """
        if self.hparams.temperature != 1.0:
            logps = self._logps(self.model, batch, temperature=1.0)
        scored = batch["scored"]
        return ((logps.detach() - batch["rollout_logps"]).abs() * scored).sum() / scored.sum().clamp(min=1)

    # -- evaluation: greedy completions of held-out prompts, scored by the same reward functions ----------
    def _evaluate(self, batch, stage: str) -> None:
        prompt_ids = batch["prompt_ids"]
        params = SamplingParams(max_tokens=self.hparams.max_completion_length, temperature=0.0)
        completions, _ = sample(self.rollout_engine(prompt_ids), prompt_ids, params)
        per_func, total = score(self.reward_funcs, self.reward_weights, *reward_inputs(batch, completions, 1))
        n = len(completions)
        self.log(f"{stage}/reward", float(total.mean()), on_epoch=True, batch_size=n, prog_bar=True)
        for j, (name, _) in enumerate(self.reward_funcs):
            self.log(f"{stage}/rewards/{name}/mean", float(per_func[:, j].nanmean()), on_epoch=True, batch_size=n)

    def _log_eval_loss(self, stage: str) -> None:
        """GRPO has no held-out loss; `_evaluate` logs held-out rewards instead."""
