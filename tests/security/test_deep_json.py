"""JSON files that Python's parser cannot take (nested too deeply, an integer of thousands of digits) are
one typed error naming the file, wherever a model, tokenizer or checkpoint folder holds them."""

from __future__ import annotations

import pytest

from astrai_pl.cli import main
from astrai_pl.commands import CommandError, generation_eos_ids
from astrai_pl.model import ModelConfig, Transformer
from astrai_pl.model.hf import CheckpointError
from astrai_pl.tokenizer import Tokenizer, TokenizerError

UNREADABLE = {"nested too deeply": "[" * 100_000 + "]" * 100_000,
              "a 5000-digit integer": '{"eos_token_id": ' + "9" * 5000 + "}"}


@pytest.mark.parametrize("text", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_tokenizer_config_that_python_cannot_parse_names_the_file(tmp_path, text):
    Tokenizer.byte_level().save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(text)
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("text", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_generation_config_that_python_cannot_parse_names_the_file(tmp_path, text):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(CommandError, match="generation_config.json is not a JSON object"):
        generation_eos_ids(tmp_path)


@pytest.mark.parametrize("text", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_config_json_that_python_cannot_parse_names_the_file(tmp_path, text):
    Transformer(ModelConfig.from_name("debug")).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        Transformer.from_pretrained(tmp_path)


def test_convert_of_a_damaged_checkpoint_is_one_line(tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(SystemExit, match=rf"^astrai-pl convert: {bad}: not a checkpoint"):
        main(["convert", "--ckpt", str(bad), "--output", str(tmp_path / "out")])
