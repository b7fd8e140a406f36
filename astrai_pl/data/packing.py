"""Packing encoded rows into bins of `max_seq_len` tokens, position ids, labels and batch collation.

Modes: `none` (one row per example), `bfd` (best-fit decreasing: longest row first, each into the open
bin whose free space is smallest yet large enough), `bfd_split` (as bfd, but a row longer than
`max_seq_len` is cut into `max_seq_len` pieces, each packed as its own document, so no token is lost).
In `none` and `bfd` a row longer than `max_seq_len` is truncated: `right` keeps its head, `left` its
tail, `drop` drops the row; `PackStats` counts what was cut or dropped.

Each example carries, aligned with `input_ids` (T tokens):
- `labels`: `labels[t] = input_ids[t]` where the token is trained, else -100. Labels are *not* shifted:
  the loss compares `logits[:, :-1]` with `labels[:, 1:]`. The first token of every document is -100,
  so no document is trained to follow the previous one in a bin (a `bfd_split` piece loses its first
  target this way).
- `document_ids`: 0, 1, … per document; attention is block-causal over them (no cross-document attention).
- `position_ids` (unless mode `none`): `doc_reset` restarts at 0 for each document, `continuous`
  counts 0…T-1 across the bin. Without them the model counts positions itself (as `continuous`).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

log = logging.getLogger(__name__)

PACKING_MODES = ("none", "bfd", "bfd_split")
TRUNCATIONS = ("right", "left", "drop")
POSITION_MODES = ("none", "doc_reset", "continuous")
IGNORE_INDEX = -100  # a label the loss ignores (torch cross_entropy's default ignore_index)


class Span(NamedTuple):
    """Tokens [start, stop) of encoded row `row`: one document of a bin."""

    row: int
    start: int
    stop: int


@dataclass
class PackStats:
    """What packing did to the rows: counts a run logs before training."""

    rows: int = 0
    bins: int = 0
    truncated: int = 0
    dropped: int = 0
    split: int = 0
    tokens_in: int = 0
    tokens_kept: int = 0
    max_seq_len: int = 0

    def describe(self) -> str:
        fill = self.tokens_kept / max(1, self.bins * self.max_seq_len)
        return (
            f"{self.rows} rows -> {self.bins} examples of <= {self.max_seq_len} tokens (fill {fill:.0%}); "
            f"truncated {self.truncated}, dropped {self.dropped}, split {self.split}; "
            f"{self.tokens_in - self.tokens_kept} of {self.tokens_in} tokens cut"
        )


def check_options(max_seq_len: int, mode: str, truncation: str, position_mode: str = "doc_reset") -> None:
    for name, value, allowed in (
        ("packing", mode, PACKING_MODES),
        ("truncation", truncation, TRUNCATIONS),
        ("position_ids", position_mode, POSITION_MODES),
    ):
        if value not in allowed:
            raise ValueError(f"{name}={value!r}; use one of {allowed}")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len={max_seq_len}; need at least 2 tokens for one next-token target")


# --- columns as flat arrays -------------------------------------------------------------------------


def ragged(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list column: an Arrow (chunked) list array or a sequence of lists."""
    if isinstance(column, (pa.Array, pa.ChunkedArray)):
        values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    else:
        values = np.fromiter((v for row in column for v in row), dtype=np.int64)
        lengths = np.fromiter((len(row) for row in column), dtype=np.int64, count=len(column))
    return values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def column_of(rows: Any, name: str) -> Any:
    """A column of a 🤗 Dataset (as Arrow, no Python objects) or of a list of dicts."""
    if hasattr(rows, "with_format"):
        return rows.with_format("arrow")[name]
    return [row[name] for row in rows]


def row_lengths(rows: Any, ids_column: str = "input_ids") -> np.ndarray:
    return np.diff(ragged(column_of(rows, ids_column))[1])


# --- planning --------------------------------------------------------------------------------------


def fit_spans(
    lengths: Sequence[int], max_seq_len: int, mode: str, truncation: str
) -> tuple[list[Span], PackStats]:
    """The documents each row becomes once it fits `max_seq_len` (truncated, dropped or split)."""
    stats = PackStats(rows=len(lengths), max_seq_len=max_seq_len, tokens_in=int(np.sum(lengths)))
    spans = []
    for row, n in enumerate(int(n) for n in lengths):
        if n == 0:
            stats.dropped += 1
        elif n <= max_seq_len:
            spans.append(Span(row, 0, n))
        elif mode == "bfd_split":
            stats.split += 1
            spans += [Span(row, s, min(s + max_seq_len, n)) for s in range(0, n, max_seq_len)]
        elif truncation == "drop":
            stats.dropped += 1
        else:
            stats.truncated += 1
            spans.append(
                Span(row, 0, max_seq_len) if truncation == "right" else Span(row, n - max_seq_len, n)
            )
    stats.tokens_kept = sum(s.stop - s.start for s in spans)
    return spans, stats


def best_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total size <= capacity, by best-fit decreasing.

    Items go longest first (ties by index); each joins the open bin with the least free space that
    still holds it, else opens a bin. Free spaces are kept in a sorted list of distinct values.
    """
    bins: list[list[int]] = []
    by_free: dict[int, list[int]] = {}  # free space -> bins with exactly that space
    frees: list[int] = []  # sorted distinct keys of by_free
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        size = sizes[item]
        assert 0 < size <= capacity, f"item {item} of size {size} does not fit capacity {capacity}"
        slot = bisect.bisect_left(frees, size)
        if slot < len(frees):
            free = frees[slot]
            b = by_free[free].pop()
            if not by_free[free]:
                del by_free[free], frees[slot]
        else:
            free, b = capacity, len(bins)
            bins.append([])
        bins[b].append(item)
        left = free - size
        if left > 0:
            if left not in by_free:
                by_free[left] = []
                bisect.insort(frees, left)
            by_free[left].append(b)
    return bins


def plan_bins(
    lengths: Sequence[int], max_seq_len: int, mode: str = "bfd", truncation: str = "right"
) -> tuple[list[list[Span]], PackStats]:
    """The documents of each example: one per row (mode none, rows in order) or packed bins."""
    check_options(max_seq_len, mode, truncation)
    spans, stats = fit_spans(lengths, max_seq_len, mode, truncation)
    if mode == "none":
        bins = [[span] for span in spans]
    else:
        bins = [
            [spans[i] for i in b] for b in best_fit_decreasing([s.stop - s.start for s in spans], max_seq_len)
        ]
    stats.bins = len(bins)
    return bins, stats


# --- examples and batches ----------------------------------------------------------------------------


def pack_example(
    docs: Sequence[tuple[Sequence[int], Sequence[int] | None]], position_mode: str = "doc_reset"
) -> dict[str, list[int]]:
    """input_ids, labels, document_ids (+ position_ids) of one example from its documents' (ids, loss_mask)."""
    ids: list[int] = []
    labels: list[int] = []
    doc_ids: list[int] = []
    positions: list[int] = []
    for d, (doc, mask) in enumerate(docs):
        mask = [1] * len(doc) if mask is None else mask
        ids += doc
        labels += [IGNORE_INDEX] + [t if m else IGNORE_INDEX for t, m in zip(doc[1:], mask[1:])]
        doc_ids += [d] * len(doc)
        positions += range(len(doc)) if position_mode == "doc_reset" else range(len(positions), len(ids))
    example = {"input_ids": ids, "labels": labels, "document_ids": doc_ids}
    if position_mode != "none":
        example["position_ids"] = positions
    return example


class PackedDataset(torch.utils.data.Dataset):
    """Examples built on access from encoded rows (a 🤗 Dataset or a list of dicts) and a bin plan."""

    def __init__(
        self,
        rows: Any,
        bins: list[list[Span]],
        position_mode: str = "doc_reset",
        ids_column: str = "input_ids",
        mask_column: str = "loss_mask",
    ):
        if position_mode not in POSITION_MODES:
            raise ValueError(f"position_ids={position_mode!r}; use one of {POSITION_MODES}")
        names = rows.column_names if hasattr(rows, "column_names") else list(rows[0]) if len(rows) else []
        self.columns = (ids_column, mask_column if mask_column in names else None)
        if hasattr(rows, "select_columns"):
            rows = rows.select_columns([c for c in self.columns if c]).with_format(None)
        self.rows, self.bins, self.position_mode = rows, bins, position_mode

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        spans = self.bins[index]
        ids_col, mask_col = self.columns
        if hasattr(self.rows, "select_columns"):
            batch = self.rows[[s.row for s in spans]]
            fetched = zip(batch[ids_col], batch[mask_col] if mask_col else [None] * len(spans))
        else:
            fetched = (
                (self.rows[s.row][ids_col], self.rows[s.row][mask_col] if mask_col else None) for s in spans
            )
        docs = [
            (ids[s.start : s.stop], None if mask is None else mask[s.start : s.stop])
            for s, (ids, mask) in zip(spans, fetched)
        ]
        return pack_example(docs, self.position_mode)


def pack_rows(
    rows: Any,
    max_seq_len: int,
    mode: str = "bfd",
    truncation: str = "right",
    position_mode: str = "doc_reset",
) -> tuple[PackedDataset, PackStats]:
    """Plan the bins of encoded rows and wrap them as a map-style dataset; logs what was cut."""
    check_options(max_seq_len, mode, truncation, position_mode)
    bins, stats = plan_bins(row_lengths(rows).tolist(), max_seq_len, mode, truncation)
    log.info("packing (%s, truncation=%s): %s", mode, truncation, stats.describe())
    return PackedDataset(rows, bins, position_mode), stats


def collate(examples: Sequence[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad to the longest example: pad_id, labels -100, a fresh document id for the padding (so it
    attends only to itself) and position ids 0, 1, … over it. Tensors of shape (B, T), int64."""
    width = max(len(e["input_ids"]) for e in examples)
    batch: dict[str, list[list[int]]] = {key: [] for key in examples[0]}
    for e in examples:
        pad = width - len(e["input_ids"])
        batch["input_ids"].append(e["input_ids"] + [pad_id] * pad)
        batch["labels"].append(e["labels"] + [IGNORE_INDEX] * pad)
        batch["document_ids"].append(e["document_ids"] + [e["document_ids"][-1] + 1] * pad)
        if "position_ids" in e:
            batch["position_ids"].append(e["position_ids"] + list(range(pad)))
    return {key: torch.tensor(rows, dtype=torch.long) for key, rows in batch.items()}
