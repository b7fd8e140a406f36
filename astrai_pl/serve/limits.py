"""What one request may cost before any work is done for it: how many completions it asks for, how much text
it sends (refused before it is tokenized when it cannot fit the context) and how many log-probabilities its
answer would hold. protocol.py applies these while it parses a request."""

from __future__ import annotations

import numbers

from .errors import bad_request

MAX_CHOICES = 1024  # prompts × n in one request
MAX_LOGPROB_ENTRIES = 2**17  # log-probabilities (chosen and alternatives) one request's choices may hold in memory:
# about 7 MiB of JSON; a single choice of 4,096 tokens with 20 alternatives each (86,016) fits
NORMALIZER_SLACK = 4  # characters a tokenizer's normalizer may fold into one (NFC composes at most 3 jamo)


def is_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def prompt_count(prompt) -> int:
    """How many prompts `prompt` holds, judged from its shape alone (nothing is encoded)."""
    if isinstance(prompt, list) and prompt and not is_id(prompt[0]):
        return len(prompt)
    return 1


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for: its longest piece (a byte-level piece has a
    symbol per byte, at least as many as its characters; an added token is its content), at least 1."""
    longest = 1
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(token_id)
        if piece is not None and len(piece) > longest:
            longest = len(piece)
    return longest


def text_limit(tokenizer, context: int) -> int:
    """Characters past which a text cannot encode to fewer than `context` tokens: no token stands for more
    than `longest_token_chars` of them (times NORMALIZER_SLACK when a normalizer may fold characters first).
    A longer text is refused before it is encoded, which costs hundreds of bytes per character."""
    slack = NORMALIZER_SLACK if tokenizer.backend.normalizer is not None else 1
    return context * longest_token_chars(tokenizer) * slack


def check_text_size(chars: int, limit: int, context: int, param: str, what: str) -> None:
    """A 400 for text of `chars` characters over `limit` (see `text_limit`), before it is encoded."""
    if chars > limit:
        raise bad_request(f"{what} has {chars} characters, more than the {limit} that could encode to fewer "
                          f"than the context's {context} tokens (prompt and completion together); shorten it",
                          param)


def check_choice_count(num_prompts: int, n, param_prompt: str = "prompt") -> None:
    """A 400 for more than MAX_CHOICES completions, before any prompt is encoded (a bad n is checked later)."""
    n = n if is_id(n) and n >= 1 else 1
    if num_prompts * n > MAX_CHOICES:
        raise bad_request(f"{num_prompts} prompts × n={n} make {num_prompts * n} completions, the server makes "
                          f"at most {MAX_CHOICES} per request; split the request", "n" if num_prompts == 1
                          else param_prompt)
