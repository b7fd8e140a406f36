"""GRPO rollouts as plain functions: sample a group of completions per prompt on the live policy, pass
them to the reward functions, and cut the scored batch into the micro-batches the Trainer accumulates over.

The GRPO objective (grpo.py) drives them; docs/objectives.md explains the schedule. A sequence here is
one prompt followed by one of its completions; tensors are right-padded, so the default positions are
right and no real token ever attends to padding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..inference import Completion, Engine, SamplingParams
from .global_counts import summed_over_ranks
from .logprobs import IGNORE_INDEX

PROMPT_COLUMNS = ("prompt", "prompt_ids", "prompt_text")


@dataclass
class Rollout:
    """One scored rollout batch, trained on `num_iterations` times."""

    micro_batches: list[dict[str, Any]]
    """Tensors of each micro-batch (see `micro_batches`), plus whatever the objective adds (old / ref log-probs)."""
    metrics: dict[str, float]
    """Rewards, completion lengths and speed, measured once when the rollout was sampled."""
    step: int
    """trainer.global_step when sampled: while it has not moved, the policy still has the rollout's weights."""


def pool_tokens(prompt_ids: Sequence[Sequence[int]], group_size: int, max_completion_length: int,
                page_size: int) -> int:
    """A KV pool for a whole rollout batch in flight: every sample at full length, with room for prompts
    up to twice this batch's longest (a later shortfall costs preemption, not an error)."""
    longest = max(len(p) for p in prompt_ids)
    return len(prompt_ids) * group_size * (2 * longest + max_completion_length + page_size)


def sample(engine: Engine, prompt_ids: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
           ) -> tuple[list[Completion], float]:
    """`params.n` completions per prompt, grouped by prompt, and the seconds they took.

    The engine forgets what it computed from earlier weights first (`Engine.weights_changed`): the
    weights changed since the last call, so cached K/V and weight copies are stale.
    """
    engine.weights_changed()
    start = time.perf_counter()
    completions = engine.generate([list(p) for p in prompt_ids], params)
    return completions, time.perf_counter() - start


def _repeat(values: Sequence, times: int) -> list:
    return [v for v in values for _ in range(times)]


def reward_inputs(batch: dict[str, list], completions: Sequence[Completion], group_size: int
                  ) -> tuple[list, list, dict[str, list]]:
    """The reward functions' arguments, one entry per completion: prompts, completions and columns.

    Conversational prompts (lists of messages) get completions as `[{"role": "assistant", "content": …}]`,
    plain prompts plain strings, as TRL passes them. Columns: every column of the batch that is not the
    prompt (e.g. `answer`), repeated per sample, and `completion_ids`.
    """
    prompts = batch["prompt"] if "prompt" in batch else batch["prompt_text"]
    texts = [c.text for c in completions]
    conversational = isinstance(prompts[0], list)
    shown = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    columns = {k: _repeat(v, group_size) for k, v in batch.items() if k not in PROMPT_COLUMNS}
    columns["completion_ids"] = [list(c.token_ids) for c in completions]
    return _repeat(prompts, group_size), shown, columns


def completion_metrics(completions: Sequence[Completion], seconds: float) -> dict[str, float]:
    """completions/{mean,min,max}_length (tokens, stop token included), completions/clipped_ratio (share cut
    at max_completion_length) and rollout/tokens_per_second (generated tokens over sampling time)."""
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float64)
    clipped = sum(c.finish_reason == "length" for c in completions)
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": clipped / len(completions),
        "rollout/tokens_per_second": float(lengths.sum()) / max(seconds, 1e-9),
        "rollout/seconds": seconds,
    }


def pack(sequences: Sequence[tuple[Sequence[int], Completion]], pad_id: int, device: torch.device,
         mask_truncated: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded tensors for (prompt ids, completion) pairs:

    input_ids (B, T) prompt + completion; labels (B, T) the completion's ids (its own `labels` where it has
    them: an episode masks what its environment wrote), -100 elsewhere; scored
    (B, T) 1 at the positions t whose next token t + 1 is a completion token (token_logprobs' layout);
    mask (B, T) the scored positions that train, without truncated completions if `mask_truncated`;
    rollout_logps (B, T) the engine's log-probabilities of those tokens, 0 elsewhere.
    """
    width = max(len(p) + len(c.token_ids) for p, c in sequences)
    ids, labels, logps, keep = [], [], [], []
    for prompt, c in sequences:
        p, n = len(prompt), len(c.token_ids)
        pad = width - p - n
        ids.append([*prompt, *c.token_ids] + [pad_id] * pad)
        labels.append([IGNORE_INDEX] * p + list(getattr(c, "labels", c.token_ids)) + [IGNORE_INDEX] * pad)
        logps.append([0.0] * (p - 1) + list(c.logprobs or [0.0] * n) + [0.0] * (pad + 1))
        keep.append(not (mask_truncated and c.finish_reason == "length"))
    labels_t = torch.tensor(labels, device=device)
    scored = torch.cat([labels_t[:, 1:] != IGNORE_INDEX, labels_t.new_zeros(len(sequences), 1, dtype=torch.bool)],
                       dim=1).float()  # (B, T)
    return {
        "input_ids": torch.tensor(ids, device=device),
        "labels": labels_t,
        "scored": scored,
        "mask": scored * torch.tensor(keep, device=device, dtype=torch.float32)[:, None],
        "rollout_logps": torch.tensor(logps, device=device, dtype=torch.float32),
    }


def accumulation_weights(parts: Sequence[dict[str, torch.Tensor]], loss_type: str) -> list[float]:
    """w_i with Σ_i w_i · L_i / k = the loss over the whole rollout batch, where L_i is micro-batch i's loss
    reduced over itself and k = len(parts) (Lightning divides each micro-batch loss by k):

        grpo, sapo, dr_grpo    w_i = k · B_i / Σ_j B_j      (B: sequences)
        bnpo                   w_i = 1                      (TRL's: each micro-batch is its own local batch)
        dapo, cispo            w_i = 1                      (normalised by `window_items` instead)
    """
    k = len(parts)
    if loss_type in ("bnpo", "dapo", "cispo"):
        return [1.0] * k
    sizes = [float(len(p["input_ids"])) for p in parts]
    total = sum(sizes)
    return [k * s / total if total else 0.0 for s in sizes]


def window_items(parts: Sequence[dict[str, torch.Tensor]], trainer: Any = None) -> float:
    """dapo's `num_items` for each of these k micro-batches: N / (k · W), N the trained completion tokens of
    every rank's micro-batches (summed over the W data-parallel ranks of `trainer`, `global_counts`: under tensor
    parallelism the ranks of one tensor-parallel group hold one rollout and count it once), so that after
    Lightning's division by k and the average over data-parallel ranks the accumulated gradient is that of
    Σ ℓ / N over the whole global batch. Every rank must call it at the same time."""
    tokens = torch.stack([p["mask"].sum() for p in parts]).sum().round().long()  # whole tokens, summed exactly
    total, ranks = summed_over_ranks(tokens, trainer)
    return max(int(total), 1) / (len(parts) * ranks)


def micro_batches(prompt_ids: Sequence[Sequence[int]], completions: Sequence[Completion], advantages: torch.Tensor,
                  k: int, pad_id: int, loss_type: str, mask_truncated: bool = False,
                  trainer: Any = None) -> list[dict[str, Any]]:
    """The rollout's N sequences in k contiguous micro-batches (sizes differ by at most one), each packed,
    with its advantages (B,), its accumulation `weight` and, for dapo and cispo, the step's `num_items`."""
    n = len(completions)
    group_size = n // len(prompt_ids)
    if not 1 <= k <= n:
        raise ValueError(f"a rollout of {n} completions cannot fill {k} micro-batches; make batch_size × "
                         "group_size at least accumulate_grad_batches")
    device = advantages.device
    bounds = [round(i * n / k) for i in range(k + 1)]
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        part = pack([(prompt_ids[i // group_size], completions[i]) for i in range(lo, hi)], pad_id, device,
                     mask_truncated)
        part["advantages"] = advantages[lo:hi]
        parts.append(part)
    for part, weight in zip(parts, accumulation_weights(parts, loss_type)):
        part["weight"] = weight
    if loss_type in ("dapo", "cispo"):
        items = window_items(parts, trainer)
        for part in parts:
            part["num_items"] = items
    return parts
