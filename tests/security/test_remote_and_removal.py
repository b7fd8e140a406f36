"""A remote --ckpt_path runs no code, and a path recorded in a checkpoint file never makes a run delete
anything but a checkpoint."""

from __future__ import annotations

import functools
import http.server
import sys
import threading
from pathlib import Path

import pytest
import torch

from astrai_pl.callbacks import AtomicCheckpointIO, CheckpointError
from astrai_pl.cli import lightning_main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fit_runs import write_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT_EVERY_STEP = ('[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": '
                         '{"dirpath": "checkpoints", "save_last": true, "save_top_k": 0, "every_n_train_steps": 1, '
                         '"enable_version_counter": false}}]')


class WritesAFile:
    """Unpickling this opens (creates) `marker`: the stand-in for any code a pickle can run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_folder(tmp_path, monkeypatch):
    """(folder, base URL): a file server on 127.0.0.1 over `folder`, shut down after the test (or 60 s)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # where torch.hub would cache a download
    folder = tmp_path / "served"
    folder.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=folder))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    deadline = threading.Timer(60, server.shutdown)
    deadline.start()
    try:
        yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        deadline.cancel()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_an_http_checkpoint_is_unpickled_weights_only(http_folder, tmp_path):
    folder, url = http_folder
    marker = tmp_path / "ran"
    torch.save({"state_dict": {}, "payload": WritesAFile(marker)}, folder / "evil.ckpt")
    with pytest.raises(CheckpointError, match="weights_only=True") as err:
        AtomicCheckpointIO().load_checkpoint(f"{url}/evil.ckpt")
    assert not marker.exists()
    assert f"{url}/evil.ckpt" in str(err.value) and len(str(err.value).splitlines()) == 1


def test_an_unreadable_http_checkpoint_is_one_checkpoint_error_naming_it(http_folder):
    folder, url = http_folder
    (folder / "junk.ckpt").write_bytes(b"not a checkpoint")
    for name in ("junk.ckpt", "missing.ckpt"):
        with pytest.raises(CheckpointError, match=f"{url}/{name}"):
            AtomicCheckpointIO().load_checkpoint(f"{url}/{name}")
    torch.save({"state_dict": {"w": torch.ones(2)}}, folder / "good.ckpt")
    assert torch.equal(AtomicCheckpointIO().load_checkpoint(f"{url}/good.ckpt")["state_dict"]["w"], torch.ones(2))


def _victim(folder: Path) -> Path:
    victim = folder / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "sub" / "file.txt").write_text("precious")
    (victim / "checksums.json").write_text("{}")  # looks like a sharded checkpoint folder
    return victim


def test_only_checkpoints_are_removed(tmp_path):
    io, run = AtomicCheckpointIO(), tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    victim = _victim(tmp_path)
    (run / "link.ckpt").symlink_to(victim, target_is_directory=True)
    (run / "notes.txt").write_text("mine")
    (run / "plain.ckpt").mkdir()
    refused = [run / ".." / ".." / "victim", run / "link.ckpt", run / "notes.txt", run / "plain.ckpt"]
    for path in refused:
        with pytest.warns(UserWarning, match="not removed"):
            io.remove_checkpoint(str(path))
    assert (victim / "sub" / "file.txt").read_text() == "precious"
    assert (run / "notes.txt").exists() and (run / "plain.ckpt").is_dir() and (run / "link.ckpt").is_symlink()
    torch.save({}, run / "step-2.ckpt")
    (run / "sharded.ckpt").mkdir()
    (run / "sharded.ckpt" / "meta.pt").write_bytes(b"")
    io.remove_checkpoint(str(run / "step-2.ckpt"))
    io.remove_checkpoint(str(run / "sharded.ckpt"))
    io.remove_checkpoint(str(run / "gone.ckpt"))  # nothing there: nothing to do, no warning
    assert not (run / "step-2.ckpt").exists() and not (run / "sharded.ckpt").exists()


def _fit(folder: Path, corpus: Path, max_steps: int, *extra: str) -> None:
    lightning_main(["fit", "--config", str(ROOT / "configs/pretrain/debug.yaml"), "--data.init_args.path",
                    str(corpus), "--trainer.max_steps", str(max_steps), "--trainer.enable_progress_bar", "false",
                    "--trainer.default_root_dir", str(folder), "--trainer.limit_val_batches", "0",
                    "--trainer.logger", "false", "--trainer.callbacks", CHECKPOINT_EVERY_STEP, *extra])


def test_resuming_from_a_crafted_checkpoint_deletes_nothing_outside_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # checkpoints go to tmp_path/checkpoints
    corpus, victim = write_corpus(tmp_path / "corpus.txt"), _victim(tmp_path)
    _fit(tmp_path, corpus, 1)
    ckpt = torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)
    states = [v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint")]
    for state in states:
        state["last_model_path"] = f"{state['dirpath']}/../victim"
    torch.save(ckpt, tmp_path / "crafted.ckpt")
    with pytest.warns(UserWarning, match="victim: not removed, because its path has a '..' component"):
        _fit(tmp_path, corpus, 2, "--ckpt_path", str(tmp_path / "crafted.ckpt"))
    assert states and (victim / "sub" / "file.txt").read_text() == "precious"
    assert torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 2
