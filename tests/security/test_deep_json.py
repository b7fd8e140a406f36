"""JSON files that Python's parser cannot take (nested too deeply, an integer of thousands of digits) are
one typed error naming the file, wherever a model, tokenizer or checkpoint folder holds them."""

from __future__ import annotations

import pytest

from astrai_pl.commands import CommandError, generation_eos_ids
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
