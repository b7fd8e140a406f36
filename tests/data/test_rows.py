import json
import logging
import pickle

import pytest
from datasets import Dataset

from astrai_pl.data.preprocess import check_row, preset_sections
from astrai_pl.data.rows import DataError, read_jsonl
from astrai_pl.data.tokenized import load_jsonl, tokenize_dataset
from astrai_pl.tokenizer import Tokenizer

GOOD = {"messages": [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]}
SECTIONS = preset_sections("messages")

BAD_LINES = {  # case -> (line 3 of the file, field named in the error, words in the error)
    "malformed JSON": ('{"messages": [{"role": "user", "content": "hi"}', None, "malformed JSON"),
    "missing field": ('{"conversation": []}', "messages", "missing field"),
    "unknown role": (
        '{"messages": [{"role": "bot", "content": "hi"}]}',
        "messages[0].role",
        "unknown role 'bot'",
    ),
    "empty conversation": ('{"messages": []}', "messages", "empty conversation"),
    "non-string content": (
        '{"messages": [{"role": "user", "content": 5}]}',
        "messages[0].content",
        "expected a string, got int",
    ),
    "missing content": ('{"messages": [{"role": "user"}]}', "messages[0]", "no 'content'"),
}


def write_rows(path, bad_line):
    lines = [json.dumps(GOOD), json.dumps(GOOD), bad_line, "", json.dumps(GOOD)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_each_bad_line_names_file_line_and_field(tmp_path, case):
    line, field, words = BAD_LINES[case]
    path = write_rows(tmp_path / "rows.jsonl", line)
    with pytest.raises(DataError) as caught:
        read_jsonl(path, lambda row: check_row(row, SECTIONS))
    err = caught.value
    assert (err.source, err.line, err.field) == (str(path), 3, field)
    assert f"{path}, line 3" in str(err) and words in str(err) and "Fix:" in str(err)


def test_skip_counts_and_logs_bad_lines(tmp_path, caplog):
    path = write_rows(tmp_path / "rows.jsonl", BAD_LINES["unknown role"][0])
    with caplog.at_level(logging.WARNING):
        rows, lines, skipped = read_jsonl(path, lambda row: check_row(row, SECTIONS), on_bad_row="skip")
    assert (len(rows), lines, skipped) == (3, [1, 2, 5], 1)
    assert "skipped 1 bad row(s)" in caplog.text and "line 3" in caplog.text


def test_load_jsonl_is_file_backed_when_clean_and_names_lines_after_skips(tmp_path):
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join(json.dumps(GOOD) for _ in range(4)) + "\n")
    ds, lines = load_jsonl(clean, SECTIONS, cache_dir=str(tmp_path / "cache"))
    assert ds.cache_files and lines == [1, 2, 3, 4]
    dirty = write_rows(tmp_path / "dirty.jsonl", "{oops")
    ds, lines = load_jsonl(dirty, SECTIONS, on_bad_row="skip", cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 3 and lines == [1, 2, 5]


def test_tokenize_dataset_names_the_row_or_line_and_survives_worker_processes():
    tok = Tokenizer.byte_level()
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "critic", "content": "no"}]}
    ds = Dataset.from_list([GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError, match=r"train.parquet, row 3, field 'messages\[1\].role': unknown role"):
        tokenize_dataset(ds, SECTIONS, tok, source="train.parquet")
    with pytest.raises(DataError, match=r"rows.jsonl, line 7"):
        tokenize_dataset(ds, SECTIONS, tok, source="rows.jsonl", lines=[1, 2, 7, 9], num_proc=2)
    err = DataError("reason", "field", "fix", "file", 3)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_tokenize_dataset_skip_drops_and_logs(caplog):
    tok = Tokenizer.byte_level()
    ds = Dataset.from_list([GOOD, {"messages": [{"role": "user", "content": "only a question"}]}, GOOD])
    ds = ds.map(lambda r: r)  # arrow fills the absent keys with None, as files do
    rows = [GOOD, {"messages": [{"role": "user", "content": None}]}, GOOD]
    with caplog.at_level(logging.WARNING):
        out = tokenize_dataset(Dataset.from_list(rows), SECTIONS, tok, source="x.parquet", on_bad_row="skip")
    assert len(out) == 2 and out.column_names == ["input_ids", "loss_mask"]
    assert "x.parquet, row 2, field 'messages[0].content'" in caplog.text
    assert len(tokenize_dataset(ds, SECTIONS, tok)) == 3  # a user-only row is valid; preflight flags it


def test_load_jsonl_keeps_mixed_column_types_with_or_without_skipped_lines(tmp_path):
    mixed = [json.dumps({**GOOD, "id": 1}), json.dumps({**GOOD, "id": "two"})]
    for name, lines in (("clean.jsonl", mixed), ("dirty.jsonl", [*mixed, "{oops"])):
        (tmp_path / name).write_text("\n".join(lines) + "\n")
        ds, _ = load_jsonl(tmp_path / name, SECTIONS, on_bad_row="skip", cache_dir=str(tmp_path / "cache"))
        assert ds["id"] == [1, "two"] and ds.cache_files
