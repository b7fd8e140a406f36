"""The GRPO objective: rollouts on the live policy, the first pass, gradients, exact accumulation, errors."""

import pytest
import torch
from fit_runs import quiet_trainer

from astrai_pl.data import Arithmetic, GRPOData
from astrai_pl.data.synthetic import problems
from astrai_pl.inference import SamplingParams
from astrai_pl.model import ModelConfig
from astrai_pl.objectives import GRPO
from astrai_pl.objectives.evaluation import chat_prompts
from astrai_pl.objectives.logprobs import token_logprobs
from astrai_pl.objectives.rewards import RewardError
from astrai_pl.objectives.rollout import micro_batches, sample
from astrai_pl.tokenizer import Tokenizer

TOKENIZER = Tokenizer.byte_level()


def constant(prompts, completions, **kwargs):
    return [1.0] * len(completions)


def varied(prompts, completions, completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


def grpo(**kw) -> GRPO:
    torch.manual_seed(0)
    kw.setdefault("arch", ModelConfig.from_name("debug"))
    kw.setdefault("max_completion_length", 6)
    return GRPO(tokenizer=TOKENIZER, **kw)


def prompt_batch(n=3, seed=0) -> dict[str, list]:
    ps = problems(n, "train", seed)
    return {"prompt": [[{"role": "user", "content": p.question}] for p in ps], "answer": [p.answer for p in ps],
            "prompt_ids": chat_prompts([p.question for p in ps], TOKENIZER)}


def trainer(**kw):
    return quiet_trainer(devices=1, **kw)


def gap(module, part, temperature=1.0):
    with torch.no_grad():
        logps = token_logprobs(module.model, part["input_ids"], part["labels"], temperature=temperature)
    return float(((logps - part["rollout_logps"]).abs() * part["scored"]).max())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_log_probs_equal_the_training_forward(temperature):
    module = grpo(temperature=temperature, beta=0.0)
    rollout = module.roll_out(prompt_batch(), num_micro_batches=2)
    assert sum(len(p["advantages"]) for p in rollout.micro_batches) == 3 * 4
    for part in rollout.micro_batches:
        assert part["scored"].sum() > 0
        assert gap(module, part) < 1e-4  # the engine reports log-probs before temperature
        sampler = module._sampler_logps(part, module._logps(module.model, part))
        assert float(module._sampling_metrics(part, sampler, None)["logprob_gap"]) < 1e-4


def test_the_prefix_cache_is_emptied_between_rollouts_so_new_weights_are_used(monkeypatch):
    module, batch = grpo(beta=0.0), prompt_batch()
    module.roll_out(batch)  # caches the prompts' full pages
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    part = module.roll_out(batch).micro_batches[0]
    assert gap(module, part) < 1e-4
    monkeypatch.setattr(type(module._engine), "weights_changed", lambda self: 0)
    module.roll_out(batch)
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stale = module.roll_out(batch).micro_batches[0]  # would reuse K/V of the old weights
    assert gap(module, stale) > 1e-3


def test_first_pass_has_ratio_one_and_zero_kl_and_only_the_policy_gets_gradients():
    module = grpo(num_iterations=2, beta=0.1, reward_funcs=[varied])
    part = module.roll_out(prompt_batch()).micro_batches[0]
    assert not part["old_logps"].requires_grad and not part["ref_logps"].requires_grad
    logps = module._logps(module.model, part)
    mask = part["mask"]
    torch.testing.assert_close(part["old_logps"] * mask, logps.detach() * mask, atol=1e-6, rtol=0)  # ρ = 1
    loss, metrics = module._shared_step({**part, "first_pass": True}, "train")
    assert float(metrics["kl"]) < 1e-6 and float(metrics["clip_ratio"]) == 0.0
    expected = -(part["advantages"][:, None] * mask).sum() / mask.sum()  # −mean A over tokens when ρ = 1
    torch.testing.assert_close(metrics["policy_loss"], expected, atol=1e-6, rtol=0)
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in module.ref_model.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.model.parameters())


def test_equal_rewards_in_every_group_give_zero_advantages_and_no_policy_gradient():
    module = grpo(reward_funcs=[constant], beta=0.0)
    rollout = module.roll_out(prompt_batch())
    part = rollout.micro_batches[0]
    assert rollout.metrics["frac_reward_zero_std"] == 1.0 and rollout.metrics["reward_std"] == 0.0
    assert torch.equal(part["advantages"], torch.zeros_like(part["advantages"]))
    loss, _ = module._shared_step(part, "train")
    loss.backward()
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in module.model.parameters())


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo", "sapo"])
def test_micro_batch_gradients_add_up_to_the_whole_rollout_batch(loss_type):
    module = grpo(beta=0.0, loss_type=loss_type, temperature=1.5, max_completion_length=8,
                  epsilon_high=5.0 if loss_type == "cispo" else None).double()
    batch = prompt_batch(4)
    params = SamplingParams(max_tokens=8, temperature=1.5, n=4, logprobs=True, stop_token_ids=list(range(100, 200)))
    completions, _ = sample(module.rollout_engine(batch["prompt_ids"]), batch["prompt_ids"], params)
    advantages = torch.randn(len(completions), dtype=torch.float64)

    def grads(k):
        module.zero_grad()
        for part in micro_batches(batch["prompt_ids"], completions, advantages, k, 0, loss_type):
            part = {key: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for key, v in part.items()}
            (module._shared_step(part, "train")[0] / k).backward()  # as Lightning scales accumulated losses
        return torch.cat([p.grad.flatten() for p in module.model.parameters()])

    lengths = {len(c.token_ids) for c in completions}
    assert len(lengths) > 1  # uneven completion lengths: a mean of micro-batch means would differ
    torch.testing.assert_close(grads(3), grads(1), atol=1e-10, rtol=1e-7)


def test_fast_dev_run_on_the_synthetic_task_leaves_the_reference_untouched(tmp_path):
    data = GRPOData(synthetic=Arithmetic(train_rows=100, test_rows=10), batch_size=2, cache_dir=str(tmp_path))
    module = grpo(num_iterations=2, beta=0.05)
    reference = [p.detach().clone() for p in module.ref_model.parameters()]
    trainer(fast_dev_run=4, accumulate_grad_batches=2).fit(module, datamodule=data)
    assert len(module.reward_history) == 1  # 4 micro-steps = μ (2) · accumulation (2): one rollout
    assert all(torch.equal(a, b) and b.grad is None for a, b in zip(reference, module.ref_model.parameters()))
    assert module._engine.model is module.model  # the engine samples from the live policy


def test_a_run_without_reward_spread_warns_loudly(tmp_path):
    data = GRPOData(synthetic=Arithmetic(train_rows=100, test_rows=10), batch_size=2, cache_dir=str(tmp_path))
    module = grpo(reward_funcs=[constant], beta=0.0, zero_std_patience=2)
    with pytest.warns(UserWarning, match="NOTHING IS BEING LEARNED"):
        trainer(max_steps=2, limit_val_batches=0).fit(module, datamodule=data)


@pytest.mark.parametrize("field, value, message", [
    ("num_generations", 1, r"GRPO\.num_generations=1: must be >= 2"),
    ("temperature", 0.0, r"GRPO\.temperature=0\.0: must be > 0"),
    ("loss_type", "sum", r"GRPO\.loss_type='sum'"),
    ("scale_rewards", "std", r"GRPO\.scale_rewards='std'"),
    ("num_iterations", 0, r"GRPO\.num_iterations=0"),
])
def test_bad_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        grpo(**{field: value})


def raising(prompts, completions, answer, **kwargs):
    return [float(int(a) / 0) for a in answer]


def one_short(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)


@pytest.mark.parametrize("fn, message", [
    (raising, r"reward function 'raising' raised ZeroDivisionError"),
    (one_short, r"reward function 'one_short' returned 11 rewards for 12 completions"),
])
def test_a_failing_reward_function_stops_the_rollout_naming_it(fn, message):
    module = grpo(reward_funcs=[fn], beta=0.0)
    with pytest.raises(RewardError, match=message):
        module.roll_out(prompt_batch())


def test_too_few_completions_for_the_accumulation_is_an_error():
    with pytest.raises(ValueError, match="cannot fill 13 micro-batches"):
        grpo(beta=0.0).roll_out(prompt_batch(), num_micro_batches=13)


def test_sharding_strategies_are_refused_with_the_fix():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    module = grpo()
    module._trainer = SimpleNamespace(strategy=FSDPStrategy())  # FSDP1; fsdp2 runs (test_grpo_fsdp.py)
    with pytest.raises(ValueError, match="trainer.strategy: fsdp2"):
        module.configure_model()
    module._trainer = SimpleNamespace(strategy=DDPStrategy())  # whole model on every rank: allowed
    module.configure_model()
