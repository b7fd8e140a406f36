"""Caches follow a file's content: a data file edited in place — same size, mtime put back — is read anew."""

import json
import os
from pathlib import Path

import pytest

from astrai_pl.data import PretrainData, SFTData


def rewrite_in_place(path: Path, text: str) -> None:
    """Replace the file's text with one of the same size, then restore its mtime (as `cp -p` or a sync tool would)."""
    before = path.stat()
    path.write_text(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def corpus(letter: str, suffix: str) -> str:
    docs = [f"document {i}: " + letter * 60 for i in range(40)]
    return "\n".join(json.dumps({"text": d}) for d in docs) if suffix == ".jsonl" else "\n".join(docs)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_pretrain_windows_follow_an_in_place_edit(tmp_path, suffix):
    path = tmp_path / f"corpus{suffix}"
    path.write_text(corpus("a", suffix))
    cache = str(tmp_path / "cache")
    first = PretrainData(path=str(path), seq_len=16, val_fraction=0.2, cache_dir=cache)
    first.setup()
    rewrite_in_place(path, corpus("b", suffix))
    again = PretrainData(path=str(path), seq_len=16, val_fraction=0.2, cache_dir=cache)
    again.setup()
    fresh = PretrainData(path=str(path), seq_len=16, val_fraction=0.2, cache_dir=str(tmp_path / "fresh"))
    fresh.setup()
    assert again.train_set["input_ids"] == fresh.train_set["input_ids"] != first.train_set["input_ids"]
    assert "b" * 10 in again.tokenizer.decode(again.train_set[0]["input_ids"] + again.train_set[1]["input_ids"])


def sft_rows(answer: str, suffix: str) -> str:
    if suffix == ".txt":
        return "\n".join(f"row {i}: {answer}" for i in range(40))
    rows = [{"messages": [{"role": "user", "content": f"Q{i:02d}"}, {"role": "assistant", "content": answer}]}
            for i in range(40)]
    return "\n".join(json.dumps(r) for r in rows)


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_sft_rows_follow_an_in_place_edit(tmp_path, suffix):
    path = tmp_path / f"rows{suffix}"
    path.write_text(sft_rows("AAAA", suffix))
    sections = "text" if suffix == ".txt" else None

    def trained_text() -> str:
        data = SFTData(path=str(path), sections=sections, packing="none", val_fraction=0.2,
                       cache_dir=str(tmp_path / "cache"))
        data.setup()
        return data.tokenizer.decode(data.train_set[0]["input_ids"])

    assert "AAAA" in trained_text()
    rewrite_in_place(path, sft_rows("BBBB", suffix))
    assert "BBBB" in trained_text()


def test_a_large_file_is_keyed_by_its_size_mtime_and_both_ends(tmp_path, monkeypatch):
    from astrai_pl.data import files

    monkeypatch.setattr(files, "FULL_HASH_BYTES", 1000)
    monkeypatch.setattr(files, "SAMPLE_BYTES", 100)
    small, large = tmp_path / "small.txt", tmp_path / "large.txt"
    small.write_text("x" * 1000)
    large.write_text("x" * 5000)
    seen = {files.file_fingerprint(small), files.file_fingerprint(large)}
    for path, edit in ((small, 500), (large, 0), (large, 4999)):  # middle of a small file, ends of a large one
        text = path.read_text()
        rewrite_in_place(path, text[:edit] + "y" + text[edit + 1:])
        seen.add(files.file_fingerprint(path))
    assert len(seen) == 5
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "part.arrow").write_text("one")
    before = files.source_fingerprint(str(saved))
    (saved / "cache-0123.arrow").write_text("what datasets' maps write into a saved dataset")
    assert files.source_fingerprint(str(saved)) == before
    rewrite_in_place(saved / "part.arrow", "two")
    assert files.source_fingerprint(str(saved)) != before
