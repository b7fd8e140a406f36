"""RLOO and Online DPO: rollouts on the live policy, their advantages and pairs, exact accumulation, a few
training steps on the debug preset, and their option errors."""

from pathlib import Path

import pytest
import torch
from fit_runs import quiet_trainer

from astrai_pl.callbacks.progress import ProgressLines, batch_tokens
from astrai_pl.cli import lightning_main
from astrai_pl.data import Arithmetic, GRPOData
from astrai_pl.data.synthetic import problems
from astrai_pl.model import ConfigError, ModelConfig
from astrai_pl.objectives import GRPO, RLOO, OnlineDPO
from astrai_pl.objectives.evaluation import chat_prompts
from astrai_pl.objectives.logprobs import sequence_logprobs, token_logprobs
from astrai_pl.objectives.on_policy_losses import rloo_advantages
from astrai_pl.tokenizer import Tokenizer

TOKENIZER = Tokenizer.byte_level()


def varied(prompts, completions, completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


def build(cls, **kw):
    torch.manual_seed(0)
    kw.setdefault("arch", ModelConfig.from_name("debug"))
    return cls(tokenizer=TOKENIZER, **kw)


def prompt_batch(n=3, seed=0) -> dict[str, list]:
    ps = problems(n, "train", seed)
    return {"prompt": [[{"role": "user", "content": p.question}] for p in ps], "answer": [p.answer for p in ps],
            "prompt_ids": chat_prompts([p.question for p in ps], TOKENIZER)}


def data(tmp_path):
    return GRPOData(synthetic=Arithmetic(train_rows=100, test_rows=10), batch_size=2, cache_dir=str(tmp_path))


# -- RLOO ----------------------------------------------------------------------------------------------------
def test_rloo_advantages_are_leave_one_out_of_the_kl_penalised_rewards():
    module = build(RLOO, reward_funcs=[varied], num_generations=3, beta=0.5, max_completion_length=6)
    with torch.no_grad():  # a reference that differs from the policy: a KL to put in the rewards
        for p in module.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    part = module.roll_out(prompt_batch()).micro_batches[0]
    mask = part["mask"]
    with torch.no_grad():
        policy = sequence_logprobs(token_logprobs(module.model, part["input_ids"], part["labels"]), mask)
        ref = sequence_logprobs(token_logprobs(module.ref_model, part["input_ids"], part["labels"]), mask)
    completions = [[int(t) for t, m in zip(ids[1:], row) if m] for ids, row in zip(part["input_ids"], mask)]
    rewards = torch.tensor([float(sum(c) % 5) for c in completions]) - 0.5 * (policy - ref)
    assert (policy - ref).abs().max() > 1e-3
    torch.testing.assert_close(part["advantages"], rloo_advantages(rewards, 3), atol=1e-5, rtol=0)


def test_rloo_first_pass_is_reinforce_and_only_the_policy_gets_gradients():
    module = build(RLOO, reward_funcs=[varied], num_generations=2, max_completion_length=6)
    part = module.roll_out(prompt_batch()).micro_batches[0]
    loss, metrics = module._shared_step(part, "train")
    torch.testing.assert_close(loss, -part["advantages"].mean(), atol=1e-6, rtol=0)  # ρ = 1
    assert float(metrics["clip_ratio/region_mean"]) == 0.0
    loss.backward()
    assert all(p.grad is None for p in module.ref_model.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.model.parameters())


def test_rloo_micro_batch_gradients_add_up_to_the_whole_rollout():
    module = build(RLOO, reward_funcs=[varied], num_generations=4, beta=0.0, max_completion_length=6,
                   num_iterations=2).double()
    batch = prompt_batch(3)

    def grads(k):
        torch.manual_seed(1)  # the same completions both times
        module.zero_grad()
        module._engine = None
        for part in module.roll_out(batch, k).micro_batches:
            (module._shared_step(part, "train")[0] / k).backward()  # as Lightning scales accumulated losses
        return [p.grad.clone() for p in module.model.parameters()]

    for whole, split in zip(grads(1), grads(3)):
        torch.testing.assert_close(whole, split, rtol=1e-9, atol=1e-12)


def test_rloo_trains_a_few_steps_on_the_debug_preset(tmp_path):
    module = build(RLOO, num_iterations=2, beta=0.05, max_completion_length=6)
    reference = [p.detach().clone() for p in module.ref_model.parameters()]
    before = [p.detach().clone() for p in module.model.parameters()]
    quiet_trainer(devices=1, fast_dev_run=4, accumulate_grad_batches=2).fit(module, datamodule=data(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(reference, module.ref_model.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters()))
    assert module._engine.model is module.model  # the engine samples from the live policy


# -- Online DPO ----------------------------------------------------------------------------------------------
def test_online_dpo_pairs_the_better_completion_and_its_loss_is_dpos():
    module = build(OnlineDPO, reward_funcs=[varied], max_new_tokens=6, beta=0.2)
    torch.manual_seed(3)
    pairs = module.sample_pairs(prompt_batch(4))
    rewards, chosen, rejected = pairs["rewards"], pairs["chosen"], pairs["rejected"]
    assert len(chosen) == 4 and (chosen // 2 == torch.arange(4)).all() and (rejected // 2 == torch.arange(4)).all()
    assert (rewards[chosen] >= rewards[rejected]).all()
    ids = [[int(t) for t, m in zip(row[1:], mask) if m] for row, mask in zip(pairs["input_ids"], pairs["mask"])]
    torch.testing.assert_close(rewards, torch.tensor([float(sum(c) % 5) for c in ids]))
    # at the start the policy is the reference: h = 0 and the sigmoid loss is log 2
    torch.manual_seed(3)
    loss, metrics = module._shared_step(prompt_batch(4), "train")
    assert loss.item() == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)
    assert metrics["objective/scores_margin"].item() >= 0


def test_missing_eos_penalty_lowers_the_reward_of_cut_completions():
    module = build(OnlineDPO, reward_funcs=[varied], max_new_tokens=3, missing_eos_penalty=10.0)
    torch.manual_seed(3)
    penalised = module.sample_pairs(prompt_batch(2))
    module.hparams.missing_eos_penalty = None
    torch.manual_seed(3)
    plain = module.sample_pairs(prompt_batch(2))
    assert torch.equal(penalised["input_ids"], plain["input_ids"])
    cut = plain["sampling"]["contain_eos_token"] < 1.0
    assert cut and (penalised["rewards"] < plain["rewards"]).any()
    torch.testing.assert_close(plain["rewards"] - penalised["rewards"],
                               10.0 * (plain["rewards"] != penalised["rewards"]).float())


def test_online_dpo_trains_a_few_steps_on_the_debug_preset(tmp_path):
    module = build(OnlineDPO, max_new_tokens=6)
    before = [p.detach().clone() for p in module.model.parameters()]
    trained, sample_pairs = [], module.sample_pairs

    def recorded(batch):  # the real tokens of each micro-batch's sampled pairs
        pairs = sample_pairs(batch)
        trained.append(int(batch_tokens(pairs, module.model.config.pad_token_id)))
        return pairs

    module.sample_pairs = recorded
    progress = ProgressLines(name="online_dpo", every_fraction=1.0, every_seconds=None)
    quiet_trainer(devices=1, max_steps=2, limit_val_batches=0, accumulate_grad_batches=2,
                  callbacks=[progress]).fit(module, datamodule=data(tmp_path))
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before, module.ref_model.parameters()))
    assert len(trained) == 4 and progress.summary.tokens == sum(trained) > 0  # its tokens/s counts what it trained on


@pytest.mark.slow  # a data module and a Trainer from the shipped config: ~10 s
@pytest.mark.parametrize("config", ["rloo/debug.yaml", "online_dpo/debug.yaml"])
def test_the_shipped_debug_config_trains(tmp_path, config):
    """The config as shipped, on fewer rows, for 2 optimizer steps (4 micro-batches)."""
    path = Path(__file__).resolve().parents[2] / "configs" / config
    cli = lightning_main(["--config", str(path), "--trainer.logger", "false", "--trainer.callbacks", "[]",
                          "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
                          "--trainer.limit_val_batches", "0", "--trainer.max_steps", "2",
                          "--trainer.default_root_dir", str(tmp_path), "--data.init_args.cache_dir", str(tmp_path),
                          "--data.init_args.synthetic.train_rows", "64"], run=False)
    before = [p.detach().clone() for p in cli.model.model.parameters()]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, cli.model.model.parameters()))


@pytest.mark.parametrize("cls, field, value, message", [
    (RLOO, "num_generations", 1, r"RLOO\.num_generations=1: must be >= 2"),
    (RLOO, "beta", -1.0, r"RLOO\.beta=-1\.0"),
    (OnlineDPO, "loss_type", "hinge", r"OnlineDPO\.loss_type='hinge'"),
    (OnlineDPO, "temperature", 0.0, r"OnlineDPO\.temperature=0\.0"),
])
def test_bad_options_are_config_errors_naming_them(cls, field, value, message):
    with pytest.raises(ConfigError, match=message):
        build(cls, **{field: value})


def test_batches_without_prompts_are_refused_with_the_data_module_to_use():
    module = build(OnlineDPO)
    with pytest.raises(ValueError, match="GRPOData"):
        module.sample_pairs({"input_ids": [[1, 2]]})


@pytest.mark.parametrize("cls", [RLOO, OnlineDPO, GRPO])
def test_train_mode_leaves_the_frozen_reference_in_eval_mode(cls):
    module = build(cls, **({} if cls is OnlineDPO else {"beta": 0.1})).eval()
    assert module.train() is module
    assert module.model.training and not module.ref_model.training
    assert all(not p.requires_grad for p in module.ref_model.parameters())
