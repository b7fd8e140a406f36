"""Encode a whole 🤗 `Dataset` with `Dataset.map` (batched, cached by fingerprint, `num_proc`).

A file-backed dataset (loaded from files, `from_generator`, `load_from_disk`) is cached: a second run
with the same rows, sections and tokenizer reads the encoded rows back instead of encoding them. Files
are loaded into a cache named by their content (`files.load_file`), so an edited file is encoded anew.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from datasets import Dataset

from .files import content_named_copy, load_file
from .formats import row_format
from .preprocess import Section, check_row, encode_pieces, generation_prompt
from .rows import DataError, Dropped, check_policy, log_skipped, read_jsonl

log = logging.getLogger(__name__)
ERROR_COLUMN = "_error"
SUMMARY_COLUMN = "_error_summary"


def encode_columns(
    batch: dict[str, list],
    indices: list[int],
    *,
    kind: str,
    sections: Sequence[Section],
    tokenizer: Any,
    source: str,
    lines: Sequence[int] | None,
    on_bad_row: str,
) -> dict[str, list]:
    """A batch of rows (columns) encoded: the kind's columns, and under on_bad_row='skip' each row's error and
    its summary ('' for a good row; a bad row is encoded empty, for the caller to drop)."""
    fmt = row_format(kind)
    header = generation_prompt(tokenizer) if any(s.template for s in sections) else ""
    names = list(batch)
    planned, errors, summaries = [], [], []
    for index, values in zip(indices, zip(*batch.values())):
        try:
            planned.append(fmt.segments(dict(zip(names, values)), sections, tokenizer, header))
            errors.append("")
            summaries.append("")
        except DataError as err:
            located = err.at_row(source, lines, index)
            if on_bad_row == "error":
                raise located from None
            planned.append([[]] * fmt.count)  # an empty row, dropped after the map
            errors.append(str(located))
            summaries.append(located.summary)
    encoded = iter(encode_pieces([seg for segs in planned for seg in segs], tokenizer))
    rows = [fmt.columns([next(encoded) for _ in segs], sections) for segs in planned]
    out = {key: [row[key] for row in rows] for key in rows[0]}
    if on_bad_row == "skip":
        out[ERROR_COLUMN], out[SUMMARY_COLUMN] = errors, summaries
    return out


def tokenize_dataset(
    dataset: Dataset,
    sections: Sequence[Section],
    tokenizer: Any,
    *,
    kind: str = "sft",
    source: str | None = None,
    lines: Sequence[int] | None = None,
    on_bad_row: str = "error",
    num_proc: int | None = None,
    batch_size: int = 1000,
    dropped: Dropped | None = None,
) -> Dataset:
    """Encode every row (kind sft: input_ids[, loss_mask]; dpo: chosen_/rejected_…; grpo: prompt_ids).

    sft and dpo keep only the encoded columns; grpo keeps the row's other columns (e.g. `answer`) for
    the reward functions. A bad row raises DataError naming `source` and its line (`lines[i]`, from
    `rows.read_jsonl`) or its 1-based row number; with on_bad_row="skip" it is dropped, logged and
    counted into `dropped`.
    """
    check_policy(on_bad_row)
    fmt = row_format(kind)
    source = source or (dataset.info.dataset_name or "dataset")
    if len(dataset) == 0:
        raise DataError(
            "no rows to encode", fix="check the path, the split and the held-out fraction", source=source
        )
    removed = [] if fmt.keeps_columns else [c for c in dataset.column_names if c not in fmt.carried]
    kwargs = dict(
        kind=kind,
        sections=list(sections),
        tokenizer=tokenizer,
        source=source,
        lines=None if lines is None else list(lines),
        on_bad_row=on_bad_row,
    )
    encoded = dataset.map(
        encode_columns,
        batched=True,
        batch_size=batch_size,
        with_indices=True,
        fn_kwargs=kwargs,
        remove_columns=removed,
        num_proc=num_proc,
        desc=f"encoding {kind} rows",
    )
    if on_bad_row == "skip":
        encoded = _drop_bad_rows(encoded, source, Dropped() if dropped is None else dropped)
    return encoded


def _drop_bad_rows(encoded: Dataset, source: str, dropped: Dropped) -> Dataset:
    errors = [e for e in encoded[ERROR_COLUMN] if e]
    log_skipped(errors, source, dropped, [s for s in encoded[SUMMARY_COLUMN] if s])
    if len(errors) == len(encoded):
        raise DataError(
            f"every row is bad; rows dropped: {dropped.describe()} (the first: {errors[0]})",
            fix="fix the rows or the sections",
            source=source,
        )
    if errors:
        encoded = encoded.filter(_is_good, input_columns=ERROR_COLUMN, batched=True)
    return encoded.remove_columns([ERROR_COLUMN, SUMMARY_COLUMN])


def _is_good(errors: list[str]) -> list[bool]:
    return [not e for e in errors]


def load_jsonl(
    path: str | Path,
    sections: Sequence[Section],
    *,
    on_bad_row: str = "error",
    cache_dir: str | None = None,
    dropped: Dropped | None = None,
) -> tuple[Dataset, list[int]]:
    """A JSONL file checked line by line against `sections`, as a Dataset, and each row's line number.

    The rows are loaded through `datasets`' json builder, so the Dataset is file-backed and
    `tokenize_dataset` caches. When lines were skipped (counted into `dropped`), the good rows are first
    written to a copy named by their content hash under `cache_dir` (or the `datasets` cache).
    """
    dropped = Dropped() if dropped is None else dropped
    rows, lines, skipped = read_jsonl(path, partial(check_row, sections=sections), on_bad_row, dropped)
    if not rows:
        raise DataError(
            f"no rows; rows dropped: {dropped.describe()}",
            fix="the file is empty or every line was bad",
            source=str(path),
        )
    target = Path(path) if skipped == 0 else _clean_copy(rows, cache_dir)
    dataset = load_file(target, cache_dir, source=str(path))
    _check_read_back(dataset, rows, lines, str(path))
    return dataset, lines


def _check_read_back(dataset: Dataset, rows: list[dict[str, Any]], lines: list[int], source: str) -> None:
    """A column whose rows mix JSON kinds (strings and numbers, …) is stored by `datasets` as JSON and its
    strings parsed back: `"03"` among numbers comes back as `3`. Such a column must read back as written."""
    for column, feature in dataset.features.items():
        if type(feature).__name__ != "Json":
            continue
        for row, line, value in zip(rows, lines, dataset[column]):
            written = row.get(column)
            if value != written or type(value) is not type(written):
                raise DataError(
                    f"{written!r} would be read back as {value!r}, because this field mixes kinds of JSON "
                    "value across the rows (strings and numbers, …)", field=column, source=source, line=line,
                    fix=f"write '{column}' as the same kind on every line (e.g. quote numbers as strings)")


def _clean_copy(rows: list[dict[str, Any]], cache_dir: str | None) -> Path:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return content_named_copy(text.encode("utf-8"), ".jsonl", cache_dir)
