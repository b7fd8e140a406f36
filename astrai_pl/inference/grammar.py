"""Structured outputs: a JSON schema, a regular expression, a list of choices or an EBNF grammar that the
generated text must follow, enforced token by token with xgrammar (Dong et al., 2024).

    spec = StructuredOutput(json={"type": "object", ...})      # or regex=, choice=, grammar=, json_object=True
    compiled = compile_structured(spec, tokenizer, vocab_size, end_ids)   # cached per (spec, tokenizer)
    state = GrammarState(compiled)                              # one per request: its own matcher
    state.sync(output_ids); state.fill(bitmask, row)            # each step: catch up, then the allowed tokens

A grammar is compiled against the tokenizer once: for every reachable state xgrammar knows which tokens keep
the text inside the language (a pushdown automaton over the tokens' bytes), so each step only fills a bitmask
of ceil(V / 32) int32 words per row. The row's state follows the accepted tokens; `sync` replays what it has
not seen yet and rolls back what was taken back, so it never drifts from the request's own token list.

xgrammar is imported on first use (it takes seconds); without it a constrained request is refused with the
install line, and unconstrained ones never notice.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

CACHE_SIZE = 64  # compiled grammars kept (per process), least recently used dropped first
MAX_SPEC_CHARS = 2**17  # a schema, regex or grammar text longer than this is refused before compiling
_XGRAMMAR_MARK = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar prefixes its errors with time and source line


class GrammarError(ValueError):
    """A structured-output spec is malformed, or its grammar cannot be compiled (the message says which part)."""

    def __init__(self, message: str, field: str = "structured_outputs"):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must be; exactly one field set. `json` is a JSON schema (dict or its text)."""

    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise GrammarError(f"structured output needs exactly one of json, regex, choice, grammar, json_object; "
                               f"got {given or 'none'}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) and c for c in self.choice):
                raise GrammarError("choice must be a non-empty list of non-empty strings", "choice")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise GrammarError(f"{name} must be a non-empty string", name)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise GrammarError(f"json must be a JSON schema object, got {type(self.json).__name__}", "json")
        if len(self.key()[1]) > MAX_SPEC_CHARS:
            raise GrammarError(f"the {given[0]} spec has more than {MAX_SPEC_CHARS} characters; shorten it", given[0])

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): what the compiled grammar is cached under."""
        if self.json_object:
            return "json_object", ""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json", text
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


@functools.cache
def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        log.info("xgrammar is not installed: structured outputs are refused (pip install 'astrai-pl[serve]')")
        return None
    return xgrammar


def available() -> bool:
    return _xgrammar() is not None


_compilers: dict[tuple, Any] = {}
_lock = threading.Lock()


def _compiler(tokenizer, vocab_size: int, end_ids: tuple[int, ...]):
    """One xgrammar GrammarCompiler per (tokenizer, logits width, end ids)."""
    xgr = _xgrammar()
    key = (id(tokenizer), vocab_size, end_ids)
    with _lock:
        found = _compilers.get(key)
        if found is not None and found[0] is tokenizer:
            return found[1]
    info = tokenizer_info(tokenizer, vocab_size, list(end_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    with _lock:
        _compilers[key] = (tokenizer, compiler)  # the tokenizer itself is held, so its id stays its own
    return compiler


def tokenizer_info(tokenizer, vocab_size: int, end_ids: list[int]):
    """xgrammar's view of our tokenizer: each id's bytes, read from the HF `tokenizers` backend (byte-level
    BPE, the byte tokenizer, SentencePiece byte fallback alike; xgrammar detects which from the decoder).
    `vocab_size` is the model's logits width, which may exceed the tokenizer's: the extra ids are never allowed."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return _xgrammar().TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=end_ids)


def compile_structured(spec: StructuredOutput, tokenizer, vocab_size: int, end_ids: list[int]):
    """The compiled grammar of `spec` for this tokenizer, from the LRU cache when it was compiled before.

    Raises GrammarError with xgrammar's own words for what it cannot compile (an unsupported keyword, a
    look-behind in a pattern, an undefined rule)."""
    if _xgrammar() is None:
        raise GrammarError("structured outputs need xgrammar, which is not installed; pip install 'astrai-pl[serve]'")
    if tokenizer is None:
        raise GrammarError("structured outputs need a tokenizer; pass tokenizer= to Engine")
    return _cached(spec.key(), tokenizer, vocab_size, tuple(sorted(set(end_ids))))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _cached(key: tuple[str, str], tokenizer, vocab_size: int, end_ids: tuple[int, ...]):
    kind, text = key
    compiler = _compiler(tokenizer, vocab_size, end_ids)
    try:
        if kind == "json_object":
            compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        elif kind == "json":
            compiled = compiler.compile_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            return Compiled(compiler.compile_regex(text), None)
        elif kind == "choice":
            choices = " | ".join(_ebnf_literal(c) for c in json.loads(text))
            return Compiled(compiler.compile_grammar("root ::= " + choices), None)
        else:
            return Compiled(compiler.compile_grammar(text), None)
    except (RuntimeError, ValueError, TypeError) as err:
        raise GrammarError(f"cannot compile the {kind.replace('_', ' ')} constraint: {_plain(err)}",
                           "json_schema" if kind == "json" else kind) from None
    return Compiled(compiled, _without_control_bytes(compiled.tokenizer_info.decoded_vocab, vocab_size))


@dataclass(frozen=True)
class Compiled:
    """A compiled grammar, and the bitmask words to AND into each of its rows (None: nothing more to drop)."""

    grammar: Any
    keep: torch.Tensor | None


def _without_control_bytes(vocab: list[bytes], vocab_size: int) -> torch.Tensor:
    """(W,) int32 words with the bits of every token holding a byte < 0x20 cleared. xgrammar's JSON strings
    admit raw control characters, which strict JSON parsers (Python's json.loads among them) refuse; compact
    JSON (no whitespace between tokens) has no raw control byte anywhere, so dropping them loses nothing."""
    allowed = torch.ones(bitmask_words(vocab_size) * 32, dtype=torch.bool)
    bad = [t for t, piece in enumerate(vocab[:vocab_size]) if any(b < 0x20 for b in piece)]
    allowed[bad] = False
    weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int64)
    words = (allowed.view(-1, 32).to(torch.int64) * weights).sum(dim=1)
    return words.to(torch.int32)


def _ebnf_literal(text: str) -> str:
    """A string literal of xgrammar's EBNF: JSON's escapes, which it reads."""
    return json.dumps(text, ensure_ascii=True)


def _plain(err: Exception) -> str:
    lines = [_XGRAMMAR_MARK.sub("", line).strip() for line in str(err).strip().splitlines()]
    return " ".join(line for line in lines if line)[:500] or type(err).__name__


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarState:
    """One request's position in its grammar: an xgrammar matcher and how many output tokens it has taken."""

    def __init__(self, compiled: Compiled):
        self.compiled = compiled
        self.matcher = _xgrammar().GrammarMatcher(compiled.grammar)
        self.taken = 0
        self.broken = False  # a token the grammar refused was committed: the row is no longer constrained

    def fork(self) -> GrammarState:
        return GrammarState(self.compiled)

    def sync(self, output: list[int]) -> None:
        """Bring the matcher to the end of `output` (the request's generated ids): roll back what was taken
        back, accept what is new."""
        if self.taken > len(output):
            self.matcher.rollback(self.taken - len(output))
            self.taken = len(output)
        for token in output[self.taken:]:
            if self.broken or self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(int(token)):
                self.broken = True
                log.warning("a generated token left its grammar; the rest of that completion is unconstrained")
            self.taken += 1
        self.taken = len(output)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed tokens into bitmask[row] (int32 words, bit t % 32 of word t // 32); False when the
        row has no constraint left (refused token or finished grammar) and must stay as it is."""
        if self.broken or self.matcher.is_terminated():
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.compiled.keep is not None:
            bitmask[row] &= self.compiled.keep
        return True


def xgrammar_apply(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int], vocab_size: int) -> None:
    """xgrammar's CPU kernel: logits[i, t] = -inf where bit t of bitmask[i] is clear, for i in `indices`."""
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask, indices=indices, vocab_size=vocab_size, backend="cpu")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(G, ceil(V/32)) int32 → (G, V) bool: token t allowed iff bit t % 32 of word t // 32 is set."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # (G, W, 32)
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
