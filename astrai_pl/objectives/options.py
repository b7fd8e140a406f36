"""The checks of the objectives' own options: each option is checked here once, by the objective's constructor
and by the loss function that takes it, and a value it cannot take is a ConfigError naming the option, the
value and the fix."""

from __future__ import annotations

from typing import Any

from ..model.config import ConfigError

DPO_LOSS_TYPES = ("sigmoid", "robust", "ipo", "hinge")
ADVANTAGE_SCALES = ("group", "batch", "none")
GRPO_LOSS_TYPES = ("token", "grpo", "dr_grpo")


def require(ok: bool, option: str, value: Any, why: str) -> None:
    """ConfigError "option=value: why" unless `ok`."""
    if not ok:
        raise ConfigError(f"{option}={value!r}: {why}")


def check_label_smoothing(objective: str, label_smoothing: float) -> None:
    """ε of a smoothed cross-entropy: in [0, 1)."""
    require(0.0 <= label_smoothing < 1.0, f"{objective}.label_smoothing", label_smoothing, "must lie in [0, 1)")


def check_dpo_options(beta: float, loss_type: str, label_smoothing: float, rpo_alpha: float | None = None) -> None:
    """The options of DPO and `dpo_loss`."""
    require(beta > 0, "DPO.beta", beta, "must be > 0 (the inverse temperature of the implicit reward; smaller "
            "keeps the policy nearer the reference); TRL's default is 0.1")
    require(loss_type in DPO_LOSS_TYPES, "DPO.loss_type", loss_type,
            f"unknown; use one of {', '.join(DPO_LOSS_TYPES)}")
    require(0.0 <= label_smoothing < 0.5, "DPO.label_smoothing", label_smoothing,
            "must lie in [0, 0.5) (the probability that a pair's labels are flipped)")
    if label_smoothing and loss_type in ("ipo", "hinge"):
        raise ConfigError(f"DPO.label_smoothing={label_smoothing!r} with loss_type={loss_type!r}: only "
                          "'sigmoid' and 'robust' use it; set it to 0.0")
    require(rpo_alpha is None or rpo_alpha >= 0, "DPO.rpo_alpha", rpo_alpha,
            "must be >= 0 (the weight of the chosen responses' negative log-likelihood), or null for none")


def check_advantage_options(group_size: int, scale_rewards: str) -> None:
    """The options of GRPO that `group_advantages` takes."""
    require(group_size >= 2, "GRPO.group_size", group_size,
            "must be >= 2: advantages compare a completion with its siblings; use the seed's 4")
    require(scale_rewards in ADVANTAGE_SCALES, "GRPO.scale_rewards", scale_rewards, f"use one of {ADVANTAGE_SCALES}")


def check_grpo_loss_options(loss_type: str, clip_eps: float, kl_coef: float) -> None:
    """The options of GRPO that `grpo_loss` takes."""
    require(clip_eps > 0, "GRPO.clip_eps", clip_eps, "must be > 0; the seed's is 0.2")
    require(kl_coef >= 0, "GRPO.kl_coef", kl_coef, "must be >= 0; 0 drops the reference model")
    require(loss_type in GRPO_LOSS_TYPES, "GRPO.loss_type", loss_type, f"use one of {GRPO_LOSS_TYPES}")
