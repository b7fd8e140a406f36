"""LoRA under DDP and FSDP2 on two CPU processes (gloo) against the one-process run: the frozen base stays bit for
bit what init_from holds on every rank, both ranks hold the same adapter, and it is the one-process run's. FSDP2
resumes a LoRA run from its adapter-only checkpoints, sharded and full, bit for bit (fast on one rank in this
process, and on two), and refuses one that lacks a trained weight. Tensor parallelism with LoRA is refused by
name."""

from __future__ import annotations

import math
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from fit_runs import finish, launch, mean_losses, quiet_trainer, write_corpus
from lora_runs import LORA, base_weights, gathered_weights, lora_debug_config, rank_weights, save_base

from astrai_pl.checkpoint import CheckpointError
from astrai_pl.checkpoint.sharded import read_dcp_metadata
from astrai_pl.data import Arithmetic, DPOData
from astrai_pl.model import ConfigError, LoraConfig, ModelConfig, Transformer
from astrai_pl.model.lora import apply_lora
from astrai_pl.objectives import DPO, Pretrain
from astrai_pl.parallel import configure_model
from astrai_pl.strategy import FSDP2Strategy

PROBES = [{"class_path": "fit_runs.MeanLoss"}, {"class_path": "lora_runs.RankWeights"}]
FULL_FILES = {"class_path": "astrai_pl.strategy.FSDP2Strategy", "init_args": {"save_distributed_checkpoint": False}}


def test_tensor_parallel_with_lora_is_refused_naming_both_options():
    model = Transformer(ModelConfig.from_name("debug"))
    apply_lora(model, LoraConfig(r=4, target_modules="all-linear"))
    strategy = FSDP2Strategy(tensor_parallel_size=2)
    strategy._device_mesh = {"tensor_parallel": SimpleNamespace(size=lambda: 2), "data_parallel": None}
    with pytest.raises(ConfigError, match=r"model\.init_args\.lora with FSDP2Strategy\.tensor_parallel_size=2.*"
                                          r"use tensor_parallel_size=1"):
        configure_model(model, strategy)
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())  # refused before any layout


SETTINGS = {
    "single": dict(batch_size=8),
    "ddp": dict(batch_size=4, strategy="ddp", devices=2),
    "sharded": dict(batch_size=4, strategy="fsdp2", devices=2, save_top_k=-1),
    "full": dict(batch_size=4, strategy=FULL_FILES, devices=2, save_top_k=-1),
}


# -- one rank in this process (a one-rank gloo group): fast ------------------------------------------------
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    yield save_base(tmp_path_factory.mktemp("one-rank") / "base")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _fsdp2_fit(base, root, max_steps, sharded, ckpt_path=None, **lora) -> Pretrain:
    torch.manual_seed(0)  # the adapter's A starts Kaiming-uniform
    module = Pretrain(init_from=str(base), lora=LoraConfig(**{**LORA, **lora}))
    ids = torch.randint(3, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    # one batch repeated: a resumed epoch restarts this (stateless) loader, and sees the same rows
    batches = torch.utils.data.DataLoader([{"input_ids": ids, "labels": ids}] * 2, batch_size=None)
    strategy = FSDP2Strategy(save_distributed_checkpoint=sharded)
    trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=max_steps, default_root_dir=root)
    trainer.fit(module, train_dataloaders=batches, ckpt_path=ckpt_path)
    if ckpt_path is None:
        trainer.save_checkpoint(root / "last.ckpt")
    return module


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full"])
def test_one_fsdp2_rank_resumes_a_lora_run_to_the_uninterrupted_adapter(one_rank, tmp_path, sharded):
    uninterrupted = gathered_weights(_fsdp2_fit(one_rank, tmp_path / "a", 2, sharded).model)
    _fsdp2_fit(one_rank, tmp_path / "b", 1, sharded)
    assert (tmp_path / "b" / "last.ckpt").is_dir() == sharded
    resumed = gathered_weights(_fsdp2_fit(one_rank, tmp_path / "c", 2, sharded, tmp_path / "b" / "last.ckpt").model)
    assert uninterrupted.keys() == resumed.keys()
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
    base = base_weights(one_rank)
    assert all(torch.equal(resumed[k], v) for k, v in base.items())  # base untouched
    assert all(v.abs().max() > 0 for k, v in _adapter(resumed).items() if ".lora_B." in k)  # B left zero: moved


def test_one_fsdp2_rank_refuses_a_sharded_lora_checkpoint_that_lacks_a_trained_weight(one_rank, tmp_path):
    _fsdp2_fit(one_rank, tmp_path / "a", 1, sharded=True)
    with pytest.raises(CheckpointError, match=r"lacks 1 trained weight\(s\) \(e\.g\. model\.lm_head\.weight\).*"
                                              r"Fix: resume with the settings it was trained with"):
        _fsdp2_fit(one_rank, tmp_path / "b", 2, True, tmp_path / "a" / "last.ckpt", modules_to_save=["lm_head"])


def test_dpo_under_fsdp2_refuses_modules_to_save_it_could_not_restore_for_its_reference(one_rank, tmp_path):
    """FSDP2 computes with gathered copies of sharded weights: switching the adapter off would leave the trained
    modules_to_save in the reference, silently."""
    data = DPOData(synthetic=Arithmetic(train_rows=16, test_rows=4), max_seq_len=64, batch_size=4,
                   cache_dir=str(tmp_path))
    lora = LoraConfig(**{**LORA, "modules_to_save": ["input_layernorm"]})
    dpo = DPO(arch=ModelConfig.from_name("debug", num_hidden_layers=1), lora=lora, tokenizer=data.tokenizer)
    trainer = quiet_trainer(devices=1, strategy=FSDP2Strategy(), max_steps=1, limit_val_batches=0)
    with pytest.raises(ConfigError, match=r"lora\.modules_to_save=\['input_layernorm'\] under a sharded strategy.*"
                                          r"Fix: leave modules_to_save empty, or train with strategy: ddp"):
        trainer.fit(dpo, datamodule=data)


# -- two processes (gloo) ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """4-step LoRA runs from one HF directory on the same data, started together: one process with batch 8; two
    processes with batch 4 each under DDP, FSDP2 with sharded checkpoints and FSDP2 with full ones."""
    root = tmp_path_factory.mktemp("lora-parallel")
    base, corpus = save_base(root / "base"), write_corpus(root / "corpus.txt")
    configs = {name: lora_debug_config(root / name, corpus, base, max_steps=4, extra_callbacks=PROBES, **kw)
               for name, kw in SETTINGS.items()}
    for proc in [launch(config) for config in configs.values()]:
        finish(proc)
    return SimpleNamespace(base=base, corpus=corpus, **{name: config.parent for name, config in configs.items()})


@pytest.fixture(scope="module")
def resumed(runs):
    """Both FSDP2 runs again from their step-2 checkpoints, started together; each test awaits its own."""
    procs = {}
    for name in ("sharded", "full"):
        folder = runs.base.parent / f"{name}-resumed"
        config = lora_debug_config(folder, runs.corpus, runs.base, max_steps=4, extra_callbacks=PROBES,
                                   **SETTINGS[name])
        procs[name] = (launch(config, "--ckpt_path", str(getattr(runs, name) / "ckpt" / "epoch=0-step=2.ckpt")),
                       folder)
    yield procs
    for proc, _ in procs.values():  # a run no test awaited (one was deselected) does not outlive the module
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _adapter(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights.items() if ".lora_A." in k or ".lora_B." in k}


@pytest.mark.parametrize("name", ["ddp", "sharded", "full"])
def test_two_processes_train_the_one_process_adapter_on_an_untouched_base(runs, name):
    folder, base = getattr(runs, name), base_weights(runs.base)
    ranks = [rank_weights(folder, rank) for rank in (0, 1)]
    for weights in ranks:
        assert all(torch.equal(weights[k], v) for k, v in base.items())  # the frozen base, bit for bit
    assert _adapter(ranks[0]).keys() == _adapter(ranks[1]).keys() and len(_adapter(ranks[0])) == 28
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in _adapter(ranks[0]))  # one adapter on both ranks
    assert all(ranks[0][k].abs().max() > 0 for k in _adapter(ranks[0]) if ".lora_B." in k)  # B left zero: moved
    losses = mean_losses(folder)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    torch.testing.assert_close(losses, mean_losses(runs.single), rtol=1e-5, atol=1e-6)
    single = rank_weights(runs.single, 0)
    for key in _adapter(single):
        torch.testing.assert_close(ranks[0][key], single[key], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sharded", "full"])
def test_fsdp2_resumes_a_lora_run_from_its_adapter_only_checkpoint_bit_for_bit(runs, resumed, name):
    proc, resumed = resumed[name]
    finish(proc)
    uninterrupted = getattr(runs, name)
    step2 = uninterrupted / "ckpt" / "epoch=0-step=2.ckpt"
    assert step2.is_dir() if name == "sharded" else step2.is_file()
    assert mean_losses(resumed) == mean_losses(uninterrupted)[2:]  # steps 3 and 4, bit for bit
    final, again = rank_weights(uninterrupted, 0), rank_weights(resumed, 0)
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)


def test_fsdp2_sharded_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_only(runs):
    entries = read_dcp_metadata(runs.sharded / "ckpt" / "last.ckpt").state_dict_metadata
    weights = {k.removeprefix("state_dict.") for k in entries if k.startswith("state_dict.")}
    assert weights == {f"model.{k}" for k in _adapter(rank_weights(runs.sharded, 0))}
    moments = {k for k in entries if k.startswith("optimizer_0.state.") and k.endswith(".exp_avg")}
    assert len(moments) == len(weights) == 28
