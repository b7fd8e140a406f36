"""GRPO's options under TRL's names: the old names refused with the new ones (in Python and in configs), and
the truncated importance weights of the engine/trainer mismatch applied to the loss."""

import math
from pathlib import Path

import pytest
import torch
import yaml

from astrai_pl.cli import lightning_main, main
from astrai_pl.model import ConfigError, ModelConfig
from astrai_pl.objectives import GRPO
from astrai_pl.objectives.evaluation import chat_prompts
from astrai_pl.objectives.losses import grpo_loss
from astrai_pl.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = Tokenizer.byte_level()


def varied(prompts, completions, completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


def grpo(**kw) -> GRPO:
    torch.manual_seed(0)
    kw.setdefault("arch", ModelConfig.from_name("debug"))
    return GRPO(tokenizer=TOKENIZER, max_completion_length=6, reward_funcs=[varied], beta=0.0, **kw)


def prompts(n=2) -> dict[str, list]:
    questions = [f"What is {i} + {i + 1}?" for i in range(n)]
    return {"prompt": questions, "prompt_ids": chat_prompts(questions, TOKENIZER)}


@pytest.mark.parametrize("old, new", [("kl_coef", "beta"), ("group_size", "num_generations"),
                                      ("clip_eps", "epsilon"),
                                      ("vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max")])
def test_old_names_are_refused_with_trls_name(old, new):
    with pytest.raises(ConfigError, match=rf"^{old} was renamed {new} \(TRL's name\); set model\.init_args\.{new}"):
        GRPO(arch=ModelConfig.from_name("debug"), **{old: 0.1})


def test_a_config_with_an_old_name_is_refused_with_the_mapping(tmp_path, capsys):
    config = yaml.safe_load((ROOT / "configs" / "grpo" / "debug.yaml").read_text())
    init = config["model"]["init_args"]
    init["kl_coef"] = init.pop("beta")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"kl_coef was renamed beta \(TRL's name\); set model\.init_args\.beta"):
        lightning_main(["fit", "--config", str(path)], run=False)
    shipped = str(ROOT / "configs" / "grpo" / "debug.yaml")
    with pytest.raises(SystemExit, match=r"astrai-pl: clip_eps was renamed epsilon"):
        main(["fit", "--config", shipped, "--model.init_args.clip_eps", "0.3", "--print_config"])


def test_trl_names_reach_the_loss(monkeypatch):
    seen = {}

    def spy(*args, **kwargs):
        seen.update(args=args[5:9], **kwargs)
        return grpo_loss(*args, **kwargs)

    monkeypatch.setattr("astrai_pl.objectives.grpo.grpo_loss", spy)
    module = grpo(epsilon=0.1, epsilon_high=0.28, loss_type="bnpo", num_generations=3)
    part = module.roll_out(prompts()).micro_batches[0]
    assert len(part["advantages"]) == 2 * 3
    module._shared_step(part, "train")
    assert seen["args"] == (0.1, 0.0, "bnpo", 6) and seen["epsilon_high"] == 0.28


def test_gspo_sapo_and_entropy_options_reach_the_loss(monkeypatch):
    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return grpo_loss(*args, **kwargs)

    monkeypatch.setattr("astrai_pl.objectives.grpo.grpo_loss", spy)
    module = grpo(loss_type="sapo", importance_sampling_level="sequence", sapo_temperature_pos=0.7,
                  sapo_temperature_neg=1.2)
    module._shared_step(module.roll_out(prompts()).micro_batches[0], "train")
    assert (seen["importance_sampling_level"], seen["sapo_temperature_pos"], seen["sapo_temperature_neg"],
            seen["entropies"], seen["entropy_coef"]) == ("sequence", 0.7, 1.2, None, 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_entropy_bonus_subtracts_the_policys_mean_entropy_over_completion_tokens(temperature):
    plain, bonus = grpo(temperature=temperature), grpo(temperature=temperature, entropy_coef=0.1)  # same weights
    part = plain.roll_out(prompts()).micro_batches[0]
    without, _ = plain._shared_step(part, "train")
    with_bonus, metrics = bonus._shared_step(part, "train")
    out = bonus.model(part["input_ids"])
    log_p = torch.log_softmax(getattr(out, "logits", out).float() / temperature, dim=-1)  # (B, T, V)
    entropy = -(log_p.exp() * log_p).sum(-1)  # (B, T)
    m = part["mask"]
    expected = (entropy * m).sum() / m.sum()
    torch.testing.assert_close(metrics["entropy"], expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(with_bonus, without - 0.1 * expected, rtol=1e-5, atol=1e-6)
    with_bonus.backward()
    assert all(p.grad is not None for p in bonus.model.parameters() if p.requires_grad)


def skewed(part, factor: float, cap: float):
    """The part with the engine's log-probs lowered by log(factor) on every other completion token, and the
    weights that should follow: min(exp(train − engine), cap)."""
    scored = part["scored"]
    every_other = scored * (torch.arange(scored.shape[1]) % 2 == 0)
    part = {**part, "rollout_logps": part["rollout_logps"] - math.log(factor) * every_other}
    return part, torch.where(every_other.bool(), min(factor, cap), 1.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_truncated_importance_weights_weigh_each_tokens_policy_loss(temperature):
    module = grpo(temperature=temperature, vllm_importance_sampling_clip_max=2.0)
    part = module.roll_out(prompts()).micro_batches[0]
    loss, metrics = module._shared_step({**part, "first_pass": True}, "train")
    # the engine and the trainer run the same weights: like compared with like (at T = 1), so w ≈ 1
    assert abs(float(metrics["sampling/importance_sampling_ratio/max"]) - 1) < 1e-4
    assert abs(float(metrics["sampling/importance_sampling_ratio/min"]) - 1) < 1e-4
    part, expected_w = skewed(part, 4.0, 2.0)
    loss, metrics = module._shared_step({**part, "first_pass": True}, "train")
    m, adv = part["mask"], part["advantages"][:, None]
    expected = -(expected_w * adv * m).sum() / part["num_items"]  # ρ = 1 on a first pass; dapo's divisor
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-4)
    assert float(metrics["sampling/importance_sampling_ratio/max"]) == pytest.approx(2.0)
    off = grpo(temperature=temperature, vllm_importance_sampling_correction=False)
    unweighted, _ = off._shared_step(part, "train")
    torch.testing.assert_close(unweighted, -(adv * m).sum() / part["num_items"], atol=1e-5, rtol=1e-5)


def test_later_passes_keep_the_weights_of_the_policy_that_sampled():
    module = grpo(temperature=0.7, num_iterations=2)
    part = module.roll_out(prompts()).micro_batches[0]
    assert "sampler_logps" in part  # scored at T = 1 when sampled: later passes cannot recompute it
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # an optimizer step later
    _, metrics = module._shared_step({**part, "first_pass": True}, "train")
    assert abs(float(metrics["sampling/importance_sampling_ratio/max"]) - 1) < 1e-4


def test_bad_importance_sampling_mode_names_the_field():
    with pytest.raises(ConfigError, match="GRPO.vllm_importance_sampling_mode='tis'"):
        grpo(vllm_importance_sampling_mode="tis")
