"""An export into an existing folder never deletes a file it did not write, and overwrites one only when asked."""

from __future__ import annotations

import pytest
import torch

from astrai_pl.cli import main as cli_main
from astrai_pl.model import LoraConfig, ModelConfig, Transformer
from astrai_pl.model.export_manifest import ExportConflictError
from astrai_pl.model.lora import apply_lora


def _model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig.from_name("debug"))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_files_the_export_does_not_write_are_kept(tmp_path):
    (tmp_path / "model-finetuned-v3.safetensors").write_bytes(b"the user's own weights")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("mine")
    _model(0).save_pretrained(tmp_path)
    assert (tmp_path / "model-finetuned-v3.safetensors").read_bytes() == b"the user's own weights"
    assert (tmp_path / "notes" / "README.md").read_text() == "mine"
    assert _same(Transformer.from_pretrained(tmp_path), _model(0))


def test_a_file_no_export_wrote_is_overwritten_only_when_asked(tmp_path):
    (tmp_path / "config.json").write_text('{"mine": true}')
    with pytest.raises(ExportConflictError, match=r"holds config\.json, which this export would overwrite.*"
                                                  r"overwrite=True \(astrai-pl convert --overwrite\)"):
        _model(0).save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}")) == []
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    assert (tmp_path / "config.json").read_text() == '{"mine": true}'
    _model(0).save_pretrained(tmp_path, overwrite=True)
    assert _same(Transformer.from_pretrained(tmp_path), _model(0))


def test_a_new_export_replaces_what_the_last_one_wrote_and_nothing_else(tmp_path):
    _model(0).save_pretrained(tmp_path, max_shard_size=200_000)  # sharded
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    (tmp_path / "README.md").write_text("kept")
    _model(1).save_pretrained(tmp_path)  # one file: the old shards and index were ours, so they go
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "README.md", "config.json", "generation_config.json", "model.safetensors"]
    assert _same(Transformer.from_pretrained(tmp_path), _model(1))
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes())  # rewritten since
    with pytest.raises(ExportConflictError, match="holds model.safetensors"):
        _model(2).save_pretrained(tmp_path)


def test_a_single_file_from_elsewhere_beside_a_new_sharded_index_needs_overwrite(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"from elsewhere")  # would shadow the index in transformers
    with pytest.raises(ExportConflictError, match="holds model.safetensors"):
        _model(0).save_pretrained(tmp_path, max_shard_size=200_000)
    _model(0).save_pretrained(tmp_path, max_shard_size=200_000, overwrite=True)
    assert not (tmp_path / "model.safetensors").exists()
    assert _same(Transformer.from_pretrained(tmp_path), _model(0))


def test_convert_refuses_without_overwrite_and_names_the_flag(tmp_path):
    ckpt = tmp_path / "hf"
    _model(0).save_pretrained(ckpt)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    with pytest.raises(SystemExit, match=r"astrai-pl convert: .*config\.json.*--overwrite"):
        cli_main(["convert", "--ckpt", str(ckpt), "--output", str(out)])
    assert (out / "config.json").read_text() == '{"mine": true}'
    cli_main(["convert", "--ckpt", str(ckpt), "--output", str(out), "--overwrite"])
    assert _same(Transformer.from_pretrained(out), _model(0))


def test_an_adapter_export_keeps_the_folders_other_files(tmp_path):
    model = _model(0)
    apply_lora(model, LoraConfig(r=2))
    (tmp_path / "notes.txt").write_text("mine")
    model.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)  # again: what it wrote is its own
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "adapter_config.json").is_file()
    (tmp_path / "adapter_config.json").write_text("{}")  # the user's now
    with pytest.raises(ExportConflictError, match="adapter_config.json"):
        model.save_pretrained(tmp_path)


def test_a_reward_model_never_replaces_a_folder_holding_files_no_export_wrote(tmp_path):
    from astrai_pl.objectives import RewardModel

    module = RewardModel(arch=ModelConfig.from_name("debug"))
    target = tmp_path / "rm"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ExportConflictError, match="notes.txt.*overwrite=True"):
        module.save_pretrained(target)
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]  # nothing was written, nothing removed
    (target / "notes.txt").unlink()
    module.save_pretrained(target)
    module.save_pretrained(target)  # its own export again: every file is one an export wrote, as renamed
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ExportConflictError):
        module.save_pretrained(target)
    module.save_pretrained(target, overwrite=True)
    assert not (target / "notes.txt").exists() and (target / "config.json").is_file()
