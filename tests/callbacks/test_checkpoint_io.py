import subprocess
import sys
import textwrap

import lightning as L
import pytest
import torch

from astrai_pl.callbacks import AtomicCheckpointIO, CheckpointError, read_checkpoint
from astrai_pl.model import ModelConfig
from astrai_pl.objectives import Pretrain
from astrai_pl.strategy import FSDP2Strategy


def _checkpoint(value: float) -> dict:
    return {"state_dict": {"w": torch.full((256, 256), value)}, "global_step": int(value)}


def test_a_kill_during_a_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_checkpoint(1.0), target)
    script = textwrap.dedent(f"""
        import os, signal, torch
        from astrai_pl.callbacks import AtomicCheckpointIO

        class DiesWhilePickled:
            def __reduce__(self):
                os.kill(os.getpid(), signal.SIGKILL)

        big = {{"w": torch.full((256, 256), 2.0), "z": DiesWhilePickled()}}
        AtomicCheckpointIO().save_checkpoint({{"state_dict": big, "global_step": 2}}, {str(target)!r})
    """)
    result = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert result.returncode == -9
    assert list(tmp_path.glob(".last.ckpt.*.partial"))  # the interrupted write, beside the target
    loaded = read_checkpoint(target)
    assert loaded["global_step"] == 1 and torch.equal(loaded["state_dict"]["w"], torch.full((256, 256), 1.0))
    AtomicCheckpointIO().save_checkpoint(_checkpoint(3.0), target)
    assert read_checkpoint(target)["global_step"] == 3
    assert not list(tmp_path.glob(".last.ckpt.*.partial"))  # the next save clears the leftover


def test_a_truncated_checkpoint_names_itself_and_the_others(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint(_checkpoint(1.0), tmp_path / "step-1.ckpt")
    io.save_checkpoint(_checkpoint(2.0), tmp_path / "last.ckpt")
    data = (tmp_path / "last.ckpt").read_bytes()
    (tmp_path / "last.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"last\.ckpt: truncated checkpoint.*remaining: step-1\.ckpt"):
        io.load_checkpoint(tmp_path / "last.ckpt")


def test_a_corrupted_checkpoint_fails_its_checksum(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_checkpoint(1.0), path)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2  # inside the tensor bytes, which torch.load alone would accept
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"corrupted checkpoint: the bytes of .* do not match the checksum"
    ):
        read_checkpoint(path)


class Opaque:
    pass


def test_objects_outside_weights_only_are_refused_with_the_way_out(tmp_path):
    path = tmp_path / "odd.ckpt"
    torch.save({"state_dict": {}, "extra": Opaque()}, path)
    with pytest.raises(CheckpointError, match=r"weights_only=True refuses.*add_safe_globals"):
        read_checkpoint(path)


def test_resuming_a_fit_from_a_broken_checkpoint_raises_the_clear_error(tmp_path):
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"PK\x03\x04 not really a checkpoint")
    data = torch.utils.data.DataLoader(
        [{"input_ids": torch.ones(2, 8, dtype=torch.long)}] * 2, batch_size=None
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=tmp_path,
    )
    with pytest.raises(CheckpointError, match="truncated checkpoint"):
        trainer.fit(
            Pretrain(arch=ModelConfig.from_name("debug")), train_dataloaders=data, ckpt_path=str(path)
        )


def test_an_incomplete_sharded_checkpoint_is_named(tmp_path):
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="incomplete sharded checkpoint"):
        FSDP2Strategy().load_checkpoint(folder)
