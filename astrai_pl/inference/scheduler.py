"""The continuous-batching scheduler: which requests compute how many tokens in the next forward.

Each step, under a budget of `max_step_tokens` new tokens:

1. every running request that decodes gets its one token (oldest first);
2. running requests still in prefill get the next chunk of their prompt (chunked prefill), so a long
   prompt shares steps with the decodes instead of stalling them;
3. waiting requests are admitted, oldest first, while rows, budget and memory allow. An admitted
   request starts from the longest cached prefix of its tokens. A request whose prompt shares a long
   prefix with one still in prefill waits for that prefill to finish and reuses its pages.

When a running request needs a page and none is free or evictable, the youngest running request is
preempted: its computed full pages go to the radix cache (where they stay if not evicted; pages whose
K/V came from a session file are never cached), the rest is freed, and it rejoins the queue at the
front to be recomputed.

When every layer slides (Mistral), each running request first gives back the pages wholly before the
window of its next position (`KVPool.slide`), except a session's turn (the session keeps, saves and
forks whole conversations) and a prompt not yet in the radix cache (its pages are kept until it is).

LongRoPE models (Phi-3) rotate every key of a sequence longer than the original length by the long factors,
so a request whose keys were computed within that length is preempted once, at its first step past it, and
recomputed whole, as transformers' generate does; a session's turn that passes it starts from scratch.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from .pool import KVPool, PoolUsage
from .request import Request

_LOOKAHEAD = 64  # waiting requests examined per step


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
    draft_tokens: int = 0  # proposed by speculative decoding and verified
    accepted_draft_tokens: int = 0  # of those, accepted


class Scheduler:
    def __init__(self, pool: KVPool, max_batch_size: int, max_step_tokens: int, long_rope_after: int | None = None):
        self.pool, self.max_batch_size, self.max_step_tokens = pool, max_batch_size, max_step_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.released_pages = 0  # pages given back from before every layer's window
        self.long_rope_after = long_rope_after  # longrope: the original length, past which keys are re-rotated
        self._rotated_long: weakref.WeakSet[Request] = weakref.WeakSet()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, req: Request) -> None:
        """Queue a request behind the waiting ones."""
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request off the queue or out of the batch (it finished or was aborted)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)

    def schedule(self) -> list[tuple[Request, int]]:
        """(request, tokens to compute) for the next forward; 0 tokens: sample from ready logits."""
        plan: list[tuple[Request, int]] = []
        budget, preemptions = self.max_step_tokens, self.preemptions
        if self.pool.window is not None:
            for req in self.running:
                self._slide(req)
        for req in list(self.running):  # decodes, oldest first
            if req in self.running and req.remaining <= 1:
                if self._holds_short_keys(req):
                    self.preempt(req)
                    preemptions += 1  # not for memory: admission goes on, this request first
                    continue
                want = req.remaining + len(req.draft)  # a draft is verified in the same forward (speculative.py)
                if req.draft and self._fit(req, want) < want:
                    req.draft, want = [], req.remaining  # no room for it: a plain decode
                n = self._grow(req, want, plan)
                if req in self.running:
                    plan.append((req, n))
                    budget -= n
        for req in list(self.running):  # prefill chunks, oldest first
            if budget > 0 and req in self.running and req.remaining > 1:
                n = self._grow(req, min(req.remaining, budget), plan)
                if n:
                    plan.append((req, n))
                    budget -= n
        if self.preemptions == preemptions:
            self._admit(plan, budget)
        return plan

    def _holds_short_keys(self, req: Request) -> bool:
        """Whether `req` passes the original length of a longrope model with keys computed within it (by its own
        steps, or a session's earlier turns): those must be computed again with the long factors."""
        after = self.long_rope_after
        if after is None or req in self._rotated_long or len(req.tokens) <= after:
            return False
        if req.num_computed == 0:  # computed whole from here, every key with the long factors
            self._rotated_long.add(req)
            return False
        return True

    # -- memory for running requests ----------------------------------------------------------------------
    def _slide(self, req: Request) -> None:
        """Release req's pages that no layer's window reaches any more. Not for a session's turn, whose
        pages go back to the session whole, nor while its prompt is computed with the radix cache on: the
        prompt's pages are kept until they are published (a recompute past the prompt publishes now)."""
        if req.session is not None:
            return
        if self.pool.radix is not None and not req.prompt_cached:
            if req.num_computed < req.num_prompt:
                return
            self.publish(req)
            req.prompt_cached = True
        self.released_pages += self.pool.slide(req.pages, req.num_computed, req.row, req.table_len)

    def _grow(self, req: Request, n: int, plan: list[tuple[Request, int]]) -> int:
        """Pages for up to n more tokens of `req`, preempting younger requests while none fit."""
        while n:
            fit = self._fit(req, n)
            if fit == n or (fit and req.remaining > 1):  # a prefill chunk may shrink to what fits
                return self._take(req, fit)
            victim = self.running[-1]  # running is in admission order: the last is the youngest
            self.preempt(victim)
            if victim is req:
                return 0
            plan[:] = [(r, k) for r, k in plan if r is not victim]
        return 0

    def _fit(self, req: Request, n: int) -> int:
        room = (len(req.pages) + self.pool.available()) * self.pool.page_size - req.num_computed
        return max(0, min(n, room))

    def _take(self, req: Request, n: int) -> int:
        need = self.pool.pages_for(req.num_computed + n) - len(req.pages)
        if need > 0:
            pages = self.pool.allocate(need)
            assert pages is not None, "allocation failed after the room check"
            req.pages.extend(pages)
        return n

    def preempt(self, req: Request) -> None:
        """Free a running request's memory and put it back at the head of the queue, to be recomputed."""
        self.running.remove(req)
        self._forget_computed(req)
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _forget_computed(self, req: Request) -> None:
        """Free a request's memory; the engine computes all its tokens again."""
        self.release(req)
        req.num_computed = req.table_len = 0
        req.ready_logits, req.draft = None, []
        req.prompt_cached = req.kv_from_file = False  # recomputed by the engine from here on

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back `req`'s pages past those of its first `num_tokens` tokens; its table ends there at most."""
        keep = self.pool.pages_for(num_tokens)
        self.pool.release(req.pages[keep:])
        req.pages, req.table_len = req.pages[:keep], min(req.table_len, num_tokens)

    def add_fork(self, parent: Request, clone: Request) -> bool:
        """Run `clone` on a copy of parent's pages (full ones shared); if there is no room, queue it to be
        prefilled from the cache later. True when it runs now."""
        pages = self.pool.fork(parent.pages, parent.num_computed)
        row = self.pool.req_to_token.alloc() if pages is not None else None
        if row is None:
            if pages is not None:
                self.pool.release(pages)
            self.waiting.appendleft(clone)
            return False
        clone.pages, clone.row, clone.num_computed = pages, row, parent.num_computed
        clone.prompt_cached = parent.prompt_cached
        self.running.append(clone)
        return True

    def publish(self, req: Request) -> None:
        """Put req's computed full pages in the radix cache, unless K/V read from a file went into them."""
        if req.num_computed and not req.kv_from_file:  # K/V computed for a draft past `tokens` is never cached
            pages = self.pool.cache_prefix(req.tokens, req.pages, min(req.num_computed, len(req.tokens)),
                                           req.params.cache_salt)
            if pages != req.pages:
                req.pages, req.table_len = pages, 0

    def release(self, req: Request, keep: bool = False) -> list[int]:
        """Give back a request's row and its pages (its computed full pages stay in the radix cache). With
        `keep` the pages are handed to the caller instead (a session taking back its turn's memory)."""
        self.publish(req)
        pages, req.pages = req.pages, []
        if req.row is not None:
            self.pool.req_to_token.free(req.row)
            req.row = None
        if keep:
            return pages
        self.pool.release(pages)
        return []

    # -- admission ----------------------------------------------------------------------------------------
    def _admit(self, plan: list[tuple[Request, int]], budget: int) -> None:
        for examined, req in enumerate(list(self.waiting)):
            if budget <= 0 or examined >= _LOOKAHEAD:
                break
            rows = 1 + req.forks_left
            if len(self.running) + rows > self.max_batch_size or self.pool.req_to_token.num_free < rows:
                break
            if self._holds_short_keys(req):  # a session's turn past a longrope model's original length
                self._forget_computed(req)
                self._rotated_long.add(req)
            fresh = not req.pages and req.num_computed == 0
            if fresh:
                req.pages, req.num_computed = self.pool.match_prefix(req.cacheable, req.params.cache_salt)
                if self._prefill_in_flight(req):  # wait for that prefill, then reuse its pages
                    self._unstart(req)
                    continue
            n = self._start(req, budget)
            if n is None:  # memory is short: keep arrival order
                if fresh:
                    self._unstart(req)
                break
            self.waiting.remove(req)
            self.running.append(req)
            plan.append((req, n))
            budget -= n

    def _start(self, req: Request, budget: int) -> int | None:
        """Reserve memory and a row for the first chunk; None when memory is short."""
        n = min(req.remaining, budget)
        headroom = req.forks_left  # a page for each fork's copy of the partial page
        if self.pool.page_size < self.pool.req_to_token.max_context:  # paged: running requests grow
            headroom += len(self.running)
        need = self.pool.pages_for(req.num_computed + n) - len(req.pages)
        if need > 0 and need + headroom > self.pool.available():
            return None
        self._take(req, n)
        req.row = self.pool.req_to_token.alloc()
        req.table_len = 0
        if not req.started:
            req.started = True
            req.cached_tokens = min(req.num_computed, req.num_prompt)
        return n

    def _unstart(self, req: Request) -> None:
        self.pool.release(req.pages)
        req.pages, req.num_computed = [], 0

    def _prefill_in_flight(self, req: Request) -> bool:
        """Whether a running prefill will soon cache much more of req's prompt than the cache holds now."""
        ps, matched = self.pool.page_size, req.num_computed
        if self.pool.radix is None:
            return False
        uncached = len(req.tokens) - matched
        for other in self.running:
            if other.prompt_cached or other.kv_from_file or other.num_computed >= other.num_prompt:
                continue
            if other.params.cache_salt != req.params.cache_salt:  # its pages will not be req's to share
                continue
            shared = common_prefix(req.cacheable, other.tokens[: other.num_prompt]) // ps * ps
            if shared - matched >= max(ps, uncached // 2):
                return True
        return False

    # -- accounting ---------------------------------------------------------------------------------------
    def check(self, other_holders: list[list[int]], sessions: Iterable) -> PoolUsage:
        """The pool's recount over every request and `other_holders`, plus rows and req_to_token."""
        pool, ps = self.pool, self.pool.page_size
        requests = list(self.running) + list(self.waiting)
        partial = [
            h.pages[h.num_computed // ps]
            for h in (*self.running, *sessions)
            if h.num_computed // ps < len(h.pages)
        ]
        usage = pool.check([r.pages for r in requests] + other_holders, writable=partial)
        rows = [r.row for r in self.running]
        assert None not in rows and len(set(rows)) == len(rows), f"request rows owned twice: {rows}"
        assert all(r.row is None for r in self.waiting), "a waiting request keeps a row"
        assert len(rows) + pool.req_to_token.num_free == pool.req_to_token.num_rows, "a request row leaked"
        for r in requests:
            assert len(r.pages) == pool.pages_for(r.num_computed), f"{r.id} holds pages past its K/V"
            live = pool.live(r.pages)
            assert r.pages[len(r.pages) - len(live) :] == live, f"{r.id} released pages that are not a prefix"
        for r in self.running:
            table = pool.req_to_token.table[r.row, : r.table_len].tolist()
            assert table == pool.slots(r.pages, 0, r.table_len), f"req_to_token of {r.id} is stale"
        return usage


def common_prefix(a: list[int], b: list[int], chunk: int = 64) -> int:
    n, i = min(len(a), len(b)), 0
    while i < n and a[i : i + chunk] == b[i : i + chunk]:
        i += chunk
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n)
