"""Losses as pure functions: tensors in, `(loss, metrics)` out. No module state, no Lightning.

Label convention shared by every objective: `labels` are aligned with `input_ids` (labels[t] is
token t itself, or -100 where it is not trained). The logits at position t predict token t + 1, so
`next_token_labels(labels)` shifts them once; losses take logits and already-shifted targets.
Per-token log-probabilities of labels under a model (`token_logprobs`) live in `logprobs.py` and are
re-exported here; the preference and RL losses take their outputs. DPO (with TRL's variants), KTO, ORPO,
SimPO and the reward model's Bradley–Terry loss live in `preference_losses.py` and are re-exported here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ops import lm_head_loss
from .logprobs import IGNORE_INDEX, logprobs_from_logits, scored_rows, sequence_logprobs, token_logprobs
from .options import (
    check_advantage_options,
    check_grpo_loss_options,
    check_importance_sampling_options,
)
from .preference_losses import bradley_terry_loss, dpo_loss, kto_loss, orpo_loss, simpo_loss

__all__ = [
    "IGNORE_INDEX", "next_token_labels", "cross_entropy", "linear_cross_entropy", "logprobs_from_logits",
    "token_logprobs",
    "sequence_logprobs", "dpo_loss", "group_advantages", "grpo_loss", "rollout_importance_weights",
    "kto_loss", "orpo_loss", "simpo_loss", "bradley_terry_loss",
]


def next_token_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Targets for next-token prediction: labels shifted left by one, the last position ignored.  (B, T)"""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


def cross_entropy(
    logits: torch.Tensor,  # (B, T, V)
    labels: torch.Tensor,  # (B, T), already the targets of each position
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level cross-entropy with optional label smoothing (Szegedy et al., 2016).

        L = Σ_t m_t · [ (1 − ε) · (−log p(y_t)) + ε · mean_v(−log p(v)) ] / N

    with m_t = 1 where labels[t] != ignore_index, ε = label_smoothing and N = Σ_t m_t, or the given
    `normalizer` (e.g. the trained-token count of a whole accumulation window, which makes gradient
    accumulation exact). Computed in float32, or float64 for float64 logits.

    Metrics: `nll` (the unsmoothed mean negative log-likelihood over this batch's trained tokens) and
    `tokens` (how many tokens were trained).
    """
    flat_logits = logits.reshape(-1, logits.size(-1))
    flat_logits = flat_logits.to(torch.promote_types(flat_logits.dtype, torch.float32))
    flat_labels = labels.reshape(-1)
    summed = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index,
                             label_smoothing=label_smoothing, reduction="sum")
    tokens = (flat_labels != ignore_index).sum()
    denom = tokens.clamp(min=1) if normalizer is None else normalizer
    loss = summed / denom
    if label_smoothing:
        with torch.no_grad():
            nll = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum")
    else:
        nll = summed.detach()
    return loss, {"nll": nll / tokens.clamp(min=1), "tokens": tokens}


def linear_cross_entropy(
    hidden: torch.Tensor,  # (B, T, H), the final normed hidden states
    weight: torch.Tensor,  # (V, H), the lm_head
    labels: torch.Tensor,  # (B, T), already the targets of each position
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    normalizer: torch.Tensor | float | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`cross_entropy(hidden @ weightᵀ, labels, …)` without ever building the (B, T, V) logits.

    Same loss, gradients and metrics as `cross_entropy` on the lm_head's output (up to summation
    order). Only the trained positions reach the lm_head, `chunk_size` rows at a time (None: the
    device's size, `ops.lm_head_loss.chunk_rows`); each chunk's log-softmax is turned into its logit
    gradient at once (see `ops.lm_head_loss.LinearCrossEntropy`), so the step holds one (chunk_size, V)
    block (two or three briefly: the logits, their float32 log-softmax) instead of the logits, their
    log-softmax and their gradient (three float32 (B, T, V) tensors, which at a 150k vocabulary are the
    largest of a step); from forward to backward it keeps the gradients of the trained rows (N, H) and of
    the weight (V, H), in float32. An input that does not require grad gets no gradient work. Under
    autocast the three matmuls run in the autocast dtype, as the lm_head's would; the softmax, the
    sums and the accumulated weight gradient stay in float32. On CUDA, Liger-Kernel's fused kernel runs
    instead where `ops.lm_head_loss.override_lm_head_loss("liger")` asks for it.
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    rows, targets, _ = scored_rows(hidden, labels, ignore_index)  # (N, H), (N,): trained positions only
    tokens = torch.tensor(len(targets), device=labels.device)
    device = hidden.device.type
    low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    need_grad = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
    chunk_size = chunk_size or lm_head_loss.chunk_rows(hidden.device, weight.shape[0])
    with torch.autocast(device, enabled=False):
        if lm_head_loss.loss_kernel(hidden.device, label_smoothing) == "liger":
            summed = lm_head_loss.liger_cross_entropy_sum(rows, weight, targets, low)
            nll = summed.detach()
        else:
            summed, nll = lm_head_loss.LinearCrossEntropy.apply(rows, weight, targets, label_smoothing,
                                                                chunk_size, need_grad, low)
    denom = tokens.clamp(min=1) if normalizer is None else normalizer
    return summed / denom, {"nll": nll / tokens.clamp(min=1), "tokens": tokens}


# -- group relative policy optimisation ---------------------------------------------------------------


def group_advantages(
    rewards: torch.Tensor,  # (N,), N = number of prompts · group_size, each group consecutive
    group_size: int,
    eps: float = 1e-8,
    scale: str = "group",
) -> torch.Tensor:
    """Group-relative advantages: each completion's reward against its siblings for the same prompt.  (N,)

        group   A_i = (r_i − mean_g) / (std_g + eps)                 Shao et al., 2024 (DeepSeekMath)
        batch   A_i = (r_i − mean_g) / (std_batch + eps)
        none    A_i = r_i − mean_g                                   Liu et al., 2025 (Dr. GRPO)

    mean_g and std_g are over the completion's group; std_batch over all N rewards. Standard
    deviations are population ones (divide by n, not n − 1) — a deliberate difference from TRL, which
    uses the Bessel-corrected std; with group_size 4 that rescales every advantage by √(4/3). "batch"
    still centres each group on its own mean (only the scale is shared), as TRL's scale_rewards="batch"
    does: advantages stay comparable across prompts of different difficulty. Dr. GRPO drops the std
    because it up-weights prompts that are nearly always right or wrong. A group whose rewards are all
    equal gets advantage 0 under every scale.
    """
    check_advantage_options(group_size, scale)
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    grouped = r.view(-1, group_size)  # (N / G, G)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # (N,)
    if scale == "none":
        return centred
    if scale == "group":
        std = grouped.std(dim=1, unbiased=False, keepdim=True).expand_as(grouped).reshape(-1)  # (N,)
    else:
        std = r.std(unbiased=False)
    return centred / (std + eps)


def rollout_importance_weights(
    train_logps: torch.Tensor,  # (B, T) the trained policy's log-probs of the sampled tokens, sampling weights
    rollout_logps: torch.Tensor,  # (B, T) the inference engine's log-probs of the same tokens
    mask: torch.Tensor,  # (B, T), 1 on completion tokens
    mode: str = "token_truncate",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> torch.Tensor:
    """Importance weights for the mismatch between the engine that sampled and the trainer that scores.

    The engine and the training forward compute π_old differently (kernels, precision, batching), so the
    tokens were drawn from π_rollout, not quite π_old. With w_t = exp(train_logps_t − rollout_logps_t):

        token_truncate     w_t clipped to [clip_min, clip_max]              (truncated IS, Yao et al., 2025)
        token_mask         w_t, or 0 where w_t lies outside [clip_min, clip_max]
        sequence_truncate  W = exp(Σ_t m·(train − rollout)) clipped, one weight per completion   (B, 1)
        sequence_mask      W, or 0 for completions whose W lies outside [clip_min, clip_max]      (B, 1)

    The names and bounds are TRL's (`vllm_importance_sampling_mode`, `_clip_max`, `_clip_min`); a bound of
    None is no bound. The weights multiply the policy-gradient term of each token (`grpo_loss`'s
    `importance_weights`); they are constants (no gradient). Positions outside `mask` get weight 1
    (token modes) or do not count (sequence modes).
    """
    check_importance_sampling_options(mode, clip_max, clip_min)
    if train_logps.shape != rollout_logps.shape or mask.shape != train_logps.shape:
        raise ValueError(f"expected train_logps, rollout_logps and mask of one shape (B, T), got "
                         f"{tuple(train_logps.shape)}, {tuple(rollout_logps.shape)} and {tuple(mask.shape)}")
    dtype = torch.promote_types(train_logps.dtype, torch.float32)
    diff = (train_logps.detach().to(dtype) - rollout_logps.detach().to(dtype)) * mask.to(dtype)  # (B, T)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=1, keepdim=True)  # (B, 1)
    weights = torch.exp(diff)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return weights.clamp(min=low, max=high)
    return weights.masked_fill((weights < low) | (weights > high), 0.0)


def _importance_ratio(logps: torch.Tensor, old: torch.Tensor, m: torch.Tensor, level: str) -> torch.Tensor:
    """ρ = exp(logps − old) per token (B, T), or GSPO's exp of its length-normalised sum per sequence (B, 1)."""
    log_ratio = logps - old  # (B, T)
    if level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)).unsqueeze(-1)  # (B, 1)
    return torch.exp(log_ratio)


def _policy_term(logps: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, loss_type: str, low: float,
                 high: float, sapo_temperatures: tuple[float, float]) -> torch.Tensor:
    """The policy-gradient term of each token (B, T), or of each sequence (B, 1) at the sequence level."""
    if loss_type == "cispo":  # the clipped ratio is a constant weight of the REINFORCE term
        return -ratio.clamp(max=high).detach() * adv * logps
    if loss_type == "sapo":
        tau_pos, tau_neg = sapo_temperatures
        tau = torch.where(adv > 0, tau_pos, tau_neg)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    return -torch.min(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)


def _reduce(per_token: torch.Tensor, m: torch.Tensor, loss_type: str, max_len: int | None,
            num_items: torch.Tensor | float | None) -> torch.Tensor:
    """The masked per-token losses (B, T) reduced as `loss_type` says (see `grpo_loss`)."""
    if loss_type in ("grpo", "sapo"):
        return ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (m.size(0) * (m.size(1) if max_len is None else max_len))
    if loss_type in ("dapo", "cispo") and num_items is not None:
        return (per_token * m).sum() / num_items
    return (per_token * m).sum() / m.sum().clamp(min=1)  # bnpo, or dapo/cispo on this batch alone


def grpo_loss(
    logps: torch.Tensor,  # (B, T) current policy, per token
    old_logps: torch.Tensor | None,  # (B, T) policy that sampled the rollouts
    ref_logps: torch.Tensor | None,  # (B, T) frozen reference
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T), 1 on completion tokens
    epsilon: float = 0.2,
    beta: float = 0.01,
    loss_type: str = "dapo",
    max_len: int | None = None,
    *,
    epsilon_high: float | None = None,
    num_items: torch.Tensor | float | None = None,
    importance_weights: torch.Tensor | None = None,  # (B, T) or (B, 1)
    importance_sampling_level: str = "token",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    entropies: torch.Tensor | None = None,  # (B, T) the policy's entropy at each position
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss with a KL penalty to a reference (GRPO, Shao et al., 2024), and its variants.

    Per completion token, with ρ = exp(logps − old_logps), r = exp(ref_logps − logps), the sequence's
    advantage A broadcast over its tokens, ε_low = epsilon, ε_high = epsilon_high (None: = epsilon) and
    w the rollout importance weights (`rollout_importance_weights`; 1 when None):

        ℓ_t = w_t · p_t + β · (r − log r − 1)
        p_t = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A)              grpo, bnpo, dr_grpo, dapo
        p_t = −sg(min(ρ, ε_high)) · A · logps_t                        cispo (MiniMax-M1, 2025: the clipped ratio
                                                                       weighs a REINFORCE term; ε_high is the
                                                                       cap itself, ScaleRL's ε_max, e.g. 5.0)
        p_t = −σ(τ·(ρ − 1)) · 4/τ · A                                  sapo (Soft Adaptive Policy Optimization,
                                                                       arXiv 2511.20347: a soft gate in place of
                                                                       the clip; τ = sapo_temperature_pos where
                                                                       A > 0, else sapo_temperature_neg)

    sg: stop-gradient. importance_sampling_level "sequence" is GSPO (Zheng et al., 2025): one ratio per
    completion, ρ_i = exp(Σ_t m·(logps − old) / Σ_t m), the length-normalised sequence log-ratio, clipped (or
    gated) as above and shared by its tokens. ε_high > ε_low is DAPO's clip-higher (Yu et al., 2025, use 0.28
    against 0.2). The KL term is Schulman's k3 estimator of KL(π ‖ π_ref): unbiased, always ≥ 0; w does not
    weigh it (as TRL). The loss_type picks how the masked ℓ_t are reduced, with TRL's names and meanings:

        grpo, sapo    mean_b( Σ_t m·ℓ / Σ_t m )      per-sequence mean, then batch mean (DeepSeekMath);
                                                     long completions' tokens count less
        bnpo          Σ_{b,t} m·ℓ / Σ_{b,t} m        over the tokens of this (local) batch
        dr_grpo       Σ_{b,t} m·ℓ / (B · max_len)    a constant divisor (Liu et al., 2025, Dr. GRPO);
                                                     max_len defaults to T, the padded length
        dapo, cispo   Σ_{b,t} m·ℓ / num_items        num_items: the completion tokens of the whole global
                                                     batch (DAPO); None = this batch's, as bnpo

    GSPO's paper reduces per sequence (grpo); with the token sums of the others a completion weighs by its
    length. An entropy bonus (TRL's `entropy_coef`, c) subtracts c · Σ m·H / Σ m, the mean entropy of the
    policy over this batch's completion tokens, whatever the loss_type (`entropies`, (B, T), with gradient).

    For dapo and cispo the caller passes num_items so that the gradients its accumulation and data parallelism
    add up are those of one batch: with K micro-batches per step and W ranks (each micro-batch loss divided by
    K, gradients averaged over ranks), num_items = N / (K · W), N the completion tokens of all K·W
    micro-batches (TRL's num_items_in_batch, rescaled alike).

    `old_logps`, `ref_logps`, `advantages` and the weights are constants: detached here, so gradients
    reach `logps` (and `entropies`) only. `old_logps=None` means one pass on fresh rollouts (old =
    logps.detach(), so ρ = 1); `ref_logps=None` is allowed when beta == 0.

    Metrics (detached): `policy_loss` (the policy term alone, reduced as the loss), `kl` (mean k3 over
    completion tokens; 0 without a reference), `entropy` (mean over completion tokens, when given);
    for the clipped loss types `clip_ratio/low_mean` (ρ < 1 − ε_low with A < 0), `clip_ratio/high_mean`
    (ρ > 1 + ε_high with A > 0) and `clip_ratio` (either: TRL's region_mean), as fractions of the completion
    tokens (of the completions, at the sequence level) where the clipped branch wins the min, so the token gives
    no gradient; for cispo `cispo_clip_ratio` (ρ > ε_high with A > 0, TRL's).
    """
    check_grpo_loss_options(loss_type, epsilon, beta, epsilon_high, importance_sampling_level,
                            (sapo_temperature_pos, sapo_temperature_neg), entropy_coef)
    high = epsilon if epsilon_high is None else epsilon_high
    if ref_logps is None and beta:
        raise ValueError(f"ref_logps is None but beta={beta}: pass reference log-probs or set beta=0")
    if mask.shape != logps.shape or advantages.shape != logps.shape[:1]:
        raise ValueError(f"expected logps and mask (B, T) and advantages (B,), got logps {tuple(logps.shape)}, "
                         f"mask {tuple(mask.shape)}, advantages {tuple(advantages.shape)}")
    if entropy_coef and (entropies is None or entropies.shape != logps.shape):
        raise ValueError(f"entropy_coef={entropy_coef} needs the policy's entropies (B, T) = {tuple(logps.shape)}")

    dtype = torch.promote_types(logps.dtype, torch.float32)
    logps = logps.to(dtype)
    m = mask.to(dtype)
    old = logps.detach() if old_logps is None else old_logps.detach().to(dtype)
    adv = advantages.detach().to(dtype).unsqueeze(1)  # (B, 1)
    ratio = _importance_ratio(logps, old, m, importance_sampling_level)  # (B, T) or (B, 1)
    per_token_pg = _policy_term(logps, ratio, adv, loss_type, epsilon, high,
                                (sapo_temperature_pos, sapo_temperature_neg)).expand_as(logps)
    if importance_weights is not None:
        per_token_pg = per_token_pg * importance_weights.detach().to(dtype)
    if ref_logps is not None:
        log_r = ref_logps.detach().to(dtype) - logps
        per_token_kl = torch.exp(log_r) - log_r - 1  # (B, T)
    else:
        per_token_kl = torch.zeros_like(logps)

    policy_loss = _reduce(per_token_pg, m, loss_type, max_len, num_items)
    loss = policy_loss + beta * _reduce(per_token_kl, m, loss_type, max_len, num_items) if beta else policy_loss
    tokens = m.sum().clamp(min=1)
    if entropies is not None:
        entropy = (entropies.to(dtype) * m).sum() / tokens
        loss = loss - entropy_coef * entropy if entropy_coef else loss
    with torch.no_grad():
        metrics = {"policy_loss": policy_loss.detach(), "kl": (per_token_kl.detach() * m).sum() / tokens,
                   **_clip_metrics(ratio, adv, m, loss_type, epsilon, high)}
        if entropies is not None:
            metrics["entropy"] = entropy.detach()
    return loss, metrics


def _clip_metrics(ratio: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, loss_type: str, low: float,
                  high: float) -> dict[str, torch.Tensor]:
    """The fractions of completion tokens whose ratio the clip stopped (TRL's names); none for sapo's gate."""
    def share(hit: torch.Tensor) -> torch.Tensor:  # of the tokens; of the sequences at the sequence level (as TRL)
        return hit.to(m.dtype).mean() if hit.size(1) == 1 else (hit.to(m.dtype) * m).sum() / m.sum().clamp(min=1)

    if loss_type == "cispo":
        return {"cispo_clip_ratio": share((ratio > high) & (adv > 0))}
    if loss_type == "sapo":
        return {}
    low_clipped, high_clipped = (ratio < 1 - low) & (adv < 0), (ratio > 1 + high) & (adv > 0)
    return {"clip_ratio": share(low_clipped | high_clipped), "clip_ratio/low_mean": share(low_clipped),
            "clip_ratio/high_mean": share(high_clipped)}
