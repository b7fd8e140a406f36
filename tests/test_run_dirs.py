"""Run directories (checkpoint/runs.py, callbacks/resume.py place_outputs): each run of a config writes into
`default_root_dir/version_N`, `latest` names the newest, `--ckpt_path last` continues it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from fit_runs import write_corpus
from jsonargparse import Namespace

from astrai_pl.callbacks import HFExport
from astrai_pl.callbacks.resume import place_outputs
from astrai_pl.checkpoint import CheckpointError
from astrai_pl.checkpoint.runs import (
    RUN_DIR_ENV,
    claim_run_dir,
    latest_run_dir,
    point_latest,
    resolve_latest,
    run_dir_for,
    shared_run_dir,
)
from astrai_pl.cli import lightning_main

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "0",
         "--trainer.val_check_interval", "null", "--trainer.accelerator", "cpu"]


def built(root: Path, *args: str, config: str = "pretrain/debug.yaml", subcommand: str | None = None):
    """`astrai-pl [subcommand] --config configs/<config>` on a small corpus with its runs under `root`; unrun
    without a subcommand."""
    corpus = root.parent / "corpus.txt"
    if not corpus.is_file():
        write_corpus(corpus)
    data = ["--data.init_args.path", str(corpus)] if config.startswith("pretrain") else []
    argv = [*([subcommand] if subcommand else []), "--config", str(ROOT / "configs" / config), *QUIET, *data,
            "--trainer.default_root_dir", str(root), *args]
    return lightning_main(argv, run=subcommand is not None)


def no_symlinks(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise OSError("symlinks are not supported on this filesystem")

    monkeypatch.setattr(os, "symlink", refuse)


# -- fast: the directories, without training -----------------------------------------------------------------
def test_two_runs_of_one_config_get_directories_of_their_own(tmp_path):
    root = tmp_path / "runs"
    first, second = built(root), built(root)
    for n, cli in enumerate((first, second)):
        assert cli.trainer.logger.log_dir == str(root / f"version_{n}")
        assert cli.trainer.checkpoint_callback.dirpath == str(root / f"version_{n}" / "checkpoints")
    assert (root / "latest").resolve() == (root / "version_1").resolve()
    assert RUN_DIR_ENV not in os.environ  # the next run in this process chooses its own


def test_default_root_dir_moves_logs_checkpoints_and_exports(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    cli = built(elsewhere, "--trainer.callbacks+=astrai_pl.callbacks.HFExport")
    run_dir = elsewhere / "version_0"
    (export,) = [c for c in cli.trainer.callbacks if isinstance(c, HFExport)]
    assert cli.trainer.logger.log_dir == str(run_dir)
    assert cli.trainer.checkpoint_callback.dirpath == str(run_dir / "checkpoints")
    assert export.dirpath == run_dir / "hf"
    assert not (tmp_path / "runs").exists()  # nothing under the config's own runs/pretrain-debug


def test_a_path_the_config_names_is_used_as_written(tmp_path):
    named = tmp_path / "mine"
    callback = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": str(named)}}
    cli = built(tmp_path / "runs", "--trainer.logger", "false", "--trainer.callbacks", json.dumps([callback]))
    assert cli.trainer.checkpoint_callback.dirpath == str(named)
    assert not (tmp_path / "runs").exists()  # nothing was left to place: no run directory is made


def test_latest_is_a_file_where_symlinks_cannot_be_made(tmp_path, monkeypatch):
    no_symlinks(monkeypatch)
    root = tmp_path / "runs"
    for _ in range(2):
        point_latest(root, claim_run_dir(root))
    assert (root / "latest").read_text().strip() == "version_1" and not (root / "latest").is_symlink()
    assert latest_run_dir(root) == root / "version_1"
    expected = str(root / "version_1" / "checkpoints" / "last.ckpt")
    assert resolve_latest(root / "latest" / "checkpoints" / "last.ckpt") == expected
    assert resolve_latest("s3://bucket/latest/last.ckpt") == "s3://bucket/latest/last.ckpt"


def test_a_pointer_file_cannot_lead_out_of_its_root(tmp_path):
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match=r"latest: holds '\.\./\.\./etc', not the name of a run directory"):
        resolve_latest(tmp_path / "latest" / "checkpoints" / "last.ckpt")


def test_which_directory_a_run_takes(tmp_path):
    root = tmp_path / "runs"
    assert run_dir_for(root, "fit", None) == (root / "version_0", True)
    assert run_dir_for(root, "fit", None) == (root / "version_1", True)
    point_latest(root, root / "version_0")
    assert run_dir_for(root, "fit", "last") == (root / "version_0", True)  # resume continues the latest run
    assert run_dir_for(root, "fit", str(root / "version_1/checkpoints/last.ckpt")) == (root / "version_1", True)
    assert run_dir_for(root, "validate", "last") == (root / "version_2", False)  # latest stays on training runs
    assert run_dir_for(root, "fit", str(tmp_path / "other.ckpt")) == (root / "version_3", True)


def test_last_names_a_checkpoint_of_the_layout_before_run_directories(tmp_path):
    old = tmp_path / "checkpoints" / "last.ckpt"
    old.parent.mkdir()
    old.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"now live in version_N/ folders.*Fix: resume it with --ckpt_path"):
        run_dir_for(tmp_path, "fit", "last")


def test_ranks_of_one_run_share_its_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "runs" / "version_7"))  # as rank 0 exports it to the others
    cli = built(tmp_path / "runs")
    assert cli.trainer.checkpoint_callback.dirpath == str(tmp_path / "runs/version_7/checkpoints")
    assert os.environ[RUN_DIR_ENV] == str(tmp_path / "runs" / "version_7")


def test_validate_with_last_reads_the_latest_runs_checkpoint_and_logs_apart(tmp_path):
    root = tmp_path / "runs"
    point_latest(root, claim_run_dir(root))
    checkpoint = Namespace(class_path="lightning.pytorch.callbacks.ModelCheckpoint", init_args=Namespace(dirpath=None))
    trainer = Namespace(default_root_dir=str(root), logger=True, callbacks=[checkpoint])
    assert place_outputs(trainer, "validate", "last") == root / "version_1"
    assert checkpoint.init_args.dirpath == str(root / "version_0" / "checkpoints")
    assert trainer.logger.init_args.version == "version_1"
    assert latest_run_dir(root) == root / "version_0"


def test_ranks_that_srun_starts_on_their_own_share_rank_0s_directory(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    claim_run_dir(root)  # an earlier run: version_0
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    chosen = {}
    for rank in ("0", "1"):  # each as its own process would: no ASTRAI_RUN_DIR inherited
        monkeypatch.delenv(RUN_DIR_ENV, raising=False)
        monkeypatch.setenv("SLURM_PROCID", rank)
        chosen[rank] = shared_run_dir(root, "fit", None)
    assert chosen == {"0": root / "version_1", "1": root / "version_1"}
    assert sorted(p.name for p in root.glob("version_*")) == ["version_0", "version_1"]


# -- slow: training, resuming, the next stage ------------------------------------------------------------------
def last_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.slow
def test_reruns_keep_both_checkpoints_resume_continues_the_latest_and_the_next_stage_starts_from_it(
        tmp_path, monkeypatch):
    no_symlinks(monkeypatch)  # `latest` as a pointer file: the path rule every reader follows
    root = tmp_path / "runs"
    built(root, "--trainer.max_steps", "2", subcommand="fit")
    built(root, "--trainer.max_steps", "2", "--model.init_args.optimizer.init_args.lr", "1e-2", subcommand="fit")
    first, second = (root / f"version_{n}/checkpoints/last.ckpt" for n in (0, 1))
    assert first.is_file() and second.is_file()
    assert not torch.equal(last_weights(first)["model.embed_tokens.weight"],
                           last_weights(second)["model.embed_tokens.weight"])

    resumed = built(root, "--trainer.max_steps", "3", "--ckpt_path", "last", subcommand="fit")
    assert resumed.trainer.ckpt_path == str(second) and resumed.trainer.global_step == 3
    (scheduler,) = [c.scheduler for c in resumed.trainer.lr_scheduler_configs]
    assert scheduler.max_steps == 3  # the length this run's log names, not the checkpoint's 2
    assert (root / "version_1/metrics.before-resume-1.csv").is_file() and not (root / "version_2").exists()

    sft = built(tmp_path / "sft", "--trainer.max_steps", "1", "--model.init_args.init_from",
                str(root / "latest/checkpoints/last.ckpt"), config="sft/debug.yaml")
    resumed_weights = last_weights(second)["model.embed_tokens.weight"]
    assert torch.equal(sft.model.model.embed_tokens.weight.detach(), resumed_weights)
