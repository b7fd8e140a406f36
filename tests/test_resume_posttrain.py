"""Exact resume for DPO, GRPO, KTO, ORPO, SimPO and the reward model (and the modules sharing their loaders): the
train loader's position travels in the checkpoint, so a run killed with SIGKILL and resumed with `--ckpt_path last`
logs the same loss, bit for bit, at every later step as the run that was never interrupted — across an epoch
boundary, with accumulation."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest
import yaml
from fit_runs import ROOT, finish, losses, quiet_trainer, wait_for_lines
from forked_fit import launch_forked as launch

from astrai_pl.callbacks import read_checkpoint
from astrai_pl.data import DPOData, GRPOData, KTOData
from astrai_pl.data.sources import Arithmetic

MAX_STEPS, ACCUMULATE, EVERY = 8, 2, 2
TASK = {"train_rows": 42, "test_rows": 4}  # about 40 training rows: 10 batches of 4, 5 steps per epoch


def _config(folder: Path, kind: str) -> Path:
    """configs/{kind}/debug.yaml on a small task: no validation, JSONL metrics, a checkpoint every 2 steps."""
    cfg = yaml.safe_load((ROOT / "configs" / kind / "debug.yaml").read_text())
    cfg["trainer"].update(accelerator="cpu", max_steps=MAX_STEPS, accumulate_grad_batches=ACCUMULATE,
                          limit_val_batches=0, val_check_interval=None, check_val_every_n_epoch=1,
                          log_every_n_steps=1, enable_progress_bar=False, default_root_dir=".")
    cfg["trainer"]["logger"] = {"class_path": "astrai_pl.callbacks.JSONLLogger", "init_args": {"save_dir": "."}}
    cfg["trainer"]["callbacks"] = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                    "init_args": {"dirpath": "ckpt", "save_last": True, "save_top_k": 0,
                                                  "every_n_train_steps": EVERY}}]
    cfg["data"]["init_args"]["synthetic"].update(TASK)
    cfg["data"]["init_args"]["cache_dir"] = str(folder / "cache")
    if kind == "grpo":  # one rollout per optimizer step, so every checkpoint lies between rollouts
        cfg["model"]["init_args"].update(num_iterations=1, num_generations=2, max_completion_length=4)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.mark.parametrize("kind", ["dpo", "grpo", "kto", "orpo", "simpo", "reward"])
def test_sigkill_then_resume_sees_the_same_batches(tmp_path, kind):
    reference = launch(_config(tmp_path / "reference", kind))
    config = _config(tmp_path / "killed", kind)
    kill_after = random.Random().randint(3, 6)  # JSONL lines: the run is then at least that many steps in
    print(f"killing after {kill_after} logged steps")
    proc = launch(config)
    wait_for_lines(config.parent / "metrics.jsonl", kill_after, proc, timeout=600)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    step = read_checkpoint(config.parent / "ckpt" / "last.ckpt")["global_step"]
    assert 0 < step < MAX_STEPS
    finish(launch(config, "--ckpt_path", "last"), timeout=600)
    finish(reference, timeout=600)
    expected, got = losses(tmp_path / "reference"), losses(config.parent)
    later = [s for s in expected if s >= step]
    assert later and all(s in got for s in later)
    assert [got[s] for s in later] == [expected[s] for s in later]  # bit-identical, every later step


def _next_batches(module, state, count):
    """The loader of `module` (restored to `state` when given) and its next `count` batches."""
    loader = module.train_dataloader()
    if state is not None:
        loader.load_state_dict(state)
    batches = iter(loader)
    return loader, [next(batches) for _ in range(count)]


@pytest.mark.parametrize("module", [DPOData, GRPOData, KTOData])
def test_train_loader_restores_its_position(tmp_path, module):
    """A fresh module's loader given the state of one that handed out 3 batches continues with batch 4."""
    def fresh():
        data = module(tokenizer="byte", batch_size=4, cache_dir=str(tmp_path), synthetic=Arithmetic(**TASK))
        data.trainer = quiet_trainer(max_steps=1, accumulate_grad_batches=1)
        data.setup("fit")
        return data

    key = {DPOData: "chosen_input_ids", GRPOData: "prompt_ids", KTOData: "input_ids"}[module]
    _, uninterrupted = _next_batches(fresh(), None, 5)
    stopped, _ = _next_batches(fresh(), None, 3)
    _, resumed = _next_batches(fresh(), stopped.state_dict(), 2)
    assert [_as_list(b[key]) for b in resumed] == [_as_list(b[key]) for b in uninterrupted[3:]]
    assert _as_list(resumed[0][key]) != _as_list(uninterrupted[0][key])


def _as_list(value):
    return value.tolist() if hasattr(value, "tolist") else value
