"""A request's state inside the engine, and what callers get back: deltas while it runs, a completion at the end.

A request is a token list plus how much of it has K/V in the pool (`num_computed`). Prefill and decode
are the same operation — compute tokens[num_computed:] — differing only in length: a prompt is computed
in chunks, a decode step computes the one token sampled last. Its pages cover positions
0 … num_computed-1 (page i holds positions [i·page_size, (i+1)·page_size)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .cache import InferenceError
from .sampling import SamplingParams
from .text import TextStream

if TYPE_CHECKING:
    from .sessions import Session


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


@dataclass
class Delta:
    """What one step added to a request: new ids, the text now safe to show, and the end if reached."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    completion: Completion | None = None


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        stream: TextStream | None,
        *,
        index: int = 0,
        session: Session | None = None,
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
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # set when a step failed for this request
        self.group: list[Request] = [self]  # this prompt's samples, index order once forked
        self.generator: torch.Generator | None = None
        if params.seed is not None:  # sample i of n draws from seed + i
            self.generator = torch.Generator(device).manual_seed(params.seed + index)

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

    def fork(self, stream: TextStream | None, device: torch.device | str) -> Request:
        """The next of this prompt's n samples, in the same group; its memory is the scheduler's business."""
        self.forks_left -= 1
        index = self.params.n - 1 - self.forks_left
        clone = Request(
            f"{self.id}.{index}", self.prompt_ids, self.params, stream, index=index, device=device
        )
        clone.started, clone.cached_tokens, clone.group = True, clone.num_prompt, self.group
        clone.kv_from_file = self.kv_from_file  # it starts on a copy of this request's pages
        self.group.append(clone)
        return clone

    def completion(self) -> Completion:
        assert self.finished, "completion() of a running request"
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
        )


def is_sample_of(sample_id: str, request_id: str) -> bool:
    """Whether `sample_id` is request `request_id` or one of its n samples (sample i of r is "r.i")."""
    return sample_id == request_id or sample_id.startswith(request_id + ".")


class Outbox:
    """Deltas made in a step that their consumer was not pulling, kept until it does: each stream's
    own, and one queue, in the order they were made, for `Engine.step()` (requests added with
    `add_request`, and their samples). Deltas of other requests are dropped: generate and session
    turns read the completion."""

    def __init__(self):
        self.streams: dict[str, list[Delta]] = {}
        self.stepped: set[str] = set()
        self.queue: list[Delta] = []

    def open(self, request_id: str, stream: bool) -> None:
        if stream:
            self.streams[request_id] = []
        else:
            self.stepped.add(request_id)

    def follow(self, parent_id: str, sample_id: str) -> None:
        """A sample goes where its parent's deltas go."""
        if parent_id in self.stepped:
            self.stepped.add(sample_id)

    def post(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            if delta.request_id in self.streams:
                self.streams[delta.request_id].append(delta)
            elif delta.request_id in self.stepped:
                self.queue.append(delta)
                if delta.finish_reason is not None:
                    self.stepped.discard(delta.request_id)

    def holds(self, request_id: str) -> bool:
        return bool(self.streams.get(request_id))

    def take(self, request_id: str) -> list[Delta]:
        """What stream `request_id` has not handed out yet."""
        if request_id not in self.streams:  # aborted
            return []
        deltas, self.streams[request_id] = self.streams[request_id], []
        return deltas

    def take_stepped(self) -> list[Delta]:
        deltas, self.queue = self.queue, []
        return deltas

    def forget(self, request_id: str) -> None:
        """Drop what request `request_id` and its samples have not handed out (it was aborted or is done)."""
        for rid in [r for r in (*self.streams, *self.stepped) if is_sample_of(r, request_id)]:
            self.streams.pop(rid, None)
            self.stepped.discard(rid)
        self.queue = [d for d in self.queue if not is_sample_of(d.request_id, request_id)]
