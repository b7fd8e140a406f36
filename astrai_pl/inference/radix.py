"""RadixCache: exact, page-aligned prefix sharing over token ids.

The tree is walked from the root along edges labelled by whole pages of token ids, so a cached page is
found only under the exact prefix that produced it (its K/V depend on every earlier token). A node holds
a run of pages; nodes are split where two sequences diverge, always on a page boundary. Only complete
pages whose K/V exist are ever inserted.

The cache owns one reference on each of its pages. A leaf whose pages nobody else holds is evictable;
`evict` frees such leaves least-recently-used first, then the parents they leave childless, and so on.
A node whose pages are held elsewhere (by a request, a session or a fork: "locked") is never evicted.

Each cache salt (`SamplingParams.cache_salt`) has a tree of its own: a prefix computed under one salt is never
found under another, so cache hits tell a client nothing about prompts sent with another salt. The tree of
no salt (None) is `root`; a salt's tree is forgotten when eviction leaves it empty.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from .cache import PageAllocator


class RadixNode:
    __slots__ = ("key", "pages", "children", "parent", "last_access")

    def __init__(self, key: list[int], pages: list[int], parent: RadixNode | None, last_access: int = 0):
        self.key = key  # token ids, len(key) == len(pages) * page_size
        self.pages = pages
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.last_access = last_access


class RadixCache:
    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.root = RadixNode([], [], None)
        self.roots: dict[str | None, RadixNode] = {None: self.root}  # one tree per cache salt
        self._clock = 0

    # -- lookup ---------------------------------------------------------------------------------------------
    def match(self, tokens: list[int], salt: str | None = None) -> tuple[list[int], int]:
        """Pages of the longest page-aligned prefix of `tokens` cached under `salt`, and its length in tokens.

        The path is marked as used now; no reference is taken (the caller increfs what it keeps).
        """
        node, matched, pages = self.roots.get(salt), 0, []
        if node is None:
            return pages, matched
        while True:
            child, shared = self._step(node, tokens, matched)
            if child is None:
                return pages, matched
            if shared < len(child.key):
                child = self._split(child, shared)
            self._touch(child)
            pages.extend(child.pages)
            matched += shared
            node = child

    def insert(self, tokens: list[int], pages: list[int], salt: str | None = None) -> list[int]:
        """Cache `pages` as the K/V of `tokens` (whole pages) under `salt`; returns the cache's pages for that
        prefix.

        Where the prefix is already cached the returned page differs from the one given: the caller
        holds a duplicate and should switch to the cached page. New pages gain the cache's reference.
        """
        ps = self.page_size
        assert len(tokens) == len(pages) * ps, "only whole pages are cached"
        node = self.roots.get(salt)
        if node is None:
            node = self.roots[salt] = RadixNode([], [], None)
        done, out = 0, []
        while done < len(tokens):
            child, shared = self._step(node, tokens, done)
            if child is None:
                leaf = RadixNode(tokens[done:], pages[done // ps :], node)
                node.children[tuple(leaf.key[:ps])] = leaf
                self.allocator.mark_cached(leaf.pages)
                self._touch(leaf)
                return out + leaf.pages
            if shared < len(child.key):
                child = self._split(child, shared)
            self._touch(child)
            out.extend(child.pages)
            done += shared
            node = child
        return out

    def _step(self, node: RadixNode, tokens: list[int], start: int) -> tuple[RadixNode | None, int]:
        """The child of `node` continuing tokens[start:], and how many tokens (whole pages) they share."""
        ps = self.page_size
        if start + ps > len(tokens):
            return None, 0
        child = node.children.get(tuple(tokens[start : start + ps]))
        if child is None:
            return None, 0
        shared, limit = ps, min(len(child.key), len(tokens) - start)
        while (
            shared + ps <= limit
            and child.key[shared : shared + ps] == tokens[start + shared : start + shared + ps]
        ):
            shared += ps
        return child, shared

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut `node` after `at` tokens (a page boundary); returns the new upper half."""
        ps = self.page_size
        upper = RadixNode(node.key[:at], node.pages[: at // ps], node.parent, node.last_access)
        node.parent.children[tuple(upper.key[:ps])] = upper
        node.key, node.pages, node.parent = node.key[at:], node.pages[at // ps :], upper
        upper.children[tuple(node.key[:ps])] = node
        return upper

    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        node.last_access = self._clock

    # -- eviction -------------------------------------------------------------------------------------------
    def _evictable(self, node: RadixNode) -> bool:
        refs = self.allocator.refs
        return node.parent is not None and not node.children and all(refs[p] == 1 for p in node.pages)

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages if that many are evictable, least recently used leaves first."""
        heap = [(n.last_access, id(n), n) for n in self.nodes() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.evict(leaf.pages)
            freed += len(leaf.pages)
            parent = leaf.parent
            del parent.children[tuple(leaf.key[: self.page_size])]
            if self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        if len(self.roots) > 1:  # a salt's emptied tree is forgotten: salts cost nothing once evicted
            self.roots = {s: r for s, r in self.roots.items() if s is None or r.children}
        return freed

    # -- inspection -----------------------------------------------------------------------------------------
    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @property
    def num_cached_tokens(self) -> int:
        return sum(len(n.key) for n in self.nodes())

    def reset(self) -> int:
        """Evict everything evictable; returns the number of pages freed."""
        return self.evict(self.allocator.num_pages)
