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
from typing import Any

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


# --- row formats: what a kind of row is (the registry is `formats.ROW_FORMATS`) ----------------------


@dataclass(frozen=True)
class RowFormat:
    """How rows of one kind are checked, encoded and shaped; the data modules' `kind` names one."""

    kind: str
    """The data module's kind (sft, dpo, grpo): the key of the format in `formats.ROW_FORMATS`."""
    segments: Callable[[dict[str, Any], Sequence[Section], Any, str], list[list[Piece]]]
    """(row, sections, tokenizer, assistant header) -> the pieces of each segment; DataError on a bad row."""
    columns: Callable[[list[tuple[list[int], list[int]]], Sequence[Section]], dict[str, Any]]
    """(the (ids, mask) of each encoded segment, sections) -> the output columns of the row."""
    count: int
    """Segments per row."""
    ids_column: str
    """The encoded column of token ids that starts with BOS (checked once per row)."""
    default_preset: str
    """The sections preset of the built-in arithmetic rows (path None)."""
    sections_of: Callable[[dict[str, Any]], list[Section]]
    """A row -> the sections matching its fields (sections None); DataError when none does."""
    arithmetic_row: Callable[[str, str, str], dict[str, Any]]
    """(question, answer, a near miss) -> one row of the built-in arithmetic task."""
    keeps_columns: bool = False
    """Encoded rows keep the row's own columns too (e.g. `answer`, for reward functions)."""


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
