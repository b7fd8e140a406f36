"""Reading and checking raw rows: `DataError`, the JSONL reader, and the per-row field checks.

Every problem with user data raises `DataError`, whose message names the file, the line (JSONL) or row
(any other source, 1-based), the field and the fix. With `on_bad_row="skip"` the caller drops the row
instead and logs how many were dropped and why; nothing is dropped silently. The drops are counted by
reason (`Dropped`), so a run left with no rows says what removed them (`require_rows`).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ..jsonl import UTF8_FIX, NotUtf8, UnreadableJson, decode_utf8, parse_json

log = logging.getLogger(__name__)

BAD_ROW_POLICIES = ("error", "skip")
LIST_INDEX = re.compile(r"\[\d+\]")
MESSAGE_KEYS = ("role", "content")


class DataError(ValueError):
    """A data file or row is malformed, or the data cannot train the model as configured."""

    def __init__(
        self,
        reason: str,
        field: str | None = None,
        fix: str | None = None,
        source: str | None = None,
        line: int | None = None,
        unit: str = "line",
    ):
        self.reason, self.field, self.fix = reason, field, fix
        self.source, self.line, self.unit = source, line, unit
        super().__init__(self._describe())

    def _describe(self) -> str:
        where = [
            part for part in (self.source, None if self.line is None else f"{self.unit} {self.line}") if part
        ]
        if self.field is not None:
            where.append(f"field '{self.field}'")
        text = f"{', '.join(where)}: {self.reason}" if where else self.reason
        return f"{text}. Fix: {self.fix}" if self.fix else text

    def at(self, source: str | None, line: int | None, unit: str = "line") -> DataError:
        """The same error located in `source` at `unit` `line` (kept where already known)."""
        return DataError(
            self.reason,
            self.field,
            self.fix,
            self.source or source,
            self.line if self.line is not None else line,
            unit if self.line is None else self.unit,
        )

    def at_row(self, source: str | None, lines: Sequence[int] | None, index: int) -> DataError:
        """The same error located at row `index` (0-based) of `source`: its line `lines[index]` when the
        rows' lines are known, else its 1-based row number."""
        return self.at(source, index + 1, "row") if lines is None else self.at(source, lines[index])

    @property
    def summary(self) -> str:
        """The reason without the row's values, e.g. "missing field ('answer')": what drops are counted by."""
        head = re.split(r" \(|: |, got ", self.reason, maxsplit=1)[0]
        if self.field is None:
            return head
        return f"{head} ('{LIST_INDEX.sub('[]', self.field)}')"

    def __reduce__(self):  # keeps the fields across datasets' worker processes
        return (DataError, (self.reason, self.field, self.fix, self.source, self.line, self.unit))


class Dropped(Counter):
    """Rows dropped (on_bad_row='skip', truncation='drop', …), counted by reason (a row dropped for two
    reasons, such as a pair with two bad responses, counts under both)."""

    def describe(self) -> str:
        return "; ".join(f"{reason} ({n})" for reason, n in self.most_common() if n > 0) or "none"


NO_ROWS_FIX = "fix the rows, or change what drops them (max_seq_len, truncation, sections, on_bad_row)"


def require_rows(count: int, what: str, source: str, dropped: Dropped, fix: str = NO_ROWS_FIX) -> None:
    """A DataError when nothing is left (`count` == 0) to train or validate on, with the drops by reason."""
    if count == 0:
        raise DataError(f"no {what} left; rows dropped: {dropped.describe()}", fix=fix, source=source)


def check_policy(on_bad_row: str) -> None:
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"on_bad_row={on_bad_row!r} is not one of {BAD_ROW_POLICIES}; use 'error' or 'skip'")


# --- field checks ---------------------------------------------------------------------------------


def require_field(row: dict[str, Any], name: str) -> Any:
    """`row[name]`, or a DataError naming the missing field and the fields the row does have."""
    if name not in row or row[name] is None:
        present = ", ".join(sorted(k for k, v in row.items() if v is not None)) or "none"
        raise DataError(
            "missing field",
            name,
            f"add '{name}' to every row, or point the section at one of the fields present ({present})",
        )
    return row[name]


def require_text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise DataError(
            f"expected a string, got {type(value).__name__} {_preview(value)}",
            field,
            "store text fields as JSON strings",
        )
    return value


def check_messages(value: Any, field: str, roles: Collection[str]) -> list[dict[str, Any]]:
    """A non-empty list of {role, content} dicts whose roles are in `roles` and whose contents are strings."""
    if not isinstance(value, list):
        raise DataError(
            f"expected a list of messages, got {type(value).__name__} {_preview(value)}",
            field,
            'store a conversation as [{"role": "user", "content": "..."}, ...]',
        )
    if not value:
        raise DataError("empty conversation", field, "drop the row or give it at least one message")
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise DataError(
                f"expected a message object, got {_preview(message)}",
                where,
                'write each message as {"role": ..., "content": ...}',
            )
        missing = [key for key in MESSAGE_KEYS if key not in message]
        if missing:
            raise DataError(
                f"message has no '{missing[0]}' (keys: {', '.join(sorted(message)) or 'none'})",
                where,
                'write each message as {"role": ..., "content": ...}',
            )
        if not isinstance(message["role"], str) or message["role"] not in roles:
            raise DataError(
                f"unknown role {message['role']!r}",
                f"{where}.role",
                f"use one of {', '.join(roles)}, or add a rule for it to the section's roles",
            )
        require_text(message["content"], f"{where}.content")
    return value


def _preview(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


# --- JSONL ----------------------------------------------------------------------------------------


UTF8_SKIP_FIX = f"{UTF8_FIX}, or pass on_bad_row='skip' to drop the line"


def decode_line(raw: bytes, fix: str = UTF8_FIX) -> str:
    """One line of a file as text, or a DataError naming the first byte that is not UTF-8 and its column."""
    try:
        return decode_utf8(raw)
    except NotUtf8 as err:
        raise DataError(str(err), fix=fix) from None


class JsonlRows(NamedTuple):
    rows: list[dict[str, Any]]
    """The good rows, in file order."""
    lines: list[int]
    """The 1-based line number of each good row."""
    skipped: int
    """Bad lines dropped (on_bad_row='skip')."""


def read_jsonl(
    path: str | Path,
    check: Callable[[dict[str, Any]], Any] | None = None,
    on_bad_row: str = "error",
    dropped: Dropped | None = None,
) -> JsonlRows:
    """Parse and check a JSONL file before `datasets` sees it; blank lines are ignored.

    `check(row)` raises DataError for a bad row (see `preprocess.check_row`). With on_bad_row="skip",
    bad lines (malformed JSON and bytes that are not UTF-8 included) are dropped, counted (into
    `dropped`) and logged with their first reasons.
    """
    check_policy(on_bad_row)
    rows, lines, skipped = [], [], []
    with open(path, "rb") as handle:
        numbered = [(n, raw) for n, raw in enumerate(handle, start=1) if raw.strip()]
    for number, raw in numbered:
        try:
            row = parse_row(decode_line(raw, UTF8_SKIP_FIX))
            if check is not None:
                check(row)
        except DataError as err:
            located = err.at(str(path), number)
            if on_bad_row == "error":
                raise located from None
            skipped.append(located)
            continue
        rows.append(row)
        lines.append(number)
    log_skipped(skipped, str(path), dropped)
    return JsonlRows(rows, lines, len(skipped))


MALFORMED_FIX = "repair the line (store long numbers as strings)"


def parse_row(
    text: str, fix: str = f"{MALFORMED_FIX}, or pass on_bad_row='skip' to drop it", parse_int: Any = None
) -> dict[str, Any]:
    """One JSONL line as an object, or a DataError saying why it is not one (`fix`: what to do about
    JSON that cannot be read)."""
    try:
        row = parse_json(text, parse_int)
    except UnreadableJson as err:
        raise DataError(f"malformed JSON ({err})", fix=fix) from None
    if not isinstance(row, dict):
        raise DataError(
            f"expected a JSON object per line, got {type(row).__name__}",
            fix='write one object per line, e.g. {"text": "..."}',
        )
    return row


def log_skipped(
    errors: Sequence[DataError | str],
    source: str,
    dropped: Dropped | None = None,
    summaries: Sequence[str] | None = None,
    shown: int = 3,
) -> None:
    """One warning with the number of skipped rows and the first reasons; the rows are counted into
    `dropped` by `summaries` (default: each error's `summary`)."""
    if not errors:
        return
    if dropped is not None:
        dropped.update(summaries if summaries is not None else [e.summary for e in errors])
    reasons = "; ".join(str(e) for e in errors[:shown])
    more = f" (and {len(errors) - shown} more)" if len(errors) > shown else ""
    log.warning("%s: skipped %d bad row(s) (on_bad_row='skip'): %s%s", source, len(errors), reasons, more)
