"""Engine: continuous batching over a paged KV pool on the shared `Transformer`.

    engine = Engine(model, tokenizer)
    engine.generate(["Once upon a time"], SamplingParams(max_tokens=32))   # -> [Completion]
    for delta in engine.stream("Hello", SamplingParams(temperature=0)): print(delta.text, end="")

Callers that drive the loop themselves use `add_request` and `step` (which returns their `Delta`s).
One step = schedule → one forward over all scheduled tokens (decodes and prefill chunks of every
running request, concatenated into a single row) → sample → append, stop, release. Whichever call
runs a step, each delta is kept for its own consumer (`Outbox`), so streams and `step()` callers may
take turns. The engine is not thread-safe; use one per thread or serialise the calls.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import count

import torch

from .admission import check_params, check_room, is_single_prompt, params_per_prompt, prompt_token_ids
from .cache import CapacityError, InferenceError, KVStorage, ReqToTokenPool
from .pool import KVPool, PoolUsage, default_total_tokens
from .request import Completion, Delta, Outbox, Request, RequestError, end_ids, is_sample_of
from .runner import ModelRunner
from .sampling import SamplingParams, SamplingParamsError, sample
from .scheduler import Scheduler
from .sessions import FingerprintCache, Session, load_session
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
        self.eos_token_ids = end_ids(model, tokenizer)
        self.sessions: dict[str, Session] = {}
        self._requests: dict[str, Request] = {}
        self._outbox = Outbox()
        self._ids = count()
        self._counts = dict(steps=0, prefill_tokens=0, decode_tokens=0, cached_tokens=0, forks=0)
        self.fingerprint = FingerprintCache(model)

    def _build_pool(self, page_size, max_total_tokens, max_batch_size, prefix_cache, contiguous) -> KVPool:
        cfg = self.model.config
        if max_total_tokens is None:
            max_total_tokens = default_total_tokens(cfg, self.device, self.dtype)
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
        prompts = [prompts] if is_single_prompt(prompts) else list(prompts)
        params = params_per_prompt(params, len(prompts))
        requests = [self._request(p, sp) for p, sp in zip(prompts, params)]
        self._complete(requests)
        return [r.completion() for req in requests for r in sorted(req.group, key=lambda r: r.index)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[Delta]:
        """Deltas of one completion as they are decoded; their texts concatenate to the final text."""
        return self._stream(self._request(prompt, params or SamplingParams()))

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> str:
        """Queue a prompt; returns its request id. Its deltas come out of `step()`."""
        req = self._request(prompt, params or SamplingParams())
        self._submit(req)
        self._outbox.open(req.id, stream=False)
        return req.id

    def abort(self, request_id: str) -> None:
        """Stop a request now, all n of its samples, and release every page they hold; what they made
        that was not handed out yet is dropped."""
        self._outbox.forget(request_id)
        for req in [r for rid, r in self._requests.items() if is_sample_of(rid, request_id)]:
            req.forks_left = 0
            if req in self.scheduler.waiting:
                self.scheduler.waiting.remove(req)
            self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        """Whether a request is queued or running, or `step()` has deltas left to return."""
        return not self.scheduler.idle or bool(self._outbox.queue)

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
        self.fingerprint.clear()
        return self.reset_prefix_cache()

    def step(self) -> list[Delta]:
        """Run one scheduling step; returns, in the order made, what the requests added with
        `add_request` gained in it and in the steps that streams and `generate` ran since the last call.

        A failure while computing or sampling fails only the requests it concerns: the step is run again
        one request at a time, and a request that fails alone ends with finish_reason "error" (its Delta's
        completion says why) and gives its pages back.
        """
        self._advance()
        return self._outbox.take_stepped()

    def _advance(self) -> bool:
        """One step, its deltas posted to their consumers; False when nothing could be scheduled."""
        self.expire_sessions()
        plan = self.scheduler.schedule()
        if not plan:
            return False
        self._counts["steps"] += 1
        self._count_tokens(plan)
        with torch.inference_mode():
            self._outbox.post(self._run(plan))
        if self.debug:
            self.check()
        return True

    # -- requests -------------------------------------------------------------------------------------------
    def _request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        session: Session | None = None,
        history: list[int] | None = None,
    ) -> Request:
        vocab_size = self.model.config.vocab_size
        check_params(params, vocab_size, self.tokenizer is not None)
        tokens = (history or []) + prompt_token_ids(prompt, self.tokenizer, vocab_size)
        check_room(len(tokens), params, self.max_context, self.scheduler.max_batch_size, self.pool)
        stream = self._text_stream(params)
        return Request(f"req-{next(self._ids)}", tokens, params, stream, session=session, device=self.device)

    def _text_stream(self, params: SamplingParams) -> TextStream | None:
        if self.tokenizer is None:
            return None
        return TextStream(self.tokenizer, params.stop, params.skip_special_tokens)

    def _submit(self, req: Request) -> None:
        self._requests[req.id] = req
        self.scheduler.waiting.append(req)

    def _stream(self, req: Request) -> Iterator[Delta]:
        """Queue `req` now; the returned iterator drives the engine until it finishes (abort if abandoned)."""
        if req.params.n != 1:
            raise SamplingParamsError(
                f"stream() returns one completion, got SamplingParams.n={req.params.n}; use generate()"
            )
        self._submit(req)
        self._outbox.open(req.id, stream=True)
        return self._deltas(req)

    def _deltas(self, req: Request) -> Iterator[Delta]:
        """Hand out req's kept deltas, stepping the engine only when none are left (the deltas of other
        requests are kept for their own consumers)."""
        try:
            while not req.finished or self._outbox.holds(req.id):
                deltas = self._outbox.take(req.id)
                if not deltas:
                    self._step_or_fail()
                for delta in deltas:
                    if delta.finish_reason == "error":
                        raise RequestError(req.id, req.error)
                    if delta.token_ids or delta.finish_reason:
                        yield delta
        finally:
            if not req.finished:
                self.abort(req.id)
            self._outbox.forget(req.id)

    def _complete(self, requests: list[Request]) -> None:
        """Queue `requests` and step until all their samples finish. On any exception they are aborted
        (nothing stays queued behind it); a sample that failed in a step raises RequestError."""
        for req in requests:
            self._submit(req)

        def samples() -> list[Request]:
            return [r for req in requests for r in req.group]

        try:
            while not all(r.finished for r in samples()):
                self._step_or_fail()
        except BaseException:
            for r in samples():
                self.abort(r.id)
            raise
        failed = next((r for r in samples() if r.error is not None), None)
        if failed is not None:
            raise RequestError(failed.id, failed.error)

    def _step_or_fail(self) -> None:
        if self.scheduler.idle:
            raise InferenceError("no request is queued or running")
        if not self._advance():
            pinned = sum(len(s.pages) for s in self.sessions.values())
            raise CapacityError(
                f"no queued request fits in the pool ({self.pool.usage()}; sessions pin {pinned} pages); "
                "close or expire sessions, or raise max_total_tokens"
            )

    # -- one step's bookkeeping -----------------------------------------------------------------------------
    def _count_tokens(self, plan: list[tuple[Request, int]]) -> None:
        for req, n in plan:
            prompt_part = max(0, min(req.num_computed + n, req.num_prompt) - req.num_computed)
            self._counts["prefill_tokens"] += prompt_part
            self._counts["decode_tokens"] += n - prompt_part

    def _run(self, plan: list[tuple[Request, int]]) -> list[Delta]:
        """Compute and sample `plan`; when that raises, run it again one request at a time.

        An InferenceError (the engine's own, e.g. BackendUnavailable) and an interrupt concern every
        request: the step is undone and the error propagates.
        """
        before = [(req, req.num_computed, req.table_len) for req, _ in plan]
        try:
            picks = self._compute(plan)
        except BaseException as err:
            if isinstance(err, Exception) and not isinstance(err, InferenceError):
                return self._isolate(plan, before)
            self._undo(before)
            raise
        return self._commit(picks)

    def _compute(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, int, float | None]]:
        """Forward, cache finished prompts, fork n > 1 requests and sample: (request, token, logprob).

        Until it returns, a request that was sampled keeps its logits in `ready_logits`, so a failure
        after the forward loses nothing that was computed.
        """
        ready, logits = self.runner.forward([(r, n) for r, n in plan if n > 0])
        for i, req in enumerate(ready):
            req.ready_logits = logits[i]
        batch = self._ready_batch(ready + [req for req, n in plan if n == 0])
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
        for req in reqs:
            req.ready_logits = None
        return [
            (r, t, None if logprobs is None else logprobs[i]) for i, (r, t) in enumerate(zip(reqs, tokens))
        ]

    def _ready_batch(self, candidates: list[Request]) -> list[tuple[Request, torch.Tensor]]:
        """(request, next-token logits) to sample; prefill-only requests finish here instead."""
        batch: list[tuple[Request, torch.Tensor]] = []
        for req in candidates:
            row = req.ready_logits
            if not req.prompt_cached:
                self.scheduler.publish(req)
                req.prompt_cached = True
            if req.params.max_tokens == 0:  # prefill only: keep the logits for whoever continues
                req.ready_logits = None
                self._finish(req, "length", last_logits=row)
                continue
            batch.append((req, row))
            for clone in self._fork(req):
                clone.ready_logits = row
                batch.append((clone, row))
        return batch

    def _isolate(self, plan: list[tuple[Request, int]], before) -> list[Delta]:
        """Run a failed step's requests one at a time; each that fails alone is failed and released."""
        self.runner.forget_step_state()
        _rewind(before)
        planned = {id(req) for req, _ in plan}
        forks = [r for r in self.scheduler.running if r.ready_logits is not None and id(r) not in planned]
        deltas: list[Delta] = []
        for i, (req, n) in enumerate(plan + [(clone, 0) for clone in forks]):
            if req.finished:
                continue
            try:
                picks = self._compute([(req, 0 if req.ready_logits is not None else n)])
            except Exception as alone:
                deltas.append(self._fail(req, alone))
                continue
            except BaseException:
                self._undo(before[i:])  # the requests not run yet
                raise
            deltas += self._commit(picks)
        return deltas

    def _undo(self, before: list[tuple[Request, int, int]]) -> None:
        """Undo a step that is not run again: counts rewound, the pages taken for its tokens given back."""
        self.runner.forget_step_state()
        _rewind(before)
        for req, _, _ in before:
            if not req.finished:
                keep = self.pool.pages_for(req.num_computed)
                self.pool.release(req.pages[keep:])
                req.pages = req.pages[:keep]

    def _commit(self, picks: list[tuple[Request, int, float | None]]) -> list[Delta]:
        deltas = []
        for req, token, logprob in picks:
            try:
                deltas.append(self._append(req, token, logprob))
            except Exception as err:
                deltas.append(self._fail(req, err))
        return deltas

    def _fail(self, req: Request, err: Exception) -> Delta:
        """End `req` with finish_reason "error": its pages and row go back, the other requests go on."""
        req.error = f"{type(err).__name__}: {err}"
        req.ready_logits, req.forks_left = None, 0
        self._finish(req, "error")
        return Delta(req.id, "", [], "error", req.completion())

    def _fork(self, parent: Request) -> list[Request]:
        """Samples 1..n-1 of a prompt: full pages shared, the partial page copied; they sample now."""
        clones = []
        while parent.forks_left:
            clone = parent.fork(self._text_stream(parent.params), self.device)
            self._requests[clone.id] = clone
            self._outbox.follow(parent.id, clone.id)
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


def _rewind(before: list[tuple[Request, int, int]]) -> None:
    """Undo a failed forward: requests without fresh logits compute their tokens again."""
    for req, num_computed, table_len in before:
        if req.ready_logits is None and not req.finished:
            req.num_computed, req.table_len = num_computed, table_len
