import json

import pandas as pd
import pytest
import torch

from astrai_pl.data import PretrainData
from astrai_pl.data.corpus import embedded_documents, is_held_out


def test_embedded_corpus_is_read_at_run_time_and_split_deterministically():
    docs = embedded_documents()
    assert len(docs) > 1000 and any(d["title"].startswith("topic:") for d in docs)
    assert sum(len(d["text"]) for d in docs) > 1_000_000
    held = [d["title"] for d in docs if is_held_out(d["title"], 0.02)]
    assert held == [d["title"] for d in embedded_documents() if is_held_out(d["title"], 0.02)]
    assert 0.01 < len(held) / len(docs) < 0.04


def _write(tmp_path, kind):
    rows = [{"text": f"row {i}: " + "alpha beta gamma " * 5} for i in range(120)]
    if kind == "txt":
        path = tmp_path / "c.txt"
        path.write_text("\n".join(r["text"] for r in rows))
    elif kind == "jsonl":
        path = tmp_path / "c.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif kind == "parquet":
        path = tmp_path / "c.parquet"
        pd.DataFrame(rows).to_parquet(path)
    else:
        from datasets import Dataset

        path = tmp_path / "saved"
        Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "saved"])
def test_local_sources_give_fixed_windows(tmp_path, kind):
    data = PretrainData(path=_write(tmp_path, kind), seq_len=32, batch_size=4, val_fraction=0.1,
                        cache_dir=str(tmp_path / "cache"))
    data.prepare_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (4, 32) and torch.equal(batch["input_ids"], batch["labels"])
    assert len(data.val_set) > 0
    eos = data.tokenizer.eos_token_id
    stream = [t for row in data.train_set["input_ids"] for t in row]
    assert stream.count(eos) >= len(data.train_set) * 32 // 100  # documents end with EOS


def test_windows_are_cached_between_runs(tmp_path):
    path = _write(tmp_path, "jsonl")
    first = PretrainData(path=path, seq_len=32, cache_dir=str(tmp_path / "cache"))
    first.setup()
    again = PretrainData(path=path, seq_len=32, cache_dir=str(tmp_path / "cache"))
    again.setup()
    assert again.train_set["input_ids"] == first.train_set["input_ids"]
    assert len(list((tmp_path / "cache" / "pretrain").iterdir())) == 1
    other = PretrainData(path=path, seq_len=16, cache_dir=str(tmp_path / "cache"))
    other.setup()
    assert len(list((tmp_path / "cache" / "pretrain").iterdir())) == 2


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="seq_len"):
        PretrainData(seq_len=1)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        PretrainData(path=str(tmp_path / "missing.jsonl")).setup()
    with pytest.raises(KeyError, match="body"):
        PretrainData(path=_write(tmp_path, "jsonl"), text_field="body").setup()
