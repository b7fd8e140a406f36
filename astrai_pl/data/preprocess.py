"""Declarative preprocessing: the sections of a row become `input_ids` and a `loss_mask` (1 = trained).

A `Section` names a field and what happens to it.

- Template mode (`template=True`): the field holds a conversation (`[{role, content}, …]`, or a string
  taken as one message of `role`). The row starts with BOS (masked; skipped when the tokenizer has
  none). Messages are masked by their role's rule (default: system, user and tool masked, assistant
  trained). In a trained message the role header — the text the template adds for
  `add_generation_prompt`, e.g. `<|im_start|>assistant\\n` — stays masked, because at inference the
  prompt supplies it; the content, the end-of-turn token (`<|im_end|>`) and the template's text after
  it (ChatML's newline) are trained, so the model learns to stop. A BOS the template renders itself is
  removed (BOS is added once, at the start). Two ways to render, chosen per tokenizer and row:
  * message by message, when the template renders each message independently (ChatML, the byte
    tokenizer's template: `renders_per_message` probes it once per template): each message is
    rendered alone, encoded without added special tokens and masked by its role;
  * the conversation whole, when it does not (a template that writes a system header with a date
    before any conversation, as Llama 3.1's, or a default system prompt, or whose tokens merge across
    messages) and for every conversation with tools, tool calls or tool results (schemas go into the
    system or first user turn, results are grouped): the render of the whole conversation is encoded
    once, and each trained message's span is located by rendering prefixes of the conversation
    (`_conversation_pieces`).
  Either way the ids equal `transformers`' `apply_chat_template(messages, tools=…)` on the same
  tokenizer files with BOS prepended.
- Non-template mode: the field is a string encoded as text; `action` "train" or "mask" sets the
  mask of all its tokens; `eos=True` appends the EOS token with the same action. No BOS is added.

When every section trains and none uses a template, rows carry no `loss_mask` (every token trains).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from astrai_pl.model.config import ConfigError

from .rows import DataError, check_messages, require_field, require_text

ACTIONS = ("train", "mask")
DEFAULT_ROLES = {"system": "mask", "user": "mask", "assistant": "train", "tool": "mask"}
PROMPT_ROLES = {"system": "mask", "user": "mask", "assistant": "mask", "tool": "mask"}
TOOLS_FIELD = "tools"  # a row's own tool schemas (a list, or that list as a JSON string)

Piece = tuple[str | list[int], int]  # text to encode (or literal ids) and the mask value of its tokens


@dataclass
class Section:
    """One field of a row and how its tokens are encoded and masked."""

    field: str
    """Name of the row's field (column)."""
    action: str = "train"
    """Non-template sections: 'train' (tokens count in the loss) or 'mask' (they do not)."""
    template: bool = False
    """Render the field through the tokenizer's chat template, message by message (whole, with tools)."""
    roles: dict[str, str] = dataclasses.field(default_factory=lambda: dict(DEFAULT_ROLES))
    """Template sections: 'train' or 'mask' per message role; a role not listed is an error in the data."""
    role: str | None = None
    """Template sections: the role a plain-string value is given (e.g. 'user' for a string prompt)."""
    eos: bool = False
    """Non-template sections: append the EOS token (with this section's action) after the text."""
    tools: list[dict[str, Any]] | None = None
    """Template sections: JSON schemas of the tools every conversation is rendered with (the template's
    `tools`); a row's own `tools` field wins."""

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
        if self.tools is not None and not self.template:
            raise ConfigError(f"Section(field={self.field!r}) sets tools without template=True; tool schemas "
                              "reach the chat template only")
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
    if isinstance(value, list):
        value = [_tool_call_message(m, f"{section.field}[{i}]") for i, m in enumerate(value)]
    checked = [{**m, "content": m.get("content") or ""} if "tool_calls" in m else m for m in value]
    check_messages(checked, section.field, section.roles)
    return value


def _drop_nulls(value: Any) -> Any:
    """`value` without the null entries of its objects: a jsonl read through `datasets` gives every object of
    a column the keys of all of them, null where absent (tool arguments, tool schemas)."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    return [_drop_nulls(v) for v in value] if isinstance(value, list) else value


def _tool_call_message(message: Any, where: str) -> Any:
    """An assistant message with `tool_calls` checked (OpenAI's shape: [{"type": "function", "function":
    {"name", "arguments"}}], arguments an object or a JSON string) and its nulls dropped; others as given."""
    if not isinstance(message, dict) or message.get("tool_calls") is None:
        return message
    calls = message["tool_calls"]
    fix = 'write tool_calls as [{"type": "function", "function": {"name": "...", "arguments": {...}}}]'
    if message.get("role") != "assistant" or not isinstance(calls, list) or not calls:
        raise DataError(f"tool_calls must be a non-empty list on an assistant message, got {calls!r:.80}",
                        f"{where}.tool_calls", fix)
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(f"a tool call needs function.name, got {call!r:.80}", f"{where}.tool_calls[{j}]", fix)
        if not isinstance(function.get("arguments"), (dict, str)):
            raise DataError(f"function.arguments must be an object or a JSON string, got {call!r:.80}",
                            f"{where}.tool_calls[{j}].function.arguments", fix)
    message = {**message, "tool_calls": _drop_nulls(calls)}
    return {k: v for k, v in message.items() if not (k == "content" and v is None)}


def row_tools(row: dict[str, Any], section: Section) -> list[dict[str, Any]] | None:
    """The tool schemas a template section renders the row with: the row's `tools` (a list or its JSON
    string) or else the section's; None when neither gives any."""
    value = row.get(TOOLS_FIELD)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise DataError(f"not valid JSON ({err})", TOOLS_FIELD, "store the tool schemas as a list or as "
                            "its JSON text") from err
    if value is None:
        value = section.tools
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"expected a list of tool schemas (objects), got {value!r:.80}", TOOLS_FIELD,
                        'give tools as [{"type": "function", "function": {"name": ..., "parameters": ...}}]')
    return _drop_nulls(value)


def uses_tools(messages: list[dict[str, Any]], tools: list | None) -> bool:
    """Whether a conversation has tool schemas, tool calls or tool results (rendered whole, not per message)."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def check_row(row: dict[str, Any], sections: Sequence[Section]) -> None:
    """Raise DataError (field named, no location) if the row cannot be encoded with `sections`."""
    for section in sections:
        section_value(row, section)
        if section.template:
            row_tools(row, section)


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


def _render(tokenizer: Any, messages: list[dict[str, Any]], field: str, **options: Any) -> str:
    """The conversation rendered whole through the chat template, without a BOS the template may add."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    except Exception as err:  # a template's raise_exception, jinja errors
        raise DataError(f"the chat template failed on this conversation: {err}", field,
                        "fix the conversation (e.g. a tool call the template cannot render) or the template") from err
    bos = getattr(tokenizer, "bos_token", None)
    return text[len(bos):] if bos and text.startswith(bos) else text


def _shared(a: str, b: str) -> int:
    """Length of the common prefix of a and b."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


PROBE_MESSAGES = (
    {"role": "system", "content": "You answer arithmetic questions."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "And 7 - 9?"},
    {"role": "assistant", "content": "-2"},
)
_PER_MESSAGE: dict[tuple[Any, ...], bool] = {}  # (tokenizer class, template, specials) -> renders_per_message


def renders_per_message(tokenizer: Any) -> bool:
    """Whether the chat template renders each message independently: the probe conversation's messages
    rendered alone and joined give the text of the whole render, and encode to the same ids. Probed once
    per template; False also when a lone message does not render (a template demanding alternation)."""
    specials = getattr(tokenizer, "special_tokens", None) or getattr(tokenizer, "special_tokens_map", {})
    key = (type(tokenizer), tokenizer.chat_template, json.dumps(specials, sort_keys=True, default=str))
    if key not in _PER_MESSAGE:
        messages, section = list(PROBE_MESSAGES), Section("messages", template=True)
        try:
            whole = _render(tokenizer, messages, section.field)
            pieces = _message_pieces(messages, section, tokenizer, generation_prompt(tokenizer))
        except DataError:
            _PER_MESSAGE[key] = False
        else:
            same_text = "".join(p for p, _ in pieces) == whole
            _PER_MESSAGE[key] = same_text and encode_pieces([pieces], tokenizer)[0][0] == tokenizer.encode(
                whole, add_special_tokens=False)
    return _PER_MESSAGE[key]


def _conversation_pieces(
    messages: list[dict[str, Any]], section: Section, tokenizer: Any, tools: list | None
) -> list[Piece]:
    """The conversation rendered whole (tools in the system or first user turn, consecutive tool results
    grouped, a dated system header, as the template decides), encoded once, so the ids are
    `apply_chat_template(messages, tools=tools, tokenize=True)`'s. A trained message's span is found by
    rendering prefixes: it ends where the render of the messages up to and including it stops agreeing
    with the whole, and starts after the render of the messages before it with `add_generation_prompt`
    (the assistant header, which the prompt supplies at inference). A token trains when its first
    character lies in a span. Rendering prefixes costs one render per trained turn and one for the
    header before it; a template that renders a turn differently once later turns follow (one that
    drops earlier reasoning) trains only the part both renders share."""
    options = {"tools": tools} if tools else {}
    whole = _render(tokenizer, messages, section.field, **options)
    spans: dict[int, tuple[int, int]] = {}  # trained message -> its characters in `whole`
    for k, message in enumerate(messages):
        if section.roles[message["role"]] != "train":
            continue
        start = _shared(_render(tokenizer, messages[:k], section.field, add_generation_prompt=True, **options),
                        whole) if k else 0
        spans[k] = (start, _shared(_render(tokenizer, messages[: k + 1], section.field, **options), whole))
    _check_tools_written(whole, messages, tools, spans, section.field)
    ids, offsets = tokenizer.encode_with_offsets(whole)
    pieces: list[Piece] = []
    for token, (begin, _) in zip(ids, offsets):
        trained = int(any(a <= begin < b for a, b in spans.values()))
        if pieces and pieces[-1][1] == trained:
            pieces[-1][0].append(token)
        else:
            pieces.append(([token], trained))
    return pieces


def _check_tools_written(
    whole: str, messages: list[dict[str, Any]], tools: list | None, spans: dict[int, tuple[int, int]], field: str
) -> None:
    """A template that ignores `tools` or `tool_calls` would train the model on conversations without them:
    every tool's name must appear in the render, every call's name in the turn that makes it."""
    fix = "use a chat template that renders tools and tool_calls (e.g. Qwen2.5's or Llama 3.1's)"
    for tool in tools or []:
        name = (tool.get("function") or tool).get("name")
        if isinstance(name, str) and name not in whole:
            raise DataError(f"the chat template does not write the tool schemas (tool {name!r} is absent)",
                            TOOLS_FIELD, fix)
    for k, (start, end) in spans.items():
        for call in messages[k].get("tool_calls") or []:
            name = call["function"]["name"]
            if name not in whole[start:end]:
                raise DataError(f"the chat template does not write the tool call {name!r}",
                                f"{field}[{k}].tool_calls", fix)


def section_pieces(row: dict[str, Any], section: Section, tokenizer: Any, header: str) -> list[Piece]:
    value = section_value(row, section)
    if section.template:
        tools = row_tools(row, section)
        if uses_tools(value, tools) or not renders_per_message(tokenizer):
            return _conversation_pieces(value, section, tokenizer, tools)
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
    carried: tuple[str, ...] = ()
    """Row columns kept as they are in the encoded rows when the data has them (dpo: `margin`); `segments`
    checks their values."""


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
