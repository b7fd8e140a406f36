"""SFT on conversation files larger than memory (`SFTData(streaming=True)`): rows read lazily, encoded and
masked on the fly, packed block by block, and resumed exactly.

Rows come from local files (a path or a glob; JSONL read line by line, so a bad line is named by its
number, and parquet, json, csv or arrow through `datasets`' iterable datasets). They are read in blocks
of `shuffle_rows` rows (`streaming.BlockWalk`); a block's rows are permuted by a generator seeded by (seed,
pass, file, row), checked, encoded and masked exactly as the map-style path encodes them
(`tokenized.encode_columns`), rows that keep no trained token refused or skipped (on_bad_row), and
packed as SFT packs (`packing.plan_bins`: best-fit decreasing within the block, or one row per example
padded by the collate); the block's examples are permuted again and handed out batch after batch. The
first `val_rows` rows of the first file validate and never train. A file runs out: the next; the last:
the next pass, its files in a new order.

The position is the pass, file, first row of the block, examples of the block taken and batches handed
out; every block is recomputed from the seed. The loader has a length, the run's batches
(trainer.max_steps x accumulate_grad_batches), so Lightning does not fetch ahead of it and accumulation
windows are tagged as for map-style rows (`windows.windowed`): a checkpoint resumes bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from .formats import infer_sections
from .packing import PackedDataset, collate, plan_bins
from .preflight import (
    check_bos_once,
    check_model_fit,
    check_tokenizer,
    check_trained_tokens,
    describe_example,
)
from .preprocess import Section
from .rows import UTF8_SKIP_FIX, DataError, Dropped, decode_line, log_skipped, parse_row
from .sampling import data_parallel_rank
from .sources import announce, plain, resolve_sections
from .streaming import BlockWalk, check_settings, expand_files, read_batches
from .tokenized import ERROR_COLUMN, SUMMARY_COLUMN, encode_columns

Numbered = tuple[int, "dict[str, Any] | DataError"]  # a row's line (JSONL) or row number, and the row
UNBOUNDED_BATCHES = 2**62  # the length of a loader that no trainer bounds


def read_records(file: str, start: int) -> Iterator[Numbered]:
    """Each row of `file` from row `start` on with its line (JSONL: blank lines are no rows) or row number;
    a JSONL line that is no JSON object comes as the DataError saying so."""
    if Path(file).suffix != ".jsonl":
        row = start
        for batch in read_batches(file, start):
            names = list(batch)
            for values in zip(*batch.values()):
                row += 1
                yield row, dict(zip(names, values))
        return
    with open(file, "rb") as handle:
        rows = 0
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            rows += 1
            if rows > start:
                try:
                    yield number, parse_row(decode_line(raw, UTF8_SKIP_FIX))
                except DataError as err:
                    yield number, err.at(file, number)


def _numbered(err: DataError, source: str) -> DataError:
    """A row's error located by line in a JSONL file, by row number in any other."""
    if source.endswith(".jsonl") or err.line is None:
        return err
    return DataError(err.reason, err.field, err.fix, err.source, err.line, "row")


class RowPacker:
    """Rows -> checked, encoded and masked rows -> packed examples, as SFTData prepares them in memory."""

    def __init__(self, tokenizer: Any, sections: Sequence[Section], hp: Any, dropped: Dropped):
        self.tokenizer, self.sections, self.hp, self.dropped = tokenizer, list(sections), hp, dropped

    def encode(self, numbered: Sequence[Numbered], source: str) -> tuple[list[dict[str, Any]], list[int]]:
        """The good rows encoded (input_ids[, loss_mask]) and their lines; a bad one raises or is dropped."""
        hp = self.hp
        unreadable = sorted((row for _, row in numbered if isinstance(row, DataError)), key=lambda e: e.line)
        rows = [(n, row) for n, row in numbered if not isinstance(row, DataError)]
        if unreadable and hp.on_bad_row == "error":  # the first bad line of the file is the one named
            rows = [(n, row) for n, row in rows if n < unreadable[0].line]
        elif unreadable:
            log_skipped(unreadable, source, self.dropped)
        if not rows:
            if unreadable and hp.on_bad_row == "error":
                raise unreadable[0]
            return [], []
        names = list(dict.fromkeys(key for _, row in rows for key in row))
        columns = {name: [row.get(name) for _, row in rows] for name in names}
        lines = [n for n, _ in rows]
        try:
            out = encode_columns(columns, list(range(len(rows))), kind="sft", sections=self.sections,
                                 tokenizer=self.tokenizer, source=source, lines=lines, on_bad_row=hp.on_bad_row)
        except DataError as err:
            raise _numbered(err, source) from None
        if unreadable and hp.on_bad_row == "error":
            raise unreadable[0]
        errors = out.pop(ERROR_COLUMN, [""] * len(rows))
        summaries = out.pop(SUMMARY_COLUMN, [""] * len(rows))
        log_skipped([e for e in errors if e], source, self.dropped, [s for s in summaries if s])
        good = [i for i, e in enumerate(errors) if not e]
        encoded = [{key: values[i] for key, values in out.items()} for i in good]
        return encoded, [lines[i] for i in good]

    def pack(self, encoded: list[dict[str, Any]], lines: list[int], source: str) -> list[dict[str, list[int]]]:
        """The examples of encoded rows: those left with a trained token, fitted and packed."""
        hp = self.hp
        if not encoded:
            return []
        try:
            check_bos_once(encoded, self.tokenizer, source, lines)
            keep = check_trained_tokens(encoded, hp.max_seq_len, hp.packing, hp.truncation, source=source,
                                        lines=lines, on_bad_row=hp.on_bad_row, sections=self.sections,
                                        dropped=self.dropped)
        except DataError as err:
            raise _numbered(err, source) from None
        rows = [encoded[i] for i in keep]
        if not rows:
            return []
        bins, stats = plan_bins([len(r["input_ids"]) for r in rows], hp.max_seq_len, hp.packing, hp.truncation)
        self.dropped[f"longer than max_seq_len={hp.max_seq_len} with truncation='{hp.truncation}'"] += \
            stats.dropped
        examples = PackedDataset(rows, bins, hp.position_ids)
        return [examples[i] for i in range(len(examples))]

    def examples(self, numbered: Sequence[Numbered], source: str) -> list[dict[str, list[int]]]:
        return self.pack(*self.encode(numbered, source), source)


class RowBlocks(BlockWalk):
    """The packed examples of a list of files, block after block, pass after pass."""

    def __init__(self, files: Sequence[str], packer: RowPacker, seed: int, shuffle_rows: int, skip_first: int):
        super().__init__(files, 0, seed, shuffle_rows, skip_first)
        self.packer = packer

    def _open(self, file: str, start: int) -> Iterator[Numbered]:
        return read_records(file, start)

    def _prepare(self, rows: list[Numbered], key: tuple[int, int, int]) -> list[dict[str, list[int]]]:
        examples = self.packer.examples(self.permuted(rows, key), self.files[key[1]])
        return self.permuted(examples, (*key, 1))

    def _exhausted(self) -> DataError:
        return DataError(f"no row left to train on (after the held-out rows); rows dropped: "
                         f"{self.packer.dropped.describe()}", fix="fix the rows, lower val_rows, or change "
                         "what drops them (max_seq_len, truncation, sections, on_bad_row)", source=self.files[0])


class StreamingRowsLoader:
    """Collated batches of examples from RowBlocks, endless, with a length and a position in checkpoints.

    Data-parallel ranks read the same stream and each keeps its slice of every global batch of
    batch_size · world_size examples. The position is that after the last batch handed out, which is the
    last trained one: Lightning does not fetch ahead of a loader with a length."""

    def __init__(self, blocks: RowBlocks, batch_size: int, collate_fn: Callable[[list], Any],
                 settings: dict[str, Any], length: int, *, rank: int = 0, world_size: int = 1):
        self.blocks, self.batch_size, self.collate_fn, self.settings = blocks, batch_size, collate_fn, settings
        self.length, self.rank, self.world_size = length, rank, world_size
        self.position = {"batches": 0, **copy.deepcopy(blocks.position)}

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Any]:
        return self._run()  # nothing is read before the first next(): Lightning calls iter() once to check

    def _run(self) -> Iterator[Any]:
        self.blocks.position = {k: v for k, v in copy.deepcopy(self.position).items() if k != "batches"}
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        while True:
            examples = [self.blocks.next_unit() for _ in range(self.batch_size * self.world_size)][lo:hi]
            self.position = {"batches": self.position["batches"] + 1, **copy.deepcopy(self.blocks.position)}
            yield self.collate_fn(examples)

    def state_dict(self) -> dict[str, Any]:
        return {**copy.deepcopy(self.position), "settings": self.settings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_settings(state.get("settings"), self.settings)
        self.position = {k: copy.deepcopy(v) for k, v in state.items() if k != "settings"}


class RowStream:
    """What SFTData does with `streaming: true`: the files, preflight, the held-out examples, the loader."""

    def __init__(self, hp: Any, tokenizer: Any, sections: Any, vocab_size: int | None):
        if hp.path is None:
            raise DataError("streaming needs files", "path", "set path to a jsonl/parquet/json/csv/arrow file or "
                            "a glob of them")
        self.hp, self.tokenizer = hp, tokenizer
        self.files = expand_files(hp.path)
        self.sections = resolve_sections(sections, "sft", None) if sections is not None else self._first_sections()
        check_model_fit(tokenizer, vocab_size)
        check_tokenizer(tokenizer, self.sections, vocab_size)
        self.dropped = Dropped()
        self.packer = RowPacker(tokenizer, self.sections, hp, self.dropped)
        encoded, lines = self.packer.encode(self._first_rows(hp.val_rows or 16), self.files[0])
        if encoded:
            announce(f"SFTData (streaming {len(self.files)} file(s)): a training row, trained tokens in [[ ]]:",
                     describe_example(encoded, tokenizer))
        self.val_set = self.packer.pack(encoded, lines, self.files[0]) if hp.val_rows else []
        if hp.val_rows and not self.val_set:
            raise DataError(f"the first val_rows={hp.val_rows} rows give no validation example; rows dropped: "
                            f"{self.dropped.describe()}", "val_rows", "raise val_rows or fix the rows",
                            source=self.files[0])

    def _first_rows(self, count: int) -> list[Numbered]:
        return [r for _, r in zip(range(count), read_records(self.files[0], 0))]

    def _first_sections(self) -> list[Section]:
        """The preset matching the first row's fields (read alone: the file may be larger than memory)."""
        rows = [row for _, row in self._first_rows(1) if not isinstance(row, DataError)]
        if not rows:
            raise DataError("no readable first row to tell the row format from", "sections",
                            "give sections explicitly, or fix the first row", source=self.files[0])
        return infer_sections(rows[0], "sft")

    def settings(self, world_size: int) -> dict[str, Any]:
        hp = self.hp
        return {"files": list(self.files), "sections": plain(self.sections), "max_seq_len": hp.max_seq_len,
                "packing": hp.packing, "truncation": hp.truncation, "position_ids": hp.position_ids,
                "batch_size": hp.batch_size, "seed": hp.seed, "shuffle_rows": hp.shuffle_rows,
                "val_rows": hp.val_rows, "on_bad_row": hp.on_bad_row, "world_size": world_size}

    def train_loader(self, trainer: Any) -> StreamingRowsLoader:
        hp = self.hp
        length = UNBOUNDED_BATCHES
        if trainer is not None:
            if getattr(trainer, "max_steps", -1) in (-1, None):
                raise DataError("a stream has no end", "trainer.max_steps", "set trainer.max_steps")
            length = trainer.max_steps * max(int(getattr(trainer, "accumulate_grad_batches", 1)), 1)
        rank, replicas = data_parallel_rank(trainer)
        blocks = RowBlocks(self.files, self.packer, hp.seed, hp.shuffle_rows, hp.val_rows)
        return StreamingRowsLoader(blocks, hp.batch_size, partial(collate, pad_id=self.tokenizer.pad_token_id),
                                   self.settings(replicas), length, rank=rank, world_size=replicas)
