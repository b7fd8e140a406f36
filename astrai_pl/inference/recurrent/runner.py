"""The engine over a recurrent (RWKV) model: a scheduler and a runner on the `StatePool` (recurrent/pool.py).

The engine's request life is unchanged (submit → schedule → step → finish → release, sampling shared);
what a request holds differs. It holds one state slot while running (its row), nothing growing with its
length, so the scheduler never runs short of memory for a running request. Each step:

1. a running request whose slot has served TIME_SLICE steps yields it when requests wait for a slot and
   none is free: its state is copied out of the slot (`StatePool.hold`), it rejoins the queue at the back
   and, once admitted again, continues from the restored state — a preemption costs one state copy, never
   a recomputation, so more requests than slots all make progress in turn;
2. every running request that decodes gets its token, then prefill chunks share the rest of
   `max_step_tokens` (chunked prefill: the state carries from chunk to chunk);
3. waiting requests are admitted while slots and budget allow, starting from a held state (a preempted
   request, a waiting fork, a session's turn), from the snapshot of their longest cached page-aligned
   prefix, or from the zero state. As for attention, a request sharing a long prefix with a prompt still in
   prefill waits for it, so N requests with one system prompt compute it once.

The runner computes a step's tokens through the recurrence from each request's slot: every request's chunk
in one batched forward per chunk length (all decodes together, (B, 1)). While a request computes its prompt
with the prefix cache on, the same forward also yields the state at each page boundary inside its chunk
(`RwkvState.at`: inside each block the recurrence runs segment by segment between them, which costs little
more than one run), and each is snapshotted into the radix tree (at most the prompt less its last token, as
attention caches pages).
"""

from __future__ import annotations

import torch

from ...model.layers import InputMajorWeights, Linear
from ...model.rwkv import LayerState, RwkvState
from ..pool import positive
from ..request import Request
from ..runner import ModelRunner
from ..scheduler import _LOOKAHEAD, Scheduler
from .pool import StatePool, StateUsage, default_snapshots

TIME_SLICE = 16  # steps a request keeps its slot before yielding it to a waiting request
DEFAULT_CONTEXT = 1 << 16  # the longest context when max_total_tokens is not given: the state has no limit


def is_recurrent(model) -> bool:
    return getattr(model.config, "mixer", "attention") == "rwkv"


def build_recurrent(model, device, dtype, page_size, max_total_tokens, max_batch_size, max_step_tokens,
                    prefix_cache, contiguous):
    """(pool, max_context, scheduler, runner) of an Engine over a recurrent model. max_total_tokens bounds the
    context (the state has no length) and, over page_size, the prefix snapshots; max_batch_size is the number
    of state slots; contiguous turns the prefix cache off (there are no pages to lay out)."""
    page_size = positive("page_size", page_size)
    max_context = positive("max_total_tokens", DEFAULT_CONTEXT if max_total_tokens is None else max_total_tokens)
    prefix_cache = prefix_cache and not contiguous
    snapshots = default_snapshots(model.config, device, dtype, max_context, page_size) if prefix_cache else 0
    pool = StatePool(model.config, max_batch_size, snapshots, page_size, prefix_cache, dtype, device)
    scheduler = RecurrentScheduler(pool, max_batch_size, max_step_tokens)
    return pool, max_context, scheduler, RecurrentRunner(model, pool, scheduler, device, dtype)


class RecurrentScheduler(Scheduler):
    """Scheduler's queue, admission order and in-flight prefill rule over state slots (module docstring).

    A request's `row` is its slot; its `pages` hold at most one handle of a held state, while it waits."""

    def __init__(self, pool: StatePool, max_batch_size: int, max_step_tokens: int):
        super().__init__(pool, max_batch_size, max_step_tokens)
        self.chains: dict[str, list[int] | None] = {}  # snapshots a request made of its prompt so far
        self.turns: dict[str, int] = {}  # steps since its admission

    def schedule(self) -> list[tuple[Request, int]]:
        self._yield_slots()
        plan: list[tuple[Request, int]] = []
        budget = self.max_step_tokens
        for req in self.running:  # decodes, and requests sampling from ready logits (0 tokens)
            if req.remaining <= 1:
                plan.append((req, req.remaining))
                budget -= req.remaining
        for req in self.running:  # prefill chunks, oldest first
            if budget > 0 and req.remaining > 1:
                plan.append((req, n := min(req.remaining, budget)))
                budget -= n
        self._admit(plan, budget)
        for req, _ in plan:
            self.turns[req.id] = self.turns.get(req.id, 0) + 1
        return plan

    def _yield_slots(self) -> None:
        """Preempt the requests longest in their slots (TIME_SLICE steps at least) for the waiting ones."""
        wanted = sum(1 + r.forks_left for _, r in zip(range(_LOOKAHEAD), self.waiting))
        short = min(wanted, self.max_batch_size) - self.pool.free_slots
        if short <= 0:
            return
        ready = [r for r in self.running
                 if self.turns.get(r.id, 0) >= TIME_SLICE and r.ready_logits is None and r.forks_left == 0]
        for victim in sorted(ready, key=lambda r: -self.turns[r.id])[:short]:
            self.preempt(victim)

    def preempt(self, req: Request) -> None:
        """Copy a running request's state out of its slot and queue it at the back; nothing is recomputed."""
        self.running.remove(req)
        self._drop_chain(req)
        req.pages = [self.pool.hold(req.row)]
        self.pool.free_slot(req.row)
        req.row = None
        self.turns.pop(req.id, None)
        self.waiting.append(req)
        self.preemptions += 1

    # -- admission ------------------------------------------------------------------------------------------
    def _admit(self, plan: list[tuple[Request, int]], budget: int) -> None:
        for examined, req in enumerate(list(self.waiting)):
            if examined >= _LOOKAHEAD or (budget <= 0 and req.remaining > 0):
                break
            rows = 1 + req.forks_left  # a slot for each fork too, as attention reserves its rows
            if len(self.running) + rows > self.max_batch_size or self.pool.free_slots < rows:
                break
            if req.pages:  # a held state: preempted, a waiting fork, or a session's turn
                req.row = self.pool.alloc_slot()
                self.pool.take(req.pages.pop(), req.row)
                self._resume_chain(req)
            elif not self._start_fresh(req):
                continue
            if not req.started:
                req.started = True
                req.cached_tokens = min(req.num_computed, req.num_prompt)
            self.waiting.remove(req)
            self.running.append(req)
            plan.append((req, n := min(req.remaining, budget)))
            budget -= n

    def _start_fresh(self, req: Request) -> bool:
        """A slot holding the snapshot of req's longest cached prefix (or the zero state); False when the
        request should wait for a running prefill of the same prefix."""
        assert req.num_computed == 0, f"{req.id} computed tokens but holds no state"
        snaps, req.num_computed = self.pool.match_prefix(req.cacheable, req.params.cache_salt)
        if self._prefill_in_flight(req):
            self.pool.release_snapshots(snaps)
            req.num_computed = 0
            return False
        req.row = self.pool.alloc_slot()
        if snaps:
            self.pool.load_snapshot(snaps[-1], req.row)
        else:
            self.pool.clear(req.row)
        self.chains[req.id] = snaps if self.pool.radix is not None and not req.prompt_cached else None
        if self.chains[req.id] is None:
            self.pool.release_snapshots(snaps)
        return True

    def _resume_chain(self, req: Request) -> None:
        """Go on snapshotting a restored request's prompt if the tree still holds every earlier boundary."""
        ps = self.pool.page_size
        self.chains[req.id] = None
        untrusted = req.kv_from_file  # a state read from a file never enters the tree
        if self.pool.radix is None or req.prompt_cached or untrusted or req.num_computed >= snapshot_limit(req):
            return
        aligned = req.num_computed // ps * ps
        snaps, matched = self.pool.match_prefix(req.tokens[:aligned], req.params.cache_salt)
        if matched == aligned:
            self.chains[req.id] = snaps
        else:
            self.pool.release_snapshots(snaps)

    # -- memory of running requests -------------------------------------------------------------------------
    def _drop_chain(self, req: Request) -> None:
        chain = self.chains.get(req.id)
        if chain:
            self.pool.release_snapshots(chain)
        self.chains[req.id] = None

    def add_fork(self, parent: Request, clone: Request) -> bool:
        """Run `clone` on a copy of parent's state; with no slot free, queue it holding that copy and the
        parent's logits, to sample when admitted. True when it runs now."""
        clone.num_computed, clone.prompt_cached = parent.num_computed, parent.prompt_cached
        slot = self.pool.alloc_slot() if len(self.running) < self.max_batch_size else None
        if slot is None:
            clone.pages, clone.ready_logits = [self.pool.hold(parent.row)], parent.ready_logits
            self.waiting.appendleft(clone)
            return False
        held = self.pool.hold(parent.row)
        self.pool.take(held, slot)
        clone.row = slot
        self.chains[clone.id] = None
        self.running.append(clone)
        return True

    def publish(self, req: Request) -> None:
        """The prompt is computed: its snapshots are in the tree already; the request lets go of them."""
        self._drop_chain(req)

    def release(self, req: Request, keep: bool = False) -> list[int]:
        """Give back a request's slot or held state; with `keep` its state is handed to the caller instead,
        held (a session taking back its turn)."""
        self._drop_chain(req)
        self.chains.pop(req.id, None)
        self.turns.pop(req.id, None)
        held, req.pages = req.pages, []
        if req.row is not None:
            if keep:
                held = [self.pool.hold(req.row)]
            self.pool.free_slot(req.row)
            req.row = None
        if keep:
            return held
        self.pool.release(held)
        return []

    def check(self, other_holders: list[list[int]], sessions) -> StateUsage:
        """Recount snapshots, held states and slots over every request and `other_holders` (sessions)."""
        requests = [*self.running, *self.waiting]
        handles = [h for holder in [*(r.pages for r in requests), *other_holders] for h in holder]
        usage = self.pool.check([c for c in self.chains.values() if c], handles)
        rows = [r.row for r in self.running]
        assert None not in rows and len(set(rows)) == len(rows), f"state slots owned twice: {rows}"
        assert all(not r.pages for r in self.running), "a running request holds a copied-out state"
        assert all(r.row is None and len(r.pages) <= 1 for r in self.waiting), "a waiting request holds a slot"
        assert len(rows) + self.pool.free_slots == self.pool.num_slots, "a state slot leaked"
        assert set(self.chains) <= {r.id for r in requests}, "a snapshot chain outlived its request"
        return usage


def snapshot_limit(req: Request) -> int:
    """The last position whose state may be snapshotted: the prompt, less what `cacheable` leaves out."""
    return min(len(req.cacheable), req.num_prompt)


class RecurrentRunner(ModelRunner):
    """Computes a step's plan through the recurrence, from and back into each request's state slot."""

    def __init__(self, model, pool: StatePool, scheduler: RecurrentScheduler, device, dtype):
        self.model, self.pool, self.scheduler, self.device, self.dtype = model, pool, scheduler, device, dtype
        self.steps = 0
        self.weights = InputMajorWeights() if device.type == "cpu" else None
        self._before: tuple[list[Request], torch.Tensor, list[torch.Tensor]] | None = None

    def forward(self, plan: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor | None]:
        """Compute `n` tokens of each planned request; the requests now ready to sample and their logits
        (float32 (N, V)). Advances each `num_computed`; the slots hold the new states once it returns."""
        if not plan:
            return [], None
        reqs = [req for req, _ in plan]
        slots = torch.tensor([req.row for req in reqs], device=self.device)
        start = self.pool.gather(slots)  # (layers, B, H) per component, kept to undo a failed step
        self._before = (reqs, slots, start)
        states = [s.clone() for s in start]
        chunks = [(req.num_computed, req.num_computed + n, self._boundaries(req, n)) for req, n in plan]
        last: dict[int, torch.Tensor] = {}
        scored: list[tuple[Request, int, torch.Tensor]] = []
        with Linear.input_major(self.weights):
            groups: dict[int, list[int]] = {}
            for i, (lo, hi, _) in enumerate(chunks):
                groups.setdefault(hi - lo, []).append(i)
            for group in groups.values():
                self._run_group(reqs, [chunks[i] for i in group], group, states, last, scored)
            self.pool.scatter(slots, states)
            self.steps += 1
            for req, n in plan:
                req.num_computed += n
                req.table_len = req.num_computed
            if scored:
                self._score_prompts(torch.stack([h for _, _, h in scored]),
                                    [(req, p, k) for k, (req, p, _) in enumerate(scored)])
            ready = [i for i, req in enumerate(reqs) if req.num_computed == len(req.tokens)]
            if not ready:
                return [], None
            return [reqs[i] for i in ready], self.model.lm_head(torch.stack([last[i] for i in ready])).float()

    def _boundaries(self, req: Request, n: int) -> list[int]:
        """The prompt page boundaries inside req's next n tokens still to snapshot (positions in the prompt)."""
        chain, ps, lo = self.scheduler.chains.get(req.id), self.pool.page_size, req.num_computed
        if chain is None:
            return []
        return [b for b in range((len(chain) + 1) * ps, min(lo + n, snapshot_limit(req)) + 1, ps) if b > lo]

    def _run_group(self, reqs, chunks, group, states, last, scored) -> None:
        """One forward over the chunks of equal length of the requests `group` (batch rows of `states`),
        recording the states at every boundary any of them snapshots."""
        index = torch.tensor(group, device=self.device)
        whole = len(group) == len(reqs)
        mine = states if whole else [s.index_select(1, index) for s in states]
        layers = mine[0].shape[0]
        at = sorted({b - lo for lo, _, bounds in chunks for b in bounds})
        cache = RwkvState([LayerState(*(s[layer] for s in mine)) for layer in range(layers)], at=tuple(at))
        ids = torch.tensor([reqs[i].tokens[lo:hi] for i, (lo, hi, _) in zip(group, chunks)], device=self.device)
        hidden, _ = self.model.hidden_states(ids, cache=cache)  # (G, T, H)
        after = [torch.stack([layer[c] for layer in cache.layers]) for c in range(len(mine))]  # (layers, G, H)
        for s, a in zip(states, after):
            if whole:
                s.copy_(a)
            else:
                s.index_copy_(1, index, a.to(s.dtype))
        points = [torch.stack([layer[c] for layer in cache.snapshots]) for c in range(len(mine))] if at else []
        for j, (i, (lo, hi, bounds)) in enumerate(zip(group, chunks)):
            req = reqs[i]
            if hi == len(req.tokens):
                last[i] = hidden[j, -1]
            scored += [(req, p, hidden[j, p - lo]) for p in req.scored_positions(lo, hi)]
            for b in bounds:  # (layers, G, P, H) per component: the state after b tokens is row j, point b − lo
                self._snapshot(req, [p[:, :, at.index(b - lo)] for p in points], j)

    def _snapshot(self, req: Request, after: list[torch.Tensor], j: int) -> None:
        """Snapshot row j of `after` as the state at req's next page boundary, into the tree; with every
        snapshot in use the request stops snapshotting."""
        chain = self.scheduler.chains.get(req.id)
        if chain is None:  # it stopped at an earlier boundary of this step
            return
        snap = self.pool.snapshot(after, j)
        if snap is None:
            self.scheduler._drop_chain(req)
            return
        chain.append(snap)
        chain[:] = self.pool.cache_chain(req.tokens, chain, req.params.cache_salt)

    def forget_step_state(self) -> None:
        """After a failed step: the slots of requests that will compute their tokens again get back the
        state they had before it (those sampled already keep theirs, with their logits)."""
        if self._before is None:
            return
        reqs, slots, start = self._before
        self._before = None
        keep = [i for i, req in enumerate(reqs) if req.ready_logits is None and not req.finished
                and req.row == int(slots[i])]
        if keep:
            index = torch.tensor(keep, device=self.device)
            self.pool.scatter(slots[index], [s.index_select(1, index) for s in start])
