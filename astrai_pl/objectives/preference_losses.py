"""The losses of DPO (with TRL's variants), KTO, ORPO, SimPO and reward modelling: pure functions, tensors in,
`(loss, metrics)` out.

They take per-sequence numbers — summed or mean token log-probabilities of the responses, or a reward
model's scores — computed by the objectives (`dpo.py`, `kto.py`, `orpo.py`, `simpo.py`, `reward.py`);
`losses.py` re-exports them. Metrics carry TRL's names, so a run reads like its TRL counterpart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .options import (
    check_dpo_options,
    check_kto_options,
    check_orpo_options,
    check_reward_options,
    check_simpo_options,
)

__all__ = ["dpo_loss", "kto_loss", "orpo_loss", "simpo_loss", "bradley_terry_loss", "log1mexp"]


def _float(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors in float32 (or float64 when one is)."""
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    return [t.to(dtype) for t in tensors]


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"expected 1-D tensors of one shape (B,), got {shapes}")


def pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor,
                 rejected_logps: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's metrics of a preference batch (means, detached): rewards/chosen, /rejected, /accuracies,
    /margins, logps/chosen, logps/rejected."""
    with torch.no_grad():
        return {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": chosen_logps.detach().mean(),
            "logps/rejected": rejected_logps.detach().mean(),
        }


# -- DPO and TRL's variants -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pairs:
    """What the DPO loss types read, per pair (B,): the log-ratios to the reference of each side, the policy's
    and the reference's own chosen − rejected gaps, the response lengths (None: not given), and the chosen
    responses' token-mean NLL (a scalar; None: not given)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    policy_gap: torch.Tensor
    ref_gap: torch.Tensor
    chosen_len: torch.Tensor | None
    rejected_len: torch.Tensor | None
    nll: torch.Tensor | None

    @property
    def h(self) -> torch.Tensor:
        return self.chosen - self.rejected

    def h_per_token(self, loss_type: str) -> torch.Tensor:
        """h with each side's log-ratio divided by its response length (TRL's ipo and sigmoid_norm)."""
        if self.chosen_len is None or self.rejected_len is None:
            if loss_type == "ipo":  # the numbers as given (a caller may have length-normalised them already)
                return self.h
            raise ValueError(f"loss_type {loss_type!r} needs chosen_lengths and rejected_lengths (B,)")
        return self.chosen / self.chosen_len.clamp(min=1) - self.rejected / self.rejected_len.clamp(min=1)


def _smoothed(u: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(u) - eps * F.logsigmoid(-u)


def _exo(u: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.sigmoid(u) * (F.logsigmoid(u) - math.log1p(-eps)) + torch.sigmoid(-u) * (F.logsigmoid(-u) - math.log(eps))


def _discopop(u: torch.Tensor, tau: float) -> torch.Tensor:
    mix = torch.sigmoid(u / tau)
    return -F.logsigmoid(u) * (1 - mix) + torch.exp(-u) * mix


def _sft(p: _Pairs) -> torch.Tensor:
    if p.nll is None:
        raise ValueError("loss_type 'sft' needs chosen_nll, the chosen responses' token-mean NLL")
    return p.nll.expand_as(p.chosen)


_DPO_LOSSES = {  # per pair (B,), from the pairs p, β, ε = label_smoothing and discopop's τ
    "sigmoid": lambda p, b, e, t: _smoothed(b * p.h, e),
    "robust": lambda p, b, e, t: (-(1 - e) * F.logsigmoid(b * p.h) + e * F.logsigmoid(-b * p.h)) / (1 - 2 * e),
    "ipo": lambda p, b, e, t: (p.h_per_token("ipo") - 1 / (2 * b)) ** 2,
    "hinge": lambda p, b, e, t: torch.relu(1 - b * p.h),
    "exo_pair": lambda p, b, e, t: _exo(b * p.h, e),
    "nca_pair": lambda p, b, e, t: (-F.logsigmoid(b * p.chosen) - 0.5 * F.logsigmoid(-b * p.chosen)
                                    - 0.5 * F.logsigmoid(-b * p.rejected)),
    "bco_pair": lambda p, b, e, t: -F.logsigmoid(b * p.chosen) - F.logsigmoid(-b * p.rejected),
    "sppo_hard": lambda p, b, e, t: (p.chosen - 0.5 / b) ** 2 + (p.rejected + 0.5 / b) ** 2,
    "aot": lambda p, b, e, t: _smoothed(b * (p.policy_gap.sort().values - p.ref_gap.sort().values), e),
    "aot_unpaired": lambda p, b, e, t: _smoothed(b * (p.chosen.sort().values - p.rejected.sort().values), e),
    "apo_zero": lambda p, b, e, t: 1 - torch.sigmoid(b * p.chosen) + torch.sigmoid(b * p.rejected),
    "apo_down": lambda p, b, e, t: torch.sigmoid(b * p.chosen) + 1 - torch.sigmoid(b * p.h),
    "discopop": lambda p, b, e, t: _discopop(b * p.h, t),
    "sft": lambda p, b, e, t: _sft(p),
    "sigmoid_norm": lambda p, b, e, t: -F.logsigmoid(b * p.h_per_token("sigmoid_norm")),
}


def dpo_loss(
    policy_chosen_logps: torch.Tensor,  # (B,) summed response log-probabilities under the policy
    policy_rejected_logps: torch.Tensor,  # (B,)
    ref_chosen_logps: torch.Tensor,  # (B,) the same under the frozen reference
    ref_rejected_logps: torch.Tensor,  # (B,)
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    label_smoothing: float = 0.0,
    *,
    loss_weights: Sequence[float] | None = None,
    chosen_lengths: torch.Tensor | None = None,  # (B,) response tokens of each side: ipo, sigmoid_norm
    rejected_lengths: torch.Tensor | None = None,  # (B,)
    chosen_nll: torch.Tensor | None = None,  # () token-mean NLL of the chosen responses: sft
    discopop_tau: float = 0.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct Preference Optimization and TRL's variants of it, each averaged over the batch of pairs.

    With c = πc − rc and r = πr − rr the log-ratios of the chosen and rejected responses to the reference
    (π: policy, r·: reference, summed over response tokens), h = c − r, u = β·h, ε = label_smoothing, and
    c̄, r̄, h̄ the same divided by each response's length:

        sigmoid       −(1 − ε)·log σ(u) − ε·log σ(−u)                  Rafailov et al., 2023 (DPO); ε > 0: cDPO
        robust        [−(1 − ε)·log σ(u) + ε·log σ(−u)] / (1 − 2ε)     Chowdhury et al., 2024 (rDPO)
        ipo           (h̄ − 1/(2β))²                                    Azar et al., 2023 (IPO)
        hinge         max(0, 1 − u)                                    Zhao et al., 2023 (SLiC-HF)
        exo_pair      σ(u)·(log σ(u) − log(1 − ε)) + σ(−u)·(log σ(−u) − log ε)   Ji et al., 2024 (EXO), ε > 0
        nca_pair      −log σ(βc) − ½·log σ(−βc) − ½·log σ(−βr)         Chen et al., 2024 (NCA)
        bco_pair      −log σ(βc) − log σ(−βr)                           Jung et al., 2024 (BCO)
        sppo_hard     (c − 1/(2β))² + (r + 1/(2β))²                     Wu et al., 2024 (SPPO, hard labels)
        aot           smoothed sigmoid of β·(sort(πc − πr) − sort(rc − rr))   Melnyk et al., 2024 (AOT, paired)
        aot_unpaired  smoothed sigmoid of β·(sort(c) − sort(r))          (AOT, unpaired)
        apo_zero      1 − σ(βc) + σ(βr)                                  D'Oosterlinck et al., 2024 (APO-zero)
        apo_down      σ(βc) + 1 − σ(u)                                   (APO-down)
        discopop      −log σ(u)·(1 − σ(u/τ)) + e^{−u}·σ(u/τ)            Lu et al., 2024 (DiscoPOP), τ 0.05
        sft           the chosen responses' token-mean NLL (`chosen_nll`)
        sigmoid_norm  −log σ(β·h̄)                                       (length-normalised DPO)

    sort is over the batch (AOT's optimal transport between the two empirical distributions). A list of names
    is TRL's combination (MPO, Wang et al., 2024: e.g. sigmoid + bco_pair + sft): L = Σ_k w_k · mean_b ℓ_k with
    w = loss_weights (None: 1 each). Names and formulas are TRL's `DPOConfig.loss_type` (TRL ≥ 1.0 calls the
    unpaired AOT `aot_unpaired`; its older `aot_pair`). ipo and sigmoid_norm divide by `chosen_lengths` and
    `rejected_lengths` (TRL divides by the completion tokens); without them ipo takes the numbers as given, so a
    caller may pass mean token log-probabilities instead. Two deliberate differences from TRL: sigmoid keeps
    cDPO's ε (TRL ≥ 1.0 ignores label_smoothing there; ε = 0 is TRL's loss), and bco_pair has no running mean
    of the rewards (as TRL ≥ 1.0: the BCOTrainer keeps that, not DPO's bco_pair). The reference
    log-probabilities are constants (detached here); gradients reach the policy's only.

    Metrics (batch means, detached), TRL's names: `rewards/chosen` = βc, `rewards/rejected` = βr,
    `rewards/margins`, `rewards/accuracies`, `logps/chosen` = πc, `logps/rejected` = πr; with several loss
    types also `loss/<name>` (each unweighted mean).
    """
    check_dpo_options(beta, loss_type, label_smoothing, loss_weights=loss_weights, discopop_tau=discopop_tau)
    _check_same_shape(policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps,
                      ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    pc, pr, rc, rr = _float(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps.detach(),
                            ref_rejected_logps.detach())
    lengths = [None if n is None else n.to(pc.dtype) for n in (chosen_lengths, rejected_lengths)]
    pairs = _Pairs(pc - rc, pr - rr, pc - pr, rc - rr, *lengths, None if chosen_nll is None else chosen_nll.to(pc.dtype))
    loss, parts = 0.0, {}
    for name, weight in zip(types, weights):
        parts[name] = _DPO_LOSSES[name](pairs, beta, label_smoothing, discopop_tau).mean()
        loss = loss + weight * parts[name]
    metrics = pair_metrics(beta * pairs.chosen.detach(), beta * pairs.rejected.detach(), pc, pr)
    if len(types) > 1:
        metrics.update({f"loss/{name}": part.detach() for name, part in parts.items()})
    return loss, metrics


# -- KTO ------------------------------------------------------------------------------------------------


def kto_loss(
    policy_logps: torch.Tensor,  # (B,) summed completion log-probabilities under the policy
    ref_logps: torch.Tensor,  # (B,) the same under the reference
    desirable: torch.Tensor,  # (B,) bool: the example's label
    policy_kl_logps: torch.Tensor | None,  # (M,) mismatched (prompt, completion) pairs under the policy
    ref_kl_logps: torch.Tensor | None,  # (M,) the same under the reference
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Kahneman–Tversky Optimization (Ethayarajh et al., 2024), over unpaired examples, averaged over the batch.

    With the implied reward r = π − π_ref of each completion (summed log-probabilities) and the reference
    point z₀ = max(0, mean over the M mismatched pairs of (π_KL − π_ref,KL)) — a batch estimate of
    KL(π ‖ π_ref), a constant (no gradient), as in the paper:

        kto                desirable  λ_D · (1 − σ(β · (r − z₀)))         Eq. (7) of the paper
                           undesirable λ_U · (1 − σ(β · (z₀ − r)))
        apo_zero_unpaired  desirable  λ_D · (1 − σ(β · r))                 D'Oosterlinck et al., 2024 (APO-zero,
                           undesirable λ_U · σ(β · r)                       unpaired); no z₀, no mismatched pairs

    L = mean of these over the B examples (λ_D = desirable_weight, λ_U = undesirable_weight), as TRL's
    KTOTrainer reduces it. The paper's value term is λ_y − v(x, y); the constant λ_y is left out (it moves no
    gradient), again as TRL does. Reference log-probabilities are constants (detached here).

    Metrics (detached): `kl` (z₀), `rewards/chosen` and `logps/chosen` (means over the desirable examples),
    `rewards/rejected` and `logps/rejected` (over the undesirable ones) — a key is left out when the batch
    holds no example of its kind — and `rewards/margins` when it holds both; rewards are β · r.
    """
    check_kto_options(beta, desirable_weight, undesirable_weight, loss_type)
    _check_same_shape(policy_logps=policy_logps, ref_logps=ref_logps, desirable=desirable)
    policy, ref = _float(policy_logps, ref_logps.detach())
    ratio = policy - ref  # (B,)
    if loss_type == "kto":
        if policy_kl_logps is None or ref_kl_logps is None:
            raise ValueError("loss_type='kto' needs the mismatched pairs' log-probabilities (policy_kl_logps, "
                             "ref_kl_logps) for its reference point; 'apo_zero_unpaired' needs none")
        kl_policy, kl_ref = _float(policy_kl_logps.detach(), ref_kl_logps.detach())
        z0 = (kl_policy - kl_ref).mean().clamp(min=0)
        chosen = 1 - torch.sigmoid(beta * (ratio - z0))
        rejected = 1 - torch.sigmoid(beta * (z0 - ratio))
    else:
        z0 = ratio.new_zeros(())
        chosen, rejected = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
    good = desirable.to(torch.bool)
    losses = torch.where(good, desirable_weight * chosen, undesirable_weight * rejected)  # (B,)
    return losses.mean(), _kto_metrics(beta * ratio.detach(), policy.detach(), good, z0)


def _kto_metrics(rewards: torch.Tensor, logps: torch.Tensor, good: torch.Tensor, z0: torch.Tensor):
    metrics = {"kl": z0.detach()}
    for side, mask in (("chosen", good), ("rejected", ~good)):
        if mask.any():
            metrics[f"rewards/{side}"], metrics[f"logps/{side}"] = rewards[mask].mean(), logps[mask].mean()
    if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics


# -- ORPO -----------------------------------------------------------------------------------------------


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, without cancellation (log1p(−eˣ) below −ln 2, log(−expm1 x) above). Each branch
    sees only inputs it is exact for, so the one not taken cannot put a NaN into the gradient."""
    low = x < -0.6931471805599453
    return torch.where(low, torch.log1p(-torch.exp(torch.where(low, x, -1.0))),
                       torch.log(-torch.expm1(torch.where(low, -0.5, x))))


def orpo_loss(
    policy_chosen_logps: torch.Tensor,  # (B,) mean token log-probability of each chosen response
    policy_rejected_logps: torch.Tensor,  # (B,) the same for each rejected response
    chosen_nll: torch.Tensor,  # () negative log-likelihood of the chosen responses (token mean)
    beta: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Odds Ratio Preference Optimization (Hong et al., 2024): SFT on the chosen response plus an odds-ratio term,
    no reference model.

    With p_c, p_r the mean token log-probabilities of the chosen and rejected responses and
    odds(p) = P / (1 − P) at P = exp(p):

        log OR = (p_c − p_r) − (log(1 − e^{p_c}) − log(1 − e^{p_r}))
        L      = L_NLL − β · mean_b log σ(log OR)                           Eq. (6)–(7); β is the paper's λ

    as TRL's ORPOTrainer computes it (its `beta`, default 0.1). A mean log-probability of exactly 0 would make
    log(1 − e^p) infinite: p is capped at −1e-12 first (a no-op for any response the model does not already
    produce with certainty).

    Metrics (detached): `nll_loss`, `log_odds_ratio` (mean log σ(log OR)), `log_odds_chosen` (mean log OR), and
    TRL's preference metrics with rewards β · p: rewards/chosen, /rejected, /accuracies, /margins, logps/….
    """
    check_orpo_options(beta)
    _check_same_shape(policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps)
    chosen, rejected = (p.clamp(max=-1e-12) for p in _float(policy_chosen_logps, policy_rejected_logps))
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))  # (B,)
    ratio = F.logsigmoid(log_odds)
    loss = chosen_nll - beta * ratio.mean()
    metrics = pair_metrics(beta * chosen.detach(), beta * rejected.detach(), chosen, rejected)
    metrics.update(nll_loss=chosen_nll.detach(), log_odds_ratio=ratio.detach().mean(),
                   log_odds_chosen=log_odds.detach().mean())
    return loss, metrics


# -- SimPO ----------------------------------------------------------------------------------------------


def simpo_loss(
    policy_chosen_logps: torch.Tensor,  # (B,) mean token log-probability of each chosen response
    policy_rejected_logps: torch.Tensor,  # (B,) the same for each rejected response
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Simple Preference Optimization (Meng et al., 2024): a reference-free margin loss on length-normalised
    rewards, averaged over the pairs.

    The reward of a response is β times its mean token log-probability, r = β/|y| · log π(y | x); with
    h = r_c − r_r − γ (γ: the target margin) and ε = label_smoothing:

        L = −(1 − ε) · log σ(h) − ε · log σ(−h)                              Eq. (6) of the paper (ε = 0)

    the same as TRL's CPOTrainer with loss_type="simpo" (its simpo_gamma is γ, applied as β·(Δ − γ/β)) and
    cpo_alpha=0.

    Metrics (detached), TRL's: rewards/chosen = β · p_c, rewards/rejected, /accuracies, /margins, logps/….
    """
    check_simpo_options(beta, gamma, label_smoothing)
    _check_same_shape(policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps)
    chosen, rejected = _float(policy_chosen_logps, policy_rejected_logps)
    h = beta * (chosen - rejected) - gamma  # (B,)
    losses = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    return losses.mean(), pair_metrics(beta * chosen.detach(), beta * rejected.detach(), chosen, rejected)


# -- reward modelling -----------------------------------------------------------------------------------


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,  # (B,) the reward model's score of each chosen sequence
    rejected_rewards: torch.Tensor,  # (B,) the same for each rejected sequence
    margin: torch.Tensor | None = None,  # (B,) a required score gap per pair (Llama 2's margin), or None
    center_rewards_coefficient: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Bradley–Terry loss of a reward model on preference pairs (Bradley & Terry, 1952; Ouyang et al., 2022),
    averaged over the pairs.

        L = −mean_b log σ(s_c − s_r − m)  +  c · mean_b (s_c + s_r)²

    s: scalar scores, m: the optional margin (Touvron et al., 2023), c = center_rewards_coefficient
    (Eisenstein et al., 2023: keeps the scores centred on 0; None or 0 = off). TRL's RewardTrainer computes the
    same.

    Metrics (detached), TRL's: `accuracy` (share of pairs with s_c > s_r), `margin` (mean s_c − s_r),
    `mean_reward`, `min_reward`, `max_reward` (over both sides' scores).
    """
    check_reward_options(center_rewards_coefficient)
    _check_same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    chosen, rejected = _float(chosen_rewards, rejected_rewards)
    gap = chosen - rejected  # (B,)
    loss = -F.logsigmoid(gap if margin is None else gap - margin.to(gap.dtype)).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        both = torch.cat([chosen, rejected])
        metrics = {"accuracy": (gap > 0).to(gap.dtype).mean(), "margin": gap.mean(), "mean_reward": both.mean(),
                   "min_reward": both.min(), "max_reward": both.max()}
    return loss, metrics
