"""What a request must satisfy before the engine queues it: valid SamplingParams, prompt ids in the
vocabulary, and room in the context, the request table and the KV pool.

Everything is checked when a request is added, before anything is queued, so a refused request leaves
nothing behind in the engine. Each refusal is one typed error that names the value and the fix.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from .cache import CapacityError, InferenceError
from .constraints import GrammarError, RowConstraint, row_constraint
from .pool import KVPool
from .request import Request
from .sampling import SamplingParams, SamplingParamsError
from .text import TextStream

Prompt = str | Sequence[int]  # text, or token ids


class PromptError(InferenceError, ValueError):
    """A prompt is empty, not text or token ids, holds an id outside the vocabulary, or is text without a tokenizer."""


def prompt_token_ids(prompt, tokenizer, vocab_size: int) -> list[int]:
    """The ids of a prompt (text, a sequence of ints, or a 1-D integer tensor or array), each checked to be
    in the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise PromptError("a text prompt needs a tokenizer; pass tokenizer= to Engine or token ids")
        ids = list(tokenizer.encode(prompt))
    elif _is_array(prompt):
        if prompt.ndim != 1:
            raise PromptError(
                f"an array prompt must be 1-D, got shape {tuple(prompt.shape)}; pass one row of ids"
            )
        ids = prompt.tolist()  # floats and bools stay floats and bools, which the check below refuses
    elif isinstance(prompt, Sequence):
        ids = list(prompt)
    else:
        raise PromptError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
    _check_ids(ids, vocab_size)
    return [int(t) for t in ids]


def _check_ids(ids: list, vocab_size: int) -> None:
    if all(type(t) is int for t in ids):
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    else:
        bad = next(
            (
                i
                for i, t in enumerate(ids)
                if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab_size
            ),
            None,
        )
    if bad is not None:
        shown = repr(ids[bad])[:40]
        raise PromptError(
            f"prompt id {shown} at position {bad} is not in the vocabulary of {vocab_size} ids "
            f"(ints 0..{vocab_size - 1}); pass ids from this model's tokenizer"
        )


def _is_array(value) -> bool:
    """A torch tensor or a NumPy array (anything with ndim, shape and tolist)."""
    return isinstance(value, torch.Tensor) or all(hasattr(value, a) for a in ("ndim", "shape", "tolist"))


def is_single_prompt(prompts) -> bool:
    """A string, or a sequence of ids (ints, or a 1-D tensor or array), rather than a list of prompts.

    Anything that is no sequence counts as one prompt, which `prompt_token_ids` then refuses."""
    if _is_array(prompts):
        return prompts.ndim != 2
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        return True
    return len(prompts) > 0 and isinstance(prompts[0], numbers.Integral)


def params_per_prompt(params, num_prompts: int) -> list:
    """`generate`'s params as one per prompt: None (the defaults), one SamplingParams, or one each."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * num_prompts
    if not isinstance(params, Sequence):
        raise SamplingParamsError(
            f"params must be SamplingParams or a list of them, got {type(params).__name__}"
        )
    if len(params) != num_prompts:
        raise SamplingParamsError(
            f"got {len(params)} SamplingParams for {num_prompts} prompts; pass one or one each"
        )
    return list(params)


def check_params(params, vocab_size: int, has_tokenizer: bool) -> None:
    """SamplingParams valid now (fields may have changed since construction) and usable by this engine."""
    if not isinstance(params, SamplingParams):
        raise SamplingParamsError(
            f"params must be SamplingParams, got {type(params).__name__}; pass SamplingParams(...)"
        )
    params.validate()
    if params.stop and not has_tokenizer:
        raise SamplingParamsError(
            f"stop strings {params.stop!r} need a tokenizer; pass tokenizer= or use stop_token_ids"
        )
    outside = [t for t in params.stop_token_ids if t >= vocab_size]
    if outside:
        raise SamplingParamsError(
            f"SamplingParams.stop_token_ids holds {outside[0]}, outside the vocabulary of {vocab_size} ids; "
            "pass ids from this model's tokenizer"
        )


def check_room(
    num_tokens: int, params: SamplingParams, max_context: int, max_batch_size: int, pool: KVPool
) -> None:
    """A prompt of `num_tokens` with `params` fits the context, the request table and an empty pool."""
    if num_tokens == 0:
        raise PromptError("the prompt is empty; pass at least one token (e.g. the BOS id)")
    if num_tokens >= max_context:
        raise CapacityError(
            f"prompt of {num_tokens} tokens leaves no room in the context of {max_context}; "
            "shorten it or raise max_total_tokens / the model's max_position_embeddings"
        )
    if params.n > max_batch_size:
        raise CapacityError(
            f"SamplingParams.n={params.n} samples run at once but max_batch_size is "
            f"{max_batch_size}; lower n or raise max_batch_size"
        )
    need = pool.pages_for(min(num_tokens + params.max_tokens, max_context))
    if need > pool.num_pages - (params.n - 1):
        raise CapacityError(
            f"{params.n} samples of {num_tokens} prompt + {params.max_tokens} new tokens need "
            f"{need + params.n - 1} pages of {pool.page_size}, the pool has "
            f"{pool.num_pages}; raise max_total_tokens or lower max_tokens or n"
        )


def text_stream(tokenizer, params: SamplingParams) -> TextStream | None:
    if tokenizer is None:
        return None
    return TextStream(tokenizer, params.stop, params.skip_special_tokens)


def new_request(
    request_id: str, prompt, params: SamplingParams, history: list[int], engine, session
) -> Request:
    """A checked request for `prompt` after `history` on `engine` (nothing is queued if a check fails)."""
    vocab_size = engine.model.config.vocab_size
    check_params(params, vocab_size, engine.tokenizer is not None)
    tokens = history + prompt_token_ids(prompt, engine.tokenizer, vocab_size)
    check_room(len(tokens), params, engine.max_context, engine.scheduler.max_batch_size, engine.pool)
    constraint = checked_constraint(params, engine.tokenizer, vocab_size, engine.eos_token_ids)
    stream = text_stream(engine.tokenizer, params)
    req = Request(request_id, tokens, params, stream, session=session, device=engine.device)
    req.constraint = constraint
    return req


def checked_constraint(params: SamplingParams, tokenizer, vocab_size: int, end_ids) -> RowConstraint | None:
    """`row_constraint`, its refusals as SamplingParamsError (a grammar that does not compile among them)."""
    try:
        return row_constraint(params, tokenizer, vocab_size, list(end_ids))
    except GrammarError as err:
        raise SamplingParamsError(f"SamplingParams.structured: {err}") from None
    except ValueError as err:
        raise SamplingParamsError(str(err)) from None
