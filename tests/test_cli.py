import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from astrai_pl.cli import lightning_main, main
from astrai_pl.model import LoraConfig, Transformer
from astrai_pl.model.trainable_tokens import token_ids
from astrai_pl.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "sweeps" not in p.parts)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_parses_and_instantiates(config):
    args = ["--config", str(config), "--trainer.logger", "false"]
    init_from = yaml.safe_load(config.read_text())["model"]["init_args"].get("init_from")
    if init_from and not Path(init_from).exists():  # a later stage of the demo, before the earlier ran
        args += ["--model.init_args.init_from", "null"]
    cli = lightning_main(args, run=False)
    assert cli.model.tokenizer is cli.datamodule.tokenizer  # declared once, linked
    # every ModelConfig field is spelled out so a diff shows every change
    arch = yaml.safe_load(config.read_text())["model"]["init_args"].get("arch")
    if arch is not None:
        assert set(arch) == set(cli.model.arch.to_dict())
    lora = yaml.safe_load(config.read_text())["model"]["init_args"].get("lora")
    if lora is not None:  # every LoraConfig field spelled out, and the adapter is what the model trains
        assert set(lora) == {f.name for f in dataclasses.fields(LoraConfig)}
        tokens = lora.get("trainable_token_indices")  # token strings are kept as the tokenizer's ids
        if tokens is not None:
            lora["trainable_token_indices"] = token_ids(tokens, cli.datamodule.tokenizer, cli.model.model.config.vocab_size)
        assert cli.model.model.lora_config == LoraConfig(**lora)


def test_print_config_shows_field_documentation(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs/pretrain/debug.yaml"), "--print_config=comments"])
    out = capsys.readouterr().out
    assert "# Width of the residual stream." in out
    assert "# Tokens per training window." in out


def test_fit_runs_from_the_command_line(tmp_path):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(f"line {i} of a small corpus for a smoke test" for i in range(300)))
    cmd = [sys.executable, "-m", "astrai_pl.cli", "fit", "--config", str(ROOT / "configs/pretrain/debug.yaml"),
           "--data.init_args.path", str(corpus), "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
           "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false",
           "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false",
           "--trainer.enable_progress_bar", "false"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max_steps=3" in result.stdout + result.stderr


def test_unknown_verb_is_named():
    with pytest.raises(SystemExit, match="unknown command 'trian'"):
        main(["trian"])


def test_tokenizer_train_verb(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(["the cat sat on the mat", "the dog sat on the log"] * 200))
    main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--output", str(tmp_path / "tok")])
    tok = Tokenizer.from_pretrained(tmp_path / "tok")
    assert 264 < tok.vocab_size <= 300
    assert tok.decode(tok.encode("the cat sat")) == "the cat sat"


def test_convert_verb_exports_a_checkpoint(tmp_path):
    from astrai_pl.model import ModelConfig
    from astrai_pl.objectives import Pretrain

    torch.manual_seed(0)
    module = Pretrain(arch=ModelConfig.from_name("debug"))
    ckpt = tmp_path / "m.ckpt"
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, ckpt)
    main(["convert", "--ckpt", str(ckpt), "--output", str(tmp_path / "hf"), "--tokenizer", "byte"])
    loaded = Transformer.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 320, (1, 8))
    torch.testing.assert_close(loaded(ids).logits, module.model(ids).logits)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def _pretrain_ckpt(path, tokenizer=None):
    """A Pretrain checkpoint as fit writes it; `tokenizer` the data module's recorded setting, if any."""
    from astrai_pl.model import ModelConfig
    from astrai_pl.objectives import Pretrain

    module = Pretrain(arch=ModelConfig.from_name("debug"))
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    if tokenizer is not None:
        checkpoint["datamodule_hyper_parameters"] = {"tokenizer": tokenizer, "seq_len": 64}
    torch.save(checkpoint, path)
    return path


def test_convert_writes_the_tokenizer_the_run_trained_with(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(["the cat sat on the mat", "the dog sat on the log"] * 200))
    main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--output", str(tmp_path / "tok")])
    ckpt = _pretrain_ckpt(tmp_path / "bpe.ckpt", tokenizer=str(tmp_path / "tok"))
    main(["convert", "--ckpt", str(ckpt), "--output", str(tmp_path / "hf")])
    assert "the run's, as its checkpoint records it" in capsys.readouterr().out
    exported = Tokenizer.from_pretrained(tmp_path / "hf")
    trained = Tokenizer.from_pretrained(tmp_path / "tok")
    assert exported.vocab_size == trained.vocab_size and exported.encode("the cat") == trained.encode("the cat")

    main(["convert", "--ckpt", str(_pretrain_ckpt(tmp_path / "byte.ckpt", "byte")), "--output", str(tmp_path / "b")])
    assert Tokenizer.from_pretrained(tmp_path / "b").vocab_size == Tokenizer.byte_level().vocab_size


def test_convert_names_a_recorded_tokenizer_that_is_gone_and_writes_none_without_a_record(tmp_path, capsys):
    ckpt = _pretrain_ckpt(tmp_path / "gone.ckpt", tokenizer=str(tmp_path / "moved-away"))
    with pytest.raises(SystemExit, match=r"moved-away.*--tokenizer DIR"):
        main(["convert", "--ckpt", str(ckpt), "--output", str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()
    main(["convert", "--ckpt", str(ckpt), "--output", str(tmp_path / "hf"), "--tokenizer", "byte"])  # the way out
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    main(["convert", "--ckpt", str(_pretrain_ckpt(tmp_path / "none.ckpt")), "--output", str(tmp_path / "bare")])
    assert "no tokenizer" in capsys.readouterr().out and not (tmp_path / "bare" / "tokenizer.json").exists()
