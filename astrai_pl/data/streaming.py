"""Pretraining on corpora larger than memory: documents read lazily from local files through `datasets`'
iterable datasets, tokenized on the fly, cut into windows of seq_len tokens, and resumed exactly.

Each *source* is a list of files (a path, a glob or a list of them; jsonl/json, parquet, txt, arrow, csv).
It is read block by block: `shuffle_rows` documents are read, permuted by a generator seeded by (seed,
source, pass, file, row) and tokenized together; each document's ids plus EOS join the source's token
buffer, and windows are cut from the front of it, so windows span documents exactly as the map-style path
cuts them. A source that runs out starts its next pass (its files in a new order). Several sources are
mixed by weight: window k comes from the source a uniform draw of a generator seeded by (seed, k // 4096)
picks, so the mixture is the same on every run and realised fractions follow the weights.

The position is small and plain: per source its pass, file, first row of the block, documents of the block
taken and the tokens not yet cut; and the number of windows cut. Nothing random is stored: every draw is
recomputed from the seed and the position. `StreamingLoader.state_dict()` is the position after the last
batch the trainer *trained* on (Lightning fetches one batch ahead of a loader without a length; the data
module reports each batch it hands to the model), so a checkpoint resumes bit for bit.
"""

from __future__ import annotations

import copy
import glob
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import load_dataset

from .corpus import corpus_version, embedded_documents
from .rows import DataError
from .sampling import ResumeMismatchError, data_parallel_rank

STREAM_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".arrow": "arrow",
                  ".csv": "csv"}
STREAM_MARK = "stream_batch"  # batch key: the batch's number, taken off by the data module before the model
MIX_BLOCK = 4096  # windows whose sources one seeded generator draws
READ_ROWS = 1024  # documents read and tokenized at once when nothing is shuffled
SOURCE_KEYS = {"path", "weight", "name"}


def expand_files(path: str | Sequence[str], field: str = "path") -> list[str]:
    """The files of a path, a glob (`**` recurses) or a list of them, each glob's matches sorted."""
    patterns = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not patterns:
        raise DataError("an empty list of files", field, "name at least one file or glob")
    files = []
    for pattern in map(str, patterns):
        pattern = os.path.expanduser(pattern)
        matched = sorted(glob.glob(pattern, recursive=True)) if any(c in pattern for c in "*?[") else [pattern]
        if not matched:
            raise DataError(f"the glob {pattern!r} matches no file", field, "check the pattern")
        for name in matched:
            suffix = Path(name).suffix
            if suffix not in STREAM_LOADERS:
                raise DataError(f"cannot stream a {suffix or 'suffix-less'} file", field,
                                f"give {', '.join(STREAM_LOADERS)} files", source=name)
            if not Path(name).is_file():
                raise DataError("no such file", field, "pass existing files or a glob that matches some",
                                source=name)
            files.append(name)
    return files


@dataclass(frozen=True)
class StreamSource:
    """One weighted source of documents."""

    name: str
    files: tuple[str, ...]
    weight: float = 1.0


def stream_sources(path: str | Sequence[str] | None, sources: Sequence[dict] | None) -> list[StreamSource]:
    """`sources: [{path, weight, name?}]`, or the single source `path`."""
    if sources is None:
        if path is None:
            raise DataError("streaming needs files", "path", "set path (a file, glob or list) or sources")
        files = expand_files(path)
        return [StreamSource(Path(files[0]).stem, tuple(files))]
    if path is not None:
        raise DataError("both path and sources are set", "sources", "give the files in one of them")
    if not sources:
        raise DataError("an empty list", "sources", "list at least one {path, weight}")
    out: list[StreamSource] = []
    for i, spec in enumerate(sources):
        where = f"sources[{i}]"
        if not isinstance(spec, dict) or "path" not in spec or set(spec) - SOURCE_KEYS:
            raise DataError(f"{spec!r} is not a {{path, weight, name}} mapping", where,
                            "give each source a path and optionally a weight (default 1) and a name")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight <= 0:
            raise DataError(f"weight {weight!r}", f"{where}.weight", "give a positive number")
        files = expand_files(spec["path"], f"{where}.path")
        name = str(spec.get("name") or Path(files[0]).stem)
        if any(s.name == name for s in out):
            name = f"{name}_{i}"
        out.append(StreamSource(name, tuple(files), float(weight)))
    return out


# --- reading one file ------------------------------------------------------------------------------


def read_batches(file: str, start: int) -> Iterator[dict[str, list]]:
    """Column batches of `file` from row `start` on, read lazily through `datasets`' iterable datasets;
    whatever the reader raises on a malformed file is a DataError naming it."""
    loader = STREAM_LOADERS[Path(file).suffix]
    dataset = load_dataset(loader, data_files=file, split="train", streaming=True)
    if start:
        dataset = dataset.skip(start)
    row, batches = start, iter(dataset.iter(batch_size=READ_ROWS))
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as err:  # a malformed file: name it, whatever the reader raised
            raise DataError(f"could not be read past row {row} ({type(err).__name__}: {err})",
                            fix="repair or remove the file", source=file) from err
        row += len(next(iter(batch.values()), ()))
        yield batch


def read_rows(file: str, text_field: str, start: int) -> Iterator[str | None]:
    """The text of each document of `file` from row `start` on (None: no text), read lazily."""
    field = "text" if STREAM_LOADERS[Path(file).suffix] == "text" else text_field
    row = start
    for batch in read_batches(file, start):
        if field not in batch:
            raise DataError(f"no column {field!r} (columns: {', '.join(batch) or 'none'})", "text_field",
                            "set text_field to the column that holds the documents' text", source=file)
        for text in batch[field]:
            row += 1
            if text is not None and not isinstance(text, str):
                raise DataError(f"expected a string or null, got {type(text).__name__}", field,
                                "store the documents' text as strings", source=file, line=row, unit="row")
            yield text


# --- one source as a stream of tokens ----------------------------------------------------------------


def fresh_position(skip_first: int) -> dict[str, Any]:
    return {"pass": 0, "file": 0, "row": None, "taken": 0, "skip": skip_first}


class BlockWalk(ABC):
    """A source's files read block by block, pass after pass, each block turned into units (`_prepare`:
    a subclass's documents' ids, packed examples); `position` says exactly where it stands: the pass, the
    file, the first row of the block and the units of it taken. Nothing else is kept: a block is a pure
    function of (seed, source, pass, file, row), so a restored position reads it again.

    `skip_first` rows of the source's first file (in sorted order) are never read: the held-out split."""

    def __init__(self, files: Sequence[str], index: int, seed: int, shuffle_rows: int, skip_first: int = 0):
        self.files, self.index, self.seed, self.shuffle = tuple(files), index, seed, shuffle_rows > 0
        self.block_rows = shuffle_rows if shuffle_rows > 0 else READ_ROWS
        self.position = fresh_position(skip_first)
        self._reader: tuple[int, int, Iterator[Any]] | None = None  # (file, next row, rows)
        self._block: tuple[tuple[int, int, int], list[Any], int] | None = None  # key, units, rows read

    @abstractmethod
    def _open(self, file: str, start: int) -> Iterator[Any]:
        """The rows of `file` from row `start` on, read lazily."""

    @abstractmethod
    def _prepare(self, rows: list[Any], key: tuple[int, int, int]) -> list[Any]:
        """The units of the block of `rows` whose key is (pass, file, first row)."""

    @abstractmethod
    def _exhausted(self) -> DataError:
        """The error when a whole pass gives no unit."""

    def permuted(self, items: list[Any], key: tuple[int, ...]) -> list[Any]:
        """`items` in the order a generator seeded by (seed, source, *key) draws (as given without shuffle)."""
        if not self.shuffle or len(items) < 2:
            return items
        order = np.random.default_rng([self.seed, self.index, *key]).permutation(len(items))
        return [items[i] for i in order]

    def file_order(self, pass_: int) -> list[int]:
        n = len(self.files)
        if not self.shuffle or n == 1:
            return list(range(n))
        return np.random.default_rng([self.seed, self.index, pass_]).permutation(n).tolist()

    def _current_file(self) -> int:
        return self.file_order(self.position["pass"])[self.position["file"]]

    def _first_row(self, file: int) -> int:
        return self.position["skip"] if file == 0 else 0

    def _read(self, file: int, row: int, count: int) -> list[Any]:
        if self._reader is None or self._reader[:2] != (file, row):
            self._reader = (file, row, self._open(self.files[file], row))
        rows = self._reader[2]
        block = [item for _, item in zip(range(count), rows)]
        self._reader = (file, row + len(block), rows)
        return block

    def units(self) -> tuple[list[Any], int]:
        """The current block's units in their order, and the rows it spans."""
        p = self.position
        file = self._current_file()
        if p["row"] is None:
            p["row"] = self._first_row(file)
        key = (p["pass"], file, p["row"])
        if self._block is None or self._block[0] != key:
            rows = self._read(file, p["row"], self.block_rows)
            self._block = (key, self._prepare(rows, key), len(rows))
        return self._block[1], self._block[2]

    def _advance(self) -> bool:
        """Past the current block: the next block of the file, or the next file, or the next pass (True)."""
        p = self.position
        _, rows = self.units()
        p["taken"] = 0
        if rows == self.block_rows:
            p["row"] += rows
            return False
        p["file"], p["row"] = p["file"] + 1, None
        if p["file"] < len(self.files):
            return False
        p["pass"], p["file"] = p["pass"] + 1, 0
        return True

    def next_unit(self) -> Any:
        """The next unit, past spent blocks, files and passes; `_exhausted()` after a whole pass without one."""
        p, passes_without_units = self.position, 0
        while True:
            units, _ = self.units()
            if p["taken"] < len(units):
                p["taken"] += 1
                return units[p["taken"] - 1]
            passes_without_units += self._advance()
            if passes_without_units > 1:
                raise self._exhausted()


class SourceStream(BlockWalk):
    """A source's documents, pass after pass, as tokens (each document's ids, then EOS)."""

    def __init__(self, source: StreamSource, index: int, tokenizer: Any, text_field: str, seed: int,
                 shuffle_rows: int, skip_first: int = 0):
        super().__init__(source.files, index, seed, shuffle_rows, skip_first)
        self.source, self.tokenizer, self.text_field = source, tokenizer, text_field
        self.position["buffer"] = []

    def _open(self, file: str, start: int) -> Iterator[str | None]:
        return read_rows(file, self.text_field, start)

    def _prepare(self, rows: list[str | None], key: tuple[int, int, int]) -> list[list[int]]:
        kept = self.permuted([t for t in rows if t is not None], key)
        return self.tokenizer.encode_batch(kept) if kept else []

    def _exhausted(self) -> DataError:
        return DataError("no document with text to train on (after the held-out rows)",
                         fix="give files with text, or lower val_rows", source=self.source.name)

    def take(self, n: int) -> list[int]:
        """The next n tokens (documents' ids, each followed by EOS)."""
        buffer = self.position["buffer"]
        while len(buffer) < n:
            buffer.extend(self.next_unit())
            buffer.append(self.tokenizer.eos_token_id)
        out = buffer[:n]
        del buffer[:n]
        return out


# --- several sources as a stream of windows ------------------------------------------------------------


class WindowStream:
    """Windows of seq_len tokens, each from the source a seeded draw picks by weight."""

    def __init__(self, streams: list[SourceStream], seq_len: int, seed: int):
        self.streams, self.seq_len, self.seed = streams, seq_len, seed
        weights = np.array([s.source.weight for s in streams], dtype=np.float64)
        self.bounds = np.cumsum(weights / weights.sum())
        self.windows = 0
        self.tokens = [0] * len(streams)  # tokens each source gave so far
        self._draws: tuple[int, np.ndarray] | None = None

    def source_of(self, k: int) -> int:
        """The source of window k: a pure function of (seed, k)."""
        if len(self.streams) == 1:
            return 0
        block = k // MIX_BLOCK
        if self._draws is None or self._draws[0] != block:
            uniforms = np.random.default_rng([self.seed, block]).random(MIX_BLOCK)
            self._draws = (block, np.minimum(np.searchsorted(self.bounds, uniforms, side="right"),
                                             len(self.streams) - 1))
        return int(self._draws[1][k % MIX_BLOCK])

    def next_window(self) -> list[int]:
        s = self.source_of(self.windows)
        self.windows += 1
        self.tokens[s] += self.seq_len
        return self.streams[s].take(self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        return {"windows": self.windows, "tokens": list(self.tokens),
                "sources": [{**s.position, "buffer": list(s.position["buffer"])} for s in self.streams]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.windows, self.tokens = int(state["windows"]), [int(t) for t in state["tokens"]]
        for stream, position in zip(self.streams, state["sources"]):
            stream.position = {**position, "buffer": list(position["buffer"])}


# --- the loader Lightning checkpoints ------------------------------------------------------------------


class StreamingLoader:
    """Endless batches `{input_ids, labels}` (B, T) cut from a WindowStream, its position in checkpoints.

    Data-parallel ranks read the same stream and each keeps its slice of every global batch of
    batch_size · world_size windows (as `shuffled_batches` splits them). With `tracked`, the saved
    position is that after the last batch reported by `trained(n)`; else after the last batch handed out."""

    def __init__(self, windows: WindowStream, batch_size: int, settings: dict[str, Any], *, rank: int = 0,
                 world_size: int = 1, tracked: bool = False):
        self.windows, self.batch_size, self.settings = windows, batch_size, settings
        self.rank, self.world_size, self.tracked = rank, world_size, tracked
        self.position = {"batches": 0, **windows.state_dict()}
        self._pending: dict[int, dict[str, Any]] = {}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._run()  # nothing is read before the first next(): Lightning calls iter() once to check

    def _run(self) -> Iterator[dict[str, Any]]:
        self.windows.load_state_dict(self.position)
        batches, self._pending = self.position["batches"], {}
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        while True:
            rows = [self.windows.next_window() for _ in range(self.batch_size * self.world_size)][lo:hi]
            batches += 1
            after = {"batches": batches, **self.windows.state_dict()}
            if self.tracked:
                self._pending[batches] = after
            else:
                self.position = after
            ids = torch.tensor(rows, dtype=torch.long)  # (B, T)
            yield {"input_ids": ids, "labels": ids.clone(), STREAM_MARK: batches}

    def trained(self, batch_number: int) -> None:
        """The batch numbered `batch_number` reached the model: the position moves past it."""
        if batch_number in self._pending:
            self.position = self._pending.pop(batch_number)
            self._pending = {n: s for n, s in self._pending.items() if n > batch_number}

    def state_dict(self) -> dict[str, Any]:
        return {**copy.deepcopy(self.position), "settings": self.settings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_settings(state.get("settings"), self.settings)
        self.position = {k: copy.deepcopy(v) for k, v in state.items() if k != "settings"}
        self._pending = {}


def check_settings(saved: dict[str, Any] | None, settings: dict[str, Any]) -> None:
    """A checkpoint's stream position fits only a stream cut with the same settings."""
    if saved != settings:
        changed = sorted(k for k in set(saved or {}) | set(settings) if (saved or {}).get(k) != settings.get(k))
        raise ResumeMismatchError(
            f"the checkpoint's stream was cut with other settings ({', '.join(changed)} changed): resume "
            "with the files, weights, lengths, batch_size, seed, shuffle_rows, val_rows and number of "
            "data-parallel processes of the interrupted run, or start a new run from its weights "
            "(model.init_args.init_from)")


# --- held-out windows ----------------------------------------------------------------------------------


def first_documents(files: Sequence[str], text_field: str, count: int) -> list[str]:
    """The texts of the first `count` rows of `files`, in order (rows without text count, and are left out)."""
    texts: list[str | None] = []
    for file in files:
        texts += [t for _, t in zip(range(count - len(texts)), read_rows(file, text_field, 0))]
        if len(texts) >= count:
            break
    return [t for t in texts if t is not None]


def cut_windows(texts: Sequence[str], tokenizer: Any, seq_len: int) -> list[list[int]]:
    """Documents' ids, each plus EOS, concatenated and cut into whole windows (the rest dropped)."""
    stream = [t for ids in tokenizer.encode_batch(list(texts)) for t in (*ids, tokenizer.eos_token_id)]
    return [stream[i:i + seq_len] for i in range(0, len(stream) // seq_len * seq_len, seq_len)]


class StreamingCorpus:
    """What PretrainData does with `streaming: true`: sources, held-out windows, the train loader."""

    def __init__(self, hp: Any, tokenizer: Any, cache_dir: Path):
        if hp.val_rows < 0 or hp.shuffle_rows < 0:
            raise DataError(f"val_rows={hp.val_rows}, shuffle_rows={hp.shuffle_rows}", "val_rows",
                            "give counts >= 0")
        self.hp, self.tokenizer = hp, tokenizer
        def embedded() -> str:  # the embedded corpus, written once as a file to stream
            return str(export_embedded_corpus(cache_dir / "pretrain" / f"embedded-{corpus_version()}.jsonl"))

        path = embedded() if hp.path is None and hp.sources is None else hp.path
        sources = None if hp.sources is None else [  # a source's `path: null` is the embedded corpus too
            {**spec, "path": embedded()} if isinstance(spec, dict) and "path" in spec and spec["path"] is None
            else spec for spec in hp.sources]
        self.sources = stream_sources(path, sources)
        self.loader: StreamingLoader | None = None
        self.val_windows = self._held_out()

    def _held_out(self) -> list[list[int]]:
        hp = self.hp
        if hp.val_path is not None:
            texts = first_documents(expand_files(hp.val_path, "val_path"), hp.text_field, hp.val_rows)
        else:
            texts = [t for s in self.sources for t in first_documents(s.files[:1], hp.text_field, hp.val_rows)]
        windows = [w for w in cut_windows(texts, self.tokenizer, hp.seq_len)]
        if not windows and hp.val_rows:
            raise DataError(f"the {len(texts)} held-out document(s) hold less than one window of "
                            f"seq_len={hp.seq_len}", "val_rows", "raise val_rows or give a val_path",
                            source=str(hp.val_path or self.sources[0].files[0]))
        return windows

    def settings(self, world_size: int) -> dict[str, Any]:
        hp = self.hp
        return {"sources": [[s.name, s.weight, *s.files] for s in self.sources], "seq_len": hp.seq_len,
                "batch_size": hp.batch_size, "seed": hp.seed, "shuffle_rows": hp.shuffle_rows,
                "val_rows": 0 if hp.val_path is not None else hp.val_rows, "world_size": world_size}

    def train_loader(self, trainer: Any) -> StreamingLoader:
        hp = self.hp
        if trainer is not None and getattr(trainer, "max_steps", 0) == -1:
            raise DataError("a stream has no end", "trainer.max_steps", "set trainer.max_steps")
        skip = 0 if hp.val_path is not None else hp.val_rows
        streams = [SourceStream(s, i, self.tokenizer, hp.text_field, hp.seed, hp.shuffle_rows, skip)
                   for i, s in enumerate(self.sources)]
        rank, replicas = data_parallel_rank(trainer)
        self.loader = StreamingLoader(WindowStream(streams, hp.seq_len, hp.seed), hp.batch_size,
                                      self.settings(replicas), rank=rank, world_size=replicas,
                                      tracked=trainer is not None)
        return self.loader

    def on_batch(self, batch: Any, trainer: Any) -> Any:
        """Take the batch number off a train batch, move the saved position past it, log the mixture."""
        if not isinstance(batch, dict) or STREAM_MARK not in batch or self.loader is None:
            return batch
        batch = dict(batch)
        number = batch.pop(STREAM_MARK)
        self.loader.trained(number)
        every = getattr(trainer, "log_every_n_steps", 0) * max(getattr(trainer, "accumulate_grad_batches", 1), 1)
        if every and number % every == 0:
            log_mixture(trainer, self.sources, self.loader.position["tokens"])
        return batch


def mixture_metrics(sources: Sequence[StreamSource], tokens: Sequence[int]) -> dict[str, float]:
    """`data/tokens/<name>`: tokens each source gave so far (all ranks); `data/share/<name>`: their share."""
    total = max(sum(tokens), 1)
    out: dict[str, float] = {}
    for source, count in zip(sources, tokens):
        out[f"data/tokens/{source.name}"] = float(count)
        out[f"data/share/{source.name}"] = count / total
    return out


def log_mixture(trainer: Any, sources: Sequence[StreamSource], tokens: Sequence[int]) -> None:
    if trainer is None or not getattr(trainer, "is_global_zero", True):
        return
    metrics = mixture_metrics(sources, tokens)
    for logger in getattr(trainer, "loggers", []):
        logger.log_metrics(metrics, step=trainer.global_step)


def export_embedded_corpus(path: str | Path) -> Path:
    """The embedded corpus written as JSONL (`{"title", "text"}` a line): a file to stream from."""
    import json

    path = Path(path)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.tmp{os.getpid()}")
        with open(partial, "w", encoding="utf-8") as handle:
            for doc in embedded_documents():
                handle.write(json.dumps(doc) + "\n")
        os.replace(partial, path)
    return path
