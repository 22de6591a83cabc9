"""Radix prefix cache over reference-counted pages (page size 4 here, to keep keys short)."""
import random

import pytest
from glmc.runtime.engine.pages import PageAllocator
from glmc.runtime.engine.prefix_cache import NoPrefixCache, RadixCache

PS = 4


def setup(num_pages=16):
    a = PageAllocator(num_pages, page_size=PS)
    return a, RadixCache(a)


def held(a, cache, tokens):
    """A request that computed `tokens` (whole pages), cached them and went away."""
    pages = a.alloc(len(tokens) // PS)
    cache.insert(tokens, pages)
    a.decref(pages)
    return pages


def test_match_is_page_aligned_and_takes_a_reference():
    a, cache = setup()
    pages = held(a, cache, list(range(8)))
    assert cache.num_cached_pages == 2 and a.num_used == 2
    assert cache.match([0, 1, 2]) == []  # less than a page never matches
    got = cache.match([0, 1, 2, 3, 4, 5, 9, 9])
    assert got == pages[:1] and a.refcount(pages[0]) == 2
    a.decref(got)
    assert cache.match(list(range(11))) == pages
    a.decref(pages)


def test_divergent_suffixes_split_a_node():
    a, cache = setup()
    p1 = held(a, cache, [1] * 4 + [2] * 4 + [3] * 4)
    p2 = held(a, cache, [1] * 4 + [2] * 4 + [4] * 4)
    # the shared two pages are stored once (p2's copies were freed), the tails separately
    assert cache.num_cached_pages == 4 and a.num_used == 4
    got = cache.match([1] * 4 + [2] * 4 + [4] * 4)
    assert got == p1[:2] + p2[2:]
    a.decref(got)


def test_insert_of_cached_prefix_takes_no_new_reference():
    a, cache = setup()
    held(a, cache, list(range(4)))
    dup = a.alloc(1)
    cache.insert(list(range(4)), dup)
    assert a.refcount(dup[0]) == 1  # the caller's reference only
    with pytest.raises(ValueError, match="5 tokens for 1 pages of 4"):
        cache.insert(list(range(5)), dup)


def test_evict_lru_and_never_pages_a_request_holds():
    a, cache = setup()
    old = held(a, cache, [1] * 8)
    new = held(a, cache, [2] * 8)
    in_use = cache.match([3] * 4 + [0])  # miss
    assert in_use == []
    in_use = cache.match([2] * 8 + [0])  # a running request holds `new`
    assert cache.num_evictable_pages() == 2
    assert cache.evict(10) == 2 and a.num_free == 16 - 2
    assert cache.match([1] * 8 + [0]) == []  # the older prefix went
    a.decref(in_use)
    assert cache.evict(1) == 2  # whole nodes go; both pages of [2]*8 are one node
    assert a.num_free == 16 and cache.num_cached_pages == 0
    del old, new


def test_evict_frees_leaves_before_their_parents():
    a, cache = setup()
    held(a, cache, [1] * 4 + [2] * 4)
    held(a, cache, [1] * 4 + [3] * 4)
    assert cache.evict(1) == 1 and cache.num_cached_pages == 2
    got = cache.match([1] * 4 + [3] * 4 + [0])
    assert len(got) == 2  # the least recently used branch ([2]) went first
    a.decref(got)


def test_reset_returns_every_page():
    a, cache = setup()
    held(a, cache, list(range(12)))
    kept = cache.match(list(range(12)) + [0])
    cache.reset()
    assert cache.num_cached_pages == 0 and a.num_used == 3  # the request's references remain
    a.decref(kept)
    assert a.num_free == 16


def test_no_prefix_cache():
    a = PageAllocator(4, page_size=PS)
    c = NoPrefixCache()
    c.insert(list(range(4)), a.alloc(1))
    assert c.match(list(range(8))) == [] and c.evict(4) == 0 and c.num_cached_pages == 0


def test_random_workload_keeps_refcounts_consistent():
    rng = random.Random(0)
    a, cache = setup(num_pages=64)
    live = []
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 6) * PS)]
        pages = cache.match(tokens + [9])
        want = len(tokens) // PS - len(pages)
        if want > a.num_free:
            cache.evict(want - a.num_free)
        new = a.alloc(want)
        if new is None:
            a.decref(pages)
            continue
        pages += new
        cache.insert(tokens, pages)
        live.append(pages)
        if len(live) > 4 or rng.random() < 0.5:
            a.decref(live.pop(rng.randrange(len(live))))
        in_cache = {p for n in cache._nodes() for p in n.pages}
        assert len(in_cache) == cache.num_cached_pages
        assert a.num_used == len(in_cache | {p for ps in live for p in ps})
    for pages in live:
        a.decref(pages)
    cache.reset()
    assert a.num_free == 64
