"""A field that mixes JSON kinds over the rows (one number among strings) is stored by `datasets` as JSON
text and its strings parsed back; a value that would come back changed is named, not trained on."""

from __future__ import annotations

import json

import pytest

from astrai_pl.data.preprocess import Section
from astrai_pl.data.rows import DataError
from astrai_pl.data.tokenized import load_jsonl

SECTIONS = [Section("prompt", action="mask")]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("skipped", [False, True], ids=["clean", "with a skipped line"])
def test_a_string_that_a_mixed_column_would_change_is_named(tmp_path, skipped):
    rows = [{"prompt": "a", "answer": 2}, {"prompt": "b", "answer": "03"}, {"prompt": "c", "answer": "two"}]
    path = _write(tmp_path / "rows.jsonl", rows)
    if skipped:
        path.write_text(path.read_text() + "{oops\n")
    with pytest.raises(DataError, match=r"rows.jsonl, line 2, field 'answer': '03' would be read back as 3"):
        load_jsonl(path, SECTIONS, on_bad_row="skip", cache_dir=str(tmp_path / "cache"))


def test_one_kind_per_field_reads_back_as_written(tmp_path):
    rows = [{"prompt": "a", "answer": "03"}, {"prompt": "b", "answer": "[1]"}, {"prompt": "c", "answer": None}]
    path = _write(tmp_path / "rows.jsonl", rows)
    dataset, _ = load_jsonl(path, SECTIONS, cache_dir=str(tmp_path / "cache"))
    assert dataset["answer"] == ["03", "[1]", None]
