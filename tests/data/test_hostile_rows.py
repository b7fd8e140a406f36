"""Rows that Python's JSON reader or the tokenizer cannot take are one DataError naming file and line."""

import json
import logging

import pandas as pd
import pytest

from astrai_pl.commands import CommandError, read_prompts
from astrai_pl.data import PretrainData
from astrai_pl.data.corpus import is_held_out
from astrai_pl.data.rows import DataError, Dropped, read_jsonl
from astrai_pl.tokenizer import Tokenizer

GOOD = '{"text": "fine"}'
DEEP = '{"text": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
BIG_INT = '{"text": "x", "extra": ' + "1" * 5000 + "}"
UNREADABLE = {"deep": (DEEP, "nested too deeply"), "big int": (BIG_INT, "an integer of more than")}


@pytest.mark.parametrize("kind", sorted(UNREADABLE))
def test_rows_json_cannot_read_are_named_or_skipped(tmp_path, kind):
    line, why = UNREADABLE[kind]
    path = tmp_path / "rows.jsonl"
    path.write_text(f"{GOOD}\n{line}\n{GOOD}\n")
    with pytest.raises(DataError, match=rf"rows\.jsonl, line 2: malformed JSON \({why}"):
        read_jsonl(path)
    dropped = Dropped()
    rows = read_jsonl(path, on_bad_row="skip", dropped=dropped)
    assert rows.lines == [1, 3] and rows.skipped == 1 and dropped == {"malformed JSON": 1}


@pytest.mark.parametrize("kind", sorted(UNREADABLE))
def test_generate_input_json_cannot_read_is_named(tmp_path, kind):
    line, why = UNREADABLE[kind]
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line.replace('"text"', '"prompt"') + "\n")
    with pytest.raises(CommandError, match=rf"prompts\.jsonl:2: not valid JSON \({why}"):
        read_prompts(path, Tokenizer.byte_level(), False, False, 10_000)


DOC = "alpha beta gamma delta " * 3


def _corpus(tmp_path, odd_line, at=4, n=40):
    lines = [json.dumps({"text": f"{i} {DOC}"}) for i in range(n)]
    lines[at - 1] = odd_line
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return PretrainData(path=str(path), seq_len=16, val_fraction=0.2, cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("odd", ['{"text": null}', '{"other": "no text field"}'])
def test_pretrain_documents_without_text_are_skipped_and_counted(tmp_path, caplog, odd):
    data = _corpus(tmp_path, odd)
    with caplog.at_level(logging.WARNING):
        data.setup()
    assert "skipped 1 document(s) without text" in caplog.text
    texts = [None if i == 3 else f"{i} {DOC}" for i in range(40)]
    train = [t for i, t in enumerate(texts) if t is not None and not is_held_out(str(i), 0.2, 0)]
    stream = [t for ids in data.tokenizer.encode_batch(train) for t in ids + [data.tokenizer.eos_token_id]]
    windows = [stream[i:i + 16] for i in range(0, len(stream) // 16 * 16, 16)]
    assert data.train_set["input_ids"] == windows


@pytest.mark.parametrize("odd, why", [
    ('{"text": 12}', r"field 'text': expected a string, got int 12"),
    ('{"text": ["a", "b"]}', r"field 'text': expected a string, got list"),
    ('{"text": {"a": 1}}', r"field 'text': expected a string, got dict"),
    (DEEP, r"malformed JSON \(nested too deeply"),
    ('{"text": "cut', r"malformed JSON"),
    ('["not", "an", "object"]', r"expected a JSON object per line"),
])
def test_pretrain_text_that_is_not_a_string_is_named(tmp_path, odd, why):
    with pytest.raises(DataError, match=rf"corpus\.jsonl, line 4(, |: ){why}"):
        _corpus(tmp_path, odd).setup()


def test_pretrain_long_integer_in_another_field_still_reads(tmp_path):
    data = _corpus(tmp_path, BIG_INT)
    data.setup()
    assert len(data.train_set) > 0


def test_pretrain_non_string_text_in_parquet_is_named_by_row(tmp_path):
    path = tmp_path / "corpus.parquet"
    pd.DataFrame({"text": [[1, 2]] * 3 + [[]]}).to_parquet(path)
    with pytest.raises(DataError, match=r"corpus\.parquet, row 1, field 'text': expected a string, got"):
        PretrainData(path=str(path), seq_len=4, cache_dir=str(tmp_path / "cache")).setup()


def test_pretrain_missing_text_column_is_a_data_error(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"body": "hello world"}\n' * 10)
    with pytest.raises(DataError, match=r"corpus\.jsonl, field 'text_field': no column 'text' \(columns: body\)"):
        PretrainData(path=str(path), seq_len=4, cache_dir=str(tmp_path / "cache")).setup()
