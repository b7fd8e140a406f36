"""KVPool: the KV storage, the request table, the page allocator and the radix cache behind one face.

Everything that holds K/V holds a list of pages covering its positions 0, 1, …: page i holds positions
[i·page_size, (i+1)·page_size). The pool never remembers who holds what; holders pass their page
lists back (`release`, `check`). Two layouts:

- paged (page_size ≥ 1): pages are taken from the free list on demand, the radix cache shares full pages;
- contiguous: one page per request spanning the whole context, so req_to_token is a linear map
  (slot = base + position) and nothing is shared.

When every layer of the model slides (`window`: the widest of them), a running request's pages wholly
before the window of its next position are released (`slide`): in the holder's list such a page becomes
`dead_page`, one page past the allocator's that is never handed out or written, so its slots stay zero.
Positions keep mapping to slots through the list, and req_to_token points released positions at the
dead page: a gather that spans them (masked out by the window) reads zeros, never a slot that another
request owns now. Nothing counts references to the dead page.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..model.layers import long_rope_after
from ..model.rwkv import UnsupportedMixerError, check_engine_support
from .cache import InferenceError, KVStorage, PageAllocator, ReqToTokenPool
from .radix import RadixCache


def default_total_tokens(cfg, device: torch.device, dtype: torch.dtype, reserve: int = 0) -> int:
    """KV pool size for a ModelConfig: 80% of free GPU memory less `reserve` bytes (the decode graphs'); on CPU
    64 contexts, at most 32k tokens."""
    max_context = cfg.max_position_embeddings
    if device.type == "cuda":
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_size * dtype.itemsize
        free, _ = torch.cuda.mem_get_info(device)
        return max(max_context, (int(0.8 * free) - reserve) // per_token)
    return min(32768, 64 * max_context)


@dataclass(frozen=True)
class PoolUsage:
    """Pages by state; free + evictable + in_use == total always holds."""

    free: int
    evictable: int
    in_use: int
    total: int
    page_size: int

    @property
    def free_tokens(self) -> int:
        return self.free * self.page_size


def release_window(cfg) -> int | None:
    """The widest window when every layer slides (earlier positions are never attended again); None when a
    layer sees the whole context."""
    windows = [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]
    return None if not windows or None in windows else max(windows)


class KVPool:
    def __init__(self, storage: KVStorage, req_to_token: ReqToTokenPool, page_size: int, prefix_cache: bool,
                 window: int | None = None):
        """window: release pages before it (every layer slides); storage then holds one page more, the dead page."""
        self.storage, self.req_to_token, self.page_size = storage, req_to_token, page_size
        num_pages = storage.num_slots // page_size - (window is not None)
        self.window, self.dead_page = window, num_pages if window is not None else None
        self.allocator = PageAllocator(num_pages, page_size)
        self.radix = RadixCache(self.allocator) if prefix_cache else None
        self.evicted_pages = 0

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def slots(self, pages: list[int], start: int, stop: int) -> list[int]:
        """Slots of positions [start, stop) for a holder with `pages`."""
        ps = self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, stop)]

    # -- pages ----------------------------------------------------------------------------------------------
    def available(self) -> int:
        """Pages that an allocation could get now: free ones plus evictable cached ones."""
        return self.allocator.num_free + self.allocator.num_evictable

    def allocate(self, n: int) -> list[int] | None:
        """n pages, evicting cached prefixes (LRU) when the free list is short; None if that is not enough."""
        short = n - self.allocator.num_free
        if short > 0 and self.radix is not None:
            self.evicted_pages += self.radix.evict(short)
        return self.allocator.allocate(n)

    def release(self, pages: list[int]) -> None:
        self.allocator.decref(self.live(pages))

    def live(self, pages: list[int]) -> list[int]:
        """`pages` without the dead page (positions released by `slide`)."""
        return pages if self.dead_page is None else [p for p in pages if p != self.dead_page]

    def slide(self, pages: list[int], num_computed: int, row: int, table_len: int) -> int:
        """Release a holder's pages wholly before the window of its next position `num_computed` (it sees
        positions > num_computed − window), in place: each becomes the dead page in `pages` and in
        req_to_token[row] (written up to `table_len`). Returns the number of pages released.

        Released pages are always a prefix of `pages`. Pages in the radix cache (a published prompt, the
        leading run) go all at once, when the window has passed the last of them: a cached node's pages are
        then held together or not at all, so what is counted evictable can always be evicted.
        """
        ps, dead, cached = self.page_size, self.dead_page, self.allocator.cached
        end = min(max(0, num_computed + 1 - self.window) // ps, len(pages))
        if end == 0 or pages[end - 1] == dead:
            return 0
        start = end
        while start > 0 and pages[start - 1] != dead and not cached[pages[start - 1]]:
            start -= 1  # back over private pages to the released ones, or to the cached run
        if start > 0 and pages[start - 1] != dead:  # the cached run ends at `start`, or goes on past `end`
            if start == end and end < len(pages) and cached[pages[end]]:
                return 0
            start = 0
        freed, pages[start:end] = pages[start:end], [dead] * (end - start)
        self.allocator.decref(freed)
        stop = min(end * ps, table_len)
        if stop > start * ps:
            positions = list(range(start * ps, stop))
            self.req_to_token.write([row] * len(positions), positions, self.slots(pages, start * ps, stop))
        return end - start

    def match_prefix(self, tokens: list[int], salt: str | None = None) -> tuple[list[int], int]:
        """Cached pages of the longest page-aligned prefix of `tokens` under `salt`, referenced for the caller."""
        if self.radix is None:
            return [], 0
        pages, matched = self.radix.match(tokens, salt)
        self.allocator.incref(pages)
        return pages, matched

    def cache_prefix(self, tokens: list[int], pages: list[int], num_computed: int, salt: str | None = None
                     ) -> list[int]:
        """Insert the full pages of tokens[:num_computed] under `salt`; returns `pages` with duplicates replaced.

        A page the cache already held for the same prefix replaces the caller's copy, which is released.
        """
        full = num_computed // self.page_size
        if self.radix is None or full == 0 or pages[0] == self.dead_page:  # released: no whole prefix left
            return pages
        cached = self.radix.insert(tokens[: full * self.page_size], pages[:full], salt)
        dupes = [mine for mine, theirs in zip(pages[:full], cached) if mine != theirs]
        if dupes:
            self.allocator.incref([theirs for mine, theirs in zip(pages[:full], cached) if mine != theirs])
            self.allocator.decref(dupes)
        return cached + pages[full:]

    def fork(self, pages: list[int], num_computed: int) -> list[int] | None:
        """A copy of a holder's pages: full pages shared, the partial page (if any) copied. None if no room."""
        full = num_computed // self.page_size
        tail = num_computed - full * self.page_size
        copy: list[int] = []
        if tail:
            copy = self.allocate(1)
            if copy is None:
                return None
            offsets = torch.arange(tail, device=self.storage.k.device)
            self.storage.copy(offsets + pages[full] * self.page_size, offsets + copy[0] * self.page_size)
        self.allocator.incref(self.live(pages[:full]))
        return pages[:full] + copy

    # -- accounting -----------------------------------------------------------------------------------------
    def reset_cache(self) -> int:
        """Evict every unused cached prefix; pages freed."""
        if self.radix is None:
            return 0
        freed = self.radix.reset()
        self.evicted_pages += freed
        return freed

    def usage(self) -> PoolUsage:
        a = self.allocator
        return PoolUsage(a.num_free, a.num_evictable, a.num_in_use, a.num_pages, self.page_size)

    def check(self, holders: Iterable[list[int]], writable: Iterable[int] = ()) -> PoolUsage:
        """Recount every reference from scratch and compare with the allocator's books.

        holders: the page lists of every request, session and fork alive now. writable: pages about
        to receive K/V writes, each of which must have exactly one holder (copy-on-write).
        """
        a = self.allocator
        expected = [0] * a.num_pages
        for pages in holders:
            for p in self.live(pages):
                expected[p] += 1
        in_tree = [False] * a.num_pages
        for node in self.radix.nodes() if self.radix is not None else ():
            assert len({a.refs[p] for p in node.pages}) <= 1, (
                f"a radix node is only partly held: {node.pages}"
            )
            for p in node.pages:
                assert not in_tree[p], f"page {p} appears twice in the radix cache"
                in_tree[p] = True
                expected[p] += 1
        assert in_tree == a.cached, "radix membership flags disagree with the tree"
        bad = [p for p in range(a.num_pages) if expected[p] != a.refs[p]]
        assert not bad, (
            f"reference counts disagree on pages {bad[:8]}: counted {[expected[p] for p in bad[:8]]}"
        )
        free = a.free_pages()
        assert len(set(free)) == len(free), "a page is on the free list twice"
        assert set(free) == {p for p in range(a.num_pages) if a.refs[p] == 0}, (
            "free list != unreferenced pages"
        )
        evictable = sum(1 for p in range(a.num_pages) if a.cached[p] and a.refs[p] == 1)
        assert evictable == a.num_evictable, f"evictable count {a.num_evictable} != {evictable}"
        in_use = sum(1 for p in range(a.num_pages) if a.refs[p] > 0 and not (a.cached[p] and a.refs[p] == 1))
        assert len(free) + evictable + in_use == a.num_pages, "free + evictable + in use != total"
        usage = self.usage()
        assert usage.in_use == in_use
        shared = [p for p in writable if a.refs[p] != 1]
        assert not shared, f"pages {shared} receive K/V writes but are shared (copy-on-write broken)"
        return usage


class EngineConfigError(InferenceError, ValueError):
    """An Engine argument is out of range."""


def positive(name: str, value: int) -> int:
    if value < 1:
        raise EngineConfigError(f"Engine {name}={value}: must be >= 1; pass a positive value")
    return value


def build_pool(cfg, device, dtype, page_size, max_total_tokens, max_batch_size, prefix_cache, contiguous):
    """The KV pool an Engine of these arguments serves from, and its longest context."""
    try:  # a recurrent model has no K/V for the pool to page
        check_engine_support(cfg)
    except UnsupportedMixerError as err:
        raise EngineConfigError(str(err)) from None
    if max_total_tokens is None:
        max_total_tokens = default_total_tokens(cfg, device, dtype)
    max_context = min(cfg.max_position_embeddings, max_total_tokens)
    if contiguous:
        page_size, prefix_cache = max_context, False
    if long_rope_after(cfg) is not None:  # longrope: a page's keys suit only sequences on its side of the length
        prefix_cache = False
    page_size = positive("page_size", page_size)
    if max_total_tokens < page_size:
        raise EngineConfigError(
            f"Engine max_total_tokens={max_total_tokens} holds no page of {page_size} tokens; raise it"
        )
    window = release_window(cfg) if page_size < max_context else None  # contiguous: nothing to release
    pages = max_total_tokens // page_size + (window is not None)  # and the dead page
    storage = KVStorage.for_model(cfg, pages * page_size, dtype, device)
    table = ReqToTokenPool(max_batch_size, max_context, device)
    return KVPool(storage, table, page_size, prefix_cache, window), max_context
