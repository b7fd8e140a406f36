"""Declarative preprocessing: the sections of a row become `input_ids` and a `loss_mask` (1 = trained).

A `Section` names a field and what happens to it.

- Template mode (`template=True`): the field holds a conversation (`[{role, content}, …]`, or a string
  taken as one message of `role`). The row starts with BOS (masked; skipped when the tokenizer has
  none). Each message is rendered *alone* through the chat template, encoded without added special
  tokens, and masked by its role's rule (default: system and user masked, assistant trained). In a
  trained message the role header — the text the template adds for `add_generation_prompt`, e.g.
  `<|im_start|>assistant\\n` — stays masked, because at inference the prompt supplies it; the content,
  the end-of-turn token (`<|im_end|>`) and the template's text after it (ChatML's newline) are
  trained, so the model learns to stop. A BOS the template renders itself is removed from each
  message's render (BOS is added once, at the start). Rendering messages alone and concatenating
  them equals rendering the whole conversation for templates that render each message
  independently (ChatML, the byte tokenizer's template); `preflight.check_template` verifies it for
  the tokenizer at hand and names the first difference otherwise. The ids equal `transformers`'
  `apply_chat_template(messages)` on the same tokenizer files with BOS prepended.
- Non-template mode: the field is a string encoded as text; `action` "train" or "mask" sets the
  mask of all its tokens; `eos=True` appends the EOS token with the same action. No BOS is added.

When every section trains and none uses a template, rows carry no `loss_mask` (every token trains).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from astrai_pl.model.config import ConfigError

from .rows import DataError, check_messages, require_field, require_text

ACTIONS = ("train", "mask")
DEFAULT_ROLES = {"system": "mask", "user": "mask", "assistant": "train"}
PROMPT_ROLES = {"system": "mask", "user": "mask", "assistant": "mask"}

Piece = tuple[str | list[int], int]  # text to encode (or literal ids) and the mask value of its tokens


@dataclass
class Section:
    """One field of a row and how its tokens are encoded and masked."""

    field: str
    """Name of the row's field (column)."""
    action: str = "train"
    """Non-template sections: 'train' (tokens count in the loss) or 'mask' (they do not)."""
    template: bool = False
    """Render the field through the tokenizer's chat template, message by message."""
    roles: dict[str, str] = dataclasses.field(default_factory=lambda: dict(DEFAULT_ROLES))
    """Template sections: 'train' or 'mask' per message role; a role not listed is an error in the data."""
    role: str | None = None
    """Template sections: the role a plain-string value is given (e.g. 'user' for a string prompt)."""
    eos: bool = False
    """Non-template sections: append the EOS token (with this section's action) after the text."""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ConfigError(f"Section(field={self.field!r}).action={self.action!r}; use one of {ACTIONS}")
        bad = {r: a for r, a in self.roles.items() if a not in ACTIONS}
        if bad:
            raise ConfigError(
                f"Section(field={self.field!r}).roles has actions {bad}; each must be one of {ACTIONS}"
            )
        if self.role is not None and self.role not in self.roles:
            raise ConfigError(
                f"Section(field={self.field!r}).role={self.role!r} has no rule in roles "
                f"{sorted(self.roles)}; add it to roles or pick one of them"
            )
        if self.template and self.eos:
            raise ConfigError(
                f"Section(field={self.field!r}) sets eos with template=True; the template "
                "writes the end-of-turn token itself, so drop eos"
            )


def preset_sections(name: str) -> list[Section]:
    """Sections for the usual row formats: messages, chat (prompt/completion through the template), text,
    prompt_completion (plain text), preference (DPO, through the template), preference_text, grpo."""
    presets = {
        "messages": [Section("messages", template=True)],
        "chat": [
            Section("prompt", template=True, role="user", roles=dict(PROMPT_ROLES)),
            Section("completion", template=True, role="assistant"),
        ],
        "text": [Section("text")],
        "prompt_completion": [Section("prompt", action="mask"), Section("completion", eos=True)],
        "preference": [
            Section("prompt", template=True, role="user", roles=dict(PROMPT_ROLES)),
            Section("chosen", template=True, role="assistant"),
            Section("rejected", template=True, role="assistant"),
        ],
        "preference_text": [
            Section("prompt", action="mask"),
            Section("chosen", eos=True),
            Section("rejected", eos=True),
        ],
        "grpo": [Section("prompt", template=True, role="user", roles=dict(PROMPT_ROLES))],
    }
    if name not in presets:
        raise ConfigError(f"unknown sections preset {name!r}; use one of {sorted(presets)} or list Sections")
    return presets[name]


def infer_sections(row: dict[str, Any], kind: str = "sft") -> list[Section]:
    """The preset matching a row's fields (kind: sft, dpo or grpo); lists of messages use the template."""
    chat = isinstance(row.get("prompt"), list)
    if kind == "dpo":
        return preset_sections("preference" if chat else "preference_text")
    if kind == "grpo":
        return preset_sections("grpo") if chat else [Section("prompt", action="mask")]
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


def needs_loss_mask(sections: Sequence[Section]) -> bool:
    return any(s.template or s.action == "mask" for s in sections)


# --- checking and rendering -----------------------------------------------------------------------


def section_value(row: dict[str, Any], section: Section) -> str | list[dict[str, Any]]:
    """The section's field, checked: a string (non-template) or a list of messages (template)."""
    value = require_field(row, section.field)
    if not section.template:
        return require_text(value, section.field)
    if isinstance(value, str) and section.role is not None:
        return [{"role": section.role, "content": value}]
    return check_messages(value, section.field, section.roles)


def check_row(row: dict[str, Any], sections: Sequence[Section]) -> None:
    """Raise DataError (field named, no location) if the row cannot be encoded with `sections`."""
    for section in sections:
        section_value(row, section)


def render_message(tokenizer: Any, message: dict[str, Any], field: str) -> str:
    """One message rendered alone through the chat template, without a BOS the template may add."""
    try:
        text = tokenizer.apply_chat_template([message], tokenize=False)
    except Exception as err:  # a template's raise_exception, jinja errors, a missing template
        raise DataError(
            f"the chat template failed on a lone {message.get('role')!r} message: {err}",
            field,
            "use a template that renders each message on its own (e.g. ChatML)",
        ) from err
    bos = getattr(tokenizer, "bos_token", None)
    return text[len(bos) :] if bos and text.startswith(bos) else text


def generation_prompt(tokenizer: Any) -> str:
    """The text the template appends for `add_generation_prompt` (the assistant header), or ''."""
    probe = [{"role": "user", "content": "."}]
    try:
        plain = tokenizer.apply_chat_template(probe, tokenize=False)
        prompted = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # the same failures as render_message
        raise DataError(
            f"the chat template failed on a lone user message: {err}",
            "chat_template",
            "fix the tokenizer's chat_template (tokenizer_config.json), or set template: false",
        ) from err
    return prompted[len(plain) :] if prompted.startswith(plain) else ""


def _message_pieces(
    messages: list[dict[str, Any]], section: Section, tokenizer: Any, header: str
) -> list[Piece]:
    pieces: list[Piece] = []
    for message in messages:
        text = render_message(tokenizer, message, section.field)
        trained = int(section.roles[message["role"]] == "train")
        if trained and header and text.startswith(header):
            pieces += [(header, 0), (text[len(header) :], 1)]
        else:
            pieces.append((text, trained))
    return pieces


def section_pieces(row: dict[str, Any], section: Section, tokenizer: Any, header: str) -> list[Piece]:
    value = section_value(row, section)
    if section.template:
        return _message_pieces(value, section, tokenizer, header)
    trained = int(section.action == "train")
    return [(value, trained), ([tokenizer.eos_token_id], trained)] if section.eos else [(value, trained)]


def bos_pieces(sections: Sequence[Section], tokenizer: Any) -> list[Piece]:
    """[BOS] (masked) when a section uses the template and the tokenizer has a BOS token."""
    bos = tokenizer.bos_token_id
    return [([bos], 0)] if bos is not None and any(s.template for s in sections) else []


def encode_pieces(rows: Sequence[Sequence[Piece]], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """Ids and mask of each row's pieces; every text of every row goes through one batched encode."""
    texts = [p for pieces in rows for p, _ in pieces if isinstance(p, str)]
    batch = getattr(tokenizer, "encode_batch", None)
    encoded = iter(batch(texts) if batch else [tokenizer.encode(t, add_special_tokens=False) for t in texts])
    out = []
    for pieces in rows:
        ids: list[int] = []
        mask: list[int] = []
        for piece, trained in pieces:
            chunk = next(encoded) if isinstance(piece, str) else piece
            ids += chunk
            mask += [trained] * len(chunk)
        out.append((ids, mask))
    return out


# --- row kinds: the pieces of each segment, then the output columns built from the encoded segments ----


def sft_segments(
    row: dict[str, Any], sections: Sequence[Section], tokenizer: Any, header: str
) -> list[list[Piece]]:
    pieces = bos_pieces(sections, tokenizer)
    for section in sections:
        pieces += section_pieces(row, section, tokenizer, header)
    return [pieces]


def sft_columns(segments: list[tuple[list[int], list[int]]], sections: Sequence[Section]) -> dict[str, Any]:
    ((ids, mask),) = segments
    return {"input_ids": ids, "loss_mask": mask} if needs_loss_mask(sections) else {"input_ids": ids}


def preference_segments(
    row: dict[str, Any], sections: Sequence[Section], tokenizer: Any, header: str
) -> list[list[Piece]]:
    """[shared prompt, chosen, rejected]: the sections on 'chosen' and 'rejected' are the two responses."""
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


def prompt_segments(
    row: dict[str, Any], sections: Sequence[Section], tokenizer: Any, header: str
) -> list[list[Piece]]:
    """The prompt a policy continues: BOS, the sections, then the assistant header (template mode)."""
    (pieces,) = sft_segments(row, sections, tokenizer, header)
    return [pieces + [(header, 0)] if header else pieces]


def prompt_columns(
    segments: list[tuple[list[int], list[int]]], sections: Sequence[Section]
) -> dict[str, Any]:
    return {"prompt_ids": segments[0][0]}


PREFERENCE_FIELDS = ("chosen", "rejected")


class RowKind(NamedTuple):
    segments: Callable[..., list[list[Piece]]]
    """The pieces of each segment of a row (raises DataError on a bad row)."""
    columns: Callable[..., dict[str, Any]]
    """The output columns, from the encoded segments."""
    count: int
    """Segments per row."""


ROW_KINDS = {
    "sft": RowKind(sft_segments, sft_columns, 1),
    "dpo": RowKind(preference_segments, preference_columns, 3),
    "grpo": RowKind(prompt_segments, prompt_columns, 1),
}


def encode_rows(
    rows: Sequence[dict[str, Any]], sections: Sequence[Section], tokenizer: Any, kind: str = "sft"
) -> list[dict[str, Any]]:
    """Encode rows of one kind (sft, dpo, grpo) with one batched tokenizer call; DataError on a bad row."""
    segments_of, columns_of, _ = ROW_KINDS[kind]
    header = generation_prompt(tokenizer) if any(s.template for s in sections) else ""
    planned = [segments_of(row, sections, tokenizer, header) for row in rows]
    encoded = iter(encode_pieces([seg for segs in planned for seg in segs], tokenizer))
    return [columns_of([next(encoded) for _ in segs], sections) for segs in planned]


def encode_row(row: dict[str, Any], sections: Sequence[Section], tokenizer: Any) -> dict[str, list[int]]:
    """{"input_ids", "loss_mask"} of one SFT row; "loss_mask" is absent when every token trains."""
    return encode_rows([row], sections, tokenizer, "sft")[0]


def encode_preference(row: dict[str, Any], sections: Sequence[Section], tokenizer: Any) -> dict[str, Any]:
    """chosen_/rejected_ input_ids and loss_mask sharing the prompt's tokens, and prompt_length."""
    return encode_rows([row], sections, tokenizer, "dpo")[0]


def encode_prompt(row: dict[str, Any], sections: Sequence[Section], tokenizer: Any) -> dict[str, Any]:
    """{"prompt_ids"}: the ids a policy continues (GRPO); the row's other columns are the caller's to keep."""
    return encode_rows([row], sections, tokenizer, "grpo")[0]


def render_example(input_ids: Sequence[int], loss_mask: Sequence[int] | None, tokenizer: Any) -> str:
    """The decoded row with every trained span wrapped in [[ ]] (no mask: the whole row is trained)."""
    mask = [1] * len(input_ids) if loss_mask is None else list(loss_mask)
    parts, start = [], 0
    for end in range(1, len(input_ids) + 1):
        if end == len(input_ids) or mask[end] != mask[start]:
            text = tokenizer.decode(list(input_ids[start:end]))
            parts.append(f"[[{text}]]" if mask[start] else text)
            start = end
    return "".join(parts)
