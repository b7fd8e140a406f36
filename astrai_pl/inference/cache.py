"""KV memory: token-level K/V storage, the request→token table and a reference-counted page allocator.

Three layers, each ignorant of the ones above it:

- `KVStorage` holds K and V for every layer in flat token slots: [n_layers, n_slots, n_kv_heads, head_dim].
- `ReqToTokenPool` maps (request row, position) → slot; every layer reads the same table.
- `PageAllocator` hands out pages of `page_size` consecutive slots and counts who holds each page.

A page is held by whoever keeps its index: a running request, a session, a fork, or the radix cache
(`radix.py`). Each holder owns one reference; a page returns to the free list when the last one is
dropped. A page whose only holder is the radix cache is *evictable*: it keeps a cached prefix but can be
reclaimed under memory pressure.
"""

from __future__ import annotations

import torch


class InferenceError(RuntimeError):
    """Base class of the errors the inference engine raises at its public boundary."""


class CapacityError(InferenceError):
    """A request or a session cannot fit in the KV pool or the request table, even when empty."""


class KVStorage:
    """K and V for every layer in flat token slots, zero-initialised so masked-out reads stay finite."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, cfg, num_slots: int, dtype: torch.dtype, device: torch.device) -> KVStorage:
        """Storage shaped for a ModelConfig: its layers, key/value heads and head width."""
        return cls(cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, cfg.head_size, dtype, device)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def bytes_per_token(self) -> int:
        per_layer = self.k.shape[2] * self.k.shape[3] * self.k.element_size()
        return 2 * self.k.shape[0] * per_layer

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (N, n_kv_heads, head_dim) at `slots` (N,) of one layer."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` (N,) for all layers: two (n_layers, N, n_kv_heads, head_dim) tensors."""
        return self.k[:, slots], self.v[:, slots]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots `src` into slots `dst`, every layer (copy-on-write of a partial page)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


class ReqToTokenPool:
    """The [row, position] → slot table of running requests, one row per request."""

    def __init__(self, num_rows: int, max_context: int, device: torch.device):
        self.table = torch.zeros(num_rows, max_context, dtype=torch.int32, device=device)
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return self.table.shape[0]

    @property
    def max_context(self) -> int:
        return self.table.shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        assert row not in self._free, f"request row {row} freed twice"
        self._free.append(row)

    def write(self, rows: list[int], positions: list[int], slots: list[int]) -> None:
        """Set table[rows[i], positions[i]] = slots[i] for all i, in one indexed store."""
        if not rows:
            return
        device = self.table.device
        index = (torch.tensor(rows, device=device), torch.tensor(positions, device=device))
        self.table.index_put_(index, torch.tensor(slots, dtype=torch.int32, device=device))


class PageAllocator:
    """Pages of `page_size` consecutive slots with reference counts and an evictable-page count.

    Page p covers slots [p·page_size, (p+1)·page_size). `cached[p]` marks pages that belong to the radix
    cache; such a page with exactly one reference (the cache's own) is evictable.
    """

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.refs = [0] * num_pages
        self.cached = [False] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low page indices go out first
        self.num_evictable = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - self.num_free - self.num_evictable

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages holding one reference each, or None when fewer than n are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        refs, cached = self.refs, self.cached
        for p in pages:
            assert refs[p] > 0, f"page {p} is free and cannot gain a holder"
            if cached[p] and refs[p] == 1:
                self.num_evictable -= 1
            refs[p] += 1

    def decref(self, pages: list[int]) -> None:
        refs, cached = self.refs, self.cached
        for p in pages:
            assert refs[p] > 0, f"page {p} released more often than held"
            refs[p] -= 1
            if refs[p] == 0:
                assert not cached[p], f"cached page {p} lost its last holder without being evicted"
                self._free.append(p)
            elif cached[p] and refs[p] == 1:
                self.num_evictable += 1

    def mark_cached(self, pages: list[int]) -> None:
        """The radix cache takes a reference on `pages`, which the caller already holds."""
        for p in pages:
            assert not self.cached[p], f"page {p} is already in the radix cache"
            self.cached[p] = True
            self.refs[p] += 1  # the caller's reference keeps it out of the evictable count

    def evict(self, pages: list[int]) -> None:
        """The radix cache drops pages only it holds; they return to the free list."""
        for p in pages:
            assert self.cached[p] and self.refs[p] == 1, f"page {p} is not evictable"
            self.cached[p] = False
            self.refs[p] = 0
            self.num_evictable -= 1
            self._free.append(p)

    def free_pages(self) -> list[int]:
        return list(self._free)
