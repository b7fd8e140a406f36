"""An explicit --ckpt_path FILE restores weights and loop state only: the hyperparameters stored in the file
never choose what the run builds or imports (the config alone does)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from astrai_pl.cli import AstraiCLI, lightning_main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fit_runs import write_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class Built(Exception):
    """Raised in place of training, once the objective is built."""


def _build(config: str, ckpt: Path, folder: Path, monkeypatch, *extra: str):
    """The objective `astrai-pl fit --config CONFIG --ckpt_path CKPT` builds, stopped before it trains."""
    def stop(cli):
        raise Built(cli.model)

    monkeypatch.setattr(AstraiCLI, "before_fit", stop, raising=False)
    corpus = write_corpus(folder / "corpus.txt")
    with pytest.raises(Built) as built:
        lightning_main(["fit", "--config", str(ROOT / config), "--ckpt_path", str(ckpt),
                        "--data.init_args.path", str(corpus), "--trainer.logger", "false",
                        "--trainer.default_root_dir", str(folder), "--trainer.callbacks", "[]",
                        "--trainer.enable_checkpointing", "false", *extra])
    return built.value.args[0]


def _checkpoint_with(folder: Path, hyper_parameters: dict) -> Path:
    path = folder / "planted.ckpt"
    torch.save({"hyper_parameters": hyper_parameters, "state_dict": {}}, path)
    return path


def test_stored_hyperparameters_do_not_replace_the_config(tmp_path, monkeypatch):
    ckpt = _checkpoint_with(tmp_path, {"_class_path": "astrai_pl.objectives.Pretrain", "label_smoothing": 0.7})
    model = _build("configs/pretrain/debug.yaml", ckpt, tmp_path, monkeypatch)
    assert model.label_smoothing == 0.0  # the shipped config's value, not the file's


def test_an_import_path_stored_in_a_checkpoint_is_never_imported(tmp_path, monkeypatch):
    # A module that does something the moment it is imported stands for any import path a file could name.
    witness = tmp_path / "imported"
    (tmp_path / "planted_reward.py").write_text(
        f"from pathlib import Path\nPath({str(witness)!r}).write_text('ran')\n"
        "def reward(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ckpt = _checkpoint_with(tmp_path, {"_class_path": "astrai_pl.objectives.GRPO",
                                       "reward_funcs": ["planted_reward.reward"], "reward_weights": None})
    model = _build("configs/grpo/debug.yaml", ckpt, tmp_path, monkeypatch, "--model.init_args.init_from", "null")
    assert not witness.exists()
    assert "planted_reward" not in sys.modules and model.reward_funcs
    sys.modules.pop("planted_reward", None)
