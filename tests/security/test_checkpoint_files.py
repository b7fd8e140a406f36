"""Checkpoint files and folders from an untrusted source: nothing in them runs, damage is one typed error
naming the file, and a checkpoint replace cut off at any point leaves a complete checkpoint."""

import itertools
import json
import os
import pickle
import random
import shutil
import zlib
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from astrai_pl.callbacks import AtomicCheckpointIO, CheckpointError, read_checkpoint
from astrai_pl.checkpoint import load_transformer
from astrai_pl.cli import main as cli_main
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.objectives import Pretrain
from astrai_pl.strategy import FSDP2Strategy


class WritesAFile:
    """Unpickling this opens (creates) `marker`: the stand-in for any code a pickle can run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _batches():
    ids = torch.arange(16).reshape(2, 8) % 300
    return torch.utils.data.DataLoader([{"input_ids": ids, "labels": ids}] * 4, batch_size=None)


def _fsdp_trainer(root: Path, max_steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(), max_steps=max_steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     default_root_dir=root)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """One FSDP2 step in this process (a one-rank gloo group) and the sharded checkpoint it saved."""
    root = tmp_path_factory.mktemp("fsdp")
    trainer = _fsdp_trainer(root, max_steps=1)
    trainer.fit(Pretrain(arch=ModelConfig.from_name("debug")), train_dataloaders=_batches())
    trainer.save_checkpoint(root / "last.ckpt")
    yield SimpleNamespace(trainer=trainer, folder=root / "last.ckpt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _copy(folder: Path, tmp_path: Path, name: str = "copy.ckpt") -> Path:
    copy = tmp_path / name
    shutil.copytree(folder, copy)
    return copy


def _forge_checksums(folder: Path) -> None:
    """What an attacker who rewrites a folder can also do: make its checksum table match."""
    files = {p.name: [p.stat().st_size, zlib.crc32(p.read_bytes())] for p in folder.iterdir()
             if p.is_file() and p.name != "checksums.json"}
    (folder / "checksums.json").write_text(json.dumps({"algorithm": "crc32", "files": files}))


def _resume(folder: Path, root: Path) -> None:
    trainer = _fsdp_trainer(root, max_steps=2)
    trainer.fit(Pretrain(arch=ModelConfig.from_name("debug")), train_dataloaders=_batches(), ckpt_path=str(folder))


def _entry_points(folder: Path, tmp_path: Path):
    return {
        "read_checkpoint": lambda: read_checkpoint(folder),
        "init_from": lambda: Pretrain(init_from=str(folder)),
        "convert": lambda: cli_main(["convert", "--ckpt", str(folder), "--output", str(tmp_path / "hf")]),
        "generate": lambda: cli_main(["generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "2"]),
        "AtomicCheckpointIO": lambda: AtomicCheckpointIO().load_checkpoint(folder),
        "FSDP2Strategy": lambda: _resume(folder, tmp_path / "resume"),
    }


ENTRY_POINTS = ["read_checkpoint", "init_from", "convert", "generate", "AtomicCheckpointIO", "FSDP2Strategy"]


# -- nothing in a sharded folder runs ---------------------------------------------------------------------
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("checksums", ["none", "forged"])
def test_a_pickle_in_the_metadata_of_a_sharded_folder_never_runs(fsdp, tmp_path, entry, checksums):
    folder, marker = _copy(fsdp.folder, tmp_path), tmp_path / "written-by-the-pickle"
    (folder / ".metadata").write_bytes(pickle.dumps(WritesAFile(marker)))
    (folder / "checksums.json").unlink(missing_ok=True)
    if checksums == "forged":
        _forge_checksums(folder)
    with pytest.raises((CheckpointError, SystemExit)) as info:
        _entry_points(folder, tmp_path)[entry]()
    assert not marker.exists()
    assert str(folder) in str(info.value) and "\n" not in str(info.value)


def test_a_pickle_in_a_shard_never_runs(fsdp, tmp_path):
    """torch.distributed.checkpoint stores a non-tensor entry as a torch.save pickle inside a shard file."""
    from torch.distributed.checkpoint import save

    folder, marker = tmp_path / "shards.ckpt", tmp_path / "written-by-the-pickle"
    weights = {"model.embed_tokens.weight": torch.zeros(4, 4), "model.extra": WritesAFile(marker)}
    save({"state_dict": weights}, checkpoint_id=folder, no_dist=True)
    shutil.copy(fsdp.folder / "meta.pt", folder / "meta.pt")
    _forge_checksums(folder)  # else it is refused before any shard is read
    for entry in ("read_checkpoint", "init_from", "AtomicCheckpointIO"):
        with pytest.raises(CheckpointError, match=str(folder)):
            _entry_points(folder, tmp_path)[entry]()
        assert not marker.exists()


def test_metadata_that_points_outside_its_folder_is_refused(fsdp, tmp_path):
    folder = _copy(fsdp.folder, tmp_path)
    (tmp_path / "elsewhere").write_bytes(b"not for this reader")
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own file, written by the fixture
    next(iter(metadata.storage_data.values())).relative_path = "../elsewhere"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _forge_checksums(folder)
    with pytest.raises(CheckpointError, match=r"points at '\.\./elsewhere', outside its folder"):
        read_checkpoint(folder)


# -- damage is one typed error naming the folder ------------------------------------------------------------
@pytest.mark.parametrize("entry", ["read_checkpoint", "FSDP2Strategy"])
def test_a_truncated_shard_is_a_checkpoint_error_naming_the_folder(fsdp, tmp_path, entry):
    folder = _copy(fsdp.folder, tmp_path)
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:4096])  # cut off inside the first weights
    _forge_checksums(folder)  # checksums that match: the reader itself fails
    with pytest.raises(CheckpointError, match=rf"{folder}: .*cannot be read") as info:
        _entry_points(folder, tmp_path)[entry]()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("entry", ["read_checkpoint", "FSDP2Strategy"])
def test_a_flipped_byte_in_a_shard_fails_its_checksum(fsdp, tmp_path, entry):
    folder = _copy(fsdp.folder, tmp_path)
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a weight, which the reader alone would load as it is
    (folder / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{folder}: corrupted checkpoint: the bytes of __0_0\.distcp"):
        _entry_points(folder, tmp_path)[entry]()


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_folder_without_checksums_is_refused(fsdp, tmp_path, entry):
    folder = _copy(fsdp.folder, tmp_path)
    (folder / "checksums.json").unlink()
    with pytest.raises((CheckpointError, SystemExit), match=rf"{folder}: no checksums\.json"):
        _entry_points(folder, tmp_path)[entry]()


def test_a_file_of_random_bytes_is_not_called_truncated(tmp_path):
    path = tmp_path / "last.ckpt"
    path.write_bytes(random.Random(0).randbytes(4096))
    with pytest.raises(CheckpointError, match=r"last\.ckpt: not a checkpoint") as info:
        read_checkpoint(path)
    assert "truncated" not in str(info.value)


# -- a checkpoint replace cut off at any point ---------------------------------------------------------------
class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs, no except Exception catches it."""


def _save(trainer: L.Trainer, target: Path, tag: str) -> None:
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()
    checkpoint["tag"] = tag
    trainer.strategy.save_checkpoint(checkpoint, target)


def _kill(patch, at: int | None = None, moving_to: Path | None = None) -> None:
    """Patch os.replace and shutil.rmtree (every rename and deletion) so that their `at`-th call, or the
    rename onto `moving_to`, is a kill."""
    calls = itertools.count()
    replace = os.replace

    def killing(real):
        def call(*args, **kwargs):
            if next(calls) == at or (real is replace and moving_to is not None and Path(args[1]) == moving_to):
                raise Killed
            return real(*args, **kwargs)
        return call

    patch.setattr(os, "replace", killing(os.replace))
    patch.setattr(shutil, "rmtree", killing(shutil.rmtree))


def test_a_kill_at_any_point_of_a_sharded_replace_leaves_a_complete_checkpoint(fsdp, tmp_path, monkeypatch):
    for point in range(20):
        folder = tmp_path / f"kill-{point}"
        target = folder / "last.ckpt"
        _save(fsdp.trainer, target, "old")
        with monkeypatch.context() as patch:
            _kill(patch, at=point)
            try:
                _save(fsdp.trainer, target, "new")
                finished = True
            except Killed:
                finished = False
        assert read_checkpoint(target)["tag"] in ("old", "new")  # a reader finds a complete copy
        _save(fsdp.trainer, target, "next")  # and the next save replaces it, leaving nothing else behind
        assert read_checkpoint(target)["tag"] == "next"
        assert [p.name for p in folder.iterdir()] == ["last.ckpt"]
        if finished:
            break
    assert point >= 3, "the kill never landed between the renames"


def _killed_between_the_renames(trainer: L.Trainer, target: Path, monkeypatch) -> None:
    _save(trainer, target, "old")
    with monkeypatch.context() as patch:
        _kill(patch, moving_to=target)
        with pytest.raises(Killed):
            _save(trainer, target, "new")
    assert not target.exists()


def test_resuming_from_last_puts_back_what_a_kill_between_the_renames_left(fsdp, tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    _killed_between_the_renames(fsdp.trainer, target, monkeypatch)
    from astrai_pl.checkpoint.archive import prepare_resume_from_last

    prepare_resume_from_last(SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(dirpath=tmp_path)]), "last")
    assert read_checkpoint(target)["tag"] == "new"  # the new copy was complete: it is the one kept
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_kill_between_the_renames_is_found_by_the_strategy(fsdp, tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    _killed_between_the_renames(fsdp.trainer, target, monkeypatch)
    _resume(target, tmp_path / "resume")  # FSDP2Strategy.load_checkpoint reads the complete copy beside it


# -- a checkpoint that does not describe its model ------------------------------------------------------------
def test_a_checkpoint_without_its_architecture_is_refused(tmp_path):
    model = Transformer(ModelConfig.from_name("debug"))
    path = tmp_path / "bare.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, path)
    with pytest.raises(CheckpointError, match=r"bare\.ckpt: records no hyper_parameters\.arch.*Fix"):
        load_transformer(None, str(path))
    arch = ModelConfig.from_name("debug", hidden_size=32)
    small = Transformer(arch)
    torch.save({"state_dict": {f"model.{k}": v for k, v in small.state_dict().items()}}, path)
    assert load_transformer(arch, str(path)).config.hidden_size == 32  # unless the caller names it


def _mismatched_checkpoint(tmp_path: Path) -> Path:
    model = Transformer(ModelConfig.from_name("debug"))
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state["model.embed_tokens.weight"] = torch.zeros(100, 64)
    path = tmp_path / "other.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": {"arch": model.config.to_dict()}}, path)
    return path


def test_init_from_weights_that_do_not_fit_are_one_line_naming_the_weight(tmp_path):
    path = _mismatched_checkpoint(tmp_path)
    with pytest.raises(CheckpointError) as info:
        Pretrain(init_from=str(path))
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert "model.embed_tokens.weight is (100, 64) in the file but (320, 64) in the model" in message


def test_init_from_that_does_not_fit_is_one_line_from_the_cli(tmp_path, monkeypatch):
    path = _mismatched_checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[2] / "configs/pretrain/debug.yaml"
    with pytest.raises(SystemExit) as info:
        cli_main(["fit", "--config", str(config), "--model.init_args.init_from", str(path),
                  "--trainer.accelerator", "cpu"])
    message = str(info.value)
    assert str(path) in message and "embed_tokens" in message and "\n" not in message and len(message) < 600


# -- `--ckpt_path last` -------------------------------------------------------------------------------------
DEBUG_CONFIG = Path(__file__).resolve().parents[2] / "configs/pretrain/debug.yaml"


def _fit(*args: str):
    """`astrai-pl fit` on the debug config in the current folder, on a small corpus so it stays quick."""
    from astrai_pl.cli import lightning_main

    corpus = Path("corpus.txt")
    if not corpus.is_file():
        words = random.Random(0).choices(["the", "list", "is", "a", "def", "return", "value", "of"], k=3000)
        corpus.write_text("\n".join(" ".join(words[i : i + 10]) for i in range(0, len(words), 10)))
    return lightning_main(["fit", "--config", str(DEBUG_CONFIG), "--trainer.accelerator", "cpu",
                           "--trainer.enable_progress_bar", "false", "--data.init_args.path", str(corpus.resolve()),
                           "--trainer.limit_val_batches", "0", *args])


def test_last_with_checkpoints_but_no_last_one_is_an_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "runs/pretrain-debug/version_0/checkpoints"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, folder / "epoch=0-step=4.ckpt")
    with pytest.raises(CheckpointError, match=r"ckpt_path='last': .* holds no last checkpoint but holds "
                                              r"epoch=0-step=4\.ckpt.*Fix: resume from one of them"):
        _fit("--ckpt_path", "last", "--trainer.max_steps", "1")


def test_last_in_a_new_run_starts_from_step_0(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = _fit("--ckpt_path", "last", "--trainer.max_steps", "1")
    assert cli.trainer.global_step == 1 and cli.trainer.ckpt_path is None


def test_last_after_a_kill_between_the_renames_resumes_from_the_complete_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sharded = ("--trainer.strategy", "fsdp2", "--trainer.devices", "1")
    _fit(*sharded, "--trainer.max_steps", "4")
    folder = tmp_path / "runs/pretrain-debug/version_0/checkpoints"
    os.replace(folder / "last.ckpt", folder / ".last.ckpt.old")  # the state a kill between the renames leaves
    cli = _fit(*sharded, "--ckpt_path", "last", "--trainer.max_steps", "5")
    assert cli.trainer.ckpt_path == str(folder / "last.ckpt")  # resumed at step 4, not restarted at step 0
    assert cli.trainer.global_step == 5
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]
