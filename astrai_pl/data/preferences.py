"""The DPO row format: a shared `prompt`, a `chosen` and a `rejected` response (text or messages).

Three segments per row — the prompt and each response — encoded as `chosen_`/`rejected_` `input_ids`
and `loss_mask` that share the prompt's tokens, and `prompt_length`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from ..model.config import ConfigError
from .preprocess import Piece, RowFormat, Section, bos_pieces, preset_sections, section_pieces
from .rows import DataError

PREFERENCE_FIELDS = ("chosen", "rejected")


def preference_segments(
    row: dict[str, Any], sections: Sequence[Section], tokenizer: Any, header: str
) -> list[list[Piece]]:
    """[shared prompt, chosen, rejected]: the sections on 'chosen' and 'rejected' are the two responses."""
    check_margin(row)
    prompt = bos_pieces(sections, tokenizer)
    responses: dict[str, list[Piece]] = {}
    for section in sections:
        pieces = section_pieces(row, section, tokenizer, header)
        if section.field in PREFERENCE_FIELDS:
            responses[section.field] = pieces
        else:
            prompt += pieces
    missing = [f for f in PREFERENCE_FIELDS if f not in responses]
    if missing:
        raise ConfigError(
            f"preference sections need a Section for {missing}; see preset_sections('preference')"
        )
    return [prompt, responses["chosen"], responses["rejected"]]


def check_margin(row: dict[str, Any]) -> None:
    """DataError unless the row's `margin`, when the data has that column, is a finite number: the score gap a
    reward model is asked for on this pair (TRL's `margin`: the loss is −log σ(s_c − s_r − margin))."""
    if "margin" not in row:
        return
    value = row["margin"]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise DataError(f"not a finite number: {value!r} (when some rows give a margin, every row must)",
                        "margin", "give every pair a number, e.g. 0.0 for no required gap, or drop the column")


def preference_columns(
    segments: list[tuple[list[int], list[int]]], sections: Sequence[Section]
) -> dict[str, Any]:
    (p_ids, p_mask), (c_ids, c_mask), (r_ids, r_mask) = segments
    return {
        "chosen_input_ids": p_ids + c_ids,
        "chosen_loss_mask": p_mask + c_mask,
        "rejected_input_ids": p_ids + r_ids,
        "rejected_loss_mask": p_mask + r_mask,
        "prompt_length": len(p_ids),
    }


def preference_sections(row: dict[str, Any]) -> list[Section]:
    """preference (through the template) when the prompt is a list of messages, else preference_text."""
    return preset_sections("preference" if isinstance(row.get("prompt"), list) else "preference_text")


def arithmetic_pair(question: str, answer: str, near_miss: str) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": question}],
        "chosen": [{"role": "assistant", "content": answer}],
        "rejected": [{"role": "assistant", "content": near_miss}],
    }


PREFERENCES = RowFormat(
    kind="dpo",
    segments=preference_segments,
    columns=preference_columns,
    count=3,
    ids_column="chosen_input_ids",
    default_preset="preference",
    sections_of=preference_sections,
    arithmetic_row=arithmetic_pair,
    carried=("margin",),
)
