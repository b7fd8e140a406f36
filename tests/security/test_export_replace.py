"""A Hugging Face export killed at any point of replacing the previous one leaves a complete export that
loading finds, and the next export puts everything back in order."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from astrai_pl.checkpoint import load_transformer
from astrai_pl.model import ModelConfig, Transformer

CHILD = """
import os, shutil, signal, sys, torch
from astrai_pl.model import ModelConfig, Transformer
torch.set_num_threads(1)
target, kill_at = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0); Transformer(ModelConfig.from_name("debug")).save_pretrained(target)
steps = []  # the renames and the removal that replace the previous export
def killed_at_step(module, name):
    real = getattr(module, name)
    def step(path, *args, **kwargs):
        if "final" in os.path.basename(str(path)) + os.path.basename(str(args[0] if args else "")):
            if len(steps) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            steps.append(name)
        return real(path, *args, **kwargs)
    setattr(module, name, step)
for module, name in ((os, "rename"), (os, "replace"), (shutil, "rmtree")):
    killed_at_step(module, name)
torch.manual_seed(1); Transformer(ModelConfig.from_name("debug")).save_pretrained(target)
"""


def _model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig.from_name("debug"))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("kill_at", [0, 1, 2])  # before the first rename, the second, the removal of the old copy
def test_an_export_killed_while_replacing_the_previous_one_leaves_a_complete_one(tmp_path, kill_at):
    target = tmp_path / "hf" / "final"
    child = subprocess.run([sys.executable, "-c", CHILD, str(target), str(kill_at)], timeout=120,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.returncode == -signal.SIGKILL
    assert target.exists() == (kill_at != 1)
    first, second = _model(0), _model(1)
    loaded = Transformer.from_pretrained(target)  # kill_at=1: only the copies beside `final` remain
    assert _same(loaded, first if kill_at == 0 else second)
    assert _same(load_transformer(None, str(target)), loaded)
    third = _model(2)
    third.save_pretrained(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["final"]
    assert _same(Transformer.from_pretrained(target), third)


def test_the_first_export_killed_while_written_leaves_no_export(tmp_path):
    target = tmp_path / "final"
    partial = tmp_path / ".final.partial"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")  # a save cut off before config.json, written last
    with pytest.raises(FileNotFoundError, match="final"):
        Transformer.from_pretrained(target)
    _model(0).save_pretrained(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert _same(Transformer.from_pretrained(target), _model(0))
