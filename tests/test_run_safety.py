"""What `astrai-pl fit` guarantees with the shipped configs as they are: atomic, verified checkpoints, the NaN
guard, RNG states and a clean stop on signals in every trainer; a SIGKILL halfway through a checkpoint write
(TMPDIR on another filesystem) leaves the previous checkpoint to resume from; an explicit --ckpt_path goes
through the verified reader; and no checkpoint is ever written from non-finite weights."""

from __future__ import annotations

import functools
import math
import re
import shutil
import signal
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from fit_runs import finish, launch_in, other_filesystem, quiet_trainer, write_corpus
from lightning.pytorch.callbacks import ModelCheckpoint

from astrai_pl.callbacks import (
    AtomicCheckpointIO,
    CheckpointError,
    FinalCheckpoint,
    NonFiniteGuard,
    NonFiniteLossError,
    RNGState,
    StopOnSignal,
    read_checkpoint,
)
from astrai_pl.cli import lightning_main, main
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.objectives import Pretrain

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "sweeps" not in p.parts)
PROTECTIONS = (NonFiniteGuard, RNGState, StopOnSignal, FinalCheckpoint)


def _shipped(config: Path, *args: str):
    init_from = yaml.safe_load(config.read_text())["model"]["init_args"].get("init_from")
    if init_from and not Path(init_from).exists():  # a later stage of the demo, before the earlier ran
        args += ("--model.init_args.init_from", "null")
    return lightning_main(["--config", str(config), "--trainer.logger", "false", *args], run=False).trainer


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_trains_with_the_protections(config):
    trainer = _shipped(config)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    for kind in PROTECTIONS:
        assert sum(isinstance(c, kind) for c in trainer.callbacks) == 1, kind.__name__


def test_a_safety_switch_turns_one_protection_off_and_a_named_one_is_not_added_twice():
    config = ROOT / "configs/pretrain/debug.yaml"
    trainer = _shipped(config, "--safety.stop_on_signal", "false", "--safety.atomic_checkpoints", "false")
    assert not any(isinstance(c, StopOnSignal) for c in trainer.callbacks)
    assert not isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert sum(isinstance(c, NonFiniteGuard) for c in trainer.callbacks) == 1
    trainer = _shipped(config, "--trainer.callbacks+=astrai_pl.callbacks.NonFiniteGuard")
    assert sum(isinstance(c, NonFiniteGuard) for c in trainer.callbacks) == 1


@pytest.mark.parametrize("final_checkpoint", ["true", "false"])
def test_last_ckpt_holds_the_final_step_when_max_steps_is_no_multiple_of_the_interval(tmp_path, final_checkpoint):
    """every_n_train_steps 4, max_steps 6: Lightning writes last.ckpt at step 4 and, having written one, not
    again at the end; FinalCheckpoint writes step 6 (switched off, the run ends with step 4 in last.ckpt)."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    main(["fit", "--config", str(ROOT / "configs/pretrain/debug.yaml"), "--data.init_args.path", str(corpus),
          "--trainer.max_steps", "6", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
          "--trainer.default_root_dir", str(tmp_path / "runs"), "--safety.final_checkpoint", final_checkpoint])
    last = read_checkpoint(tmp_path / "runs/latest/checkpoints/last.ckpt")
    assert last["global_step"] == (6 if final_checkpoint == "true" else 4)


# -- an explicit --ckpt_path is read verified --------------------------------------------------------------
@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    """A checkpoint of configs/pretrain/debug.yaml after one step, as `astrai-pl fit` writes it."""
    folder = tmp_path_factory.mktemp("ckpt_path")
    corpus = write_corpus(folder / "corpus.txt")
    cli = lightning_main(["--config", str(ROOT / "configs/pretrain/debug.yaml"), "--trainer.logger", "false",
                          "--data.init_args.path", str(corpus),
                          "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false",
                          "--trainer.default_root_dir", str(folder), "--trainer.enable_checkpointing", "false",
                          "--trainer.callbacks", "[]", "--trainer.limit_val_batches", "0"], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.save_checkpoint(folder / "good.ckpt")
    return folder / "good.ckpt"


def _flip_a_byte_of_tensor_data(src: Path, dst: Path) -> Path:
    with zipfile.ZipFile(src) as archive:
        member = max(archive.infolist(), key=lambda info: info.file_size)  # the largest tensor
        offset = member.header_offset + 30 + len(member.filename.encode()) + len(member.extra)
    data = bytearray(src.read_bytes())
    data[offset + member.compress_size // 2] ^= 0x40
    dst.write_bytes(bytes(data))
    return dst


def _fit_from(path: Path, folder: Path, corpus: Path) -> None:
    main(["fit", "--config", str(ROOT / "configs/pretrain/debug.yaml"), "--ckpt_path", str(path),
          "--data.init_args.path", str(corpus),
          "--trainer.max_steps", "2", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
          "--trainer.default_root_dir", str(folder), "--trainer.callbacks", "[]",
          "--trainer.enable_checkpointing", "false", "--trainer.limit_val_batches", "0"])


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_a_damaged_ckpt_path_is_one_error_naming_the_file(good_checkpoint, tmp_path, damage):
    bad = tmp_path / "bad.ckpt"
    if damage == "flipped byte":
        _flip_a_byte_of_tensor_data(good_checkpoint, bad)
    else:
        bad.write_bytes(good_checkpoint.read_bytes()[: good_checkpoint.stat().st_size // 2])
    with pytest.raises(SystemExit, match=rf"astrai-pl: {re.escape(str(bad))}: (truncated|.*checksum)"):
        _fit_from(bad, tmp_path, good_checkpoint.parent / "corpus.txt")


def test_an_intact_ckpt_path_resumes(good_checkpoint, tmp_path):
    _fit_from(good_checkpoint, tmp_path, good_checkpoint.parent / "corpus.txt")  # the same command as above, on the file before it was damaged


# -- no checkpoint from non-finite weights -----------------------------------------------------------------
def _batches(n=12):
    torch.manual_seed(1)
    return torch.utils.data.DataLoader(
        [{"input_ids": x, "labels": x} for x in torch.randint(3, 320, (n, 2, 16))], batch_size=None
    )


def _every_step_checkpoints(tmp_path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)


def _weights_are_finite(path: Path) -> bool:
    return all(torch.isfinite(v).all() for v in read_checkpoint(path)["state_dict"].values())


def test_lr_1e6_stops_before_a_nan_weight_is_saved_and_says_so_truly(tmp_path):
    module = Pretrain(arch=ModelConfig.from_name("debug"),
                      optimizer=functools.partial(torch.optim.AdamW, lr=1e6, weight_decay=0.1))
    trainer = quiet_trainer(max_steps=12, gradient_clip_val=1.0, enable_checkpointing=True,
                            callbacks=[_every_step_checkpoints(tmp_path), NonFiniteGuard()])
    with pytest.raises(NonFiniteLossError, match=rf"did not step.*{tmp_path / 'last.ckpt'} holds the weights"):
        trainer.fit(module, train_dataloaders=_batches())
    assert _weights_are_finite(tmp_path / "last.ckpt")  # Lightning's own writer: the guard alone kept it good
    assert read_checkpoint(tmp_path / "last.ckpt")["global_step"] == trainer.global_step


class NanGradientAtStep(Pretrain):
    """A finite loss whose gradient in one weight is NaN, in the first micro-batch of step `bad_step`."""

    def __init__(self, bad_step: int, **kw):
        super().__init__(**kw)
        self.bad_step, self.before = bad_step, None

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == self.bad_step and self.before is None:
            self.before = {k: v.clone() for k, v in self.state_dict().items()}

    def on_after_backward(self):
        if self.trainer.global_step == self.bad_step:
            self.model.lm_head.weight.grad[0, 0] = math.nan


def test_a_nan_gradient_is_refused_before_clipping_and_the_step(tmp_path):
    module = NanGradientAtStep(2, arch=ModelConfig.from_name("debug"))
    trainer = quiet_trainer(max_steps=6, accumulate_grad_batches=2, gradient_clip_val=1.0,
                            callbacks=[NonFiniteGuard()])
    with pytest.raises(NonFiniteLossError, match=r"gradients at optimizer step 2.*model\.lm_head\.weight"
                                                 r".*did not step"):
        trainer.fit(module, train_dataloaders=_batches())
    assert trainer.global_step == 2
    assert all(torch.equal(module.before[k], v) for k, v in module.state_dict().items())  # nothing stepped


class PoisonsAWeight(torch.optim.AdamW):
    """AdamW whose `bad_step`-th step (0-based) leaves an infinite weight, as an overflowing update would."""

    def __init__(self, params, bad_step: int, **kw):
        super().__init__(params, **kw)
        self.bad_step, self.steps = bad_step, 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        if self.steps == self.bad_step:
            self.param_groups[0]["params"][0].view(-1)[0] = math.inf
        self.steps += 1
        return loss


def test_a_step_that_makes_a_weight_infinite_stops_before_anything_saves_it(tmp_path):
    module = Pretrain(arch=ModelConfig.from_name("debug"),
                      optimizer=functools.partial(PoisonsAWeight, bad_step=3, lr=1e-3))
    trainer = quiet_trainer(max_steps=8, enable_checkpointing=True,
                            callbacks=[_every_step_checkpoints(tmp_path), NonFiniteGuard()])
    with pytest.raises(NonFiniteLossError, match=r"turned weights non-finite: model\.embed_tokens\.weight"):
        trainer.fit(module, train_dataloaders=_batches())
    assert _weights_are_finite(tmp_path / "last.ckpt")
    assert read_checkpoint(tmp_path / "last.ckpt")["global_step"] == 3


def test_atomic_checkpoint_io_refuses_nan_weights_and_keeps_the_file_there(tmp_path):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    state = Transformer(ModelConfig.from_name("debug")).state_dict()
    io.save_checkpoint({"state_dict": state, "global_step": 4}, path)
    before = path.read_bytes()
    state["norm.weight"][3] = math.nan
    with pytest.raises(CheckpointError, match=rf"{path}: not written.*step 5.*norm\.weight"):
        io.save_checkpoint({"state_dict": state, "global_step": 5}, path)
    assert path.read_bytes() == before


# -- shipped configs, killed halfway through a checkpoint write, resumed ----------------------------------
def _write_init_checkpoint(path: Path, arch: dict) -> None:
    """What an earlier stage leaves for `init_from`: a checkpoint of that stage's model."""
    path.parent.mkdir(parents=True, exist_ok=True)
    model = Transformer(ModelConfig(**arch))
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "hyper_parameters": {"arch": arch}}, path)


def _stage_inputs(config: Path, folder: Path) -> tuple[str, ...]:
    """What a shipped config needs from earlier stages, made in `folder`; CLI arguments that point to it."""
    if config.parent.name == "pretrain":  # a small corpus instead of the embedded documentation: quicker
        return ("--data.init_args.path", str(write_corpus(folder / "corpus.txt")))
    init_from = yaml.safe_load(config.read_text())["model"]["init_args"].get("init_from")
    if init_from:
        arch = yaml.safe_load((ROOT / "configs/pretrain" / config.name).read_text())["model"]["init_args"]["arch"]
        _write_init_checkpoint(folder / init_from, arch)
    return ()


def _kill_during_the_second_save_then_resume(config: Path, folder: Path, *overrides: str) -> None:
    cfg = yaml.safe_load(config.read_text())
    ckpt_dir = folder / cfg["trainer"]["default_root_dir"] / "version_0" / "checkpoints"  # resumed there too
    every = cfg["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"]
    args = ("--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0", *overrides,
            *_stage_inputs(config, folder))
    tmpdir = other_filesystem(folder)
    try:
        killed = launch_in(folder, config, *args, kill_write=(ckpt_dir, 2), tmpdir=tmpdir)
        killed.wait(timeout=300)
        log = (folder / "run.log").read_text()
        assert killed.returncode == -signal.SIGKILL, log[-3000:]
        assert read_checkpoint(ckpt_dir / "last.ckpt")["global_step"] == every  # the save before, intact
        finish(launch_in(folder, config, *args, "--ckpt_path", "last", tmpdir=tmpdir), timeout=300, folder=folder)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    resumed = (folder / "run.log").read_text()[len(log):]
    assert f"Restored all states from the checkpoint at {ckpt_dir / 'last.ckpt'}" in resumed
    assert read_checkpoint(ckpt_dir / "last.ckpt")["global_step"] == 2 * every


DEBUG_RUNS = {  # CLI overrides that make each run save twice
    "pretrain": (),
    "sft": (),
    "dpo": (),
    "grpo": ("--trainer.max_steps", "8", "--model.init_args.scheduler.init_args.max_steps", "8"),
}


@pytest.mark.parametrize("stage", [stage if stage == "pretrain" else pytest.param(stage, marks=pytest.mark.slow)
                                   for stage in DEBUG_RUNS])  # each about 30 s: two processes start
def test_a_shipped_debug_config_killed_while_saving_resumes_from_the_save_before(stage, tmp_path):
    _kill_during_the_second_save_then_resume(ROOT / "configs" / stage / "debug.yaml", tmp_path, *DEBUG_RUNS[stage])


TINY_RUNS = {  # smaller batches and sequences; each run saves twice
    "pretrain": ("--data.init_args.batch_size", "2", "--data.init_args.seq_len", "64"),
    "sft": ("--data.init_args.batch_size", "2", "--trainer.max_steps", "400"),
    "dpo": ("--data.init_args.batch_size", "2"),
    "grpo": ("--data.init_args.batch_size", "4"),
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", TINY_RUNS)
def test_a_shipped_tiny_config_killed_while_saving_resumes_from_the_save_before(stage, tmp_path):
    _kill_during_the_second_save_then_resume(ROOT / "configs" / stage / "tiny.yaml", tmp_path, *TINY_RUNS[stage])


def test_lr_1e6_on_a_shipped_config_never_writes_a_nan_checkpoint(tmp_path, monkeypatch):
    config = ROOT / "configs/pretrain/debug.yaml"
    ckpt_dir = tmp_path / "runs/pretrain-debug/version_0/checkpoints"
    args = ("--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0",
            *_stage_inputs(config, tmp_path))
    finish(launch_in(tmp_path, config, *args, "--trainer.max_steps", "4"), folder=tmp_path)  # last.ckpt at step 4
    before = (ckpt_dir / "last.ckpt").read_bytes()
    monkeypatch.setenv("ASTRAI_RUN_DIR", str(ckpt_dir.parent))  # a new run from step 0 in the same run directory
    proc = launch_in(tmp_path, config, *args, "--model.init_args.optimizer.init_args.lr", "1e6",
                     "--trainer.max_steps", "40")  # a new run from step 0 with the same checkpoint folder
    proc.wait(timeout=300)
    log = (tmp_path / "run.log").read_text()
    assert proc.returncode == 1, log[-3000:]
    assert re.search(r"astrai-pl: non-finite .*did not step.*last\.ckpt holds the weights from before", log)
    assert (ckpt_dir / "last.ckpt").read_bytes() == before
    assert all(_weights_are_finite(p) for p in ckpt_dir.glob("*.ckpt"))
