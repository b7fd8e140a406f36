"""What a request allows the sampler to pick, applied to every row of a step's logits at once:
`logit_bias`, `min_tokens`, `bad_words` and a structured-output grammar.

    constraint = row_constraint(params, tokenizer, vocab_size, end_ids)    # at admission; None if unconstrained
    logits = constrain(logits, constraints, contexts, num_outputs)        # in `sample`, before the penalties

On row r, with b the request's bias and m its set of forbidden tokens:
    l'[r, t] = l[r, t] + b[t]                       (OpenAI's logit_bias: -100 bans, +100 all but forces)
    l'[r, t] = -inf  for t ∉ grammar(r)             (the tokens that keep the text inside the language)
    l'[r, t] = -inf  for t ∈ bad(r)                 (the last token of a bad word whose other tokens just came)
    l'[r, t] = -inf  for t ∈ end ids while fewer than min_tokens tokens were generated
The grammar outranks the other two masks, and bad words outrank min_tokens: a mask that would leave a row
without a finite logit is not applied to it (a grammar that can only end, ends). Rows without a constraint are not touched, and
everything that reaches the device is one copy per kind of mask.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from .grammar import (
    GrammarError,
    GrammarState,
    StructuredOutput,
    bitmask_words,
    compile_structured,
    unpack_bitmask,
    xgrammar_apply,
)

MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
LOGIT_BIAS_RANGE = 100.0
MAX_BAD_WORDS = 256


# -- SamplingParams' fields ---------------------------------------------------------------------------------------
def check_fields(params, fail) -> None:
    """Validate and normalise logit_bias, min_tokens, bad_words and structured; `fail(name, why, fix)` raises."""
    params.logit_bias = _logit_bias(params.logit_bias, fail)
    value = params.min_tokens
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        fail("min_tokens", "must be a whole number >= 0", "use 0 to let the completion end at any time")
    params.min_tokens = int(value)
    if params.min_tokens > params.max_tokens:
        fail("min_tokens", f"is more than max_tokens={params.max_tokens}", "lower min_tokens or raise max_tokens")
    words = params.bad_words
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w for w in words):
        fail("bad_words", "must be a list of non-empty strings", 'pass e.g. ["forbidden"]')
    if len(words) > MAX_BAD_WORDS:
        fail("bad_words", f"holds {len(words)} words, at most {MAX_BAD_WORDS} are taken", "shorten the list")
    params.bad_words = list(words)
    if params.structured is not None and not isinstance(params.structured, StructuredOutput):
        fail("structured", "must be a StructuredOutput or None", "pass StructuredOutput(json=schema) or the like")
    if params.structured is not None and params.ignore_eos:
        fail("structured", "cannot be combined with ignore_eos (the grammar ends on an end-of-sequence token)",
             "leave ignore_eos False")


def _logit_bias(bias, fail) -> dict[int, float]:
    fix = 'pass {token_id: bias} with ids >= 0 and biases in [-100, 100], e.g. {"50256": -100}'
    if not isinstance(bias, dict):
        fail("logit_bias", "must be a dict of token id to bias", fix)
    if len(bias) > MAX_LOGIT_BIAS:
        fail("logit_bias", f"holds {len(bias)} entries, at most {MAX_LOGIT_BIAS} are taken", "shorten it")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() and key.isascii() else key
        if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
            fail("logit_bias", f"has the key {key!r}, not a token id", fix)
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) \
                or abs(value) > LOGIT_BIAS_RANGE:
            fail("logit_bias", f"maps {key!r} to {value!r}, outside [-100, 100]", fix)
        out[int(token)] = float(value)
    return out


def constrained(params) -> bool:
    return bool(params.logit_bias or params.min_tokens or params.bad_words or params.structured is not None)


# -- one request's constraint -------------------------------------------------------------------------------------
@dataclass
class RowConstraint:
    """A request's constraint as the sampler reads it: ids resolved against the tokenizer, its grammar state."""

    bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    end_ids: tuple[int, ...] = ()
    bad_words: list[tuple[int, ...]] = field(default_factory=list)
    grammar: GrammarState | None = None

    def fork(self) -> RowConstraint:
        """The same constraint for another sample of the prompt, with a grammar state of its own."""
        grammar = None if self.grammar is None else self.grammar.fork()
        return RowConstraint(self.bias, self.min_tokens, self.end_ids, self.bad_words, grammar)

    def banned(self, output: list[int], num_outputs: int) -> tuple[list[int], list[int]]:
        """(hard, soft) forbidden ids for the next token: bad words' last tokens, then end ids under min_tokens."""
        hard = [w[-1] for w in self.bad_words if len(w) == 1 or tuple(output[-(len(w) - 1):]) == w[:-1]]
        soft = list(self.end_ids) if num_outputs < self.min_tokens else []
        return hard, soft


def row_constraint(params, tokenizer, vocab_size: int, end_ids: list[int]) -> RowConstraint | None:
    """The constraint of a request with `params` on this model, or None when it has none. Raises GrammarError
    (a spec that cannot be compiled) or ValueError (an id outside the vocabulary, bad words without tokenizer)."""
    if not constrained(params):
        return None
    outside = [t for t in params.logit_bias if t >= vocab_size]
    if outside:
        raise ValueError(f"SamplingParams.logit_bias has the token id {outside[0]}, outside the vocabulary of "
                         f"{vocab_size} ids; pass ids from this model's tokenizer")
    if params.bad_words and tokenizer is None:
        raise ValueError("SamplingParams.bad_words needs a tokenizer; pass tokenizer= to Engine")
    stops = tuple(dict.fromkeys([*end_ids, *params.stop_token_ids]))
    grammar = None
    if params.structured is not None:
        grammar = GrammarState(compile_structured(params.structured, tokenizer, vocab_size, list(end_ids)))
    words = bad_word_ids(params.bad_words, tokenizer) if params.bad_words else []
    return RowConstraint(params.logit_bias, params.min_tokens, stops, words, grammar)


def bad_word_ids(words: list[str], tokenizer) -> list[tuple[int, ...]]:
    """Each word's ids as written alone and after a space (as vLLM bans them), duplicates dropped."""
    found: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text))
            if ids:
                found[ids] = None
    return list(found)


# -- the batched application --------------------------------------------------------------------------------------
def constrain(
    logits: torch.Tensor,  # (N, V) float32, finite or -inf; modified in place
    constraints: list[RowConstraint | None],
    contexts: list[list[int]],
    num_outputs: list[int],
) -> torch.Tensor:
    """Every row's constraint applied to `logits` in place (rows without one keep their values); returns it."""
    N, V = logits.shape
    bias = ([], [], [])
    hard, soft, grammar_rows = ([], []), ([], []), []
    bitmask = None
    for r, c in enumerate(constraints):
        if c is None:
            continue
        output = contexts[r][len(contexts[r]) - num_outputs[r]:]
        for token, value in c.bias.items():
            bias[0].append(r), bias[1].append(token), bias[2].append(value)
        for ids, into in zip(c.banned(output, num_outputs[r]), (hard, soft)):
            into[0].extend([r] * len(ids)), into[1].extend(ids)
        if c.grammar is not None:
            c.grammar.sync(output)
            if bitmask is None:
                bitmask = torch.full((N, bitmask_words(V)), -1, dtype=torch.int32)
            if c.grammar.fill(bitmask, r):
                grammar_rows.append(r)
    if bias[0]:
        index = torch.tensor(bias[:2], dtype=torch.int64).to(logits.device)
        logits.index_put_((index[0], index[1]), torch.tensor(bias[2]).to(logits.device), accumulate=True)
    if grammar_rows:
        apply_bitmask(logits, bitmask, grammar_rows)
    _ban(logits, hard)
    _ban(logits, soft)
    return logits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[r, t] = -inf where bit t of bitmask[r] is clear, for r in `rows`. On the CPU xgrammar's kernel does it
    in one pass; elsewhere the packed words go to the device (V / 8 bytes a row) and are unpacked there."""
    V = logits.shape[-1]
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        xgrammar_apply(logits, bitmask, indices=rows, vocab_size=V)
        return
    index = torch.tensor(rows).to(logits.device)
    allowed = unpack_bitmask(bitmask[rows].to(logits.device), V)  # (G, V)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _ban(logits: torch.Tensor, banned: tuple[list[int], list[int]]) -> None:
    """The (row, id) pairs of `banned` set to -inf, except on rows that would be left without a finite logit."""
    if not banned[0]:
        return
    rows = sorted(set(banned[0]))
    index = torch.tensor(banned, dtype=torch.int64).to(logits.device)  # (2, K)
    at = torch.tensor(rows).to(logits.device)
    before = logits[at]  # (R, V), a copy
    logits.index_put_((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))
    emptied = ~logits[at].isfinite().any(dim=-1, keepdim=True)
    logits[at] = torch.where(emptied, before, logits[at])


__all__ = ["GrammarError", "RowConstraint", "StructuredOutput", "check_fields", "constrain", "row_constraint"]
