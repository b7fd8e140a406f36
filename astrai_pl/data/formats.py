"""The registry of row formats, keyed by a data module's `kind`, and the encoders that look a kind up.

A format (`preprocess.RowFormat`) says how its rows are split into segments and encoded, which columns
the encoded rows have, which sections fit a row's fields, and what the built-in arithmetic task's rows
look like. Adding one is a file defining its `RowFormat` and an entry in `ROW_FORMATS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .conversations import CONVERSATIONS
from .preferences import PREFERENCES
from .preprocess import RowFormat, Section, encode_pieces, generation_prompt
from .prompts import PROMPTS
from .unpaired import UNPAIRED

ROW_FORMATS: dict[str, RowFormat] = {f.kind: f for f in (CONVERSATIONS, PREFERENCES, PROMPTS, UNPAIRED)}


def row_format(kind: str) -> RowFormat:
    """The format of `kind` (sft, dpo, grpo, kto); ValueError naming the kinds for any other."""
    if kind not in ROW_FORMATS:
        raise ValueError(f"kind={kind!r}; use one of {sorted(ROW_FORMATS)}")
    return ROW_FORMATS[kind]


def infer_sections(row: dict[str, Any], kind: str = "sft") -> list[Section]:
    """The preset matching a row's fields (kind: sft, dpo or grpo); lists of messages use the template."""
    return row_format(kind).sections_of(row)


def encode_rows(
    rows: Sequence[dict[str, Any]], sections: Sequence[Section], tokenizer: Any, kind: str = "sft"
) -> list[dict[str, Any]]:
    """Encode rows of one kind (sft, dpo, grpo) with one batched tokenizer call; DataError on a bad row."""
    fmt = row_format(kind)
    header = generation_prompt(tokenizer) if any(s.template for s in sections) else ""
    planned = [fmt.segments(row, sections, tokenizer, header) for row in rows]
    encoded = iter(encode_pieces([seg for segs in planned for seg in segs], tokenizer))
    return [fmt.columns([next(encoded) for _ in segs], sections) for segs in planned]


def encode_row(row: dict[str, Any], sections: Sequence[Section], tokenizer: Any) -> dict[str, list[int]]:
    """{"input_ids", "loss_mask"} of one SFT row; "loss_mask" is absent when every token trains."""
    return encode_rows([row], sections, tokenizer, "sft")[0]


def encode_preference(row: dict[str, Any], sections: Sequence[Section], tokenizer: Any) -> dict[str, Any]:
    """chosen_/rejected_ input_ids and loss_mask sharing the prompt's tokens, and prompt_length."""
    return encode_rows([row], sections, tokenizer, "dpo")[0]


def encode_prompt(row: dict[str, Any], sections: Sequence[Section], tokenizer: Any) -> dict[str, Any]:
    """{"prompt_ids"}: the ids a policy continues (GRPO); the row's other columns are the caller's to keep."""
    return encode_rows([row], sections, tokenizer, "grpo")[0]
