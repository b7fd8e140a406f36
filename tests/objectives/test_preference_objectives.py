"""KTO, ORPO, SimPO and RewardModel: their shipped debug configs train through the CLI path and lower the loss;
KTO's reference and batches; the reward model's Hugging Face export scores as the model does."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai_pl.checkpoint import CheckpointError
from astrai_pl.cli import lightning_main
from astrai_pl.data import Arithmetic, DPOData, KTOData
from astrai_pl.model import ModelConfig
from astrai_pl.model.config import ConfigError
from astrai_pl.objectives import KTO, RewardModel
from astrai_pl.objectives.reward import last_scored_positions

ROOT = Path(__file__).resolve().parents[2]
OBJECTIVES = ["kto", "orpo", "simpo", "reward"]
ARCH = ModelConfig.from_name("debug", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
SMALL = Arithmetic(train_rows=16, test_rows=4)


def debug_cli(name, tmp_path, *overrides):
    """`astrai-pl fit --config configs/<name>/debug.yaml` on 16 rows, without validation, built but not run."""
    args = ["--config", str(ROOT / "configs" / name / "debug.yaml"), "--trainer.logger", "false",
            "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0",
            "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path),
            "--data.init_args.cache_dir", str(tmp_path), "--data.init_args.synthetic.train_rows", "16",
            "--data.init_args.synthetic.test_rows", "4", *overrides]
    return lightning_main(args, run=False)


def fixed_batch_loss(module, batch):
    module.eval()
    with torch.no_grad():
        loss, _ = module._shared_step(batch, "val")
    module.train()
    return float(loss)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_the_debug_config_trains_and_lowers_the_loss(name, tmp_path):
    torch.manual_seed(0)
    cli = debug_cli(name, tmp_path, "--trainer.max_steps", "4", "--trainer.accumulate_grad_batches", "1")
    data = cli.datamodule
    data.setup("fit")
    batch = next(iter(data._loader(data.train_set)))
    before = fixed_batch_loss(cli.model, batch)
    cli.trainer.fit(cli.model, datamodule=data)
    assert cli.trainer.global_step == 4
    after = fixed_batch_loss(cli.model, batch)
    assert after < before, (before, after)


@pytest.mark.slow
@pytest.mark.parametrize("name", OBJECTIVES)
def test_fit_runs_from_the_command_line(name, tmp_path):
    cmd = [sys.executable, "-m", "astrai_pl.cli", "fit", "--config", str(ROOT / "configs" / name / "debug.yaml"),
           "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2",
           "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false", "--trainer.callbacks", "[]",
           "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
           "--data.init_args.cache_dir", str(tmp_path), "--data.init_args.synthetic.train_rows", "64"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max_steps=2" in result.stdout + result.stderr


# -- KTO ----------------------------------------------------------------------------------------------------


def kto(seed=0, **kw):
    torch.manual_seed(seed)
    return KTO(arch=ARCH, **kw)


def test_kto_reference_is_frozen_outside_the_module_and_the_first_loss_is_that_of_equal_policies(tmp_path):
    data = KTOData(synthetic=SMALL, max_seq_len=64, batch_size=4, cache_dir=str(tmp_path))
    data.setup()
    batch = next(iter(data.val_dataloader()))
    module = kto(desirable_weight=1.0, undesirable_weight=1.0)
    assert not any(k.startswith("reference") for k in module.state_dict())
    assert all(not p.requires_grad for p in module.reference.parameters())
    loss, metrics = module._shared_step(batch, "val")
    assert float(loss.detach()) == pytest.approx(0.5, abs=1e-6)  # r = z0 = 0 everywhere: 1 - σ(0)
    assert float(metrics["kl"]) == 0.0
    module.model.lm_head.weight.data.add_(0.1)  # policy != reference
    tagged, _ = module._shared_step({**batch, "window_examples": 3 * len(batch["label"])}, "train")
    alone, _ = module._shared_step(batch, "train")
    torch.testing.assert_close(tagged, alone / 3)  # K = 1: this batch is a third of its window


def test_kto_checkpoints_leave_the_reference_out_and_refuse_another_one():
    module = kto()
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    assert not any(k.startswith("reference") for k in checkpoint["state_dict"])
    kto(seed=0).on_load_checkpoint(checkpoint)  # the same initialisation: the same reference
    with pytest.raises(CheckpointError, match="not the one this run trained against"):
        kto(seed=1).on_load_checkpoint(checkpoint)


def test_kto_refuses_batches_of_one(tmp_path):
    cli = debug_cli("kto", tmp_path, "--data.init_args.batch_size", "1")
    with pytest.raises(ConfigError, match="batch_size=1"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def test_kto_bad_options_fail_at_construction():
    with pytest.raises(ConfigError, match="KTO.undesirable_weight"):
        kto(undesirable_weight=0.0)


# -- the reward model -------------------------------------------------------------------------------------


def test_the_score_is_read_at_the_last_scored_token():
    labels = torch.tensor([[-100, 5, 6, -100, -100], [-100, -100, 7, 8, 9]])
    assert last_scored_positions(labels).tolist() == [2, 4]


def test_reward_model_exports_a_sequence_classifier_that_transformers_scores_alike(tmp_path):
    transformers = pytest.importorskip("transformers")
    data = DPOData(synthetic=SMALL, max_seq_len=64, batch_size=4, cache_dir=str(tmp_path))
    data.setup()
    batch = next(iter(data.val_dataloader()))
    torch.manual_seed(0)
    module = RewardModel(arch=ARCH, tokenizer=data.tokenizer).eval()
    module.model.lm_head.weight.data.normal_(0, 1.0)  # scores visibly apart
    with torch.no_grad():
        chosen, rejected = module.scores(batch)
    module.save_pretrained(tmp_path / "rm")
    hf, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "rm", output_loading_info=True, dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    assert not info["missing_keys"] and not info["unexpected_keys"]
    pad = data.tokenizer.pad_token_id
    for side, ours in (("chosen", chosen), ("rejected", rejected)):
        ids = batch[f"{side}_input_ids"]
        with torch.no_grad():
            theirs = hf(input_ids=ids, attention_mask=(ids != pad).long()).logits.squeeze(-1)
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(chosen, rejected)


def test_reward_model_refuses_callbacks_that_need_a_language_model_head(tmp_path):
    from astrai_pl.callbacks import HFExport

    cli = debug_cli("reward", tmp_path)
    cli.trainer.callbacks.append(HFExport(dirpath=str(tmp_path / "hf")))
    with pytest.raises(ConfigError, match=r"\['HFExport'\].*RewardModel.save_pretrained"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
