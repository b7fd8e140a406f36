"""The GRPO row format: a `prompt` (text or messages) for a policy to continue, plus the columns its
reward functions read (e.g. `answer`), which the encoded rows keep beside `prompt_ids`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .conversations import conversation_segments
from .preprocess import Piece, RowFormat, Section, preset_sections


def prompt_segments(
    row: dict[str, Any], sections: Sequence[Section], tokenizer: Any, header: str
) -> list[list[Piece]]:
    """The prompt a policy continues: BOS, the sections, then the assistant header (template mode)."""
    (pieces,) = conversation_segments(row, sections, tokenizer, header)
    return [pieces + [(header, 0)] if header else pieces]


def prompt_columns(
    segments: list[tuple[list[int], list[int]]], sections: Sequence[Section]
) -> dict[str, Any]:
    return {"prompt_ids": segments[0][0]}


def prompt_sections(row: dict[str, Any]) -> list[Section]:
    """grpo (through the template) when the prompt is a list of messages, else the prompt as plain text."""
    return preset_sections("grpo") if isinstance(row.get("prompt"), list) else [Section("prompt", action="mask")]


def arithmetic_prompt(question: str, answer: str, near_miss: str) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": question}], "answer": answer}


PROMPTS = RowFormat(
    kind="grpo",
    segments=prompt_segments,
    columns=prompt_columns,
    count=1,
    ids_column="prompt_ids",
    default_preset="grpo",
    sections_of=prompt_sections,
    arithmetic_row=arithmetic_prompt,
    keeps_columns=True,
)
