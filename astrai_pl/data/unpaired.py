"""The KTO row format (TRL's unpaired preference format): a `prompt`, a `completion` (text or messages) and a
boolean `label` — true when the completion is desirable, false when it is not.

Two segments per row — the prompt and the completion — encoded as `input_ids` and `loss_mask` (the completion
trained), `prompt_length` (where the completion starts: KTO pairs prompts with other rows' completions for its
KL estimate) and the row's own columns, `label` among them.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from ..model.config import ConfigError
from .preprocess import Piece, RowFormat, Section, bos_pieces, preset_sections, section_pieces
from .rows import DataError, require_field


def check_label(row: dict[str, Any]) -> bool:
    """The row's `label`, a JSON boolean; DataError for anything else (a string "true", 1, null, …)."""
    label = require_field(row, "label")
    if not isinstance(label, bool):
        raise DataError(f"expected true or false, got {type(label).__name__} {label!r}", "label",
                        "write the label as a JSON boolean: true (desirable completion) or false (undesirable)")
    return label


def unpaired_segments(
    row: dict[str, Any], sections: Sequence[Section], tokenizer: Any, header: str
) -> list[list[Piece]]:
    """[prompt, completion]: the section on 'completion' is the completion, every other one the prompt."""
    check_label(row)
    prompt = bos_pieces(sections, tokenizer)
    completion: list[Piece] | None = None
    for section in sections:
        pieces = section_pieces(row, section, tokenizer, header)
        if section.field == "completion":
            completion = pieces
        else:
            prompt += pieces
    if completion is None:
        raise ConfigError("unpaired (KTO) sections need a Section on 'completion'; see preset_sections('chat') "
                          "or preset_sections('prompt_completion')")
    return [prompt, completion]


def unpaired_columns(segments: list[tuple[list[int], list[int]]], sections: Sequence[Section]) -> dict[str, Any]:
    (p_ids, p_mask), (c_ids, c_mask) = segments
    return {"input_ids": p_ids + c_ids, "loss_mask": p_mask + c_mask, "prompt_length": len(p_ids)}


def unpaired_sections(row: dict[str, Any]) -> list[Section]:
    """chat (through the template) when the prompt is a list of messages, else prompt_completion (plain text)."""
    return preset_sections("chat" if isinstance(row.get("prompt"), list) else "prompt_completion")


def arithmetic_example(question: str, answer: str, near_miss: str) -> dict[str, Any]:
    """About half the problems (by a CRC of the question) answered right and labelled desirable, the others
    answered with the near miss and labelled undesirable."""
    desirable = zlib.crc32(question.encode()) % 2 == 0
    return {
        "prompt": [{"role": "user", "content": question}],
        "completion": [{"role": "assistant", "content": answer if desirable else near_miss}],
        "label": desirable,
    }


UNPAIRED = RowFormat(
    kind="kto",
    segments=unpaired_segments,
    columns=unpaired_columns,
    count=2,
    ids_column="input_ids",
    default_preset="chat",
    sections_of=unpaired_sections,
    arithmetic_row=arithmetic_example,
    keeps_columns=True,
)
