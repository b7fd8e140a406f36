"""One line of a JSONL file read as text and parsed as JSON, each failure a ValueError that says why.

The data modules (data/rows.py) turn these into a DataError naming the file and the line; the commands
(commands.py) into a CommandError.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

UTF8_FIX = "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 FILE > NEW`)"


class NotUtf8(ValueError):
    """Bytes that are not UTF-8; the message names the first bad byte and its column."""


def decode_utf8(raw: bytes) -> str:
    """`raw` as text, or NotUtf8 naming the first byte that is not UTF-8 and its column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        column = len(raw[: err.start].decode("utf-8", errors="replace")) + 1
        raise NotUtf8(f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {column})") from None


class UnreadableJson(ValueError):
    """Text that `json.loads` cannot turn into a value; the message says why."""


def parse_json(text: str, parse_int: Callable[[str], Any] | None = None) -> Any:
    """`json.loads(text)` (integers read by `parse_int`), or UnreadableJson saying why not: a syntax error
    and its column, nesting deeper than the parser recurses, or an integer longer than Python converts.
    Nothing else escapes."""
    try:
        return json.loads(text, parse_int=parse_int)
    except json.JSONDecodeError as err:
        raise UnreadableJson(f"{err.msg} at column {err.colno}") from None
    except RecursionError:
        raise UnreadableJson("nested too deeply to parse") from None
    except ValueError:  # the only other one: an integer past sys.get_int_max_str_digits()
        raise UnreadableJson(f"an integer of more than {sys.get_int_max_str_digits()} digits") from None
