"""Checks of a pretraining corpus's documents before they are tokenized.

A document's text is a string, or null / missing: such a document has no text and is skipped (counted
in one log line). Any other value (a number, a list, an object) is a DataError naming the file, the
line (JSONL) or row (any other source, 1-based), the field and the value. A JSONL corpus is read line by
line first (`check_jsonl_corpus`), so a line that is not UTF-8, not readable JSON or not an object is
named by its number before `datasets`, whose JSON reader names no line, sees it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from datasets import Dataset, Value

from .rows import MALFORMED_FIX, DataError, decode_line, parse_row, require_text

log = logging.getLogger(__name__)
TEXT_TYPES = ("string", "large_string", "null")


class MissingColumnError(DataError, KeyError):
    """The corpus has no column of the configured name (a KeyError too, for callers that catch that)."""

    __str__ = DataError.__str__


def check_document_text(value: Any, field: str) -> None:
    """None (no text: the document is skipped) or a string; else a DataError naming the value."""
    if value is not None:
        require_text(value, field)


def _int_as_datasets_reads_it(digits: str) -> int | float:
    """Other columns do not matter here: an integer too long for Python, `datasets` reads as a float."""
    return int(digits) if len(digits) <= sys.get_int_max_str_digits() else float(digits)


def check_jsonl_corpus(path: Path, text_field: str) -> None:
    """Every non-blank line of `path` is a UTF-8 JSON object whose `text_field` is a string or null."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                row = parse_row(decode_line(raw), MALFORMED_FIX, _int_as_datasets_reads_it)
                check_document_text(row.get(text_field), text_field)
            except DataError as err:
                raise err.at(str(path), number) from None


def require_text_column(docs: Dataset, text_field: str, source: str) -> None:
    if text_field not in docs.column_names:
        raise MissingColumnError(
            f"no column {text_field!r} (columns: {', '.join(docs.column_names) or 'none'})",
            "text_field",
            "set text_field to the column that holds the documents' text",
            source=source,
        )


def textless_documents(docs: Dataset, text_field: str, source: str) -> list[bool]:
    """Whether each document has no text (null); a DataError at the first text that is not a string."""
    require_text_column(docs, text_field, source)
    feature = docs.features[text_field]
    if isinstance(feature, Value) and feature.dtype in TEXT_TYPES:
        return docs.with_format("arrow")[text_field].is_null().to_pylist()
    missing = []
    for index, value in enumerate(docs[text_field]):
        try:
            check_document_text(value, text_field)
        except DataError as err:
            raise err.at(source, index + 1, "row") from None
        missing.append(value is None)
    return missing


def log_textless(missing: list[bool], source: str, text_field: str) -> None:
    if any(missing):
        log.warning("%s: skipped %d document(s) without text (null or missing '%s')", source, sum(missing),
                    text_field)
