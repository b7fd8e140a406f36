"""StatePool: the memory of a recurrent (RWKV) model in the engine — fixed state rows instead of K/V pages.

A recurrent model's whole context is its state: per layer five (H,) vectors (`LayerState`: two token-shift
inputs, the wkv sums aa, bb and their exponent pp), whatever the context length. The pool preallocates
them as one (layers, rows, H) tensor per component; rows are of three kinds:

- slots, rows [0, num_slots): one per running request, held from admission to finish or preemption;
- snapshots, the rows after them: the state after a page-aligned prefix of a prompt (every page_size
  tokens), kept in the radix tree (radix.py) in place of pages, so a request sharing that prefix starts
  from the snapshot of its longest cached page-aligned prefix. Snapshots are reference counted by the
  `PageAllocator` like pages: the tree holds one reference, a request snapshotting its prompt holds the
  chain it has made (so no link of it is evicted under it); unreferenced ones go least recently used first.
  As for pages, each cache salt (`SamplingParams.cache_salt`, an adapter's) has a tree of its own, so a
  snapshot made under one salt is never a cache hit under another;
- held states: copies out of a slot (`hold`) for a preempted request, a waiting fork or a session between
  turns, kept by a handle in that holder's `pages` list until restored (`take`) or released.

The bytes of a request are constant in its length: one slot while running, one held copy while waiting.
An engine session saves its held state in the state file format of the standalone state sessions
(files.py, float32, with its token ids) and loads it back as a held state, checked as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

import torch

from ...model.rwkv import NO_EXPONENT, LayerState, UnsupportedMixerError
from ..cache import PageAllocator
from ..pool import KVPool
from ..radix import RadixCache
from ..sessions import Session, SessionMemory, _checked_tokens, file_refuser
from .files import read_state, write_state

COMPONENTS = LayerState._fields  # ffn_shift, att_shift (activations' dtype), aa, bb, pp (float32)
SNAPSHOT_BYTES_CPU = 256 << 20  # default snapshot memory on CPU
SNAPSHOT_SHARE_GPU = 0.1  # of free GPU memory, by default


@dataclass(frozen=True)
class StateUsage:
    """Rows by state. free / evictable / in_use / total count snapshot rows (free + evictable + in_use ==
    total), as `PoolUsage` counts pages; the slots and bytes are the recurrent pool's own."""

    free: int
    evictable: int
    in_use: int
    total: int
    page_size: int
    slots_free: int
    slots_total: int
    held_states: int  # copies out of a slot: preempted requests, waiting forks, sessions between turns
    state_bytes: int  # of one request's state, whatever its length

    @property
    def slots_in_use(self) -> int:
        return self.slots_total - self.slots_free

    @property
    def bytes_in_use(self) -> int:
        """States of running and held requests, plus the snapshots someone uses."""
        return (self.slots_in_use + self.held_states + self.in_use) * self.state_bytes


def state_bytes(cfg, dtype: torch.dtype) -> int:
    """Bytes of one request's state: per layer two shifts in `dtype` and three float32 sums of hidden_size."""
    return cfg.num_hidden_layers * cfg.hidden_size * (2 * dtype.itemsize + 3 * 4)


def default_snapshots(cfg, device: torch.device, dtype: torch.dtype, max_context: int, page_size: int) -> int:
    """Snapshot rows: one per page of a context, bounded by 256 MiB on CPU or 10% of free GPU memory."""
    if device.type == "cuda":
        budget = int(SNAPSHOT_SHARE_GPU * torch.cuda.mem_get_info(device)[0])
    else:
        budget = SNAPSHOT_BYTES_CPU
    return max(1, min(max_context // page_size, budget // state_bytes(cfg, dtype)))


class StatePool:
    def __init__(self, cfg, num_slots: int, num_snapshots: int, page_size: int, prefix_cache: bool,
                 dtype: torch.dtype, device: torch.device):
        L, H, rows = cfg.num_hidden_layers, cfg.hidden_size, num_slots + num_snapshots
        self.page_size, self.num_slots, self.device = page_size, num_slots, device
        self.state_bytes = state_bytes(cfg, dtype)
        self.rows = [torch.zeros(L, rows, H, dtype=dtype if i < 2 else torch.float32, device=device)
                     for i in range(len(COMPONENTS))]  # each (layers, rows, H)
        self.rows[-1].fill_(NO_EXPONENT)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.snapshots = PageAllocator(num_snapshots, page_size)  # snapshot i lives in row num_slots + i
        self.radix = RadixCache(self.snapshots) if prefix_cache else None
        self.held: dict[int, list[torch.Tensor]] = {}
        self._handles = count()
        self.evicted_pages = 0  # snapshots evicted: the counter attention uses for pages
        self.window = None  # nothing slides: the scheduler's hooks for windowed attention stay off

    # -- the face the scheduler's shared code and admission see (a request holds no pages) ------------------
    @property
    def num_pages(self) -> int:
        return self.num_slots

    def pages_for(self, num_tokens: int) -> int:
        return 0

    @property
    def allocator(self):
        raise UnsupportedMixerError(
            "an RWKV engine keeps one recurrent state per request, not K/V pages, so K/V page tables have no "
            "meaning on it. Fix: use the engine's and its sessions' public methods (a session saves its state "
            "with Session.save).")

    storage = slots = allocate = allocator  # K/V pool names: scheduler or runner code reaching them fails clearly

    # -- slots ----------------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def alloc_slot(self) -> int | None:
        return self._free_slots.pop() if self._free_slots else None

    def free_slot(self, slot: int) -> None:
        assert slot not in self._free_slots, f"state slot {slot} freed twice"
        self._free_slots.append(slot)

    def clear(self, slot: int) -> None:
        """The state before any token: zero shifts and sums, pp at NO_EXPONENT."""
        for i, rows in enumerate(self.rows):
            rows[:, slot] = NO_EXPONENT if i == len(self.rows) - 1 else 0.0

    def gather(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """The states in `slots` (B,), as one (layers, B, H) tensor per component (copies)."""
        return [rows.index_select(1, slots) for rows in self.rows]

    def scatter(self, slots: torch.Tensor, states: list[torch.Tensor]) -> None:
        for rows, state in zip(self.rows, states):
            rows.index_copy_(1, slots, state.to(rows.dtype))

    # -- held states ----------------------------------------------------------------------------------------
    def hold(self, slot: int) -> int:
        """Copy the state of `slot` out; the handle that restores it."""
        handle = next(self._handles)
        self.held[handle] = [rows[:, slot].clone() for rows in self.rows]
        return handle

    def hold_state(self, state: list[torch.Tensor]) -> int:
        """Hold `state` (one (layers, H) tensor per component, in the rows' dtypes); the handle that restores it."""
        handle = next(self._handles)
        self.held[handle] = state
        return handle

    def zero_state(self) -> list[torch.Tensor]:
        """The state before any token, one (layers, H) tensor per component (what `clear` writes)."""
        last = len(self.rows) - 1
        return [torch.full_like(rows[:, 0], NO_EXPONENT if i == last else 0.0) for i, rows in enumerate(self.rows)]

    def take(self, handle: int, slot: int) -> None:
        """Restore a held state into `slot`; the handle is spent."""
        for rows, saved in zip(self.rows, self.held.pop(handle)):
            rows[:, slot] = saved

    def release(self, handles: list[int]) -> None:
        """Drop held states (a holder's `pages`)."""
        for handle in handles:
            del self.held[handle]

    def fork(self, handles: list[int], num_computed: int) -> list[int]:
        """A copy of a holder's held state (a session's fork)."""
        copies = []
        for handle in handles:
            copies.append(new := next(self._handles))
            self.held[new] = [t.clone() for t in self.held[handle]]
        return copies

    def session_memory(self, session) -> SessionMemory:
        """What an engine session holds here: its computed tokens in one held state (none while a turn runs,
        which holds a slot), never shared (a fork copies it)."""
        held = len(session.pages)
        return SessionMemory(len(session.tokens), session.num_computed, held, 0, held * self.state_bytes)

    def save_session(self, session, path, fingerprint: str) -> None:
        """Write a session's held state (zeros before any computed token), its next-token logits and its token
        ids in the state file format."""
        if session.pages:
            [handle] = session.pages
            held = self.held[handle]
        else:
            assert session.num_computed == 0, f"{session.id} computed tokens but holds no state"
            held = self.zero_state()
        layers = [LayerState(*(t[i : i + 1] for t in held)) for i in range(held[0].shape[0])]
        write_state(path, layers, session.last_logits, fingerprint, session.num_computed, torch.float32,
                    token_ids=session.tokens)

    def load_session(self, engine, path, ttl: float | None) -> Session:
        """A session on the state of a file written by `save_session`, held; refused (SessionError) unless the
        file fits this engine's model. The state is untrusted: the session's turns never snapshot it into the
        radix tree (`kv_from_file`), until they compute the history again."""
        cfg = engine.model.config
        layers, logits, computed, ids = read_state(path, engine.fingerprint.get(), cfg.num_hidden_layers,
                                                   cfg.hidden_size, cfg.vocab_size, with_token_ids=True)
        refuse = file_refuser(path)
        tokens = _checked_tokens(engine, ids, refuse)
        if (logits is not None) != (0 < computed == len(tokens)):
            raise refuse(f"last_logits are {'present' if logits is not None else 'missing'} for {computed} "
                         f"computed of {len(tokens)} tokens (a session keeps them when every token is computed)")
        session = Session(engine, ttl)
        session.tokens = tokens
        if computed:
            handle = next(self._handles)
            self.held[handle] = [torch.cat(tensors).to(rows)
                                 for rows, tensors in zip(self.rows, zip(*layers))]
            session.pages, session.num_computed, session.kv_from_file = [handle], computed, True
        if logits is not None:
            session.last_logits = logits.to(engine.device, torch.float32)
        return session

    # -- prefix snapshots -----------------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int], salt: str | None = None) -> tuple[list[int], int]:
        """Snapshots of the longest page-aligned prefix of `tokens` cached under `salt` (a request's
        `cache_salt`: another salt's prompts are never found), referenced for the caller."""
        if self.radix is None:
            return [], 0
        snaps, matched = self.radix.match(tokens, salt)
        self.snapshots.incref(snaps)
        return snaps, matched

    def load_snapshot(self, snap: int, slot: int) -> None:
        row = self.num_slots + snap
        for rows in self.rows:
            rows[:, slot] = rows[:, row]

    def snapshot(self, states: list[torch.Tensor], i: int) -> int | None:
        """A snapshot row holding batch row i of `states` (one reference, the caller's), evicting the least
        recently used unreferenced snapshots when none is free; None when every snapshot is in use."""
        if self.snapshots.num_free == 0:
            self.evicted_pages += self.radix.evict(1)
        got = self.snapshots.allocate(1)
        if got is None:
            return None
        row = self.num_slots + got[0]
        for rows, state in zip(self.rows, states):
            rows[:, row] = state[:, i]
        return got[0]

    def cache_chain(self, tokens: list[int], chain: list[int], salt: str | None = None) -> list[int]:
        """Insert the snapshots of tokens[:len(chain) * page_size] in the tree under `salt`; the chain with each
        snapshot the tree already held for that prefix in place of the caller's copy, which is released."""
        cached = self.radix.insert(tokens[: len(chain) * self.page_size], chain, salt)
        for mine, theirs in zip(chain, cached):
            if mine != theirs:  # the caller now holds the tree's snapshot instead of its own
                self.snapshots.incref([theirs])
                self.snapshots.decref([mine])
        return cached

    def release_snapshots(self, chain: list[int]) -> None:
        self.snapshots.decref(chain)

    reset_cache = KVPool.reset_cache  # evict every unused snapshot; snapshots freed

    # -- accounting -----------------------------------------------------------------------------------------
    def usage(self) -> StateUsage:
        a = self.snapshots
        return StateUsage(a.num_free, a.num_evictable, a.num_in_use, a.num_pages, self.page_size,
                          self.free_slots, self.num_slots, len(self.held), self.state_bytes)

    def check(self, chains: list[list[int]], handles: list[int]) -> StateUsage:
        """Recount snapshot references (the requests' chains and the tree) and held states (handles)."""
        a = self.snapshots
        expected = [0] * a.num_pages
        for chain in chains:
            for snap in chain:
                expected[snap] += 1
        for node in self.radix.nodes() if self.radix is not None else ():
            for snap in node.pages:
                expected[snap] += 1
        assert expected == a.refs, "snapshot reference counts disagree with their holders"
        assert sorted(handles) == sorted(self.held), f"held states {sorted(self.held)}, holders {sorted(handles)}"
        assert len(set(self._free_slots)) == len(self._free_slots), "a state slot is free twice"
        return self.usage()


