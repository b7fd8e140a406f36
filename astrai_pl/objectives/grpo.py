"""Group Relative Policy Optimization: online RL on completions the inference engine samples from the policy
being trained, scored by reward functions, with group-relative advantages and a clipped surrogate."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from ..inference import Engine, SamplingParams
from ..parallel import configure_model as configure_layout
from ..parallel import gather_full_weights, release_weights, weightless_copy
from .base import Objective, frozen_copy, reference_scope
from .environments import environment_spec_name, load_environment
from .episodes import episode_metrics, row_columns, run_episodes, score_episodes
from .logprobs import token_logprobs
from .losses import group_advantages, grpo_loss, rollout_importance_weights
from .options import (
    check_advantage_options,
    check_grpo_loss_options,
    check_importance_sampling_options,
    refuse_renamed,
    require,
)
from .rewards import RewardSpec, load_reward_funcs, reward_metrics, score, spec_name
from .rollout import Rollout, completion_metrics, micro_batches, pool_tokens, reward_inputs, sample

DEFAULT_REWARDS = ("astrai_pl.objectives.rewards.exact_match_reward",)


class GRPO(Objective):
    """GRPO (Shao et al., 2024, DeepSeekMath): per prompt, G completions o_1..o_G from π_old, rewards R_i,

        A_i = (R_i − mean_g R) / (std_g R + ε)                       (scale_rewards="group")
        L = Σ_{i,t} −w_{i,t} · min(ρ_{i,t}·A_i, clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high)·A_i) / N
            + β · Σ_{i,t} (r_{i,t} − log r_{i,t} − 1) / N                  (loss_type="dapo")
        ρ = π_θ(o_t | q, o_<t) / π_old(o_t | q, o_<t),   r = π_ref(o_t | …) / π_θ(o_t | …)

    N the completion tokens of the optimizer step on every rank, however many micro-batches the Trainer
    accumulates; w the truncated importance weights of the engine/trainer mismatch (see `losses.grpo_loss`
    for the reductions, `rollout.accumulation_weights` and `rollout.window_items` for the exactness).
    Option names and meanings are TRL's GRPOConfig's. Rollouts: one per `num_iterations` optimizer steps,
    on the live policy with the inference engine; the rollout batch is `batch_size` prompts ×
    `num_generations` completions, cut into `accumulate_grad_batches` micro-batches; each optimizer step is
    one pass over all of them. docs/objectives.md has the schedule.
    """

    def __init__(
        self,
        *args: Any,
        reward_funcs: list[RewardSpec] | None = None,
        reward_weights: list[float] | None = None,
        num_generations: int = 4,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        num_iterations: int = 1,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.01,
        loss_type: str = "dapo",
        importance_sampling_level: str = "token",
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        entropy_coef: float = 0.0,
        scale_rewards: str = "group",
        mask_truncated_completions: bool = False,
        vllm_importance_sampling_correction: bool = True,
        vllm_importance_sampling_mode: str = "token_truncate",
        vllm_importance_sampling_clip_max: float | None = 3.0,
        vllm_importance_sampling_clip_min: float | None = None,
        zero_std_patience: int = 3,
        engine_page_size: int = 16,
        engine_max_total_tokens: int | None = None,
        environment: RewardSpec | Callable | None = None,
        max_turns: int = 4,
        max_episode_tokens: int | None = None,
        **kwargs: Any,
    ):
        """
        Args:
            reward_funcs: Import paths of reward functions `f(prompts, completions, **columns) -> list[float | None]`
                (TRL's signature; `async def` ones are awaited together), `{path: …, kwargs: {…}}`, or the
                directory of a Hugging Face sequence-classification model (a reward model) that scores
                prompt + completion; see astrai_pl/objectives/rewards.py.
            reward_weights: One weight per reward function; None = all 1.0.
            num_generations: Completions sampled per prompt (G); advantages compare siblings, so at least 2.
            max_completion_length: Most tokens per completion (the stop token included).
            temperature: Sampling temperature of the rollouts; training scores tokens at the same temperature.
            top_p: Nucleus sampling of the rollouts (1.0 = off).
            top_k: Top-k sampling of the rollouts (0 = off).
            num_iterations: Optimizer steps (passes over the rollout batch) per rollout (μ); the old policy's
                log-probabilities are taken when the rollout is sampled.
            epsilon: Lower clip ε_low of the ratio: clip(ρ, 1 − epsilon, 1 + epsilon_high).
            epsilon_high: Upper clip ε_high; None = epsilon. DAPO's clip-higher uses 0.28; with loss_type
                'cispo' it is the cap of the ratio itself (ScaleRL's ε_max, e.g. 5.0) and must be set.
            beta: Weight of the k3 KL penalty to the frozen reference (the initial policy); 0 = no reference
                model is kept at all.
            loss_type: How token losses are reduced (TRL's names): 'dapo' (over every completion token of the
                optimizer step, on all ranks), 'bnpo' (over the tokens of each micro-batch), 'grpo' (per
                completion, then over completions) or 'dr_grpo' (over completions × max_completion_length);
                'cispo' (the clipped ratio, a constant, weighs log π: MiniMax-M1), reduced as 'dapo'; 'sapo'
                (a sigmoid gate of temperature τ in place of the clip), reduced as 'grpo'.
            importance_sampling_level: 'token' (one ratio per token) or 'sequence' (GSPO: one ratio per completion,
                the exp of its mean token log-ratio; the paper pairs it with loss_type 'grpo').
            sapo_temperature_pos: τ of 'sapo' for tokens with a positive advantage (TRL's default 1.0).
            sapo_temperature_neg: τ of 'sapo' for the others (TRL's default 1.05).
            entropy_coef: Weight c of the entropy bonus: the loss less c × the policy's mean entropy over the
                completion tokens (a second output of the scoring pass); 0 = off.
            scale_rewards: Advantage scale: 'group' (group std), 'batch' (rollout std) or 'none' (Dr. GRPO).
            mask_truncated_completions: Leave completions cut at max_completion_length out of the loss.
            vllm_importance_sampling_correction: Weigh each token's policy loss by the importance weight of the
                engine's sampling against the trainer's scoring, exp(log π_train_old − log π_engine) (TRL's name;
                here the engine is our own, not vLLM).
            vllm_importance_sampling_mode: 'token_truncate' (weights clipped per token), 'token_mask' (tokens
                outside the bounds dropped), 'sequence_truncate' or 'sequence_mask' (one weight per completion).
            vllm_importance_sampling_clip_max: Upper bound C of the weights (truncate: min(w, C)); None = none.
            vllm_importance_sampling_clip_min: Lower bound of the weights; None = none.
            zero_std_patience: Warn once this many rollouts in a row had equal rewards within every group
                (frac_reward_zero_std = 1: all advantages are 0 and nothing is learned).
            engine_page_size: Tokens per KV page of the rollout engine.
            engine_max_total_tokens: KV pool of the rollout engine in tokens; None = room for a whole rollout batch.
            environment: Multi-turn episodes: the import path (or `{path, kwargs}`) of an environment that answers
                each model turn (tool results, the next user turn) and ends the episode with a reward, e.g.
                astrai_pl.objectives.environments.Calculator; see environments.py. None = one completion each.
                With one, reward_funcs may be [] (the environment's reward alone).
            max_turns: Most model turns of an episode (with an environment).
            max_episode_tokens: Most tokens of an episode after its prompt, model and environment together
                (with an environment); None = max_turns × max_completion_length. dr_grpo divides by it.
        """
        refuse_renamed("GRPO", kwargs)  # options.RENAMED_OPTIONS
        check_advantage_options(num_generations, scale_rewards)
        require(max_completion_length >= 1, "GRPO.max_completion_length", max_completion_length, "must be >= 1")
        require(temperature > 0, "GRPO.temperature", temperature, "must be > 0: GRPO needs sampled, varied "
                "completions; use 1.0")
        require(0 < top_p <= 1, "GRPO.top_p", top_p, "must lie in (0, 1]; use 1.0 to sample from the full distribution")
        require(top_k >= 0, "GRPO.top_k", top_k, "must be >= 0; use 0 for no top-k")
        require(num_iterations >= 1, "GRPO.num_iterations", num_iterations, "must be >= 1")
        check_grpo_loss_options(loss_type, epsilon, beta, epsilon_high, importance_sampling_level,
                                (sapo_temperature_pos, sapo_temperature_neg), entropy_coef)
        check_importance_sampling_options(vllm_importance_sampling_mode, vllm_importance_sampling_clip_max,
                                          vllm_importance_sampling_clip_min)
        require(zero_std_patience >= 1, "GRPO.zero_std_patience", zero_std_patience, "must be >= 1")
        require(engine_page_size >= 1, "GRPO.engine_page_size", engine_page_size, "must be >= 1")
        require(max_turns >= 1, "GRPO.max_turns", max_turns, "must be >= 1")
        require(max_episode_tokens is None or max_episode_tokens >= 1, "GRPO.max_episode_tokens",
                max_episode_tokens, "must be >= 1, or null for max_turns × max_completion_length")
        specs: list[RewardSpec | Callable] = list(DEFAULT_REWARDS if reward_funcs is None else reward_funcs)
        # an unknown import path fails here, before any weights are loaded
        self.environment = load_environment(environment)
        self.reward_funcs, self.reward_weights = (load_reward_funcs(specs, reward_weights)
                                                  if specs or self.environment is None else ([], []))
        super().__init__(*args, **kwargs)  # the options of every objective: arch, init_from, … (Objective)
        self.hparams["reward_funcs"] = [spec_name(s) for s in specs]  # plain values: checkpoints load weights_only
        self.hparams["environment"] = environment_spec_name(environment)
        # With LoRA the base, adapter switched off, is the KL reference (base.reference_scope): no copy.
        self.ref_model = frozen_copy(self.model) if beta > 0 and self.model.lora_config is None else None
        self.rollout: Rollout | None = None
        self.reward_history: list[float] = []  # mean reward of every rollout so far
        self._engine: Engine | None = None
        self._zero_std_streak = 0
        # Under FSDP2 / tensor parallel: a plain copy of the policy, full weights only during a rollout. Kept out
        # of the module tree (no checkpoint, optimizer or device move sees it).
        object.__setattr__(self, "_rollout_model", None)

    # -- rollouts --------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """As every objective; under `strategy: fsdp2` (FSDP2 and/or tensor parallel) also a plain copy of the
        policy for the rollouts (made before the layout, its weights freed until a rollout gathers them), and
        the KL reference laid out as the policy is (sharded alike)."""
        from lightning.pytorch.strategies import (
            DDPStrategy,
            DeepSpeedStrategy,
            ModelParallelStrategy,
            SingleDeviceStrategy,
        )

        strategy = self.trainer.strategy if self._trainer is not None else None
        whole = isinstance(strategy, SingleDeviceStrategy) or (
            isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy))
        sharded = isinstance(strategy, ModelParallelStrategy)
        if strategy is not None and not (whole or sharded):
            raise ValueError(
                f"GRPO does not run under trainer.strategy={type(strategy).__name__}: its rollouts need the whole "
                "model on each rank, gathered from the shards only under FSDP2. Use trainer.strategy: fsdp2 "
                "(FSDP2, tensor parallel), ddp, or a single device")
        if sharded and self._rollout_model is None:
            object.__setattr__(self, "_rollout_model", weightless_copy(self.model))
        super().configure_model()
        if sharded and self.ref_model is not None:
            configure_layout(self.ref_model, strategy)

    @contextlib.contextmanager
    def _full_weights(self):
        """The model the engine decodes on, with the policy's current weights: the policy itself, or under
        FSDP2 / tensor parallel the rollout copy, gathered into on every rank at once (one parameter at a
        time) and freed afterwards, with the engine's weight copies and cached K/V."""
        if self._rollout_model is None:
            yield self.model
            return
        with torch.inference_mode(False):
            gather_full_weights(self.model, self._rollout_model)
        try:
            yield self._rollout_model
        finally:
            if self._engine is not None:
                self._engine.weights_changed()
            release_weights(self._rollout_model)

    def _tensor_parallel_group(self):
        """The tensor-parallel process group under tensor_parallel_size > 1, else None."""
        mesh = getattr(self.trainer.strategy, "device_mesh", None) if self._rollout_model is not None else None
        return mesh["tensor_parallel"].get_group() if mesh is not None and mesh["tensor_parallel"].size() > 1 else None

    def rollout_engine(self, prompt_ids: list[list[int]], model: torch.nn.Module | None = None) -> Engine:
        """The engine on `model`: the live policy (self.model itself, not a copy), or under FSDP2 the rollout
        copy that `_full_weights` fills; built on first use."""
        model = self.model if model is None else model
        param = next(model.parameters())
        if self._engine is None or (self._engine.device, self._engine.dtype) != (param.device, param.dtype):
            if self.tokenizer is None:
                raise ValueError("GRPO.tokenizer is None: completions must be decoded for the reward functions; "
                                 "pass tokenizer= (astrai-pl fit links it from the data module)")
            hp = self.hparams
            tokens = hp.engine_max_total_tokens or pool_tokens(prompt_ids, hp.num_generations, self.completion_length,
                                                               hp.engine_page_size)
            with torch.inference_mode(False):
                self._engine = Engine(model, self.tokenizer, page_size=hp.engine_page_size,
                                      max_total_tokens=tokens)
        return self._engine

    @torch.no_grad()
    def roll_out(self, batch: dict[str, list], num_micro_batches: int = 1, seed: int | None = None) -> Rollout:
        """Sample num_generations completions per prompt of `batch`, score them, and pack the micro-batches.

        With a `seed`, sample j of prompt i draws from its own generator seeded seed + i · num_generations + j, so
        two calls on the same batch use the same random numbers (a paired comparison of two policies).
        """
        if "prompt_ids" not in batch:
            raise ValueError(f"GRPO expects batches of prompts with a 'prompt_ids' column (GRPOData makes them), "
                             f"got the keys {sorted(batch)}; use data.class_path: astrai_pl.data.GRPOData")
        hp, prompt_ids = self.hparams, batch["prompt_ids"]
        params = SamplingParams(max_tokens=hp.max_completion_length, temperature=hp.temperature, top_p=hp.top_p,
                                top_k=hp.top_k, n=hp.num_generations, logprobs=True)
        if seed is not None:
            params = [replace(params, seed=seed + i * hp.num_generations) for i in range(len(prompt_ids))]
        completions, per_func, total, metrics = self._sample_and_score(batch, params, hp.num_generations)
        advantages = group_advantages(total.to(self.device), hp.num_generations, scale=hp.scale_rewards)
        parts = micro_batches(prompt_ids, completions, advantages, num_micro_batches, self.tokenizer.pad_token_id,
                              hp.loss_type, hp.mask_truncated_completions, self._trainer)
        for part in parts:  # both fixed for the whole rollout: scored once, not once per iteration
            if self.ref_model is not None:
                part["ref_logps"] = self._logps(self.ref_model, part)
                if hasattr(self.ref_model, "reshard"):  # FSDP2 keeps a root gathered until a backward: none here
                    self.ref_model.reshard()
            elif hp.beta > 0:  # a LoRA run: its base is the reference
                with reference_scope(self.model):
                    part["ref_logps"] = self._logps(self.model, part)
            if hp.num_iterations > 1:
                part["old_logps"] = self._logps(self.model, part)
                if hp.temperature != 1.0 and hp.vllm_importance_sampling_correction:  # later passes need them
                    part["sampler_logps"] = self._logps(self.model, part, temperature=1.0)
        metrics.update(reward_metrics(self._reward_names, per_func, total, hp.num_generations))
        return Rollout(parts, metrics, self.trainer.global_step if self._trainer is not None else 0)

    @property
    def completion_length(self) -> int:
        """Most tokens after a prompt: a completion's, or with an environment an episode's."""
        hp = self.hparams
        if self.environment is None:
            return hp.max_completion_length
        return hp.max_episode_tokens or hp.max_turns * hp.max_completion_length

    @property
    def _reward_names(self) -> list[str]:
        names = [n for n, _ in self.reward_funcs]
        return names if self.environment is None else [*names, f"env_{self.environment.name}"]

    def _sample_and_score(self, batch: dict[str, list], params, group_size: int):
        """group_size completions (or episodes, with an environment) per prompt, their per-function rewards
        (N, F), totals (N,) and the sampling metrics. Each rank samples its own prompts; under tensor parallel
        the ranks of one group hold the same prompts, so the group's first rank samples and sends its results
        to the others, which must train on the same completions."""
        group = self._tensor_parallel_group()
        with self._full_weights() as model:
            if group is None:
                return self._sample_and_score_on(model, batch, params, group_size)
            first = torch.distributed.get_global_rank(group, 0)
            results = [self._sample_and_score_on(model, batch, params, group_size)
                       if torch.distributed.get_rank() == first else None]
        torch.distributed.broadcast_object_list(results, src=first, group=group, device=self.device)
        return results[0]

    def _sample_and_score_on(self, model: torch.nn.Module, batch: dict[str, list], params, group_size: int):
        prompt_ids, engine = batch["prompt_ids"], self.rollout_engine(batch["prompt_ids"], model)
        if self.environment is None:
            completions, seconds = sample(engine, prompt_ids, params)
            per_func, total = score(self.reward_funcs, self.reward_weights,
                                    *reward_inputs(batch, completions, group_size))
            return completions, per_func, total, completion_metrics(completions, seconds)
        hp, start = self.hparams, time.perf_counter()
        engine.weights_changed()  # as rollout.sample: the cached K/V are the old weights'
        each = params if isinstance(params, list) else [params] * len(prompt_ids)
        turn = [replace(p, n=1, seed=None if p.seed is None else p.seed + j) for p in each for j in range(group_size)]
        prompts = batch["prompt"] if "prompt" in batch else batch["prompt_text"]
        episodes = run_episodes(engine, [p for p in prompt_ids for _ in range(group_size)],
                                [p for p in prompts for _ in range(group_size)], row_columns(batch, group_size),
                                self.environment, turn, hp.max_turns, self.completion_length)
        seconds = time.perf_counter() - start
        per_func, total = score_episodes(self.reward_funcs, self.reward_weights, batch, episodes, group_size)
        return episodes, per_func, total, {**completion_metrics(episodes, seconds), **episode_metrics(episodes)}

    def _logps(self, model, part: dict[str, Any], temperature: float | None = None, entropies: bool = False):
        t = self.hparams.temperature if temperature is None else temperature
        return token_logprobs(model, part["input_ids"], part["labels"], temperature=t, entropies=entropies)  # (B, T)

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
                "fine-tune it first), or raise num_generations or temperature.")

    def longest_sequence(self, datamodule: Any) -> tuple[str, int] | None:
        """A prompt of max_prompt_len tokens and its longest completion."""
        prompt = getattr(datamodule, "hparams", {}).get("max_prompt_len")
        what = "max_completion_length" if self.environment is None else "max_episode_tokens"
        if prompt is None:
            return f"model.init_args.{what}", self.completion_length
        return f"data.init_args.max_prompt_len + model.init_args.{what}", int(prompt) + self.completion_length

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
        logps, entropies = self._logps(self.model, batch, entropies=True) if hp.entropy_coef else (
            self._logps(self.model, batch), None)  # (B, T) each, gradients flow here only
        correct, first = hp.vllm_importance_sampling_correction, batch.get("first_pass", False)
        sampler = self._sampler_logps(batch, logps) if correct or first else None
        weights = None
        if correct:
            weights = rollout_importance_weights(sampler, batch["rollout_logps"], batch["scored"],
                                                 hp.vllm_importance_sampling_mode, hp.vllm_importance_sampling_clip_max,
                                                 hp.vllm_importance_sampling_clip_min)
        loss, metrics = grpo_loss(logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"],
                                  batch["mask"], hp.epsilon, hp.beta, hp.loss_type, self.completion_length,
                                  epsilon_high=hp.epsilon_high, num_items=batch.get("num_items"),
                                  importance_weights=weights, importance_sampling_level=hp.importance_sampling_level,
                                  sapo_temperature_pos=hp.sapo_temperature_pos,
                                  sapo_temperature_neg=hp.sapo_temperature_neg, entropies=entropies,
                                  entropy_coef=hp.entropy_coef)
        if first:
            metrics.update(self._sampling_metrics(batch, sampler, weights))
        return loss * batch["weight"], metrics

    @torch.no_grad()
    def _sampler_logps(self, batch: dict[str, Any], logps: torch.Tensor) -> torch.Tensor:
        """The policy's log-probabilities of the completion tokens as the engine reports them (before
        temperature), under the weights that sampled them: the old policy's at T = 1, or, on a first pass,
        the current forward (at T ≠ 1 scored once more at temperature 1, so like is compared with like)."""
        if "sampler_logps" in batch:
            return batch["sampler_logps"]
        if self.hparams.temperature != 1.0:
            return self._logps(self.model, batch, temperature=1.0)
        old = batch.get("old_logps")
        return logps.detach() if old is None else old

    @torch.no_grad()
    def _sampling_metrics(self, batch: dict[str, Any], sampler: torch.Tensor,
                          weights: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """logprob_gap (mean |log π_train − log π_engine| over the completion tokens, TRL's
        sampling/sampling_logp_difference/mean), its max, and the importance weights' min, mean and max."""
        scored = batch["scored"]
        gap = (sampler - batch["rollout_logps"]).abs() * scored
        metrics = {"logprob_gap": gap.sum() / scored.sum().clamp(min=1),
                   "sampling/sampling_logp_difference/max": gap.max()}
        if weights is not None:
            keep = scored.bool() if weights.shape == scored.shape else torch.ones_like(weights, dtype=torch.bool)
            w = weights[keep] if keep.any() else weights.new_ones(1)
            metrics.update({"sampling/importance_sampling_ratio/min": w.min(),
                            "sampling/importance_sampling_ratio/mean": w.mean(),
                            "sampling/importance_sampling_ratio/max": w.max()})
        return metrics

    # -- evaluation: greedy completions of held-out prompts, scored by the same reward functions ----------
    def _evaluate(self, batch, stage: str) -> None:
        params = SamplingParams(max_tokens=self.hparams.max_completion_length, temperature=0.0)
        completions, per_func, total, metrics = self._sample_and_score(batch, params, 1)
        n = len(completions)
        self.log(f"{stage}/reward", float(total.mean()), on_epoch=True, batch_size=n, prog_bar=True)
        if self.environment is not None:
            self.log(f"{stage}/episodes/mean_tool_calls", metrics["episodes/mean_tool_calls"], on_epoch=True,
                     batch_size=n)
        for j, name in enumerate(self._reward_names):
            self.log(f"{stage}/rewards/{name}/mean", float(per_func[:, j].nanmean()), on_epoch=True, batch_size=n)

    def _log_eval_loss(self, stage: str) -> None:
        """GRPO has no held-out loss; `_evaluate` logs held-out rewards instead."""
