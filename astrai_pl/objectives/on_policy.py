"""What the on-policy objectives beside GRPO (Distill, OnlineDPO, RLOO) share, as free functions: the engine
on the live policy, sampling a batch of prompts into packed sequences (`rollout.pack`'s layout), rewards,
the reference's log-probabilities, and the strategies they run under.

GRPO's rollout path (rollout.py) does the sampling and packing; these functions put it together for
objectives that need no environments, FSDP2 rollout copies or multi-pass schedules of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..inference import Completion, Engine, SamplingParams
from .base import reference_scope
from .logprobs import token_logprobs
from .rewards import RewardFunc, score
from .rollout import completion_metrics, pack, pool_tokens, reward_inputs, sample


def check_whole_model(objective: str, trainer: Any) -> None:
    """A ValueError unless the trainer keeps the whole model on each rank (one device, DDP): the engine
    samples on the policy's own weights."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    strategy = getattr(trainer, "strategy", None)
    whole = isinstance(strategy, SingleDeviceStrategy) or (
        isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy))
    if strategy is not None and not whole:
        raise ValueError(f"{objective} does not run under trainer.strategy={type(strategy).__name__}: it samples "
                         "on the whole policy on each rank. Use trainer.strategy: ddp, or a single device")


def require_prompts(objective: str, batch: dict[str, Any]) -> None:
    if "prompt_ids" not in batch:
        raise ValueError(f"{objective} expects batches of prompts with a 'prompt_ids' column (GRPOData makes them), "
                         f"got the keys {sorted(batch)}; use data.class_path: astrai_pl.data.GRPOData")


def policy_engine(engine: Engine | None, model: torch.nn.Module, tokenizer: Any, prompt_ids: Sequence[Sequence[int]],
                  group_size: int, max_tokens: int, page_size: int, max_total_tokens: int | None,
                  objective: str) -> Engine:
    """`engine` when it still decodes on `model`'s device and dtype, else a new one on `model` itself (the live
    weights, no copy), with a KV pool for the whole batch unless `max_total_tokens` says otherwise."""
    param = next(model.parameters())
    if engine is not None and (engine.device, engine.dtype) == (param.device, param.dtype):
        return engine
    if tokenizer is None:
        raise ValueError(f"{objective}.tokenizer is None: completions must be decoded; pass tokenizer= "
                         "(astrai-pl fit links it from the data module)")
    tokens = max_total_tokens or pool_tokens(prompt_ids, group_size, max_tokens, page_size)
    with torch.inference_mode(False):
        return Engine(model, tokenizer, page_size=page_size, max_total_tokens=tokens)


def sample_packed(engine: Engine, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, pad_id: int,
                  device: torch.device) -> tuple[list[Completion], dict[str, torch.Tensor], dict[str, float]]:
    """`params.n` completions per prompt (grouped by prompt), packed as `rollout.pack` packs them, and the
    sampling metrics (`rollout.completion_metrics`)."""
    completions, seconds = sample(engine, prompt_ids, params)
    n = params.n
    packed = pack([(prompt_ids[i // n], c) for i, c in enumerate(completions)], pad_id, device)
    return completions, packed, completion_metrics(completions, seconds)


def completion_rewards(funcs: Sequence[tuple[str, RewardFunc]], weights: Sequence[float], batch: dict[str, list],
                       completions: Sequence[Completion], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reward functions' scores (N, F) and weighted totals (N,) of `completions`, as GRPO's are."""
    return score(funcs, weights, *reward_inputs(batch, completions, group_size))


@torch.no_grad()
def reference_logps(ref_model: torch.nn.Module | None, model: torch.nn.Module, part: dict[str, torch.Tensor],
                    temperature: float = 1.0) -> torch.Tensor:
    """The reference's token log-probabilities of `part`'s completions: `ref_model`'s, or with a LoRA policy
    (ref_model None) its base, adapters off.  (B, T)"""
    if ref_model is not None:
        return token_logprobs(ref_model, part["input_ids"], part["labels"], temperature=temperature)
    with reference_scope(model):
        return token_logprobs(model, part["input_ids"], part["labels"], temperature=temperature)


def missing_eos(completions: Sequence[Completion]) -> torch.Tensor:
    """1.0 for each completion cut at max tokens (no stop token), else 0.0.  (N,)"""
    return torch.tensor([float(c.finish_reason == "length") for c in completions])


@torch.no_grad()
def held_out_rewards(engine: Engine, batch: dict[str, list], funcs: Sequence[tuple[str, RewardFunc]],
                     weights: Sequence[float], max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rewards (N, F) and totals (N,) of one greedy completion per held-out prompt."""
    completions, _ = sample(engine, batch["prompt_ids"], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return completion_rewards(funcs, weights, batch, completions, 1)


def log_held_out_rewards(module: Any, stage: str, names: Sequence[str], per_func: torch.Tensor,
                         total: torch.Tensor) -> None:
    """`{stage}/reward` and `{stage}/rewards/<name>/mean`, averaged over the epoch."""
    n = len(total)
    module.log(f"{stage}/reward", float(total.mean()), on_epoch=True, batch_size=n, prog_bar=True)
    for j, name in enumerate(names):
        module.log(f"{stage}/rewards/{name}/mean", float(per_func[:, j].nanmean()), on_epoch=True, batch_size=n)


def longest_prompted_sequence(datamodule: Any, option: str, completion: int) -> tuple[str, int]:
    """The config fields that bound the longest sequence (a prompt of the data module's max_prompt_len tokens and
    a completion of `completion` tokens, the objective's `option`), and its length."""
    prompt = getattr(datamodule, "hparams", {}).get("max_prompt_len")
    if prompt is None:
        return f"model.init_args.{option}", completion
    return f"data.init_args.max_prompt_len + model.init_args.{option}", int(prompt) + completion
