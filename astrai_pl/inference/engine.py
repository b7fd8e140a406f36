"""Engine: continuous batching over a paged KV pool on the shared `Transformer`.

    engine = Engine(model, tokenizer)
    engine.generate(["Once upon a time"], SamplingParams(max_tokens=32))   # -> [Completion]
    for delta in engine.stream("Hello", SamplingParams(temperature=0)): print(delta.text, end="")

    with engine:                                   # a background thread steps the batch
        handle = engine.submit("Hello", params)    # from any thread
        for delta in handle: ...                   # or `async for`, `handle.result()`, `await handle.result_async()`

A request's life: submit (checked, queued, a handle opened) → schedule → step (one forward over every
scheduled token, in a single row; sample; append) → finish or abort → release (`_finish`: row and pages
go back, or to the session of the turn) → its handle closes. One step runs at a time, under `lock`: on
the background loop, or, when none runs, on whichever caller waits (`drive`). `add_request`/`step`
callers run their own loop; each delta reaches its own consumer (`Outbox`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from itertools import count

import torch

from ..model.layers import long_rope_after
from .adapters import bind_adapter
from .admission import Prompt, is_single_prompt, new_request, params_per_prompt, text_stream
from .decode_graphs import graphs_wanted, record_decode_graphs, reserve_bytes
from .handle import Outbox, RequestHandle, wait_all
from .loop import BackgroundLoop
from .pool import EngineConfigError, PoolUsage, build_pool, default_total_tokens, positive
from .reader import ReaderSteps, TextReader
from .recovery import StepRecovery
from .recurrent.runner import build_recurrent, is_recurrent
from .request import Completion, Delta, Request, end_ids, is_sample_of
from .runner import ModelRunner
from .sampling import Alternatives, SamplingParams, SamplingParamsError, sample
from .scheduler import EngineStats, Scheduler
from .sessions import FingerprintCache, Session, load_session
from .speculative import SpeculativeConfig, SpeculativeSteps, Verified, check_speculative_model

__all__ = ["Engine", "EngineConfigError", "EngineStats", "Prompt"]

Pick = tuple[Request, int, float | None, Alternatives | None]  # a sampled token, its logprob and alternatives


class Engine(StepRecovery, SpeculativeSteps, ReaderSteps):
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
        cuda_graphs: bool | None = None,
        speculative: SpeculativeConfig | dict | None = None,
    ):
        """Serve `model` (a Transformer). `tokenizer` (optional) turns strings into ids and ids into text.

        page_size: tokens per KV page; the radix cache shares whole pages. max_total_tokens: KV pool size
        in tokens (default: 80% of free GPU memory, or 32k tokens on CPU). max_batch_size: running requests
        at once. device/dtype: move/cast the model (default: where and what it is). prefix_cache: share
        prompt prefixes across requests. contiguous: give each request one region spanning the whole
        context (req_to_token a linear map; no prefix cache). max_step_tokens: new tokens per forward,
        the chunked-prefill size. debug: recheck the pool's accounting after every step (default: the
        ASTRAI_INFERENCE_DEBUG environment variable). cuda_graphs: replay decode steps from CUDA graphs, one
        per batch-size bucket (default: on CUDA; decode_graphs.py); their memory comes out of the pool's share.
        speculative: n-gram speculative decoding (speculative.py; off by default); its steps run eagerly.
        """
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype or param.dtype
        if self.device != param.device or self.dtype != param.dtype:
            model.to(device=self.device, dtype=self.dtype)
        self.model, self.tokenizer = model, tokenizer
        self.speculative = check_speculative_model(model, speculative)
        if debug is None:
            debug = os.environ.get("ASTRAI_INFERENCE_DEBUG", "0").lower() not in ("", "0", "false", "no")
        self.debug = debug
        gpu = self.device.type == "cuda"
        max_batch_size = positive(
            "max_batch_size", (256 if gpu else 64) if max_batch_size is None else max_batch_size
        )
        max_step_tokens = positive(
            "max_step_tokens", (8192 if gpu else 1024) if max_step_tokens is None else max_step_tokens
        )
        graphs = graphs_wanted(cuda_graphs, model, self.device, contiguous)  # False, logged, for RWKV
        self._recurrent = is_recurrent(model)
        if self._recurrent:  # RWKV: a state slot per request instead of K/V pages (recurrent/runner.py)
            self.pool, self.max_context, self.scheduler, self.runner = build_recurrent(
                model, self.device, self.dtype, page_size, max_total_tokens, max_batch_size, max_step_tokens,
                prefix_cache, contiguous,
            )  # fmt: skip
        else:
            reserve = reserve_bytes(model.config, max_batch_size, self.dtype) if graphs else 0
            if graphs and max_total_tokens is None:
                max_total_tokens = default_total_tokens(model.config, self.device, self.dtype, reserve)
            self.pool, self.max_context = build_pool(
                model.config, self.device, self.dtype, page_size, max_total_tokens, max_batch_size, prefix_cache,
                contiguous,
            )  # fmt: skip
            self.scheduler = Scheduler(self.pool, max_batch_size, max_step_tokens, long_rope_after(model.config))
            self.runner = ModelRunner(model, self.pool, self.device, self.dtype)
            if graphs:
                self.runner.graphs = record_decode_graphs(self.runner, self.pool, max_batch_size, reserve)
        self.page_size = self.pool.page_size
        self.eos_token_ids = end_ids(model, tokenizer)
        self.sessions: dict[str, Session] = {}
        self.fingerprint = FingerprintCache(model)
        self.lock = threading.RLock()  # held by every step and every change to the requests
        self._loop = BackgroundLoop(
            self.lock, lambda: not self.scheduler.idle, self._serve_step, self._wake_handles
        )
        self._requests: dict[str, Request] = {}
        self._outbox = Outbox()
        self._step_reader = TextReader(tokenizer, self._settle)  # the text of what step() returns
        self._ended: list[Request] = []  # groups whose last sample finished in this step
        self._ids = count()
        self._counts = dict(steps=0, prefill_tokens=0, decode_tokens=0, cached_tokens=0, forks=0,
                            draft_tokens=0, accepted_draft_tokens=0)

    # -- public API -----------------------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            **self._counts, evicted_pages=self.pool.evicted_pages, preemptions=self.scheduler.preemptions
        )

    def load(self) -> tuple[int, int]:
        """Requests running (each of n samples counts) and waiting to be scheduled, now."""
        with self.lock:
            return len(self.scheduler.running), len(self.scheduler.waiting)

    def usage(self) -> PoolUsage:
        """Pages free, evictable (cached, unused) and in use."""
        with self.lock:
            return self.pool.usage()

    def submit(
        self, prompt: Prompt, params: SamplingParams | None = None, *, session: Session | None = None
    ) -> RequestHandle:
        """Queue a prompt (a refusal raises here and queues nothing), from any thread; its deltas come to
        the handle as the batch is stepped. With `session`, a turn of that conversation."""
        return self._open(prompt, params or SamplingParams(), session, keep_deltas=True)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Completions for each prompt (a string or a list of ids): n per prompt, grouped by prompt, in order."""
        prompts = [prompts] if is_single_prompt(prompts) else list(prompts)
        params = params_per_prompt(params, len(prompts))
        with self.lock:  # every prompt is checked before any is queued
            requests = [self._request(p, sp) for p, sp in zip(prompts, params)]
            handles = [self._queue(req, keep_deltas=False) for req in requests]
        try:
            wait_all(handles)  # each read as it fills: a stop string cuts its request one step later
        except BaseException:
            for handle in handles:
                self.abort(handle.id)
            raise
        return [c for handle in handles for c in handle.result()]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[Delta]:
        """Deltas of one completion as they are decoded; their texts concatenate to the final text.
        The request is queued now; abandoning the iterator aborts it."""
        with self.lock:
            req = self._request(prompt, params or SamplingParams())
            if req.params.n != 1:
                raise SamplingParamsError(
                    f"stream() returns one completion, got SamplingParams.n={req.params.n}; use generate()"
                )
            return self.deltas(self._queue(req, keep_deltas=True))

    def deltas(self, handle: RequestHandle) -> Iterator[Delta]:
        """Iterate `handle`, aborting its request if the iteration stops before the end."""
        try:
            yield from handle
        finally:
            if not handle.done:
                self.abort(handle.id)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> str:
        """Queue a prompt; returns its request id. Its deltas come out of `step()`."""
        with self.lock:
            req = self._request(prompt, params or SamplingParams())
            self._queue(req, None)
            return req.id

    def abort(self, request_id: str) -> None:
        """Stop a request now, all n of its samples, and release every page they hold; what they made
        that was not handed out yet is dropped. Safe from any thread."""
        with self.lock:
            self._outbox.forget(request_id)
            for req in [r for rid, r in self._requests.items() if is_sample_of(rid, request_id)]:
                req.forks_left = 0
                self._finish(req, "abort")
            self._close_ended()

    def has_unfinished(self) -> bool:
        """Whether a request is queued or running, or `step()` has deltas left to return."""
        with self.lock:
            return not self.scheduler.idle or bool(self._outbox.queue)

    def session(self, ttl: float | None = None) -> Session:
        """A conversation whose K/V stays in the pool between turns (see sessions.py)."""
        with self.lock:
            return self.sessions.setdefault((session := Session(self, ttl)).id, session)

    def load_session(self, path, ttl: float | None = None) -> Session:
        """A session saved by `Session.save`, into this engine; refused if the model differs."""
        with self.lock:
            return self.sessions.setdefault((session := load_session(self, path, ttl)).id, session)

    def expire_sessions(self, now: float | None = None) -> list[Session]:
        """Expire every idle session whose TTL has run out at `now` (time.monotonic()); returns them."""
        with self.lock:
            due = [s for s in self.sessions.values() if s.due(now)]
            for session in due:
                session.expire()
            return due

    def reset_prefix_cache(self) -> int:
        """Evict every unused cached prefix; returns pages freed. After changing the weights call
        `weights_changed()` instead, which also does this."""
        with self.lock:
            return self.pool.reset_cache()

    def weights_changed(self) -> int:
        """Forget everything computed from the old weights: the cached prefixes (their K/V) and, on CPU,
        the weight copies; returns pages freed. Call it after any change to the weights: the CPU copies
        notice writes that bump a version counter, not `AdamW(fused=True)` or `param.data` writes, and the
        cached K/V are never checked against the weights."""
        with self.lock:
            if self.runner.weights is not None:
                self.runner.weights.clear()
            if getattr(self.runner, "graphs", None) is not None:  # recorded over where the weights were
                self.runner.graphs.follow_weights()
            self.fingerprint.clear()
            return self.reset_prefix_cache()

    def step(self) -> list[Delta]:
        """Run one scheduling step; returns, in the order made, what the requests added with
        `add_request` gained in it and in the steps that other callers or the loop ran since the last call.

        A failure while computing or sampling fails only the requests it concerns: the step is run again
        one request at a time; one failing alone ends with finish_reason "error" and gives its pages back.
        """
        with self._step_reader.lock:  # the text is made after the step, by its caller (reader.py)
            with self.lock:
                self._advance()
                raw = self._outbox.take_stepped()
            return [d for d in map(self._step_reader.read, raw) if d is not None]

    def drive(self) -> None:
        """Step once for a caller waiting on a handle, unless the background loop does the stepping.
        Raises when nothing is queued, or nothing queued fits in the pool."""
        with self.lock:
            if not self.running:
                self._step_or_fail()

    # -- the background loop (loop.py) ----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether a background loop steps the batch."""
        return self._loop.running

    def start(self) -> Engine:
        """Step the batch on a background thread until `stop()`; `with engine:` does both."""
        self._loop.start()
        return self

    def stop(self) -> None:
        """Stop the background loop after its current step; requests stay queued for whoever steps next."""
        self._loop.stop()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def run_forever(self) -> None:
        """Step whenever a request is queued, on this thread, until `stop()` from another."""
        self._loop.run()

    def _serve_step(self) -> None:
        """The background loop's step. An error ends the requests it concerns (a sample failing alone:
        that sample; an engine-wide error, or nothing queued fitting in the pool: every request)."""
        try:
            self._step_or_fail()
        except Exception as err:  # an engine-wide error, or nothing fits: it ends every request
            for handle in self._outbox.open_handles():
                handle.close([], err)
            for request_id in {req.group[0].id for req in self._requests.values()}:
                self.abort(request_id)

    def _wake_handles(self) -> None:  # the loop ended: their readers step the engine themselves now
        for handle in self._outbox.open_handles():
            handle.wake()

    # -- requests: submit → schedule → step → finish → release ----------------------------------------------
    def _request(self, prompt: Prompt, params: SamplingParams, session: Session | None = None) -> Request:
        history = session.tokens if session is not None else []
        req = new_request(f"req-{next(self._ids)}", prompt, params, history, self, session)
        bind_adapter(self, req, session)
        return req

    def _open(
        self, prompt, params: SamplingParams, session: Session | None, keep_deltas: bool
    ) -> RequestHandle:
        with self.lock:
            req = self._request(prompt, params, session)
            if session is not None:
                req.resume(*session.lend(req.id))
            return self._queue(req, keep_deltas)

    def _queue(self, req: Request, keep_deltas: bool | None) -> RequestHandle | None:
        """Track and queue `req`; its handle (None for `add_request`: its deltas go to `step()`)."""
        handle = None
        if keep_deltas is not None:
            handle = RequestHandle(req.id, self, keep_deltas, TextReader(self.tokenizer, self._settle))
        req.defer_text = keep_deltas is False and not req.params.stop  # text decoded once, at the end
        self._requests[req.id] = req
        self._outbox.open(req.id, handle)
        self._read_outside(req)  # otherwise its reader makes its text (reader.py)
        self.scheduler.add(req)
        self._loop.notify()
        return handle

    def _advance(self) -> bool:
        """One step, its deltas posted to their consumers; False when nothing could be scheduled."""
        self.expire_sessions()
        if self.speculative is not None:
            self._propose_drafts()
        plan = self.scheduler.schedule()
        if not plan:
            self._drop_drafts()
            return False
        self._counts["steps"] += 1
        self._count_tokens(plan)
        try:
            with torch.inference_mode():
                self._outbox.post(self._run(plan))
        finally:
            self._drop_drafts()  # drafts a failed step left unverified
            self._close_ended()
        if self.debug:
            self.check()
        return True

    def _close_ended(self) -> None:
        """Close the handles of the requests whose every sample ended, after their last deltas went out."""
        ended, self._ended = self._ended, []
        for parent in ended:
            self._outbox.end(parent.id, [r.completion() for r in sorted(parent.group, key=lambda r: r.index)])

    # -- one step's bookkeeping -----------------------------------------------------------------------------
    def _count_tokens(self, plan: list[tuple[Request, int]]) -> None:
        for req, n in plan:
            prompt_part = max(0, min(req.num_computed + n, req.num_prompt) - req.num_computed)
            self._counts["prefill_tokens"] += prompt_part
            self._counts["decode_tokens"] += n - prompt_part

    def _compute(self, plan: list[tuple[Request, int]]) -> list[Pick]:
        """Forward, cache finished prompts, fork n > 1 requests and sample: (request, token, logprob).

        Until it returns, a request that was sampled keeps its logits in `ready_logits`, so a failure
        after the forward loses nothing that was computed.
        """
        ready, logits = self.runner.forward([(r, n) for r, n in plan if n > 0])
        ready, logits, verified = self._split_verified(ready, logits)  # drafted requests: speculative.py
        for i, req in enumerate(ready):
            req.ready_logits = logits[i]
        batch = self._ready_batch(ready + [req for req, n in plan if n == 0])
        if not batch:
            return verified
        reqs = [req for req, _ in batch]
        # the forward's logits as they are when the batch is its ready requests in order (the usual step): a
        # stacked copy of their rows cost 1.3 ms a step at a 49k vocabulary
        same = len(reqs) == len(ready) and all(a is b for a, b in zip(reqs, ready))
        tokens, logprobs, top = sample(
            logits if same else torch.stack([row for _, row in batch]),
            [r.params for r in reqs],
            [r.tokens for r in reqs],
            [len(r.tokens) - r.num_prompt for r in reqs],
            [r.seed for r in reqs],
            [r.constraint for r in reqs],
        )
        for req in reqs:
            req.ready_logits = None
        return verified + [
            (r, t, None if logprobs is None else logprobs[i], None if top is None else top[i])
            for i, (r, t) in enumerate(zip(reqs, tokens))
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
                clones = self._fork(req)  # n samples, each the same empty completion
                self._finish(req, "length", last_logits=row)
                for clone in clones:
                    self._finish(clone, "length")
                continue
            batch.append((req, row))
            for clone in self._fork(req):
                clone.ready_logits = row
                batch.append((clone, row))
        return batch

    def _commit(self, picks: list[Pick | Verified]) -> list[Delta]:
        deltas = []
        for pick in picks:
            try:
                if isinstance(pick, Verified):
                    deltas += self._commit_verified(pick)
                else:
                    deltas.append(self._append(*pick))
            except Exception as err:
                deltas.append(self._fail(pick[0], err))
        return deltas

    def _fork(self, parent: Request) -> list[Request]:
        """Samples 1..n-1 of a prompt: full pages shared, the partial page copied; they sample now."""
        clones = []
        while parent.forks_left:
            clone = parent.fork(None if parent.stream is None else text_stream(self.tokenizer, parent.params),
                                self.device)
            self._requests[clone.id] = clone
            self._outbox.follow(parent.id, clone.id)
            self._read_outside(clone)
            if self.scheduler.add_fork(parent, clone):
                self._counts["forks"] += 1
                clones.append(clone)
        return clones

    def _append(self, req: Request, token: int, logprob: float | None, top: Alternatives | None) -> Delta:
        text, reason = req.append(token, logprob, self.eos_token_ids, self.max_context, top)
        logprobs = [logprob] if req.params.logprobs else None
        tops = [top or []] if req.params.top_logprobs else None
        first = len(req.tokens) == req.num_prompt + 1
        prompt_logprobs = list(req.prompt_logprobs) if first and req.prompt_logprobs is not None else None
        completion = None
        if reason is not None and req.awaits_reader:
            self._park(req, reason)  # its reader settles it (reader.py)
        elif reason is not None:
            self._finish(req, reason)
            completion = req.completion()
        return Delta(req.id, text, [token], reason, completion, logprobs, tops, prompt_logprobs)

    def _finish(self, req: Request, reason: str, last_logits: torch.Tensor | None = None) -> None:
        """End `req` and release it: its row and pages go back (full computed pages to the radix cache),
        or, for a session's turn that did not fail, to the session. The one place memory leaves a request."""
        req.finish_reason = reason
        self._counts["cached_tokens"] += req.cached_tokens
        self.scheduler.remove(req)
        session = req.session
        pages = self.scheduler.release(req, keep=session is not None and req.error is None)
        if session is not None:
            session.end_turn(req, pages, req.ready_logits if last_logits is None else last_logits)
        self._requests.pop(req.id, None)
        parent = req.group[0]
        if parent.forks_left == 0 and all(r.finished for r in parent.group):
            self._ended.append(parent)

    # -- accounting -----------------------------------------------------------------------------------------
    def check(self) -> PoolUsage:
        """Recount the pool: free + evictable + in use == total, no page or row owned twice, tables right;
        every tracked request queued or running, every open handle and step() id one of a tracked request."""
        with self.lock:
            held = [s.pages for s in self.sessions.values()] + [r.pages for r in self._parked()]
            if getattr(self.runner, "graphs", None) is not None:
                held.append(self.runner.graphs.pages)  # the padding rows' page
            usage = self.scheduler.check(held, self.sessions.values())
            scheduled = {r.id for r in (*self.scheduler.waiting, *self.scheduler.running, *self._parked())}
            assert scheduled == set(self._requests), (
                f"tracked {sorted(self._requests)}, scheduled {sorted(scheduled)}"
            )
            self._outbox.check(self._requests)
            assert not self._ended, "a finished request's handle was never closed"
            return usage

