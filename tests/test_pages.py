"""Page allocator and req_to_token rows: pure bookkeeping, checked directly."""
import pytest
import torch
from glmc.runtime.engine.pages import (
    PAGE_SIZE,
    PageAllocator,
    ReqToTokenPool,
    num_pages_for,
    slots_for,
)


def test_page_math():
    assert PAGE_SIZE == 64
    assert [num_pages_for(n) for n in (0, 1, 64, 65, 128)] == [0, 1, 1, 2, 2]
    # positions 62..66 straddle pages 7 and 3: slot = page * 64 + offset
    assert slots_for([7, 3], 62, 66) == [7 * 64 + 62, 7 * 64 + 63, 3 * 64, 3 * 64 + 1]


def test_alloc_is_all_or_nothing_and_refcounted():
    a = PageAllocator(4)
    assert a.alloc(5) is None and a.num_free == 4
    pages = a.alloc(3)
    assert pages == [0, 1, 2] and a.num_free == 1 and a.num_used == 3
    a.incref(pages[:1])  # a second holder (the prefix cache, another request)
    a.decref(pages)
    assert a.num_free == 3 and a.refcount(0) == 1
    a.decref([0])
    assert a.num_free == 4
    with pytest.raises(ValueError, match="decref of free page 0"):
        a.decref([0])
    with pytest.raises(ValueError, match="incref of free page 1"):
        a.incref([1])


def test_freed_pages_are_reused():
    a = PageAllocator(2)
    p = a.alloc(2)
    a.decref(p[1:])
    assert a.alloc(1) == [1] and a.alloc(1) is None


def test_req_to_token_rows():
    pool = ReqToTokenPool(max_reqs=2, max_context=128)
    r0, r1 = pool.alloc(), pool.alloc()
    assert {r0, r1} == {0, 1} and pool.alloc() is None
    pool.write(r1, 60, slots_for([5, 2], 60, 70))
    assert pool.table.dtype == torch.int64
    assert pool.table[r1, 60:70].tolist() == slots_for([5, 2], 60, 70)
    with pytest.raises(ValueError, match="exceeds max_context 128"):
        pool.write(r1, 120, list(range(10)))
    pool.free(r0)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(r0)
    assert pool.alloc() == r0
