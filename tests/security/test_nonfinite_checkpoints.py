"""Weights holding NaN or ±inf are refused wherever a model is loaded from one of our checkpoints, and never
written to a Hugging Face export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from astrai_pl.checkpoint import load_transformer
from astrai_pl.cli import main as cli_main
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.model.hf import NonFiniteWeightError


def _checkpoint(folder: Path, bad: float) -> Path:
    """A .ckpt as astrai-pl fit writes it, with one value of lm_head.weight set to `bad`."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("debug")
    state = {f"model.{k}": v.clone() for k, v in Transformer(cfg).state_dict().items()}
    state["model.lm_head.weight"][3, 5] = bad
    path = folder / f"bad-{bad}.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": {"arch": cfg.to_dict()}, "global_step": 7}, path)
    return path


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_init_from_refuses_nonfinite_weights(tmp_path, bad):
    path = _checkpoint(tmp_path, bad)
    with pytest.raises(NonFiniteWeightError, match=r"bad-.*\.ckpt: weight\(s\) model\.lm_head\.weight hold NaN"):
        load_transformer(None, str(path))


def test_generate_refuses_a_checkpoint_with_nan_weights(tmp_path, capsys):
    path = _checkpoint(tmp_path, float("nan"))
    with pytest.raises(SystemExit) as stop:
        cli_main(["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "4"])
    assert str(path) in str(stop.value.code) and "lm_head.weight" in str(stop.value.code)
    assert capsys.readouterr().out == ""


def test_convert_writes_no_export_from_nan_weights(tmp_path):
    path, out = _checkpoint(tmp_path, float("nan")), tmp_path / "hf"
    with pytest.raises(SystemExit, match=r"^astrai-pl convert: .*bad-nan.ckpt: weight\(s\) model.lm_head.weight hold NaN"):
        cli_main(["convert", "--ckpt", str(path), "--output", str(out)])
    assert not out.exists()


def test_save_pretrained_refuses_nonfinite_weights_and_keeps_the_previous_export(tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("debug"))
    model.save_pretrained(tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteWeightError, match=r"hf: not written, because weight\(s\) model\.layers\.0\.mlp"):
        model.save_pretrained(tmp_path / "hf")
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
