"""Engine: continuous batching over a paged KV pool on the shared `Transformer`.

    engine = Engine(model, tokenizer)
    engine.generate(["Once upon a time"], SamplingParams(max_tokens=32))   # -> [Completion]
    for delta in engine.stream("Hello", SamplingParams(temperature=0)): print(delta.text, end="")

Callers that drive the loop themselves use `add_request` and `step` (which returns every `Delta`).
One step = schedule → one forward over all scheduled tokens (decodes and prefill chunks of every
running request, concatenated into a single row) → sample → append, stop, release. The engine is not
thread-safe; use one per thread or serialise the calls.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import count

import torch

from .cache import CapacityError, InferenceError, KVStorage, ReqToTokenPool
from .pool import KVPool, PoolUsage
from .request import Completion, Delta, Request
from .runner import ModelRunner
from .sampling import SamplingParams, sample
from .scheduler import Scheduler
from .sessions import Session, load_session
from .text import TextStream

Prompt = str | Sequence[int]


class EngineConfigError(InferenceError, ValueError):
    """An Engine argument is out of range."""


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine was built. Prefill tokens are computed prompt positions; decode, the rest."""

    steps: int
    prefill_tokens: int
    decode_tokens: int
    cached_tokens: int  # prompt tokens of finished requests taken from the cache, a session or a fork
    evicted_pages: int
    preemptions: int
    forks: int


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise EngineConfigError(f"Engine {name}={value}: must be >= 1; pass a positive value")
    return value


def _default_total_tokens(device: torch.device, bytes_per_token: int, max_context: int) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(max_context, int(0.8 * free) // bytes_per_token)
    return min(32768, 64 * max_context)  # a sane CPU cap: at most 32k tokens


class Engine:
    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        page_size: int = 16,
        max_total_tokens: int | None = None,
        max_batch_size: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        prefix_cache: bool = True,
        contiguous: bool = False,
        max_step_tokens: int | None = None,
        debug: bool | None = None,
    ):
        """Serve `model` (a Transformer). `tokenizer` (optional) turns strings into ids and ids into text.

        page_size: tokens per KV page; the radix cache shares whole pages. max_total_tokens: KV pool size
        in tokens (default: 80% of free GPU memory, or 32k tokens on CPU). max_batch_size: running requests
        at once. device/dtype: move/cast the model (default: where and what it is). prefix_cache: share
        prompt prefixes across requests. contiguous: give each request one region spanning the whole
        context (req_to_token a linear map; no prefix cache). max_step_tokens: new tokens per forward,
        the chunked-prefill size. debug: recheck the pool's accounting after every step (default: the
        ASTRAI_INFERENCE_DEBUG environment variable).
        """
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype or param.dtype
        if self.device != param.device or self.dtype != param.dtype:
            model.to(device=self.device, dtype=self.dtype)
        self.model, self.tokenizer = model, tokenizer
        if debug is None:
            debug = os.environ.get("ASTRAI_INFERENCE_DEBUG", "0").lower() not in ("", "0", "false", "no")
        self.debug = debug
        gpu = self.device.type == "cuda"
        if max_batch_size is None:
            max_batch_size = 256 if gpu else 64
        if max_step_tokens is None:
            max_step_tokens = 8192 if gpu else 1024
        max_batch_size = _positive("max_batch_size", max_batch_size)
        max_step_tokens = _positive("max_step_tokens", max_step_tokens)
        self.pool = self._build_pool(page_size, max_total_tokens, max_batch_size, prefix_cache, contiguous)
        self.scheduler = Scheduler(self.pool, max_batch_size, max_step_tokens)
        self.runner = ModelRunner(model, self.pool, self.device, self.dtype)
        self.eos_token_ids = self._eos_ids(model, tokenizer)
        self.sessions: dict[str, Session] = {}
        self._requests: dict[str, Request] = {}
        self._ids = count()
        self._counts = dict(steps=0, prefill_tokens=0, decode_tokens=0, cached_tokens=0, forks=0)

    def _build_pool(self, page_size, max_total_tokens, max_batch_size, prefix_cache, contiguous) -> KVPool:
        cfg = self.model.config
        if max_total_tokens is None:
            per_token = (
                2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_size * self.dtype.itemsize
            )
            max_total_tokens = _default_total_tokens(self.device, per_token, cfg.max_position_embeddings)
        self.max_context = min(cfg.max_position_embeddings, max_total_tokens)
        if contiguous:
            page_size, prefix_cache = self.max_context, False
        self.page_size = _positive("page_size", page_size)
        if max_total_tokens < page_size:
            raise EngineConfigError(
                f"Engine max_total_tokens={max_total_tokens} holds no page of {page_size} tokens; raise it"
            )
        storage = KVStorage.for_model(cfg, max_total_tokens // page_size * page_size, self.dtype, self.device)
        table = ReqToTokenPool(max_batch_size, self.max_context, self.device)
        return KVPool(storage, table, page_size, prefix_cache)

    @staticmethod
    def _eos_ids(model, tokenizer) -> set[int]:
        ids = set(model.config.eos_token_ids)
        if tokenizer is not None:
            ids.update(getattr(tokenizer, "eos_token_ids", None) or [])
        generation = getattr(model, "generation_config", None)
        extra = getattr(generation, "eos_token_id", None)
        if extra is None and isinstance(generation, dict):
            extra = generation.get("eos_token_id")
        ids.update([extra] if isinstance(extra, int) else extra or [])
        return ids

    # -- public API -----------------------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            **self._counts, evicted_pages=self.pool.evicted_pages, preemptions=self.scheduler.preemptions
        )

    def usage(self) -> PoolUsage:
        """Pages free, evictable (cached, unused) and in use."""
        return self.pool.usage()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Completions for each prompt (a string or a list of ids): n per prompt, grouped by prompt, in order."""
        prompts = [prompts] if _is_single(prompts) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one each"
            )
        requests = [self._request(p, sp) for p, sp in zip(prompts, params)]
        for req in requests:
            self._submit(req)
        self._run_until(lambda: all(r.finished for req in requests for r in req.group))
        return [r.completion() for req in requests for r in sorted(req.group, key=lambda r: r.index)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[Delta]:
        """Deltas of one completion as they are decoded; their texts concatenate to the final text."""
        return self._stream(self._request(prompt, params or SamplingParams()))

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> str:
        """Queue a prompt; returns its request id. Results come out of `step()`."""
        req = self._request(prompt, params or SamplingParams())
        self._submit(req)
        return req.id

    def abort(self, request_id: str) -> None:
        """Stop a request now and release every page it holds."""
        req = self._requests.get(request_id)
        if req is None:
            return
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return not self.scheduler.idle

    def session(self, ttl: float | None = None) -> Session:
        """A conversation whose K/V stays in the pool between turns (see sessions.py)."""
        session = Session(self, ttl)
        self.sessions[session.id] = session
        return session

    def load_session(self, path, ttl: float | None = None) -> Session:
        """A session saved by `Session.save`, into this engine; refused if the model differs."""
        session = load_session(self, path, ttl)
        self.sessions[session.id] = session
        return session

    def expire_sessions(self, now: float | None = None) -> list[Session]:
        """Expire every idle session whose TTL has run out at `now` (time.monotonic()); returns them."""
        due = [s for s in self.sessions.values() if s.due(now)]
        for session in due:
            session.expire()
        return due

    def reset_prefix_cache(self) -> int:
        """Evict every unused cached prefix; returns pages freed. After changing the weights call
        `weights_changed()` instead, which also does this."""
        if self.pool.radix is None:
            return 0
        freed = self.pool.radix.reset()
        self.pool.evicted_pages += freed
        return freed

    def weights_changed(self) -> int:
        """Forget everything computed from the old weights: the cached prefixes (their K/V) and, on CPU,
        the weight copies. Returns pages freed. Call it after any change to the model's weights.

        The CPU weight copies notice in-place updates that bump a weight's version counter by themselves
        (foreach and for-loop optimizers, `load_state_dict`), but not `torch.optim.AdamW(fused=True)` or
        writes through `param.data`, which bump none: for those this call is what makes the engine use the
        new weights. The cached K/V are never checked against the weights: only this call drops them.
        """
        if self.runner.weights is not None:
            self.runner.weights.clear()
        return self.reset_prefix_cache()

    def step(self) -> list[Delta]:
        """Run one scheduling step; returns what every request gained."""
        self.expire_sessions()
        plan = self.scheduler.schedule()
        if not plan:
            return []
        self._counts["steps"] += 1
        self._count_tokens(plan)
        with torch.inference_mode():
            ready, logits = self.runner.forward([(r, n) for r, n in plan if n > 0])
            deltas = self._advance(plan, ready, logits)
        if self.debug:
            self.check()
        return deltas

    # -- requests -------------------------------------------------------------------------------------------
    def _request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        session: Session | None = None,
        history: list[int] | None = None,
    ) -> Request:
        ids = self._encode(prompt)
        tokens = (history or []) + ids
        if not tokens:
            raise ValueError("the prompt is empty; pass at least one token (e.g. the BOS id)")
        if len(tokens) >= self.max_context:
            raise CapacityError(
                f"prompt of {len(tokens)} tokens leaves no room in the context of {self.max_context}; "
                "shorten it or raise max_total_tokens / the model's max_position_embeddings"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"stop strings {params.stop!r} need a tokenizer; pass tokenizer= or use stop_token_ids"
            )
        if params.n > self.scheduler.max_batch_size:
            raise CapacityError(
                f"SamplingParams.n={params.n} samples run at once but max_batch_size is "
                f"{self.scheduler.max_batch_size}; lower n or raise max_batch_size"
            )
        need = min(len(tokens) + params.max_tokens, self.max_context)
        capacity = self.pool.num_pages - (params.n - 1)
        if self.pool.pages_for(need) > capacity:
            raise CapacityError(
                f"{params.n} samples of {len(tokens)} prompt + {params.max_tokens} new tokens need "
                f"{self.pool.pages_for(need) + params.n - 1} pages of {self.page_size}, the pool has "
                f"{self.pool.num_pages}; raise max_total_tokens or lower max_tokens or n"
            )
        stream = self._text_stream(params)
        return Request(f"req-{next(self._ids)}", tokens, params, stream, session=session, device=self.device)

    def _text_stream(self, params: SamplingParams) -> TextStream | None:
        if self.tokenizer is None:
            return None
        return TextStream(self.tokenizer, params.stop, params.skip_special_tokens)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass tokenizer= to Engine or token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def _submit(self, req: Request) -> None:
        self._requests[req.id] = req
        self.scheduler.waiting.append(req)

    def _stream(self, req: Request) -> Iterator[Delta]:
        """Queue `req` now; the returned iterator drives the engine until it finishes (abort if abandoned)."""
        if req.params.n != 1:
            raise ValueError(
                f"stream() returns one completion, got SamplingParams.n={req.params.n}; use generate()"
            )
        self._submit(req)
        return self._deltas(req)

    def _deltas(self, req: Request) -> Iterator[Delta]:
        try:
            while not req.finished:
                for delta in self._step_or_fail():
                    if delta.request_id == req.id and (delta.token_ids or delta.finish_reason):
                        yield delta
        finally:
            if not req.finished:
                self.abort(req.id)

    def _run_until(self, done) -> None:
        while not done():
            self._step_or_fail()

    def _step_or_fail(self) -> list[Delta]:
        if self.scheduler.idle:
            raise InferenceError("no request is queued or running")
        before = self._counts["steps"]
        deltas = self.step()
        if self._counts["steps"] == before:
            pinned = sum(len(s.pages) for s in self.sessions.values())
            raise CapacityError(
                f"no queued request fits in the pool ({self.pool.usage()}; sessions pin {pinned} pages); "
                "close or expire sessions, or raise max_total_tokens"
            )
        return deltas

    # -- one step's bookkeeping -----------------------------------------------------------------------------
    def _count_tokens(self, plan: list[tuple[Request, int]]) -> None:
        for req, n in plan:
            prompt_part = max(0, min(req.num_computed + n, req.num_prompt) - req.num_computed)
            self._counts["prefill_tokens"] += prompt_part
            self._counts["decode_tokens"] += n - prompt_part

    def _advance(self, plan, ready: list[Request], logits: torch.Tensor | None) -> list[Delta]:
        """Cache finished prompts, fork n > 1 requests, sample, append and stop."""
        rows = [(req, logits[i]) for i, req in enumerate(ready)]
        for req, n in plan:
            if n == 0:  # next-token logits were already known (a session or a fork)
                rows.append((req, req.ready_logits))
                req.ready_logits = None
        batch: list[tuple[Request, torch.Tensor]] = []
        for req, row in rows:
            if not req.prompt_cached and self.pool.radix is not None:
                pages = self.pool.cache_prefix(req.tokens, req.pages, req.num_computed)
                if pages != req.pages:
                    req.pages, req.table_len = pages, 0
                req.prompt_cached = True
            if req.params.max_tokens == 0:  # prefill only: keep the logits for whoever continues
                self._finish(req, "length", last_logits=row)
                continue
            batch.append((req, row))
            batch += [(clone, row) for clone in self._fork(req)]
        if not batch:
            return []
        reqs = [req for req, _ in batch]
        tokens, logprobs = sample(
            torch.stack([row for _, row in batch]),
            [r.params for r in reqs],
            [r.tokens for r in reqs],
            [len(r.tokens) - r.num_prompt for r in reqs],
            [r.generator for r in reqs],
        )
        return [
            self._append(r, t, None if logprobs is None else logprobs[i])
            for i, (r, t) in enumerate(zip(reqs, tokens))
        ]

    def _fork(self, parent: Request) -> list[Request]:
        """Samples 1..n-1 of a prompt: full pages shared, the partial page copied; they sample now."""
        clones = []
        while parent.forks_left:
            clone = parent.fork(self._text_stream(parent.params), self.device)
            self._requests[clone.id] = clone
            if self.scheduler.add_fork(parent, clone):
                self._counts["forks"] += 1
                clones.append(clone)
        return clones

    def _append(self, req: Request, token: int, logprob: float | None) -> Delta:
        req.tokens.append(token)
        if logprob is not None and req.params.logprobs:
            req.logprobs.append(logprob)
        params, text, reason = req.params, "", None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            reason = "stop"  # the stop id is kept in token_ids, left out of the text
        else:
            if req.stream is not None:
                text = req.stream.push(token)
                reason = "stop" if req.stream.stopped else None
            if reason is None and (
                len(req.tokens) - req.num_prompt >= params.max_tokens or len(req.tokens) >= self.max_context
            ):
                reason = "length"
        if reason is None:
            return Delta(req.id, text, [token])
        if req.stream is not None:
            text += req.stream.finish()
        self._finish(req, reason)
        return Delta(req.id, text, [token], reason, req.completion())

    def _finish(self, req: Request, reason: str, last_logits: torch.Tensor | None = None) -> None:
        req.finish_reason = reason
        self._counts["cached_tokens"] += req.cached_tokens
        if req in self.scheduler.running:
            self.scheduler.running.remove(req)
        if req.session is not None:
            req.session.adopt(req, last_logits)
        else:
            self.scheduler.release(req)
        self._requests.pop(req.id, None)

    # -- accounting -----------------------------------------------------------------------------------------
    def check(self) -> PoolUsage:
        """Recount the pool: free + evictable + in use == total, no page or row owned twice, tables right."""
        usage = self.scheduler.check([s.pages for s in self.sessions.values()], self.sessions.values())
        if self.scheduler.idle:
            assert not self._requests, f"idle engine still tracks {list(self._requests)}"
        return usage


def _is_single(prompts) -> bool:
    """A string, or a sequence of ids (ints, or a 1-D tensor), rather than a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, torch.Tensor) and prompts.dim() == 1):
        return True
    return len(prompts) > 0 and isinstance(prompts[0], int)
