"""The checks of the objectives' own options: each option is checked here once, by the objective's constructor
and by the loss function that takes it, and a value it cannot take is a ConfigError naming the option, the
value and the fix."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ..model.config import ConfigError
from ..parallel import check_fp8_recipe

DPO_LOSS_TYPES = ("sigmoid", "robust", "ipo", "hinge", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
DPO_SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")  # the loss types that use label_smoothing
ADVANTAGE_SCALES = ("group", "batch", "none")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def require(ok: bool, option: str, value: Any, why: str) -> None:
    """ConfigError "option=value: why" unless `ok`."""
    if not ok:
        raise ConfigError(f"{option}={value!r}: {why}")


def check_label_smoothing(objective: str, label_smoothing: float) -> None:
    """ε of a smoothed cross-entropy: in [0, 1)."""
    require(0.0 <= label_smoothing < 1.0, f"{objective}.label_smoothing", label_smoothing, "must lie in [0, 1)")


def check_fp8_options(fp8: str | None, lora: Any, quantize: str | None) -> None:
    """The fp8 option of every objective: a known recipe, and not over a frozen base (lora, quantize)."""
    check_fp8_recipe(fp8)
    if fp8 is not None and (lora is not None or quantize is not None):
        raise ConfigError(f"fp8={fp8!r} with {'quantize' if quantize else 'lora'}: FP8 trains the full linear "
                          "weights, while LoRA freezes them (and NF4 stores them in 4 bits); drop one of them")


def check_dpo_options(beta: float, loss_type: str | Sequence[str], label_smoothing: float,
                      rpo_alpha: float | None = None, loss_weights: Sequence[float] | None = None,
                      discopop_tau: float = 0.05) -> None:
    """The options of DPO and `dpo_loss`; `loss_type` is one name or a list of them (TRL's combination)."""
    require(beta > 0, "DPO.beta", beta, "must be > 0 (the inverse temperature of the implicit reward; smaller "
            "keeps the policy nearer the reference); TRL's default is 0.1")
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    require(len(types) >= 1, "DPO.loss_type", loss_type, "name at least one loss type")
    for name in types:
        if name == "aot_pair":
            raise ConfigError("DPO.loss_type='aot_pair' is TRL's 'aot_unpaired' (sorted chosen log-ratios against "
                              "sorted rejected ones); set loss_type: aot_unpaired")
        require(name in DPO_LOSS_TYPES, "DPO.loss_type", name, f"unknown; use one of {', '.join(DPO_LOSS_TYPES)}")
    require(len(set(types)) == len(types), "DPO.loss_type", loss_type, "names a loss type twice; list each once")
    require(loss_weights is None or len(loss_weights) == len(types), "DPO.loss_weights", loss_weights,
            f"needs one weight per loss type ({len(types)}), or null for 1.0 each")
    require(0.0 <= label_smoothing < 0.5, "DPO.label_smoothing", label_smoothing,
            "must lie in [0, 0.5) (the probability that a pair's labels are flipped)")
    if label_smoothing and not set(types) & set(DPO_SMOOTHED):
        raise ConfigError(f"DPO.label_smoothing={label_smoothing!r} with loss_type={loss_type!r}: only "
                          f"{', '.join(DPO_SMOOTHED)} use it; set it to 0.0")
    require(label_smoothing > 0 or "exo_pair" not in types, "DPO.label_smoothing", label_smoothing,
            "must be > 0 with loss_type exo_pair (its target distribution is (1 − ε, ε)); the EXO paper uses 1e-3")
    require(discopop_tau > 0, "DPO.discopop_tau", discopop_tau, "must be > 0 (the paper and TRL use 0.05)")
    require(rpo_alpha is None or rpo_alpha >= 0, "DPO.rpo_alpha", rpo_alpha,
            "must be >= 0 (the weight of the chosen responses' negative log-likelihood), or null for none")


def check_advantage_options(group_size: int, scale_rewards: str) -> None:
    """The options of GRPO that `group_advantages` takes."""
    require(group_size >= 2, "GRPO.num_generations", group_size,
            "must be >= 2: advantages compare a completion with its siblings; use the seed's 4")
    require(scale_rewards in ADVANTAGE_SCALES, "GRPO.scale_rewards", scale_rewards, f"use one of {ADVANTAGE_SCALES}")


def check_grpo_loss_options(loss_type: str, epsilon: float, beta: float, epsilon_high: float | None = None,
                            importance_sampling_level: str = "token",
                            sapo_temperatures: tuple[float, float] = (1.0, 1.05), entropy_coef: float = 0.0) -> None:
    """The options of GRPO that `grpo_loss` takes."""
    require(epsilon > 0, "GRPO.epsilon", epsilon, "must be > 0; TRL's default is 0.2")
    require(epsilon_high is None or epsilon_high > 0, "GRPO.epsilon_high", epsilon_high,
            "must be > 0 (DAPO's clip-higher uses 0.28), or null for epsilon's value")
    require(beta >= 0, "GRPO.beta", beta, "must be >= 0; 0 drops the reference model")
    if loss_type == "token":
        raise ConfigError("GRPO.loss_type='token' was renamed 'dapo' (TRL's name for the mean over every "
                          "completion token of the step); set model.init_args.loss_type: dapo")
    require(loss_type in GRPO_LOSS_TYPES, "GRPO.loss_type", loss_type, f"use one of {GRPO_LOSS_TYPES}")
    require(loss_type != "cispo" or epsilon_high is not None, "GRPO.epsilon_high", epsilon_high,
            "loss_type cispo caps the ratio at epsilon_high itself (ScaleRL's ε_max): set it, e.g. 5.0")
    require(importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, "GRPO.importance_sampling_level",
            importance_sampling_level, f"use one of {IMPORTANCE_SAMPLING_LEVELS} ('sequence' is GSPO)")
    for name, tau in zip(("sapo_temperature_pos", "sapo_temperature_neg"), sapo_temperatures):
        require(tau > 0, f"GRPO.{name}", tau, "must be > 0 (TRL's defaults are 1.0 and 1.05)")
    require(entropy_coef >= 0, "GRPO.entropy_coef", entropy_coef, "must be >= 0 (the weight of the entropy "
            "bonus); 0 = off")


def check_importance_sampling_options(mode: str, clip_max: float | None, clip_min: float | None) -> None:
    """The options of GRPO's rollout importance sampling (`rollout_importance_weights`)."""
    require(mode in IMPORTANCE_SAMPLING_MODES, "GRPO.vllm_importance_sampling_mode", mode,
            f"use one of {IMPORTANCE_SAMPLING_MODES}")
    require(clip_max is None or clip_max > 0, "GRPO.vllm_importance_sampling_clip_max", clip_max,
            "must be > 0 (TRL's default is 3.0), or null for no upper bound")
    require(clip_min is None or clip_min >= 0, "GRPO.vllm_importance_sampling_clip_min", clip_min,
            "must be >= 0, or null for no lower bound")
    if clip_max is not None and clip_min is not None and clip_min > clip_max:
        raise ConfigError(f"GRPO.vllm_importance_sampling_clip_min={clip_min!r} is above "
                          f"vllm_importance_sampling_clip_max={clip_max!r}; the lower bound must not exceed the upper")


# Options that took TRL's names, per objective: a config or call with an old name is refused with the new one.
RENAMED_OPTIONS = {"GRPO": {"kl_coef": "beta", "group_size": "num_generations", "clip_eps": "epsilon",
                            "vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max"}}


def renamed_message(objective: str, option: str) -> str | None:
    """What to write instead of a renamed option of `objective`, or None when `option` was not renamed."""
    new = RENAMED_OPTIONS.get(objective, {}).get(option)
    if new is None:
        return None
    return f"{option} was renamed {new} (TRL's name); set model.init_args.{new} ({objective}.{new} in Python)"


def refuse_renamed(objective: str, options: dict[str, Any]) -> None:
    """A ConfigError for the first option of `options` that `objective` renamed, naming the new name."""
    for option in options:
        if (message := renamed_message(objective, option)) is not None:
            raise ConfigError(message)


_NOT_ACCEPTED = re.compile(r"class_path '(?:[\w.]+\.)?(\w+)'.*?Option '(\w+)' is not accepted", re.S)


def renamed_in_parse_error(message: str) -> str | None:
    """The renamed-option message for a config parser's "Option 'kl_coef' is not accepted", else None."""
    found = _NOT_ACCEPTED.search(message)
    return renamed_message(*found.groups()) if found else None


KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def check_kto_options(beta: float, desirable_weight: float, undesirable_weight: float, loss_type: str) -> None:
    """The options of KTO and `kto_loss`."""
    require(beta > 0, "KTO.beta", beta, "must be > 0 (the scale of the implied reward); TRL's default is 0.1")
    require(desirable_weight > 0, "KTO.desirable_weight", desirable_weight,
            "must be > 0 (the weight of the desirable examples' losses); 1.0 weighs both kinds alike")
    require(undesirable_weight > 0, "KTO.undesirable_weight", undesirable_weight,
            "must be > 0 (the weight of the undesirable examples' losses); 1.0 weighs both kinds alike")
    require(loss_type in KTO_LOSS_TYPES, "KTO.loss_type", loss_type, f"use one of {', '.join(KTO_LOSS_TYPES)}")


def check_orpo_options(beta: float) -> None:
    """The option of ORPO and `orpo_loss`."""
    require(beta > 0, "ORPO.beta", beta, "must be > 0 (λ, the weight of the odds-ratio term); TRL's default is 0.1")


def check_simpo_options(beta: float, gamma: float, label_smoothing: float) -> None:
    """The options of SimPO and `simpo_loss`."""
    require(beta > 0, "SimPO.beta", beta, "must be > 0 (the scale of the length-normalised reward); the paper "
            "uses 2.0 to 2.5, TRL's CPO default is 0.1")
    require(gamma >= 0, "SimPO.gamma", gamma, "must be >= 0 (the target reward margin); 0 drops the margin")
    require(0.0 <= label_smoothing < 0.5, "SimPO.label_smoothing", label_smoothing,
            "must lie in [0, 0.5) (the probability that a pair's labels are flipped)")


def check_reward_options(center_rewards_coefficient: float | None) -> None:
    """The option of RewardModel and `bradley_terry_loss`."""
    require(center_rewards_coefficient is None or center_rewards_coefficient >= 0,
            "RewardModel.center_rewards_coefficient", center_rewards_coefficient,
            "must be >= 0 (the weight of the mean squared summed reward of a pair), or null for none; "
            "the paper of Eisenstein et al. (2023) uses 0.01")
