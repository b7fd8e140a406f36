"""The shipped RWKV configs run through `astrai-pl fit` for two steps with tiny overrides (pretrain, then SFT
from its checkpoint as the shipped SFT starts from the pretrain's; DPO and GRPO at debug size), and bf16-mixed
trains an RWKV model close to fp32 with its decay and bonus, and the recurrence, in float32."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from fit_runs import quiet_trainer, write_corpus

from astrai_pl.cli import lightning_main
from astrai_pl.model import ModelConfig
from astrai_pl.model import rwkv as rwkv_module
from astrai_pl.objectives import Pretrain

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--trainer.limit_val_batches", "0", "--trainer.max_steps", "2",
         "--trainer.accumulate_grad_batches", "1"]
SMALL_TASK = ["--data.init_args.synthetic.train_rows", "64", "--data.init_args.synthetic.test_rows", "8"]


def fit_shipped(config: str, tmp_path: Path, *overrides: str, moves: bool = True):
    """`astrai-pl fit --config configs/<config> <overrides>` for two steps; checks the run trained an RWKV
    model (and that its weights moved, unless `moves` is False)."""
    cli = lightning_main(["--config", str(ROOT / "configs" / config), *QUIET, "--trainer.default_root_dir",
                          str(tmp_path / "run"), *overrides], run=False)
    model = cli.model.model
    assert model.config.mixer == "rwkv" and type(model.layers[0]).__name__ == "RwkvBlock"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    assert math.isfinite(float(cli.trainer.callback_metrics["train/loss"]))
    assert not moves or any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    return cli, before


@pytest.mark.slow
def test_rwkv_tiny_pretrain_then_sft_from_its_checkpoint(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    pre, _ = fit_shipped("pretrain/rwkv-tiny.yaml", tmp_path / "pre", "--data.init_args.path", str(corpus),
                         "--data.init_args.seq_len", "32", "--data.init_args.batch_size", "2")
    assert pre.model.model.config == ModelConfig.from_name("rwkv-tiny")
    pre.trainer.save_checkpoint(tmp_path / "pre.ckpt")
    sft, start = fit_shipped("sft/rwkv-tiny.yaml", tmp_path / "sft", "--model.init_args.init_from",
                             str(tmp_path / "pre.ckpt"), *SMALL_TASK, "--data.init_args.max_seq_len", "64",
                             "--data.init_args.batch_size", "2")
    pretrained = pre.model.model.state_dict()
    assert all(torch.equal(start[k], pretrained[k]) for k in pretrained)  # SFT began where pretraining ended


def test_rwkv_debug_dpo(tmp_path):
    cli, _ = fit_shipped("dpo/rwkv-debug.yaml", tmp_path, *SMALL_TASK, "--data.init_args.batch_size", "2")
    assert cli.model.model.config == ModelConfig.from_name("rwkv-debug")


def test_rwkv_debug_grpo(tmp_path):
    cli, _ = fit_shipped("grpo/rwkv-debug.yaml", tmp_path, *SMALL_TASK, "--data.init_args.batch_size", "2",
                         "--model.init_args.num_generations", "2",
                         "--model.init_args.max_completion_length", "4",
                         moves=False)  # random weights: rewards may not vary within a group, so no update
    assert cli.model.model.config == ModelConfig.from_name("rwkv-debug")
    assert len(cli.model.reward_history) >= 1  # rollouts decoded on the RWKV policy and were scored
    assert "train/reward" in cli.trainer.callback_metrics


# -- bf16-mixed ---------------------------------------------------------------------------------------------
class _Batches(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(3, 320, (2, 4, 32), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_bf16_mixed_trains_rwkv_close_to_fp32_with_the_recurrence_in_float32(monkeypatch):
    seen = []
    recurrence = rwkv_module.wkv

    def recorded(w, u, k, v, *args, **kwargs):
        out, state = recurrence(w, u, k, v, *args, **kwargs)
        seen.append((torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None, w.dtype,
                     u.dtype, state[0].dtype))
        return out, state

    monkeypatch.setattr(rwkv_module, "wkv", recorded)
    losses, grads = {}, {}
    for precision in ("32-true", "bf16-mixed"):
        torch.manual_seed(0)
        module = Pretrain(arch=ModelConfig.from_name("rwkv-debug"))
        loader = torch.utils.data.DataLoader(_Batches(), batch_size=None)
        trainer = quiet_trainer(devices=1, max_steps=2, precision=precision, gradient_clip_val=None)
        seen.clear()
        trainer.fit(module, train_dataloaders=loader)
        losses[precision] = float(trainer.callback_metrics["train/loss"])
        block = module.model.layers[0].attention
        assert block.time_decay.dtype == block.time_first.dtype == torch.float32  # the weights stay fp32
        grads[precision] = torch.cat([block.time_decay.grad, block.time_first.grad])
        assert seen and all(w == u == s == torch.float32 for _, w, u, s in seen)
        if precision == "bf16-mixed":
            assert {autocast for autocast, *_ in seen} == {torch.bfloat16}  # it did run under autocast
    assert math.isfinite(losses["bf16-mixed"])
    assert losses["bf16-mixed"] == pytest.approx(losses["32-true"], rel=2e-2)
    assert torch.isfinite(grads["bf16-mixed"]).all()
    cosine = torch.nn.functional.cosine_similarity(grads["bf16-mixed"], grads["32-true"], dim=0)
    assert cosine > 0.95, cosine
