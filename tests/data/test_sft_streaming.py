"""Streaming SFT rows: examples are the map-style encoding packed block by block, the position round-trips
through a checkpoint exactly (across passes too), held-out rows never train, bad rows are named by line,
and the shipped example config prepares."""

from __future__ import annotations

import io
import itertools
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from astrai_pl.data import DataError, SFTData
from astrai_pl.data.formats import encode_row
from astrai_pl.data.packing import IGNORE_INDEX
from astrai_pl.data.preprocess import Section, preset_sections
from astrai_pl.data.sampling import ResumeMismatchError
from astrai_pl.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _row(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {i} + {i % 7}?"},
                         {"role": "assistant", "content": f"{i + i % 7}" + "!" * (i % 5)}]}


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft-stream")
    for k in range(2):
        _jsonl(folder / f"chat-{k}.jsonl", [_row(100 * k + i) for i in range(30)])
    return folder


def _data(path, **overrides):
    settings = dict(path=str(path), streaming=True, max_seq_len=64, batch_size=3, val_rows=4, shuffle_rows=8,
                    cache_dir=str(Path(path).parent / "cache"))
    data = SFTData(**{**settings, **overrides})
    data.setup("fit")
    return data


def _batches(data, n, state=None):
    loader = data.train_dataloader()
    if state is not None:
        loader.load_state_dict(state)
    return loader, list(itertools.islice(iter(loader), n))


def test_examples_are_the_rows_encoded_as_the_map_style_path_in_file_order(files):
    """Without shuffling or packing, each example is one row after the held-out ones, ids and labels as
    encode_row gives them, in file order, then the next file."""
    data = _data(files / "chat-*.jsonl", shuffle_rows=0, packing="none", batch_size=1)
    _, batches = _batches(data, 30)
    rows = [_row(i) for i in range(4, 30)] + [_row(100 + i) for i in range(4)]
    tok = data.tokenizer
    for batch, row in zip(batches, rows, strict=True):
        expected = encode_row(row, preset_sections("messages"), tok)
        assert batch["input_ids"][0].tolist() == expected["input_ids"]
        labels = [t if m else IGNORE_INDEX for t, m in zip(expected["input_ids"], expected["loss_mask"])]
        assert batch["labels"][0].tolist() == [IGNORE_INDEX] + labels[1:]
    assert [e["input_ids"] for e in data.val_set] == [
        encode_row(_row(i), preset_sections("messages"), tok)["input_ids"] for i in range(4)]


def test_packed_examples_hold_every_trained_row_once_per_pass(files):
    """bfd within blocks: a pass's examples hold each training row's assistant answer exactly once."""
    data = _data(files / "chat-0.jsonl", shuffle_rows=8, packing="bfd", batch_size=1, val_rows=4)
    loader = data.train_dataloader()
    it, seen = iter(loader), []
    while loader.position["pass"] == 0:  # the batch that moves the position to pass 1 is of that pass
        seen.append(next(it))
    assert all(b["input_ids"].shape[1] <= 64 for b in seen)
    text = "".join(data.tokenizer.decode(b["input_ids"][0].tolist()) for b in seen[:-1])
    assert [text.count(f"What is {i} + {i % 7}?") for i in range(30)] == [0] * 4 + [1] * 26


def test_position_round_trips_through_a_checkpoint_across_passes(files):
    reference = _batches(_data(files / "chat-*.jsonl"), 40)[1]
    loader, first = _batches(_data(files / "chat-*.jsonl"), 17)
    buffer = io.BytesIO()
    torch.save(loader.state_dict(), buffer)  # as Lightning stores it
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert state["batches"] == 17
    resumed, rest = _batches(_data(files / "chat-*.jsonl"), 40 - 17, state)
    for a, b in zip([*first, *rest], reference, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.position["pass"] >= 1  # 52 training rows in ~40 batches of 3 packed examples: a new pass
    with pytest.raises(ResumeMismatchError, match="batch_size"):
        _data(files / "chat-*.jsonl", batch_size=4).train_dataloader().load_state_dict(state)


def test_parquet_rows_stream_like_jsonl(files, tmp_path):
    rows = [_row(i) for i in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    parquet = _batches(_data(tmp_path / "chat.parquet", cache_dir=str(tmp_path / "c")), 6)[1]
    jsonl = _batches(_data(files / "chat-0.jsonl"), 6)[1]
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(parquet, jsonl, strict=True))


def test_bad_rows_are_named_by_line_or_skipped_and_counted(tmp_path, caplog):
    rows = [_row(i) for i in range(20)]
    rows[9] = {"messages": [{"role": "robot", "content": "x"}]}
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with path.open("a") as f:
        f.write("{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl, line 10, field 'messages\[0\]\.role': unknown role"):
        _batches(_data(path, shuffle_rows=0), 10)
    with caplog.at_level(logging.WARNING):
        loader, batches = _batches(_data(path, shuffle_rows=0, on_bad_row="skip"), 10)
    assert "line 10" in caplog.text and "line 21" in caplog.text and "malformed JSON" in caplog.text
    assert len(batches) == 10


def test_streaming_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(DataError, match="field 'path': streaming needs files"):
        SFTData(streaming=True).setup("fit")
    with pytest.raises(DataError, match="matches no file"):
        SFTData(path=str(tmp_path / "*.jsonl"), streaming=True).setup("fit")
    with pytest.raises(ValueError, match="val_rows=-1"):
        SFTData(path="x.jsonl", streaming=True, val_rows=-1)


def test_the_shipped_streaming_config_prepares_and_streams(tmp_path, caplog):
    config = yaml.safe_load((ROOT / "configs" / "sft" / "streaming-debug.yaml").read_text())
    args = config["data"]["init_args"]
    assert args["streaming"] is True
    args.update(path=str(ROOT / args["path"]), cache_dir=str(tmp_path),
                sections=[Section(**s) for s in args["sections"]] if args["sections"] else None)
    data = SFTData(**{k: v for k, v in args.items() if k != "synthetic"})
    with caplog.at_level(logging.INFO):
        data.setup("fit")
    assert "[[" in caplog.text and "a training row" in caplog.text
    _, batches = _batches(data, 3)
    assert len(data.val_set) > 0 and all(b["input_ids"].shape[1] <= args["max_seq_len"] for b in batches)
    assert all((b["labels"] != IGNORE_INDEX).any() for b in batches)


def test_byte_tokenizer_rows_carry_document_ids_and_positions(files):
    batch = _batches(_data(files / "chat-0.jsonl", tokenizer="byte"), 1)[1][0]
    assert set(batch) >= {"input_ids", "labels", "document_ids", "position_ids"}
    assert Tokenizer.byte_level().bos_token_id in batch["input_ids"][0].tolist()
