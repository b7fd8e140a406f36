"""Streaming pretraining data: windows equal the concatenated documents, the position round-trips through
a checkpoint exactly (mid-mixture too), the mixture follows the weights, held-out rows never train, and bad
input is named."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import pytest
import torch
import yaml

from astrai_pl.data import DataError, PretrainData
from astrai_pl.data.sampling import ResumeMismatchError
from astrai_pl.data.streaming import (
    SourceStream,
    StreamSource,
    WindowStream,
    expand_files,
    mixture_metrics,
    stream_sources,
)
from astrai_pl.tokenizer import Tokenizer


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream")
    for k in range(3):
        _jsonl(folder / f"web-{k}.jsonl", [f"web {k}.{i} " + "w" * (i % 23) for i in range(20)])
    (folder / "code.txt").write_text("\n".join(f"code {i} " + "c" * (i % 11) for i in range(150)))
    return folder


def _data(corpus, **overrides):
    settings = dict(streaming=True, seq_len=16, batch_size=3, val_rows=5, shuffle_rows=8,
                    sources=[{"path": str(corpus / "web-*.jsonl"), "weight": 3}, {"path": str(corpus / "code.txt")}],
                    cache_dir=str(corpus / "cache"))
    data = PretrainData(**{**settings, **overrides})
    data.setup("fit")
    return data


def _ids(batches):
    return [b["input_ids"] for b in batches]


def test_position_round_trips_through_a_checkpoint_mid_mixture(corpus):
    """Batches after a saved position are those an uninterrupted loader yields, across passes of a source."""
    reference = _ids(itertools.islice(iter(_data(corpus).train_dataloader()), 60))
    loader = _data(corpus).train_dataloader()
    it = iter(loader)
    for _ in range(23):
        next(it)
    buffer = io.BytesIO()
    torch.save(loader.state_dict(), buffer)  # as Lightning stores it
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert state["batches"] == 23 and all(t > 0 for t in state["tokens"])
    resumed = _data(corpus).train_dataloader()
    resumed.load_state_dict(state)
    got = _ids(itertools.islice(iter(resumed), 60 - 23))
    assert all(torch.equal(a, b) for a, b in zip(got, reference[23:], strict=True))
    passes = [s["pass"] for s in resumed.position["sources"]]
    assert max(passes) >= 1  # the web source ran out and started over within the 60 batches


def test_a_tracked_loader_saves_the_position_after_the_last_trained_batch(corpus):
    """Lightning fetches a batch ahead of an endless loader: the saved position must not count it."""
    loader = _data(corpus).stream.train_loader(None)
    loader.tracked = True
    it = iter(loader)
    batches = [next(it) for _ in range(4)]  # trained 3, one fetched ahead
    for b in batches[:3]:
        loader.trained(b["stream_batch"])
    state = loader.state_dict()
    assert state["batches"] == 3
    resumed = _data(corpus).train_dataloader()
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))["input_ids"], batches[3]["input_ids"])


def test_windows_are_the_documents_concatenated_with_eos_in_file_order(tmp_path):
    """No shuffle, one source: the stream is every document plus EOS, file after file, cut into windows."""
    tok = Tokenizer.byte_level()
    texts = [[f"a{i} " * (i % 5 + 1) for i in range(30)], [None, "b", "", "bb " * 9]]
    files = [_jsonl(tmp_path / "0.jsonl", texts[0]), _jsonl(tmp_path / "1.jsonl", texts[1])]
    source = StreamSource("s", tuple(map(str, files)))
    stream = WindowStream([SourceStream(source, 0, tok, "text", 0, shuffle_rows=0)], seq_len=7, seed=0)
    flat = [t for doc in texts[0] + texts[1] if doc is not None for t in (*tok.encode(doc), tok.eos_token_id)]
    n = len(flat) // 7
    assert [stream.next_window() for _ in range(n)] == [flat[i * 7:(i + 1) * 7] for i in range(n)]
    assert stream.streams[0].position["pass"] == 0  # the next window needs the next pass
    stream.next_window()
    assert stream.streams[0].position["pass"] == 1


def test_the_realised_mixture_follows_the_weights_and_the_seed(corpus):
    sources = [StreamSource(str(i), (str(corpus / "code.txt"),), w) for i, w in enumerate((0.6, 0.3, 0.1))]
    tok = Tokenizer.byte_level()

    def draws(seed):
        streams = [SourceStream(s, i, tok, "text", seed, 8) for i, s in enumerate(sources)]
        windows = WindowStream(streams, 8, seed)
        return [windows.source_of(k) for k in range(6000)]

    picks = draws(0)
    shares = [picks.count(i) / len(picks) for i in range(3)]
    assert shares == pytest.approx([0.6, 0.3, 0.1], abs=0.02)
    assert picks == draws(0) and picks != draws(1)
    metrics = mixture_metrics(sources, [picks.count(i) * 8 for i in range(3)])
    assert metrics["data/share/0"] == pytest.approx(shares[0])
    assert metrics["data/tokens/2"] == picks.count(2) * 8


@pytest.mark.parametrize(("pattern", "doc"), [("code.txt", "code {} "), ("web-*.jsonl", "web 0.{} ")])
def test_held_out_rows_never_train(corpus, pattern, doc):
    """The first val_rows documents of the source's first file validate; a whole pass trains on the rest."""
    data = _data(corpus, sources=[{"path": str(corpus / pattern)}], val_rows=5, shuffle_rows=0)
    tok = data.tokenizer
    held = "".join(tok.decode(w["input_ids"]) for w in data.val_set)
    assert doc.format(0) in held
    trained = "".join(tok.decode(row.tolist()) for b in itertools.islice(iter(data.train_dataloader()), 50)
                      for row in b["input_ids"])  # one source, no shuffle: one contiguous stream, > one pass
    assert trained.startswith(doc.format(5)) and f"<eos>{doc.format(6)}" in trained
    assert all(f"<eos>{doc.format(i)}" not in trained for i in range(5))


def test_a_separate_val_path_validates_and_holds_nothing_out(corpus, tmp_path):
    val = _jsonl(tmp_path / "val.jsonl", ["held out text " * 4] * 3)
    data = _data(corpus, val_path=str(val), val_rows=2, shuffle_rows=0)
    assert "held out text" in data.tokenizer.decode(data.val_set[0]["input_ids"])
    first = data.tokenizer.decode(next(iter(data.train_dataloader()))["input_ids"].flatten().tolist())
    assert "0.0 " in first or "code 0 " in first


def test_a_changed_setting_refuses_to_resume(corpus):
    loader = _data(corpus).train_dataloader()
    next(iter(loader))
    other = _data(corpus, seq_len=32).train_dataloader()
    with pytest.raises(ResumeMismatchError, match="seq_len"):
        other.load_state_dict(loader.state_dict())


def test_globs_and_lists_expand_in_order(corpus):
    assert expand_files(str(corpus / "web-*.jsonl")) == [str(corpus / f"web-{k}.jsonl") for k in range(3)]
    both = [str(corpus / "code.txt"), str(corpus / "web-1.jsonl")]
    assert expand_files(both) == both
    assert [s.name for s in stream_sources(None, [{"path": both}, {"path": both, "weight": 2}])] == ["code", "code_1"]


@pytest.mark.parametrize(("spec", "match"), [
    ([{"path": "nowhere/*.jsonl"}], "matches no file"),
    ([{"path": "x.jsonl", "weight": 0}], "weight"),
    ([{"path": "x.jsonl", "weights": 1}], "sources\\[0\\]"),
    ([], "empty"),
])
def test_bad_sources_are_named(spec, match, corpus, monkeypatch):
    monkeypatch.chdir(corpus)
    (corpus / "x.jsonl").write_text("")
    with pytest.raises(DataError, match=match):
        stream_sources(None, spec)


def test_a_text_that_is_not_a_string_names_the_file_and_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 7}\n')
    data = PretrainData(streaming=True, path=str(bad), val_rows=0, seq_len=4, cache_dir=str(tmp_path))
    data.setup("fit")
    with pytest.raises(DataError, match=r"bad.jsonl, row 2, field 'text'"):
        next(iter(data.train_dataloader()))


def test_streaming_options_need_streaming(corpus):
    with pytest.raises(ValueError, match="streaming: true"):
        PretrainData(sources=[{"path": str(corpus / "code.txt")}])


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".arrow"])
def test_parquet_csv_and_arrow_files_stream(tmp_path, suffix):
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    texts = [f"row {i} of a table" for i in range(12)]
    table, path = pa.table({"text": texts, "n": list(range(12))}), tmp_path / f"t{suffix}"
    if suffix == ".parquet":
        pq.write_table(table, path)
    elif suffix == ".csv":
        pacsv.write_csv(table, path)
    else:
        with pa.ipc.new_stream(path, table.schema) as writer:
            writer.write_table(table)
    tok = Tokenizer.byte_level()
    source = StreamSource("t", (str(path),))
    stream = WindowStream([SourceStream(source, 0, tok, "text", 0, shuffle_rows=0)], seq_len=5, seed=0)
    flat = [t for doc in texts for t in (*tok.encode(doc), tok.eos_token_id)]
    assert [t for _ in range(len(flat) // 5) for t in stream.next_window()] == flat[:len(flat) // 5 * 5]


@pytest.mark.parametrize("name", ["streaming-debug", "mixture-debug"])
def test_the_shipped_streaming_configs_set_up_and_stream(name, tmp_path):
    """configs/pretrain/{streaming,mixture}-debug.yaml: windows of seq_len; the mixture draws both sources."""
    root = Path(__file__).resolve().parents[2]
    args = yaml.safe_load((root / "configs" / "pretrain" / f"{name}.yaml").read_text())["data"]["init_args"]
    for source in args["sources"] or []:
        source["path"] = source["path"] and str(root / source["path"])  # null: the embedded corpus
    data = PretrainData(**{**args, "cache_dir": str(tmp_path)})
    data.setup("fit")
    loader = data.train_dataloader()
    batches = list(itertools.islice(iter(loader), 40))
    assert all(b["input_ids"].shape == (args["batch_size"], args["seq_len"]) for b in batches)
    assert len(data.val_set) > 0
    if args["sources"]:
        shares = mixture_metrics(data.stream.sources, loader.position["tokens"])
        assert 0.6 < shares["data/share/docs"] < 0.9 and shares["data/share/arithmetic"] > 0.1  # weights 3 : 1
