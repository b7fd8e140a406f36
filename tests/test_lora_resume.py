"""LoRA checkpoints: a run from an init_from Hugging Face directory saves the adapter and its optimizer state, no
base weight; killed with SIGKILL at a random step and resumed with `--ckpt_path last`, it logs the same loss at
every later step and ends with the same adapter, bit for bit, as the run that was never interrupted."""

from __future__ import annotations

import os
import random
import signal

import lightning as L
import pytest
import torch
from fit_runs import finish, launch, losses, quiet_trainer, wait_for_lines, write_corpus
from lightning.pytorch.callbacks import ModelCheckpoint
from lora_runs import LORA, lora_debug_config, save_base
from safetensors.torch import load_file

from astrai_pl.callbacks import read_checkpoint
from astrai_pl.model import LoraConfig, Transformer
from astrai_pl.model.lora import adapter_state
from astrai_pl.objectives import Pretrain

MAX_STEPS, ACCUMULATE = 10, 2


class _Batches(L.LightningDataModule):
    def train_dataloader(self):
        ids = torch.randint(3, 320, (2, 2, 32), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=None)


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_and_no_base_weight(tmp_path):
    base = save_base(tmp_path / "base")
    module = Pretrain(init_from=str(base), lora=LoraConfig(**LORA))
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    quiet_trainer(devices=1, max_steps=2, enable_checkpointing=True, callbacks=[checkpoints]).fit(
        module, datamodule=_Batches())

    ckpt = read_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    adapter = {f"model.{k}" for k in adapter_state(module.model)}
    base_keys = {f"model.{k}" for k in Transformer.from_pretrained(base).state_dict()}
    assert set(ckpt["state_dict"]) == adapter and len(adapter) == 28
    assert not base_keys & set(ckpt["state_dict"])
    (optimizer,) = ckpt["optimizer_states"]
    assert len(optimizer["state"]) == len(adapter)  # AdamW moments of the adapter only
    assert ckpt["lora_base"]["init_from"] == str(base) and ckpt["hyper_parameters"]["lora"]["r"] == LORA["r"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-resume")
    return save_base(root / "base"), write_corpus(root / "corpus.txt")


def _config(folder, setup):
    base, corpus = setup
    return lora_debug_config(folder, corpus, base, max_steps=MAX_STEPS, accumulate=ACCUMULATE, every_n_train_steps=3)


def test_sigkill_at_a_random_step_then_resume_gives_the_same_adapter_bit_for_bit(tmp_path, setup):
    reference = launch(_config(tmp_path / "reference", setup))
    kill_after = random.Random().randint(4, 8)  # JSONL lines: the run is then at least that many steps in
    print(f"killing after {kill_after} logged steps")
    config = _config(tmp_path / "killed", setup)
    proc = launch(config)
    wait_for_lines(config.parent / "metrics.jsonl", kill_after, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ckpt = read_checkpoint(config.parent / "ckpt" / "last.ckpt")
    step = ckpt["global_step"]
    assert 0 < step < MAX_STEPS and all(".lora_" in k for k in ckpt["state_dict"])

    finish(launch(config, "--ckpt_path", "last"))
    finish(reference)
    expected, got = losses(tmp_path / "reference"), losses(config.parent)
    later = [s for s in expected if s >= step]
    assert later and [got[s] for s in later] == [expected[s] for s in later]  # bit-identical, every later step
    adapter = "hf/final/adapter_model.safetensors"
    ref, resumed = load_file(str(tmp_path / "reference" / adapter)), load_file(str(config.parent / adapter))
    assert ref.keys() == resumed.keys() and len(ref) == 28
    assert all(torch.equal(ref[k], resumed[k]) for k in ref)
