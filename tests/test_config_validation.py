"""Training settings no run can mean are refused before step 1, with the config field, the value and the fix:
accumulation below 1, a schedule outside its range, sequences longer than the model's positions, a tokenizer
with more ids than the embedding."""

import math
from pathlib import Path

import pytest
import torch
from fit_runs import quiet_trainer
from torch.utils.data import DataLoader

from astrai_pl.cli import lightning_main
from astrai_pl.data.rows import DataError
from astrai_pl.model import ConfigError, ModelConfig, Transformer
from astrai_pl.objectives import GRPO, Pretrain
from astrai_pl.objectives.schedules import WarmupCosine, WarmupStableDecay

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
         "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0", "--trainer.max_steps", "2"]


def shipped(config: str, tmp_path: Path, *overrides: str):
    """`astrai-pl fit --config configs/<config> <overrides>`, built but not run (at most 2 steps when fitted)."""
    args = ["--config", str(ROOT / "configs" / config), *QUIET, "--trainer.default_root_dir", str(tmp_path),
            *overrides]
    return lightning_main(args, run=False)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_not_stepped(trainer, model, before: dict[str, torch.Tensor]) -> None:
    assert trainer.global_step == 0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


# -- trainer.accumulate_grad_batches ---------------------------------------------------------------------
@pytest.mark.parametrize("k", [-1, 0])
def test_shipped_config_refuses_accumulation_below_one(k, tmp_path):
    cli = shipped("pretrain/debug.yaml", tmp_path, "--trainer.accumulate_grad_batches", str(k))
    before = weights(cli.model)
    with pytest.raises(ConfigError, match=rf"trainer\.accumulate_grad_batches={k}: must be a whole number >= 1.*"
                                          "set it to 1"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert_not_stepped(cli.trainer, cli.model, before)


def window_batches(n: int = 4) -> DataLoader:
    ids = torch.randint(3, 200, (n, 2, 16), generator=torch.Generator().manual_seed(0))
    return DataLoader([{"input_ids": x, "labels": x.clone()} for x in ids], batch_size=None)


@pytest.mark.parametrize("k", [-1, 0])
def test_hand_built_trainer_refuses_accumulation_below_one(k):
    model = Pretrain(ModelConfig.from_name("debug"))
    before = weights(model)
    trainer = quiet_trainer(max_steps=2, accumulate_grad_batches=k)
    with pytest.raises(ConfigError, match=rf"trainer\.accumulate_grad_batches={k}"):
        trainer.fit(model, train_dataloaders=window_batches())
    assert_not_stepped(trainer, model, before)


def test_accumulation_scale_never_divides_by_a_bad_accumulation():
    model = Pretrain(ModelConfig.from_name("debug"))
    model.trainer = quiet_trainer(accumulate_grad_batches=-1)
    with pytest.raises(ConfigError, match="accumulate_grad_batches=-1"):
        model.accumulation_scale({"window_tokens": 64}, torch.tensor(32))
    model.trainer.accumulate_grad_batches = 2
    assert model.accumulation_scale({"window_tokens": 64}, torch.tensor(32)) == 32


# -- schedules ----------------------------------------------------------------------------------------------
def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


@pytest.mark.parametrize("schedule", [WarmupCosine, WarmupStableDecay])
@pytest.mark.parametrize("field,value", [("min_lr_ratio", -3.0), ("min_lr_ratio", 1.5), ("min_lr_ratio", math.nan),
                                         ("max_steps", 0), ("warmup_steps", -1), ("warmup_steps", 20)])
def test_schedules_refuse_values_outside_their_range(schedule, field, value):
    settings = {"warmup_steps": 0, "max_steps": 10, "min_lr_ratio": 0.1, field: value}
    with pytest.raises(ConfigError, match=rf"{schedule.__name__}: model\.init_args\.scheduler\.init_args\.{field}="):
        schedule(optimizer(), **settings)


@pytest.mark.parametrize("schedule", [WarmupCosine, WarmupStableDecay])
def test_schedules_take_the_ends_of_their_ranges(schedule):
    for ratio in (0.0, 1.0):
        lr = schedule(optimizer(), warmup_steps=0, max_steps=10, min_lr_ratio=ratio)
        assert lr.factor(10) == pytest.approx(ratio)
    assert schedule(optimizer(), warmup_steps=10, max_steps=10).factor(9) == pytest.approx(10 / 11)


def test_shipped_config_refuses_a_negative_min_lr_ratio(tmp_path):
    cli = shipped("pretrain/debug.yaml", tmp_path, "--model.init_args.scheduler.init_args.min_lr_ratio", "-3")
    before = weights(cli.model)
    with pytest.raises(ConfigError, match=r"WarmupCosine: .*min_lr_ratio=-3\.0: must lie in \[0, 1\].*use e\.g\. 0\.1"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert_not_stepped(cli.trainer, cli.model, before)


# -- sequence length against the model's positions ----------------------------------------------------------
@pytest.mark.parametrize("config,field,positions", [
    ("pretrain/debug.yaml", "data.init_args.seq_len=64", 32),
    ("sft/debug.yaml", "data.init_args.max_seq_len=128", 64),
    ("dpo/debug.yaml", "data.init_args.max_seq_len=128", 64),
])
def test_sequences_longer_than_the_model_are_refused(config, field, positions, tmp_path):
    cli = shipped(config, tmp_path, "--model.init_args.arch.max_position_embeddings", str(positions))
    with pytest.raises(ConfigError, match=rf"{field}: longer than the {positions} positions of the model "
                                          rf"\(model\.init_args\.arch\.max_position_embeddings={positions}\)"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 0


def test_grpo_refuses_prompt_and_completion_longer_than_the_model(tmp_path):
    # configs/grpo/debug.yaml: prompts of up to 64 tokens, completions of up to 8
    cli = shipped("grpo/debug.yaml", tmp_path, "--model.init_args.arch.max_position_embeddings", "70")
    before = weights(cli.model)
    with pytest.raises(ConfigError, match=r"data\.init_args\.max_prompt_len \+ model\.init_args\."
                                          r"max_completion_length=72: longer than the 70 positions"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert_not_stepped(cli.trainer, cli.model, before)


def test_grpo_without_data_module_bounds_its_completions():
    model = GRPO(ModelConfig.from_name("debug", max_position_embeddings=32), max_completion_length=40, beta=0.0)
    with pytest.raises(ConfigError, match=r"model\.init_args\.max_completion_length=40: longer than the 32"):
        model.check_sequence_length(model.longest_sequence(None))


def test_init_from_model_positions_bound_the_data(tmp_path):
    small = Transformer(ModelConfig.from_name("debug", max_position_embeddings=32))
    small.save_pretrained(tmp_path / "hf")
    cli = shipped("pretrain/debug.yaml", tmp_path, "--model.init_args.init_from", str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match=r"data\.init_args\.seq_len=64: .*max_position_embeddings=32 of the model "
                                          r"in model\.init_args\.init_from="):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def test_scaled_rope_extends_the_positions():
    from astrai_pl.objectives.base import context_limit

    base = ModelConfig.from_name("debug", max_position_embeddings=32)
    linear = ModelConfig.from_name("debug", max_position_embeddings=32,
                                   rope_scaling={"rope_type": "linear", "factor": 4.0})
    dynamic = ModelConfig.from_name("debug", max_position_embeddings=32,
                                    rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert (context_limit(base), context_limit(linear), context_limit(dynamic)) == (32, 128, None)
    model = Pretrain(linear)
    model.check_sequence_length(("data.init_args.seq_len", 128))
    with pytest.raises(ConfigError, match="seq_len=129"):
        model.check_sequence_length(("data.init_args.seq_len", 129))


# -- vocabulary --------------------------------------------------------------------------------------------
def test_vocab_smaller_than_the_tokenizer_is_refused(tmp_path):
    cli = shipped("pretrain/debug.yaml", tmp_path, "--model.init_args.arch.vocab_size", "100")
    n = cli.datamodule.tokenizer.vocab_size
    # refused by the data module, before its corpus is tokenized (data/preflight.py check_model_fit)
    with pytest.raises(DataError, match=rf"'model\.init_args\.arch\.vocab_size': the tokenizer .* has {n} ids but "
                                        rf"the model's vocab_size is 100.*--model\.init_args\.arch\.vocab_size "
                                        rf"{-(-n // 64) * 64} \(at least {n}"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 0
