"""Preflight: checks that fail before the first step, each with a DataError naming the reason and the fix.

`check_model_fit` refuses a tokenizer with more ids than the model's embedding has rows (before any row is
encoded: at step 1 it would be an IndexError deep in the embedding); `check_tokenizer` runs the
tokenizer-side checks on probe rows (special tokens exist, the chat template renders, the end-of-turn token
is trained in trained turns, several template sections only with a template that renders each message
the same alone as in the conversation);
`check_bos_once` and `check_trained_tokens` scan encoded rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from .packing import column_of, ragged
from .preprocess import (
    PROBE_MESSAGES,
    Section,
    bos_pieces,
    encode_pieces,
    generation_prompt,
    render_example,
    render_message,
    renders_per_message,
    section_pieces,
)
from .rows import DataError, Dropped, check_policy, log_skipped

log = logging.getLogger(__name__)

VOCAB_FIELD = "model.init_args.arch.vocab_size"


def check_model_fit(tokenizer: Any, vocab_size: int | None) -> None:
    """Every id of the tokenizer has a row in the model's embedding of `vocab_size` rows (None: no model)."""
    n = getattr(tokenizer, "vocab_size", None)
    if vocab_size is None or n is None or n <= vocab_size:
        return
    room = -(-n // 64) * 64
    raise DataError(
        f"the tokenizer (data.init_args.tokenizer) has {n} ids but the model's vocab_size is {vocab_size}: "
        f"ids {vocab_size}..{n - 1} have no embedding row",
        VOCAB_FIELD,
        f"give the model a row for every id, --{VOCAB_FIELD} {room} (at least {n}; a multiple of 64 runs "
        "faster on GPUs), or use the tokenizer the model was trained with",
    )


def _probe(section: Section) -> list[dict[str, str]]:
    return [m for m in PROBE_MESSAGES if m["role"] in section.roles]


def check_special_tokens(tokenizer: Any, sections: Sequence[Section], vocab_size: int | None = None) -> None:
    """EOS and pad exist (and a chat template when a section uses one), all ids below `vocab_size`."""
    named = {
        "eos_token": tokenizer.eos_token_id,
        "pad_token": tokenizer.pad_token_id,
        "bos_token": tokenizer.bos_token_id,
    }
    for name in ("eos_token", "pad_token"):
        if named[name] is None:
            raise DataError(
                f"the tokenizer has no {name}",
                name,
                f"set '{name}' in the tokenizer folder's tokenizer_config.json",
            )
    if any(s.template for s in sections) and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "a section uses the chat template but the tokenizer has none",
            "chat_template",
            "add 'chat_template' to tokenizer_config.json, or set template: false",
        )
    ids = {**named, **{f"eos_token_ids[{i}]": t for i, t in enumerate(tokenizer.eos_token_ids)}}
    too_big = {k: v for k, v in ids.items() if v is not None and vocab_size is not None and v >= vocab_size}
    if too_big:
        raise DataError(
            f"special token ids {too_big} do not exist in a model of vocab_size={vocab_size}",
            next(iter(too_big)),
            "use the model's own tokenizer, or resize the model's vocabulary",
        )


def check_template(tokenizer: Any, section: Section) -> None:
    """The template renders the probe conversation. When rendering each message alone does not give the
    whole render (`preprocess.renders_per_message`), conversations are rendered whole and masked by
    prefix renders: said once in the log, with the first difference."""
    messages = _probe(section)
    try:
        whole = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as err:
        raise DataError(
            f"the chat template failed to render a conversation: {err}",
            section.field,
            "fix the tokenizer's chat_template (tokenizer_config.json)",
        ) from err
    if renders_per_message(tokenizer):
        return
    bos = getattr(tokenizer, "bos_token", None)
    whole = whole[len(bos) :] if bos and whole.startswith(bos) else whole
    try:
        parts = "".join(render_message(tokenizer, m, section.field) for m in messages)
    except DataError as err:
        parts = f"(a lone message does not render: {err.reason})"
    at = next((i for i, (a, b) in enumerate(zip(parts, whole)) if a != b), min(len(parts), len(whole)))
    log.info("the chat template renders messages depending on each other (alone %r vs whole %r at character "
             "%d, or tokens merge across messages): '%s' is rendered whole and masked by prefix renders",
             parts[at : at + 40], whole[at : at + 40], at, section.field)


def check_sections_render(tokenizer: Any, sections: Sequence[Section]) -> None:
    """Several template sections (prompt/completion as messages, preference pairs) are rendered each on
    its own and joined, which needs a template that renders each message independently."""
    fields = [s.field for s in sections if s.template]
    if len(fields) > 1 and not renders_per_message(tokenizer):
        raise DataError(
            f"the chat template renders messages depending on each other (e.g. a system header before any "
            f"conversation), so the template sections {fields} cannot be rendered one by one and joined",
            fields[0],
            "give each row its whole conversation in one 'messages' field (sections: messages), or use a "
            "template that renders each message independently (e.g. ChatML)",
        )


def check_end_of_turn(tokenizer: Any, sections: Sequence[Section]) -> None:
    """Every trained turn trains a token that ends generation (EOS or the template's end-of-turn)."""
    stops = set(tokenizer.eos_token_ids)
    header = generation_prompt(tokenizer) if any(s.template for s in sections) else ""
    masks_some = any(s.template or s.action == "mask" for s in sections)
    for section in sections:
        if not section.template:
            if masks_some and section.action == "train" and not section.eos:
                raise DataError(
                    "a trained section ends without EOS, so the model never learns to stop",
                    section.field,
                    f"set eos: true on the section for '{section.field}'",
                )
            continue
        if not renders_per_message(tokenizer):
            _check_whole_end_of_turn(tokenizer, section, stops)
            continue
        for message in _probe(section):
            if section.roles[message["role"]] != "train":
                continue
            pieces = [
                p for p in section_pieces({section.field: [message]}, section, tokenizer, header) if p[1]
            ]
            ((ids, _),) = encode_pieces([pieces], tokenizer)
            if not stops.intersection(ids):
                raise DataError(
                    f"a trained {message['role']!r} turn trains {tokenizer.decode(ids)!r}, which holds "
                    f"none of the end-of-generation ids {sorted(stops)}",
                    section.field,
                    "name the template's end-of-turn token as eos_token in tokenizer_config.json",
                )


def _check_whole_end_of_turn(tokenizer: Any, section: Section, stops: set[int]) -> None:
    """The probe conversation rendered whole: each trained message is one trained span that holds a stop id."""
    messages = _probe(section)
    pieces = section_pieces({section.field: messages}, section, tokenizer, "")
    runs = [ids for ids, trained in pieces if trained]  # whole renders give literal ids
    turns = [m["role"] for m in messages if section.roles[m["role"]] == "train"]
    if len(runs) != len(turns):
        raise DataError(
            f"the {len(turns)} trained turn(s) of a probe conversation rendered whole give {len(runs)} trained "
            "span(s): rendering the conversation up to each turn does not agree with rendering all of it",
            section.field,
            "use a chat template whose render of a conversation starts with the render of its first turns",
        )
    for role, ids in zip(turns, runs):
        if not stops.intersection(ids):
            raise DataError(
                f"a trained {role!r} turn trains {tokenizer.decode(ids)!r}, which holds none of the "
                f"end-of-generation ids {sorted(stops)}",
                section.field,
                "name the template's end-of-turn token as eos_token in tokenizer_config.json",
            )


def check_tokenizer(tokenizer: Any, sections: Sequence[Section], vocab_size: int | None = None) -> None:
    """All tokenizer-side preflight checks for `sections`."""
    check_special_tokens(tokenizer, sections, vocab_size)
    check_sections_render(tokenizer, sections)
    for section in sections:
        if section.template:
            check_template(tokenizer, section)
    check_end_of_turn(tokenizer, sections)
    check_bos_once([{"input_ids": _probe_ids(tokenizer, sections)}], tokenizer, "probe row")


def _probe_ids(tokenizer: Any, sections: Sequence[Section]) -> list[int]:
    pieces = bos_pieces(sections, tokenizer)
    for section in sections:
        row = {section.field: _probe(section) if section.template else "probe text"}
        pieces += section_pieces(
            row, section, tokenizer, generation_prompt(tokenizer) if section.template else ""
        )
    return encode_pieces([pieces], tokenizer)[0][0]


def check_bos_once(
    rows: Any, tokenizer: Any, source: str, lines: Sequence[int] | None = None, ids_column: str = "input_ids"
) -> None:
    """No encoded row starts with two BOS tokens (the template or the text already had one)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return
    values, offsets = ragged(column_of(rows, ids_column))
    starts = offsets[:-1][np.diff(offsets) >= 2]
    doubled = starts[(values[starts] == bos) & (values[starts + 1] == bos)]
    if len(doubled):
        i = int(np.searchsorted(offsets, doubled[0], side="right")) - 1
        raise DataError(
            f"the row starts with BOS twice ({len(doubled)} row(s) do)",
            ids_column,
            "drop the BOS from the chat template or the text; BOS is added once, before the first message",
        ).at_row(source, lines, i)


def trained_targets(
    rows: Any,
    max_seq_len: int,
    packing: str = "bfd",
    truncation: str = "right",
    mask_column: str = "loss_mask",
) -> np.ndarray:
    """Per row: trained targets left once it fits max_seq_len (-1 for a row truncation='drop' drops).

    The first token of a document is never a target (nothing of the document precedes it).
    """
    values, offsets = ragged(column_of(rows, mask_column))
    lengths = np.diff(offsets)
    cut = packing != "bfd_split" and truncation != "drop"
    lo = offsets[:-1] + (np.maximum(lengths - max_seq_len, 0) if cut and truncation == "left" else 0)
    hi = offsets[:-1] + (np.minimum(lengths, max_seq_len) if cut and truncation == "right" else lengths)
    csum = np.concatenate([[0], np.cumsum(values != 0)])
    counts = csum[hi] - csum[np.minimum(lo + 1, hi)]
    if packing != "bfd_split" and truncation == "drop":
        counts = np.where(lengths > max_seq_len, -1, counts)
    return counts


def check_trained_tokens(
    rows: Any,
    max_seq_len: int,
    packing: str = "bfd",
    truncation: str = "right",
    *,
    source: str = "dataset",
    lines: Sequence[int] | None = None,
    on_bad_row: str = "error",
    mask_column: str = "loss_mask",
    sections: Sequence[Section] | None = None,
    dropped: Dropped | None = None,
) -> np.ndarray:
    """Indices of the rows to keep: those with >= 1 trained target once they fit max_seq_len. A row left
    with none raises DataError — saying so when the row trains nothing at any length (a missing turn of
    a role that trains, named from `sections`) — or with on_bad_row='skip' is left out (counted into
    `dropped` and logged)."""
    check_policy(on_bad_row)
    names = rows.column_names if hasattr(rows, "column_names") else (list(rows[0]) if len(rows) else [])
    if mask_column not in names:
        return np.arange(len(rows))  # no mask: every token trains
    counts = trained_targets(rows, max_seq_len, packing, truncation, mask_column)
    bad = np.flatnonzero(counts == 0)
    if len(bad):
        never = trained_targets(rows, max_seq_len, "bfd_split", mask_column=mask_column)[bad] == 0
        untrained = _untrained_row(sections, mask_column, int(never.sum()))
        cut = DataError(
            f"no trained token left once the row fits max_seq_len={max_seq_len} (packing={packing}, "
            f"truncation={truncation}; {int((~never).sum())} row(s) like this)",
            mask_column,
            "raise max_seq_len, use truncation 'left' or packing 'bfd_split', shorten the prompt, check the "
            "roles' train/mask rules, or pass on_bad_row='skip'",
        )
        shown = len(bad) if on_bad_row == "skip" else 1
        errors = [(untrained if never[j] else cut).at_row(source, lines, int(bad[j])) for j in range(shown)]
        if on_bad_row == "error":
            raise errors[0]
        log_skipped(errors, source, dropped)
    return np.flatnonzero(counts != 0)


def _trained_parts(sections: Sequence[Section]) -> dict[str, str]:
    """Field -> what in it trains: "an assistant message" (template sections) or "text"."""
    parts = {}
    for s in sections:
        roles = [r for r, action in s.roles.items() if action == "train"]
        if s.template and roles:
            parts[s.field] = f"{'/'.join(roles)} message"
        elif not s.template and s.action == "train":
            parts[s.field] = "text"
    return parts


def _untrained_row(sections: Sequence[Section] | None, mask_column: str, count: int) -> DataError:
    """A row that trains no token at any length: the turn (or text) that would train is missing."""
    parts = _trained_parts(sections or ())
    what = " or ".join(f"{kind} in '{field}'" for field, kind in parts.items())
    return DataError(
        f"the row trains no token: it has no {what or 'turn of a role that trains'} ({count} row(s) like this)",
        next(iter(parts), mask_column),
        "add the missing turn (e.g. the assistant's answer), check the sections' train/mask rules, "
        "or pass on_bad_row='skip'",
    )


def describe_example(
    rows: Any, tokenizer: Any, index: int = 0, ids_column: str = "input_ids", mask_column: str = "loss_mask"
) -> str:
    """One encoded row decoded with its trained spans wrapped in [[ ]] (what a run prints at start)."""
    row = rows[index]
    return render_example(row[ids_column], row.get(mask_column), tokenizer)
