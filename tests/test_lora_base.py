"""Where a LoRA checkpoint's base is found again: its resolved path and run are recorded, so a later run that
moves `latest`, or reading it from another folder, still finds it; a base that moved or was overwritten is
found among its run root's checkpoints by its fingerprint, with one log line naming it."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from astrai_pl.checkpoint import CheckpointError, load_transformer
from astrai_pl.checkpoint.runs import point_latest
from astrai_pl.model import ModelConfig
from astrai_pl.objectives import SFT, Pretrain

LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}
WRITTEN = "runs/pretrain/latest/checkpoints/last.ckpt"


def pretrain_run(root, version: int, seed: int):
    """`root/version_N/checkpoints/last.ckpt` of a debug Pretrain run, `latest` moved to it."""
    torch.manual_seed(seed)
    module = Pretrain(arch=ModelConfig.from_name("debug"))
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    path = root / f"version_{version}" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(checkpoint, path)
    point_latest(root, path.parent.parent)
    return path


def lora_run(folder, init_from: str):
    """A LoRA SFT run's checkpoint from `init_from` (adapter only, with B at noise so that it shows)."""
    module = SFT(init_from=init_from, lora=LORA)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    path = folder / "sft" / "version_0" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(checkpoint, path)
    return path, module.model.eval()


def same_logits(a, b) -> bool:
    ids = torch.randint(0, 320, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return torch.allclose(a(ids).logits, b(ids).logits, atol=1e-5)


@pytest.fixture
def trained(tmp_path, monkeypatch):
    """In tmp_path/project: pretrain version_0 (latest), and a LoRA run from `latest` as a config writes it."""
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    base = pretrain_run(project / "runs" / "pretrain", 0, seed=0)
    ckpt, adapted = lora_run(project / "runs", WRITTEN)
    return project, base, ckpt, adapted


def test_the_base_is_recorded_as_its_resolved_path_and_run(trained):
    project, base, ckpt, _ = trained
    record = torch.load(ckpt, weights_only=True)["lora_base"]
    assert record["init_from"] == str(base.resolve()) and os.path.isabs(record["init_from"])
    assert record["as_written"] == WRITTEN and record["run"] == "version_0"
    assert isinstance(record["fingerprint"], float)


def test_a_later_run_that_moves_latest_and_another_folder_leave_the_base_found(trained, tmp_path, monkeypatch):
    project, _, ckpt, adapted = trained
    pretrain_run(project / "runs" / "pretrain", 1, seed=1)  # latest now names other weights
    assert same_logits(load_transformer(None, str(ckpt)), adapted)
    monkeypatch.chdir(tmp_path)  # elsewhere: the relative path the config gave means nothing here
    assert same_logits(load_transformer(None, str(ckpt)), adapted)


def test_a_moved_base_is_found_by_its_fingerprint_among_the_runs_checkpoints(trained, caplog):
    project, base, ckpt, adapted = trained
    pretrain_run(project / "runs" / "pretrain", 1, seed=1)
    root = project / "runs" / "pretrain"
    shutil.move(root / "version_0", root / "version_7")  # the recorded path is gone
    with caplog.at_level(logging.WARNING, logger="astrai_pl.checkpoint.lora_base"):
        model = load_transformer(None, str(ckpt))
    assert same_logits(model, adapted)
    [line] = [r.getMessage() for r in caplog.records if r.name == "astrai_pl.checkpoint.lora_base"]
    assert "is gone" in line and str(root.resolve() / "version_7" / "checkpoints" / "last.ckpt") in line
    assert model.adapter_extra["base_model_name_or_path"].endswith("version_7/checkpoints/last.ckpt")


def test_an_overwritten_base_is_found_in_another_checkpoint_of_its_run(trained, caplog):
    project, base, ckpt, adapted = trained
    shutil.copy(base, base.with_name("step-4.ckpt"))
    torch.manual_seed(5)
    other = Pretrain(arch=ModelConfig.from_name("debug"))
    checkpoint = {"state_dict": other.state_dict(), "hyper_parameters": dict(other.hparams)}
    other.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, base)  # last.ckpt went on training
    with caplog.at_level(logging.WARNING, logger="astrai_pl.checkpoint.lora_base"):
        assert same_logits(load_transformer(None, str(ckpt)), adapted)
    assert "holds other weights" in caplog.text and "step-4.ckpt" in caplog.text


def test_a_checkpoint_recording_the_path_as_written_is_found_from_another_folder(trained, tmp_path, monkeypatch):
    """Checkpoints written before the resolved path was recorded hold init_from as the config gave it."""
    project, _, ckpt, adapted = trained
    stored = torch.load(ckpt, weights_only=True)
    stored["lora_base"] = {"init_from": WRITTEN, "fingerprint": stored["lora_base"]["fingerprint"]}
    torch.save(stored, ckpt)
    pretrain_run(project / "runs" / "pretrain", 1, seed=1)
    monkeypatch.chdir(tmp_path)
    assert same_logits(load_transformer(None, str(ckpt)), adapted)


def test_no_checkpoint_with_the_fingerprint_is_an_error_naming_what_was_searched(trained):
    project, base, ckpt, _ = trained
    torch.manual_seed(5)
    other = Pretrain(arch=ModelConfig.from_name("debug"))
    checkpoint = {"state_dict": other.state_dict(), "hyper_parameters": dict(other.hparams)}
    other.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, base)
    pretrain_run(project / "runs" / "pretrain", 1, seed=1)
    with pytest.raises(CheckpointError, match=r"not those the adapter was trained on .*none of the 1 other "
                                              r"checkpoint\(s\) of its runs \(.*runs/pretrain\)"):
        load_transformer(None, str(ckpt))
    shutil.rmtree(project / "runs" / "pretrain")
    with pytest.raises(CheckpointError, match=r"no such file or directory.*none of the 0 other"):
        load_transformer(None, str(ckpt))


# -- the adapter `convert` exports loads with PEFT's one call --------------------------------------------------
def peft_in_one_call(folder, monkeypatch):
    peft = pytest.importorskip("peft")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything is read from disk; nothing may reach a hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return peft.AutoPeftModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()


def test_convert_writes_a_checkpoints_base_beside_the_adapter_for_peft(trained, tmp_path, monkeypatch):
    from astrai_pl.cli import main

    _, _, ckpt, adapted = trained
    out = tmp_path / "adapter"
    main(["convert", "--ckpt", str(ckpt), "--output", str(out), "--tokenizer", "byte"])
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((out / "base").resolve())
    assert (out / "base" / "config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert same_logits(peft_in_one_call(out, monkeypatch), adapted)
    main(["convert", "--ckpt", str(ckpt), "--output", str(out), "--tokenizer", "byte"])  # again, over its own


def test_an_adapter_on_a_hugging_face_base_names_that_directory(tmp_path, monkeypatch):
    from astrai_pl.cli import main
    from astrai_pl.model import Transformer
    from astrai_pl.tokenizer import Tokenizer

    torch.manual_seed(0)
    Transformer(ModelConfig.from_name("debug")).save_pretrained(tmp_path / "hf", tokenizer=Tokenizer.byte_level())
    monkeypatch.chdir(tmp_path)
    ckpt, adapted = lora_run(tmp_path / "runs", "hf")
    main(["convert", "--ckpt", str(ckpt), "--output", str(tmp_path / "adapter"), "--tokenizer", "byte"])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "hf").resolve())
    assert not (tmp_path / "adapter" / "base").exists()  # no second copy of a base PEFT already reads
    assert same_logits(peft_in_one_call(tmp_path / "adapter", monkeypatch), adapted)


def test_resuming_on_another_base_names_the_recorded_one(trained):
    project, base, ckpt, _ = trained
    pretrain_run(project / "runs" / "pretrain", 1, seed=1)  # the config's init_from now reads other weights
    module = SFT(init_from=WRITTEN, lora=LORA)
    with pytest.raises(CheckpointError, match=rf"not those this LoRA checkpoint was trained on .*'{base.resolve()}'"):
        module.on_load_checkpoint(torch.load(ckpt, weights_only=True))
