"""A request's state inside the engine, and what callers get back: deltas while it runs, a completion at the end.

A request is a token list plus how much of it has K/V in the pool (`num_computed`). Prefill and decode
are the same operation — compute tokens[num_computed:] — differing only in length: a prompt is computed
in chunks, a decode step computes the one token sampled last. Its pages cover positions
0 … num_computed-1 (page i holds positions [i·page_size, (i+1)·page_size)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .cache import InferenceError
from .constraints import RowConstraint
from .sampling import Alternatives, SamplingParams
from .text import TextStream


class RequestError(InferenceError):
    """A request failed inside a step; the engine dropped it, released its pages and serves the others."""

    def __init__(self, request_id: str, error: str):
        super().__init__(
            f"{request_id} failed and was dropped ({error}); the engine serves the other requests"
        )
        self.request_id, self.error = request_id, error


def end_ids(model, tokenizer) -> set[int]:
    """The ids that end a completion: the model config's, the tokenizer's and a `generation_config`'s."""
    ids = set(model.config.eos_token_ids)
    if tokenizer is not None:
        ids.update(getattr(tokenizer, "eos_token_ids", None) or [])
    generation = getattr(model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None)
    if extra is None and isinstance(generation, dict):
        extra = generation.get("eos_token_id")
    ids.update([extra] if isinstance(extra, int) else extra or [])
    return ids


@dataclass
class Completion:
    """One finished sample: the generated ids (stop token included), their text, and why it ended."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (an end id, stop id or stop string) or "length"; "abort" / "error" otherwise
    logprobs: list[float] | None
    prompt_token_ids: list[int]
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache or a session
    index: int = 0  # which of the prompt's n samples
    request_id: str = ""
    error: str | None = None  # why the request failed, when finish_reason is "error"
    top_logprobs: list[Alternatives] | None = None  # per generated token, with SamplingParams.top_logprobs
    prompt_logprobs: list[PromptLogprob | None] | None = None  # per prompt token, with prompt_logprobs


PromptLogprob = tuple[float, Alternatives]  # a prompt token's log-probability and the likeliest tokens there


@dataclass
class Delta:
    """What one step added to a request: new ids, the text now safe to show, and the end if reached."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    completion: Completion | None = None
    logprobs: list[float] | None = None  # of token_ids, with SamplingParams.logprobs
    top_logprobs: list[Alternatives] | None = None  # per token of token_ids, with SamplingParams.top_logprobs
    prompt_logprobs: list[PromptLogprob | None] | None = None  # on a sample's first delta, with prompt_logprobs


class TurnOwner(Protocol):
    """What a session turn's request gives its memory back to when it ends (a `Session`)."""

    def end_turn(self, req: Request, pages: list[int], last_logits: torch.Tensor | None) -> None: ...


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        stream: TextStream | None,
        *,
        index: int = 0,
        session: TurnOwner | None = None,
        device: torch.device | str = "cpu",
    ):
        self.id, self.params, self.stream, self.index, self.session = (
            request_id,
            params,
            stream,
            index,
            session,
        )
        self.prompt_ids = prompt
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.num_computed = 0  # tokens with K/V in the pool
        self.pages: list[int] = []
        self.row: int | None = None  # row in req_to_token while running
        self.table_len = 0  # positions of req_to_token[row] already written
        self.cached_tokens = 0
        self.started = False  # admitted at least once
        self.prompt_cached = False  # the prompt's full pages went into the radix cache
        self.kv_from_file = False  # its K/V derive from a loaded session file: never cached
        self.forks_left = params.n - 1 if index == 0 else 0
        self.ready_logits: torch.Tensor | None = None  # (V,) next-token logits known without a forward
        self.draft: list[int] = []  # proposed next tokens, computed after `tokens` and verified in this step
        self.logprobs: list[float] = []
        self.top_logprobs: list[Alternatives] = []
        self.prompt_logprobs: list[PromptLogprob | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * self.num_prompt
        self.finish_reason: str | None = None
        self.error: str | None = None  # set when a step failed for this request
        self.group: list[Request] = [self]  # this prompt's samples, index order once forked
        self.seed = None if params.seed is None else params.seed + index  # sample i of n draws from seed + i
        # nobody reads this request's text before it ends (generate, rollouts) and no stop string needs it: its
        # ids are decoded once at the end instead of at every step (TextStream.add)
        self.defer_text = False
        # its text is made by its reader (reader.py), and it has stop strings: at its own end it parks (`parked`
        # holds why it ended) until the reader has looked for them
        self.awaits_reader = False
        self.parked: str | None = None
        self.constraint: RowConstraint | None = None  # bias, masks and grammar state the sampler applies

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return len(self.tokens) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cacheable(self) -> list[int]:
        """The tokens whose K/V may come from the prefix cache: all but the last, since its logits are
        needed, and none whose logits score a prompt token (`prompt_logprobs`)."""
        end = len(self.tokens) - 1
        if self.prompt_logprobs is not None:
            end = min(end, max(0, self.params.prompt_logprobs_start - 1))
        return self.tokens[:end]

    def scored_positions(self, start: int, stop: int) -> range:
        """Of the positions start..stop-1 computed now, those whose logits score a prompt token."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, self.params.prompt_logprobs_start - 1), min(stop, self.num_prompt - 1))

    def fork(self, stream: TextStream | None, device: torch.device | str) -> Request:
        """The next of this prompt's n samples, in the same group; its memory is the scheduler's business."""
        self.forks_left -= 1
        index = self.params.n - 1 - self.forks_left
        clone = Request(
            f"{self.id}.{index}", self.prompt_ids, self.params, stream, index=index, device=device
        )
        clone.started, clone.cached_tokens, clone.group = True, clone.num_prompt, self.group
        clone.kv_from_file = self.kv_from_file  # it starts on a copy of this request's pages
        clone.prompt_logprobs = self.prompt_logprobs  # computed once, by this request's prefill
        clone.defer_text, clone.awaits_reader = self.defer_text, self.awaits_reader
        clone.constraint = None if self.constraint is None else self.constraint.fork()
        self.group.append(clone)
        return clone

    def resume(self, pages: list[int], num_computed: int, last_logits, kv_from_file: bool) -> None:
        """Start on a session's memory: its pages, computed tokens and kept (V,) logits."""
        self.pages, self.num_computed, self.kv_from_file = pages, num_computed, kv_from_file
        if num_computed:
            self.started, self.cached_tokens = True, min(num_computed, self.num_prompt)
        if num_computed == len(self.tokens):  # nothing new to compute: sample from the kept logits
            assert last_logits is not None, "a fully computed session keeps its logits"
            self.ready_logits = last_logits

    def append(
        self, token: int, logprob: float | None, end_ids: set[int], max_context: int,
        top: Alternatives | None = None,
    ) -> tuple[str, str | None]:
        """Add a sampled token: the text now safe to show, and why the request ends here (or None)."""
        self.tokens.append(token)
        if logprob is not None and self.params.logprobs:
            self.logprobs.append(logprob)
            if self.params.top_logprobs:
                self.top_logprobs.append(top or [])
        params, text, reason = self.params, "", None
        if token in params.stop_token_ids or (not params.ignore_eos and token in end_ids):
            reason = "stop"  # the stop id is kept in token_ids, left out of the text
        else:
            if self.stream is not None and self.defer_text:
                self.stream.add(token)
            elif self.stream is not None:
                text = self.stream.push(token)
                reason = "stop" if self.stream.stopped else None
            if reason is None and (
                len(self.tokens) - self.num_prompt >= params.max_tokens or len(self.tokens) >= max_context
            ):
                reason = "length"
        if reason is not None and self.stream is not None:
            text += self.stream.finish()
        return text, reason

    def completion(self) -> Completion:
        assert self.finished, "completion() of a running request"
        if self.defer_text and self.stream is not None:
            self.stream.finish()  # ids an error or abort left undecoded (a no-op after the end's finish)
        return Completion(
            token_ids=self.output_ids,
            text=self.stream.text if self.stream is not None else "",
            finish_reason=self.finish_reason,
            logprobs=list(self.logprobs) if self.params.logprobs else None,
            prompt_token_ids=self.prompt_ids,
            cached_tokens=self.cached_tokens,
            index=self.index,
            request_id=self.id,
            error=self.error,
            top_logprobs=list(self.top_logprobs) if self.params.top_logprobs else None,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )


def is_sample_of(sample_id: str, request_id: str) -> bool:
    """Whether `sample_id` is request `request_id` or one of its n samples (sample i of r is "r.i")."""
    return sample_id == request_id or sample_id.startswith(request_id + ".")
