"""KV memory: storage, request table, page allocator, radix cache and the pool's accounting."""

import pytest
import torch

from astrai_pl.inference.cache import KVStorage, PageAllocator, ReqToTokenPool
from astrai_pl.inference.pool import KVPool
from astrai_pl.inference.radix import RadixCache


def make_pool(num_pages=16, page_size=4, prefix_cache=True, rows=4) -> KVPool:
    storage = KVStorage(2, num_pages * page_size, 2, 8, torch.float32, torch.device("cpu"))
    return KVPool(storage, ReqToTokenPool(rows, 64, torch.device("cpu")), page_size, prefix_cache)


def test_storage_writes_and_reads_slots_of_every_layer():
    storage = KVStorage(3, 10, 2, 4, torch.float32, torch.device("cpu"))
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    storage.write(1, torch.tensor([7, 3]), k, v)
    rk, rv = storage.read(torch.tensor([3, 7]))
    assert torch.equal(rk[1], k.flip(0)) and torch.equal(rv[1], v.flip(0))
    assert not rk[0].any() and not rk[2].any()
    storage.copy(torch.tensor([3, 7]), torch.tensor([0, 1]))
    assert torch.equal(storage.k[1, :2], k.flip(0))
    assert storage.bytes_per_token == 2 * 3 * 2 * 4 * 4


def test_req_to_token_rows_and_batched_writes():
    table = ReqToTokenPool(2, 8, torch.device("cpu"))
    a, b = table.alloc(), table.alloc()
    assert {a, b} == {0, 1} and table.alloc() is None
    table.write([a, a, b], [0, 1, 5], [10, 11, 12])
    assert table.table[a, :2].tolist() == [10, 11] and table.table[b, 5] == 12
    table.free(a)
    assert table.num_free == 1
    with pytest.raises(AssertionError):
        table.free(a)


def test_allocator_counts_references_and_evictable_pages():
    alloc = PageAllocator(4, page_size=2)
    pages = alloc.allocate(3)
    assert alloc.num_free == 1 and alloc.allocate(2) is None
    alloc.mark_cached(pages[:2])  # the radix cache joins the holder
    assert alloc.num_evictable == 0 and alloc.num_in_use == 3
    alloc.decref(pages)  # the holder leaves: cached pages stay, evictable; the third is free
    assert (alloc.num_free, alloc.num_evictable, alloc.num_in_use) == (2, 2, 0)
    alloc.incref(pages[:1])  # a new holder locks one cached page
    assert alloc.num_evictable == 1
    alloc.decref(pages[:1])
    alloc.evict(pages[:2])
    assert alloc.num_free == 4 and alloc.num_evictable == 0
    with pytest.raises(AssertionError):
        alloc.decref(pages[:1])


def test_radix_insert_match_split_are_page_aligned():
    alloc = PageAllocator(16, page_size=2)
    radix = RadixCache(alloc)
    a = alloc.allocate(3)
    assert radix.insert([1, 2, 3, 4, 5, 6], a) == a
    assert radix.match([1, 2, 3, 4, 5, 6, 7]) == (a, 6)
    assert radix.match([1, 2, 3, 9]) == (a[:1], 2)  # diverges inside page 2: only page 1 is shared
    assert radix.match([1, 2, 3]) == (a[:1], 2)  # a partial page never matches
    assert radix.match([7, 7]) == ([], 0)
    b = alloc.allocate(3)
    cached = radix.insert([1, 2, 3, 4, 8, 8], b)  # shares two pages, branches at the third
    assert cached == a[:2] + b[2:]
    assert sorted(len(n.key) for n in radix.nodes()) == [2, 2, 2, 2]  # split at both divergences
    assert radix.match([1, 2, 3, 4, 8, 8]) == (a[:2] + b[2:], 6)
    assert radix.num_cached_tokens == 8
    with pytest.raises(AssertionError):
        radix.insert([1, 2, 3], alloc.allocate(2))


def test_radix_matches_only_under_the_exact_prefix():
    alloc = PageAllocator(8, page_size=2)
    radix = RadixCache(alloc)
    radix.insert([1, 2, 3, 4], alloc.allocate(2))
    assert radix.match([9, 9, 3, 4]) == ([], 0)  # the page [3, 4] exists, but under another prefix


def test_lru_eviction_never_touches_locked_nodes():
    pool = make_pool(num_pages=6, page_size=2)
    old, locked, new = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    for tokens in (old, locked, new):
        pool.release(pool.cache_prefix(tokens, pool.allocate(2), 4))
    assert pool.usage().evictable == 6
    held, matched = pool.match_prefix(locked)  # a request holds these pages: the node is locked
    assert matched == 4 and pool.usage().evictable == 4
    pool.release(pool.match_prefix(new)[0])  # using `new` leaves `old` least recently used
    got = pool.allocate(2)  # no free page: evicts the LRU leaf
    assert got is not None and pool.match_prefix(old) == ([], 0) and pool.evicted_pages == 2
    assert pool.allocate(4) is None  # `locked` cannot be evicted, so 4 pages are out of reach
    again, matched = pool.match_prefix(locked)
    assert matched == 4 and again == held
    pool.check([held, again, got])


def test_exact_cached_token_counts_after_warm_up():
    pool = make_pool(num_pages=32, page_size=4)
    prompt = list(range(10, 31))  # 21 tokens: 5 full pages
    pages = pool.allocate(6)
    pages = pool.cache_prefix(prompt, pages, 21)
    assert pool.radix.num_cached_tokens == 20
    pool.release(pages)
    got, matched = pool.match_prefix(prompt[:20])
    assert matched == 20 and len(got) == 5
    assert pool.match_prefix(prompt[:19])[1] == 16  # page-aligned
    assert pool.match_prefix(prompt[:3])[1] == 0


def test_cache_prefix_swaps_duplicates_for_cached_pages():
    pool = make_pool(num_pages=8, page_size=2)
    first = pool.cache_prefix([5, 6, 7, 8, 9], pool.allocate(3), 5)
    mine = pool.allocate(3)
    swapped = pool.cache_prefix([5, 6, 7, 8, 1], mine, 5)
    assert swapped[:2] == first[:2] and swapped[2] == mine[2]
    assert pool.usage().free == 8 - 3 - 1  # my two duplicate pages went back
    pool.check([first, swapped])


def test_fork_shares_full_pages_and_copies_the_partial_one():
    pool = make_pool(num_pages=8, page_size=4)
    pages = pool.allocate(2)
    pool.storage.k[:, pages[1] * 4 : pages[1] * 4 + 2] = 7.0
    child = pool.fork(pages, 6)
    assert child[0] == pages[0] and child[1] != pages[1]
    assert (pool.storage.k[:, child[1] * 4 : child[1] * 4 + 2] == 7.0).all()
    assert pool.allocator.refs[pages[0]] == 2 and pool.allocator.refs[child[1]] == 1
    pool.check([pages, child], writable=[pages[1], child[1]])
    with pytest.raises(AssertionError, match="copy-on-write"):
        pool.check([pages, child], writable=[pages[0]])


def test_check_catches_a_leaked_page():
    pool = make_pool()
    pages = pool.allocate(2)
    pool.check([pages])
    with pytest.raises(AssertionError, match="reference counts"):
        pool.check([])


def test_contiguous_layout_maps_positions_linearly():
    pool = make_pool(num_pages=2, page_size=32, prefix_cache=False)
    [page] = pool.allocate(1)
    assert pool.slots([page], 0, 5) == [page * 32 + i for i in range(5)]
    assert pool.match_prefix([1, 2, 3]) == ([], 0)


def test_a_prefix_is_found_only_under_the_salt_it_was_cached_with():
    pool = make_pool(num_pages=8, page_size=2)
    prompt = [5, 6, 7, 8, 9]
    pool.release(pool.cache_prefix(prompt, pool.allocate(3), 4, salt="alice"))
    assert pool.match_prefix(prompt)[1] == 0  # no salt is a salt of its own
    assert pool.match_prefix(prompt, "bob")[1] == 0
    mine, matched = pool.match_prefix(prompt, "alice")
    assert matched == 4
    pool.release(mine)
    pool.release(pool.cache_prefix(prompt, pool.allocate(3), 4, salt="bob"))  # the same tokens, its own pages
    theirs, matched = pool.match_prefix(prompt, "bob")
    assert matched == 4 and set(theirs).isdisjoint(mine)
    pool.release(theirs)
    pool.check([])
    assert pool.allocate(8) is not None  # every salt's pages are evictable, and their emptied trees forgotten
    assert list(pool.radix.roots) == [None]
