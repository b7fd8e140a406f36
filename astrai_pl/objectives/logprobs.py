"""Per-token log-probabilities of given labels under a model: what DPO, GRPO and evaluation share.

Labels follow the convention of `losses.py`: aligned with `input_ids`, -100 where a token is not
scored; the logits at position t score label t + 1. A 150k vocabulary makes the float32 (B, T, V)
log-softmax the memory peak of a preference or RL step, so `token_logprobs` never builds it: the
lm_head runs on chunks of the scored positions only, each chunk is reduced to one number per position
(logsumexp and a gather, in float32), and under autograd each chunk is recomputed in the backward pass
instead of being kept (activation checkpointing), so at most one (chunk_size, V) block is alive.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..data.packing import IGNORE_INDEX


def logprobs_from_logits(
    logits: torch.Tensor,  # (..., V)
    targets: torch.Tensor,  # (...), -100 where not scored
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """log p(target) = logit[target] − logsumexp(logits), in float32 (or wider); 0 where ignored.  (...)"""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    scored = targets != ignore_index
    picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(scored, picked - logits.logsumexp(-1), 0.0)


def scored_rows(
    hidden: torch.Tensor,  # (B, T, H)
    targets: torch.Tensor,  # (B, T), -100 where not scored
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hidden rows (N, H) and targets (N,) of the scored positions, and their flat indices (N,)."""
    flat = targets.reshape(-1)
    where = (flat != ignore_index).nonzero().squeeze(-1)
    return hidden.reshape(-1, hidden.size(-1)).index_select(0, where), flat.index_select(0, where), where


def _chunk_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float, entropy: bool = False) -> torch.Tensor:
    logits = lm_head(hidden)  # (C, V)
    if temperature != 1.0:
        logits = logits / temperature
    logps = logprobs_from_logits(logits, targets)  # (C,)
    if not entropy:
        return logps
    log_p = torch.log_softmax(logits.to(logps.dtype), dim=-1)  # (C, V)
    return torch.stack([logps, -(log_p.exp() * log_p).sum(-1)], dim=-1)  # (C, 2): log p(target), H


def _check_scoring(chunk_size: int, temperature: float) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of positions, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (it divides the logits), got {temperature}")


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # (B, T)
    labels: torch.Tensor,  # (B, T), aligned with input_ids, -100 where not scored
    *,
    position_ids: torch.Tensor | None = None,  # (B, T)
    document_ids: torch.Tensor | None = None,  # (B, T)
    chunk_size: int = 1024,
    temperature: float = 1.0,
    entropies: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(labels[t + 1] | input_ids[≤ t]) at each position t, 0 where labels[t + 1] is -100.  (B, T)

    With `entropies=True` also the entropy H = −Σ_v p(v) log p(v) of each scored position's (tempered)
    distribution, 0 elsewhere, with its gradient: a pair of (B, T) tensors.

    The last position is always 0 (nothing follows it). `temperature` divides the logits first, as
    sampling does, so rollout and training score tokens under the same distribution. Only positions
    with a scored label reach the lm_head, `chunk_size` of them at a time; gradients flow to the
    model. Requires `model.hidden_states(...) -> (hidden, aux)` and `model.lm_head`; the MoE
    auxiliary loss is dropped (preference and RL losses do not add it).
    """
    _check_scoring(chunk_size, temperature)  # before the forward
    hidden, _ = model.hidden_states(input_ids, position_ids=position_ids, document_ids=document_ids)
    return hidden_logprobs(model.lm_head, hidden, labels, chunk_size=chunk_size, temperature=temperature,
                           entropies=entropies)


def hidden_logprobs(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,  # (B, T, H), the model's final normed hidden states
    labels: torch.Tensor,  # (B, T), aligned with the tokens the states were computed from, -100 where not scored
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    entropies: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` from hidden states already computed: the lm_head on the scored positions only, in
    chunks recomputed in the backward pass.  (B, T), or two of them with `entropies`"""
    _check_scoring(chunk_size, temperature)
    B, T = labels.shape
    targets = torch.cat([labels[:, 1:], labels.new_full((B, 1), IGNORE_INDEX)], dim=1)
    hidden, targets, where = scored_rows(hidden, targets)  # (N, H), (N,), flat indices of scored positions
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    chunks = []
    for start in range(0, max(len(where), 1), chunk_size):  # one empty chunk keeps the graph when N == 0
        h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]
        if recompute:
            chunks.append(checkpoint(_chunk_logprobs, lm_head, h, t, temperature, entropies, use_reentrant=False))
        else:
            chunks.append(_chunk_logprobs(lm_head, h, t, temperature, entropies))
    scored = torch.cat(chunks)  # (N,) or (N, 2)
    out = scored.new_zeros(B * T, *scored.shape[1:]).index_put((where,), scored)
    return out.view(B, T) if not entropies else tuple(out.view(B, T, 2).unbind(-1))


def sequence_logprobs(token_lp: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_t token_lp[b, t] · mask[b, t]: one log-probability per sequence.  (B, T) → (B,)

    `token_logprobs` already puts 0 at unscored positions, so `mask` is only needed to narrow further.
    """
    if mask is not None:
        token_lp = token_lp * mask.to(token_lp.dtype)
    return token_lp.sum(-1)
