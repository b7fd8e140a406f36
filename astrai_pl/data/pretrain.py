"""PretrainData: fixed-length token windows over a corpus tokenized once with `datasets` and cached.

The cache is keyed by the corpus's content (`files.source_fingerprint`), the tokenizer and the window
settings, so a corpus edited in place is tokenized again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import lightning as L
import torch
from datasets import Dataset, load_dataset, load_from_disk
from torch.utils.data import DataLoader

from ..hub import resolve_dataset
from ..tokenizer import Tokenizer, load_tokenizer
from .corpus import corpus_version, embedded_documents, is_held_out
from .documents import check_jsonl_corpus, log_textless, require_text_column, textless_documents
from .files import FILE_LOADERS, load_file, source_fingerprint
from .preflight import check_model_fit
from .rows import DataError
from .sampling import StatefulLoader, data_parallel_rank, shuffled_batches
from .sources import model_vocab_size
from .streaming import StreamingCorpus


def default_cache_dir() -> Path:
    return Path(os.environ.get("ASTRAI_CACHE", Path.home() / ".cache" / "astrai_pl"))


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A short hash of the vocabulary, merges, specials and template: cached data is keyed by it."""
    blob = tokenizer.backend.to_str() + (tokenizer.chat_template or "")
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_documents(path: str, text_field: str, cache_dir: str | None = None) -> Dataset:
    """A local txt/json/jsonl/parquet file, a directory saved by `datasets`, or a hub dataset name.

    A text file must be UTF-8 throughout and a JSONL line a JSON object whose text is a string or null
    (DataError naming the first line that is not); files are cached by content under `cache_dir`
    (default: the `datasets` cache). A missing `text_field` column is a DataError (a KeyError too)."""
    p = Path(path)
    if p.is_dir():
        ds = load_from_disk(str(p))
    elif p.suffix in FILE_LOADERS:
        if not p.is_file():
            raise FileNotFoundError(f"data path {path!r} does not exist; pass an existing file or directory")
        if p.suffix == ".jsonl":
            check_jsonl_corpus(p, text_field)
        ds = load_file(p, cache_dir)
    else:  # a hub id (owner/name[@revision]) is read from its snapshot's data files in the hub cache
        ds = load_dataset(resolve_dataset(path), split="train")
    require_text_column(ds, text_field, path)
    return ds


def token_windows(docs: Dataset, tokenizer: Tokenizer, text_field: str, seq_len: int,
                  num_proc: int | None) -> Dataset:
    """Tokenize each document, append EOS, concatenate and cut into windows of seq_len tokens."""
    eos = tokenizer.eos_token_id

    def encode(batch):
        return {"ids": [ids + [eos] for ids in tokenizer.encode_batch(batch[text_field])]}

    def chunk(batch):
        stream = [t for ids in batch["ids"] for t in ids]
        n = len(stream) // seq_len * seq_len
        return {"input_ids": [stream[i:i + seq_len] for i in range(0, n, seq_len)]}

    ids = docs.map(encode, batched=True, num_proc=num_proc, remove_columns=docs.column_names,
                   desc="tokenizing")
    return ids.map(chunk, batched=True, batch_size=1000, remove_columns=["ids"], desc="windows")


def collate_windows(rows: list[dict]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone()}


class PretrainData(L.LightningDataModule):
    """Token windows for next-token prediction. `path=None` reads the embedded CPython documentation."""

    def __init__(
        self,
        path: str | list[str] | None = None,
        tokenizer: str = "byte",
        seq_len: int = 256,
        batch_size: int = 16,
        val_fraction: float = 0.02,
        text_field: str = "text",
        num_proc: int | None = None,
        num_workers: int = 0,
        cache_dir: str | None = None,
        seed: int = 0,
        streaming: bool = False,
        sources: list[dict] | None = None,
        val_rows: int = 64,
        val_path: str | list[str] | None = None,
        shuffle_rows: int = 1024,
    ):
        """
        Args:
            path: Local txt/json/jsonl/parquet file, a saved `datasets` directory or a hub id
                (owner/name[@revision], see docs/data.md); None = embedded corpus.
                With streaming also a glob or a list of files (jsonl/json, parquet, txt, arrow, csv).
            tokenizer: 'byte' (built in), a Hugging Face tokenizer directory, or a hub id (its tokenizer files).
            seq_len: Tokens per training window.
            batch_size: Windows per micro-batch.
            val_fraction: Share of documents held out for validation (chosen by a hash of the title or row index).
            text_field: Column holding the text in `path`.
            num_proc: Processes for tokenization (`Dataset.map`).
            num_workers: DataLoader worker processes.
            cache_dir: Where tokenized windows are cached between runs (default ~/.cache/astrai_pl or $ASTRAI_CACHE).
            seed: Seed of the held-out split and of the shuffle (and, streaming, of the mixture).
            streaming: Read the files lazily, tokenize on the fly and never hold the corpus in memory (needs
                trainer.max_steps); the stream's position is saved in checkpoints. See docs/data.md.
            sources: Streaming only: several weighted sources instead of `path`, `[{path, weight, name}]`
                (path: a file, a glob, a list, or null for the embedded corpus; weight default 1; name default
                the first file's stem).
            val_rows: Streaming only: the first val_rows documents of each source's first file are held out
                for validation (never trained), or the first val_rows of val_path when given.
            val_path: Streaming only: files (a path, glob or list) to validate on instead of held-out rows.
            shuffle_rows: Streaming only: documents read, shuffled and tokenized together (0: file order).
        """
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"PretrainData.seq_len={seq_len}: need at least 2 tokens per window")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"PretrainData.val_fraction={val_fraction}: must lie in (0, 1)")
        if not streaming and (sources is not None or val_path is not None or not isinstance(path, (str, type(None)))):
            raise ValueError("PretrainData: sources, val_path and a list of files need streaming: true")
        self.save_hyperparameters()
        self.tokenizer = load_tokenizer(tokenizer)
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.stream: StreamingCorpus | None = None

    def _cache_key(self) -> str:
        hp = self.hparams
        source = corpus_version() if hp.path is None else source_fingerprint(resolve_dataset(hp.path))
        blob = json.dumps([source, tokenizer_fingerprint(self.tokenizer), hp.seq_len, hp.val_fraction, hp.seed,
                           hp.text_field])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def prepare_data(self) -> None:
        if not self.hparams.streaming:
            self._load_or_build()

    def setup(self, stage: str | None = None) -> None:
        if self.hparams.streaming and self.stream is None:
            check_model_fit(self.tokenizer, model_vocab_size(self.trainer))
            self.stream = StreamingCorpus(self.hparams, self.tokenizer, self.cache_dir)
            self.val_set = [{"input_ids": w} for w in self.stream.val_windows]
        if self.train_set is None and not self.hparams.streaming:
            self.train_set, self.val_set = self._load_or_build()

    def _load_or_build(self) -> tuple[Dataset, Dataset]:
        check_model_fit(self.tokenizer, model_vocab_size(self.trainer))  # before a corpus is tokenized for nothing
        target = self.cache_dir / "pretrain" / self._cache_key()
        if (target / "train").is_dir() and (target / "val").is_dir():
            return load_from_disk(str(target / "train")), load_from_disk(str(target / "val"))
        hp = self.hparams
        if hp.path is None:
            docs = Dataset.from_list(embedded_documents())
            held = [is_held_out(t, hp.val_fraction, hp.seed) for t in docs["title"]]
            textless = [False] * len(docs)
        else:
            docs = load_documents(hp.path, hp.text_field, str(self.cache_dir / "datasets"))
            held = [is_held_out(str(i), hp.val_fraction, hp.seed) for i in range(len(docs))]
            textless = textless_documents(docs, hp.text_field, hp.path)
            log_textless(textless, hp.path, hp.text_field)
        splits = {}
        for name, keep in (("train", False), ("val", True)):
            subset = docs.select([i for i, h in enumerate(held) if h == keep and not textless[i]])
            splits[name] = token_windows(subset, self.tokenizer, hp.text_field, hp.seq_len, hp.num_proc)
            if len(splits[name]) == 0:
                self._no_windows(name, subset)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        for name, ds in splits.items():
            ds.save_to_disk(str(tmp / name))
        os.replace(tmp, target) if not target.exists() else None
        return splits["train"], splits["val"]

    def _no_windows(self, split: str, docs: Dataset) -> None:
        hp = self.hparams
        tokens = sum(len(ids) + 1 for ids in self.tokenizer.encode_batch(docs[hp.text_field])) if len(docs) else 0
        raise DataError(
            f"no {split} windows: the {len(docs)} {split} document(s) hold {tokens} tokens (EOS included), "
            f"fewer than one window of seq_len={hp.seq_len}",
            "seq_len",
            "give more text, lower seq_len" + (", or raise val_fraction" if split == "val" else ""),
            source=hp.path or "embedded corpus",
        )

    def train_dataloader(self) -> StatefulLoader:
        """Shuffled windows split over the data-parallel ranks; the position is saved in checkpoints."""
        hp = self.hparams
        if hp.streaming:
            return self.stream.train_loader(self.trainer)
        rank, replicas = data_parallel_rank(self.trainer)
        plan = functools.partial(shuffled_batches, len(self.train_set), hp.batch_size, seed=hp.seed, rank=rank,
                                 world_size=replicas)
        return StatefulLoader(self.train_set, plan, collate_windows, num_workers=hp.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, collate_fn=collate_windows,
                          num_workers=self.hparams.num_workers)

    test_dataloader = val_dataloader

    def on_before_batch_transfer(self, batch, dataloader_idx):
        """A streamed train batch: the saved stream position moves past it (see data/streaming.py)."""
        return batch if self.stream is None else self.stream.on_batch(batch, self.trainer)
