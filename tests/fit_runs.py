"""Helpers for tests that run `astrai-pl fit` in subprocesses: configs derived from configs/pretrain/debug.yaml,
launching (also of shipped configs, and with a kill halfway through a checkpoint write), waiting, reading
results. Imported by test_resume.py, test_parallel.py and test_run_safety.py."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEBUG_CONFIG = ROOT / "configs" / "pretrain" / "debug.yaml"
KILLED_WRITES = ROOT / "tests" / "killed_writes"  # sitecustomize.py: SIGKILL halfway through a write
WORDS = (
    "the a of to and in is it that for on with as was at by an be this which or from python code list "
    "dict value error type class module function object string number file"
).split()


def quiet_trainer(**overrides: Any) -> L.Trainer:
    """A CPU Trainer that writes no logs or checkpoints and prints no bars or summaries; `overrides` add to
    or replace those settings."""
    settings = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
    return L.Trainer(**{**settings, **overrides})


def write_corpus(path: Path, lines: int = 160) -> Path:
    rng = random.Random(0)
    path.write_text(
        "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(lines))
    )
    return path


def debug_config(
    folder: Path,
    corpus: Path,
    *,
    max_steps: int,
    accumulate: int = 1,
    batch_size: int = 8,
    every_n_train_steps: int = 2,
    save_top_k: int = 0,
    strategy: Any = "auto",
    devices: int = 1,
    extra_callbacks: list[dict] | None = None,
    arch: dict | None = None,
) -> Path:
    """configs/pretrain/debug.yaml with the run shortened, validation off, JSONL metrics, a final HF export,
    clean stops on SIGTERM and atomic checkpoints. Relative paths resolve against the run's folder."""
    cfg = yaml.safe_load(DEBUG_CONFIG.read_text())
    trainer = cfg["trainer"]
    trainer.update(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        val_check_interval=None,
        check_val_every_n_epoch=1,
        log_every_n_steps=1,
        enable_progress_bar=False,
        default_root_dir=".",
        plugins=[{"class_path": "astrai_pl.callbacks.AtomicCheckpointIO"}],
    )
    trainer["logger"] = {"class_path": "astrai_pl.callbacks.JSONLLogger", "init_args": {"save_dir": "."}}
    trainer["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {
                "dirpath": "ckpt",
                "save_last": True,
                "save_top_k": save_top_k,
                "every_n_train_steps": every_n_train_steps,
            },
        },
        {"class_path": "astrai_pl.callbacks.HFExport", "init_args": {"dirpath": "hf"}},
        {"class_path": "astrai_pl.callbacks.StopOnSignal"},
        {"class_path": "astrai_pl.callbacks.RNGState"},
        *(extra_callbacks or []),
    ]
    cfg["model"]["init_args"]["scheduler"]["init_args"]["max_steps"] = max_steps
    cfg["model"]["init_args"]["arch"].update(arch or {})
    cfg["data"]["init_args"].update(path=str(corpus), batch_size=batch_size)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(threads: int, extra_path: tuple[Path, ...] = (), **variables: str) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join([*map(str, extra_path), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
        **variables,
    }


def _start(folder: Path, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    log = open(folder / "run.log", "ab")
    return subprocess.Popen(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def launch(config: Path, *args: str, threads: int = 1) -> subprocess.Popen:
    """Start `python -m astrai_pl.cli fit --config config …` in the config's folder, in its own session."""
    cmd = [sys.executable, "-m", "astrai_pl.cli", "fit", "--config", str(config), *args]
    return _start(config.parent, cmd, _env(threads))


def launch_in(folder: Path, config: Path, *args: str, kill_write: tuple[Path, int] | None = None,
              tmpdir: Path | None = None, threads: int = 1) -> subprocess.Popen:
    """Start `python -m astrai_pl.cli fit --config config …` in `folder` (a shipped config's relative paths
    resolve there). kill_write=(checkpoint folder, n): the run SIGKILLs itself halfway through writing the
    n-th file it opens in that folder (tests/killed_writes). tmpdir: its TMPDIR."""
    folder.mkdir(parents=True, exist_ok=True)
    variables = {"TMPDIR": str(tmpdir)} if tmpdir else {}
    if kill_write:
        variables.update(KILL_WRITE_DIR=str(kill_write[0].resolve()), KILL_WRITE_COUNT=str(kill_write[1]))
    cmd = [sys.executable, "-m", "astrai_pl.cli", "fit", "--config", str(config), *args]
    return _start(folder, cmd, _env(threads, (KILLED_WRITES,) if kill_write else (), **variables))


def other_filesystem(near: Path) -> Path:
    """A fresh folder on another filesystem than `near` where there is one (/dev/shm), else one inside `near`."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != near.stat().st_dev else near
    return Path(tempfile.mkdtemp(prefix="tmpdir-", dir=base))


def finish(proc: subprocess.Popen, timeout: float = 240, folder: Path | None = None) -> None:
    """Wait for a launched run and fail with the end of its log unless it exited cleanly. folder: where
    the run's log is when it is not the config's folder."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
    if proc.returncode != 0:
        folder = folder or Path(proc.args[proc.args.index("--config") + 1]).parent
        raise AssertionError(
            f"run in {folder} exited with {proc.returncode}:\n" + (folder / "run.log").read_text()[-4000:]
        )


def wait_for_lines(path: Path, count: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until `path` has `count` lines (a JSONL step line is written when the next step is logged)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if path.is_file() and len(path.read_text().splitlines()) >= count:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before {path} had {count} lines")
        time.sleep(0.02)
    raise AssertionError(f"{path} did not reach {count} lines in {timeout} s")


def losses(folder: Path, key: str = "train/loss") -> dict[int, float]:
    steps: dict[int, float] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if key in row:
            steps[row["step"]] = row[key]
    return steps


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "hf" / "final" / "model.safetensors"))


class MeanLoss(L.Callback):
    """Test probe: the training loss averaged over all ranks after each batch, appended by rank 0."""

    def __init__(self, path: str = "mean_loss.jsonl"):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.strategy.reduce(outputs["loss"].detach().clone(), reduce_op="mean")
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": float(loss)}) + "\n")


def mean_losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "mean_loss.jsonl").read_text().splitlines()]
