"""Losses of the on-policy objectives beside GRPO, as pure functions: GKD's generalised Jensen–Shannon
divergence (full vocabulary, or a teacher's top-k support), RLOO's leave-one-out advantages and its
sequence-level clipped surrogate, and Online DPO's pairing of two sampled completions by reward.

Option names and meanings are TRL's (GKDConfig, RLOOConfig, OnlineDPOConfig); each function's docstring
gives its equation and where it deviates.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..data.packing import IGNORE_INDEX
from .options import require


def check_jsd_beta(beta: float, option: str = "Distill.beta") -> None:
    require(0.0 <= beta <= 1.0, option, beta, "must lie in [0, 1]: 0 is the forward KL(teacher‖student), 1 the "
            "reverse KL(student‖teacher), between them the generalised JSD; TRL's default is 0.5")


def jsd_per_position(
    student_logps: torch.Tensor,  # (N, V) log-probabilities
    teacher_logps: torch.Tensor,  # (N, V) log-probabilities, no gradient
    beta: float,
    keep: torch.Tensor | None = None,  # (N, V) bool: entries outside weigh nothing (their log-probs must be finite)
) -> torch.Tensor:
    """Σ_v of the generalised JSD's terms at each position.  (N,)

        β = 0        KL(T ‖ S) = Σ_v T·(log T − log S)
        β = 1        KL(S ‖ T) = Σ_v S·(log S − log T)
        otherwise    β·KL(T ‖ M) + (1 − β)·KL(S ‖ M),   M = (1 − β)·S + β·T

    (Agarwal et al., 2024, GKD, eq. 1; the two ends are TRL's: the limits of the mixture form are 0.)
    """
    teacher_logps = teacher_logps.detach()
    s, t = student_logps.exp(), teacher_logps.exp()
    if keep is not None:
        s, t = s * keep, t * keep
    if beta == 0:
        return (t * (teacher_logps - student_logps)).sum(-1)
    if beta == 1:
        return (s * (student_logps - teacher_logps)).sum(-1)
    mixture = torch.logsumexp(torch.stack([student_logps + math.log1p(-beta), teacher_logps + math.log(beta)]), 0)
    return beta * (t * (teacher_logps - mixture)).sum(-1) + (1 - beta) * (s * (student_logps - mixture)).sum(-1)


def _scored(x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """The rows of x (..., D) at positions whose label is not -100, flattened to (N, D)."""
    x = x.reshape(-1, x.size(-1))
    return x if labels is None else x[labels.reshape(-1) != IGNORE_INDEX]


def _reduced(per_position: torch.Tensor, num_items: float | torch.Tensor | None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    n = per_position.new_tensor(max(per_position.numel(), 1)) if num_items is None else num_items
    loss = per_position.sum() / n
    return loss, {"jsd": per_position.detach().mean() if per_position.numel() else loss.detach(),
                  "tokens": per_position.new_tensor(float(per_position.numel()))}


def generalized_jsd_loss(
    student_logits: torch.Tensor,  # (B, T, V) or (N, V): at the positions that predict the scored tokens
    teacher_logits: torch.Tensor,  # same shape
    labels: torch.Tensor | None = None,  # (B, T) or (N,): -100 where not scored; None = every position
    beta: float = 0.5,
    temperature: float = 1.0,
    num_items: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GKD's loss (Agarwal et al., 2024): the generalised JSD between the student's and the teacher's next-token
    distributions, S = softmax(z_s / τ) and T = softmax(z_t / τ), summed over the vocabulary and averaged over
    the scored positions (or divided by `num_items`, the scored positions of a whole accumulation window):

        L = Σ_{scored t} JSD_β(S_t, T_t) / N            (JSD_β: see `jsd_per_position`)

    TRL's `GKDTrainer.generalized_jsd_loss` with reduction "batchmean" and labels; the logits and labels are
    already aligned (logits at t with the label of the token they predict). Only the scored rows are
    converted to log-probabilities, in float32 or wider. Deviation: with labels None every position counts
    and N is their number (TRL's "batchmean" without labels divides by the batch size).
    Metrics: `jsd` (the mean per scored position) and `tokens` (N).
    """
    check_jsd_beta(beta)
    require(temperature > 0, "Distill.temperature", temperature, "must be > 0 (it divides the logits)")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: both models must share the vocabulary")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student = F.log_softmax(_scored(student_logits, labels).to(dtype) / temperature, -1)  # (N, V)
    teacher = F.log_softmax(_scored(teacher_logits, labels).to(dtype) / temperature, -1)  # (N, V)
    return _reduced(jsd_per_position(student, teacher, beta), num_items)


def topk_generalized_jsd_loss(
    student_logits: torch.Tensor,  # (N, V) at the scored positions
    teacher_ids: torch.Tensor,  # (N, K) the teacher's k most likely next tokens at each position
    teacher_logps: torch.Tensor,  # (N, K) their log-probabilities under the teacher (at temperature 1)
    beta: float = 0.5,
    temperature: float = 1.0,
    num_items: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The generalised JSD on the teacher's top-k support, for a teacher that reports only its k most likely
    tokens (an OpenAI-compatible server's top logprobs). At each position both distributions are restricted to
    those k ids K_t and renormalised there:

        S̃_t(v) = softmax_{v ∈ K_t}(z_s(v) / τ),   T̃_t(v) = softmax_{v ∈ K_t}(log T(v) / τ)
        L = Σ_t JSD_β(S̃_t, T̃_t) / N

    log T(v) / τ and z_t(v) / τ differ by one constant per position, which the renormalisation removes, so T̃
    is exactly the teacher at temperature τ conditioned on K_t. With k = V this is `generalized_jsd_loss`;
    with k < V the student's mass outside K_t is not penalised (a deliberate approximation: the teacher
    gives no information there). Duplicate ids in a row (padding of rows with fewer than k) must carry
    log-probability −inf so they weigh nothing.
    """
    check_jsd_beta(beta)
    require(temperature > 0, "Distill.temperature", temperature, "must be > 0 (it divides the logits)")
    if teacher_ids.shape != teacher_logps.shape or teacher_ids.shape[0] != student_logits.shape[0]:
        raise ValueError(f"teacher ids {tuple(teacher_ids.shape)} and log-probabilities {tuple(teacher_logps.shape)} "
                         f"must be (N, K) for the student's (N, V) = {tuple(student_logits.shape)}")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    picked = student_logits.to(dtype).gather(-1, teacher_ids) / temperature  # (N, K)
    keep = torch.isfinite(teacher_logps)
    student = F.log_softmax(picked.masked_fill(~keep, float("-inf")), -1)  # (N, K)
    teacher = F.log_softmax(teacher_logps.to(dtype) / temperature, -1)  # (N, K), −inf where padded
    zero = torch.zeros((), dtype=dtype, device=student.device)
    student, teacher = torch.where(keep, student, zero), torch.where(keep, teacher, zero)  # finite; weigh 0 there
    return _reduced(jsd_per_position(student, teacher, beta, keep), num_items)


# -- RLOO ------------------------------------------------------------------------------------------------
def kl_penalised_rewards(
    rewards: torch.Tensor,  # (B,)
    old_logps: torch.Tensor,  # (B, T) the sampling policy's token log-probabilities
    ref_logps: torch.Tensor | None,  # (B, T) the reference's; None: no penalty
    mask: torch.Tensor,  # (B, T) 1 on completion tokens
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO's rewards with the KL penalty in them, and the per-sequence KL estimate (B,), (B,):

        r'_i = r_i − β · Σ_t (log π_old(o_t) − log π_ref(o_t))

    the first-order (k1) estimate summed over the completion's tokens, as Ahmadian et al. (2024) and TRL's
    RLOOTrainer do; it can be negative. NaN rewards (unscorable completions) stay NaN.
    """
    if ref_logps is None or beta == 0:
        return rewards, torch.zeros_like(rewards)
    kl = ((old_logps - ref_logps) * mask).sum(-1).to(rewards.dtype)  # (B,)
    return rewards - beta * kl, kl


def rloo_advantages(rewards: torch.Tensor, num_generations: int, normalize: bool = False) -> torch.Tensor:
    """Leave-one-out advantages (Kool et al., 2019; Ahmadian et al., 2024), rewards grouped by prompt:  (B,)

        A_i = r_i − (1 / (G − 1)) · Σ_{j ≠ i} r_j       (j over the group's scorable siblings)

    NaN rewards (every reward function returned None) are left out of their siblings' baselines and get
    advantage 0, as TRL does. `normalize`: then (A − mean A) / (std A + 1e-4) over the batch (TRL's
    normalize_advantages; std with Bessel's correction).
    """
    require(num_generations >= 2, "RLOO.num_generations", num_generations,
            "must be >= 2: the baseline of a completion is the mean of its siblings'")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    grouped = rewards.view(-1, num_generations)  # (P, G)
    scorable = (~grouped.isnan()).sum(1, keepdim=True)  # (P, 1)
    baselines = (grouped.nansum(1, keepdim=True) - grouped) / (scorable - 1)  # 0/0 = NaN: zeroed below
    advantages = (grouped - baselines).view(-1)
    if normalize:
        kept = advantages[~advantages.isnan()]
        std = kept.std() if kept.numel() > 1 else kept.new_zeros(())
        advantages = (advantages - kept.mean()) / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def rloo_loss(
    logps: torch.Tensor,  # (B, T) the policy's token log-probabilities, with gradients
    old_logps: torch.Tensor | None,  # (B, T) the sampling policy's; None: the policy's own (detached)
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T) 1 on trained completion tokens
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    num_items: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RLOO's clipped surrogate at the sequence level (TRL's RLOOTrainer):

        ρ_i = exp(Σ_t log π_θ(o_{i,t}) − Σ_t log π_old(o_{i,t}))
        L = −Σ_i min(ρ_i · A_i, clip(ρ_i, 1 − ε_low, 1 + ε_high) · A_i) / N

    N = B, or `num_items` (the sequences of a whole accumulation window, so micro-batches add up exactly).
    On the first pass over a rollout ρ = 1 and this is REINFORCE with the leave-one-out baseline.
    Metrics: `policy_loss`, `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    seq = (logps * mask).sum(-1)  # (B,)
    old = seq.detach() if old_logps is None else (old_logps * mask).sum(-1)
    ratio = torch.exp(seq - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    per_sequence = -torch.min(ratio * advantages, clipped * advantages)  # (B,)
    n = per_sequence.numel() if num_items is None else num_items
    loss = per_sequence.sum() / max(n, 1)
    with torch.no_grad():
        low = ((ratio < 1 - epsilon) & (advantages < 0)).float()
        high = ((ratio > 1 + eps_high) & (advantages > 0)).float()
        metrics = {"policy_loss": loss.detach(), "clip_ratio/low_mean": low.mean(),
                   "clip_ratio/high_mean": high.mean(), "clip_ratio/region_mean": (low + high).clamp(max=1).mean()}
    return loss, metrics


# -- Online DPO ------------------------------------------------------------------------------------------
def preference_pairs(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (P,), (P,) of the chosen and rejected completion of each prompt, from rewards (2P,) grouped by
    prompt (completion 2p and 2p + 1 are prompt p's): the first is chosen on a tie, as TRL's OnlineDPOTrainer
    does (mask = first ≥ second)."""
    if rewards.dim() != 1 or rewards.numel() % 2:
        raise ValueError(f"rewards must be (2P,), two completions per prompt; got {tuple(rewards.shape)}")
    pairs = rewards.view(-1, 2)  # (P, 2)
    first = torch.nan_to_num(pairs[:, 0], nan=float("-inf")) >= torch.nan_to_num(pairs[:, 1], nan=float("-inf"))
    base = torch.arange(0, rewards.numel(), 2, device=rewards.device)
    return base + (~first).long(), base + first.long()
