"""The SFT row format: conversations (`messages`), prompt/completion pairs, or plain `text`.

One segment per row, encoded as `input_ids` (and `loss_mask` when some token is masked).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .preprocess import (
    Piece,
    RowFormat,
    Section,
    bos_pieces,
    needs_loss_mask,
    preset_sections,
    section_pieces,
)
from .rows import DataError


def conversation_segments(
    row: dict[str, Any], sections: Sequence[Section], tokenizer: Any, header: str
) -> list[list[Piece]]:
    pieces = bos_pieces(sections, tokenizer)
    for section in sections:
        pieces += section_pieces(row, section, tokenizer, header)
    return [pieces]


def conversation_columns(
    segments: list[tuple[list[int], list[int]]], sections: Sequence[Section]
) -> dict[str, Any]:
    ((ids, mask),) = segments
    return {"input_ids": ids, "loss_mask": mask} if needs_loss_mask(sections) else {"input_ids": ids}


def conversation_sections(row: dict[str, Any]) -> list[Section]:
    """messages, chat (prompt/completion as messages), prompt_completion (as text) or text, by the fields."""
    chat = isinstance(row.get("prompt"), list)
    for fields, name in (
        (("messages",), "messages"),
        (("prompt", "completion"), "chat" if chat else "prompt_completion"),
        (("text",), "text"),
    ):
        if all(f in row for f in fields):
            return preset_sections(name)
    raise DataError(
        f"cannot tell the row format from its fields {sorted(row)}",
        None,
        "give rows 'messages', 'prompt'+'completion' or 'text', or pass sections explicitly",
    )


def arithmetic_conversation(question: str, answer: str, near_miss: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


CONVERSATIONS = RowFormat(
    kind="sft",
    segments=conversation_segments,
    columns=conversation_columns,
    count=1,
    ids_column="input_ids",
    default_preset="messages",
    sections_of=conversation_sections,
    arithmetic_row=arithmetic_conversation,
)
