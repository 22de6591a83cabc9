"""KV page bookkeeping: which pages are free, who holds them, and each request's token -> slot row.

The device-side KV pool (`runtime/worker/kv_cache.py`) owns the memory; this module only hands out page
numbers. A KV slot is `page * page_size + offset`. The main MLA cache and the DSA indexer cache are
paged in lockstep (the same page number addresses both), so nothing here knows about the indexer.

Pages are reference-counted because the prefix cache and any number of requests may hold the same
page: a page returns to the free list when its last holder lets go. Everything is pure Python except
`ReqToTokenPool.table`, the int64 tensor the attention kernels read.
"""
from __future__ import annotations

import torch

PAGE_SIZE = 64  # must match runtime/worker/kv_cache.py: PAGE_SIZE (FlashMLA's page size)


def num_pages_for(num_tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def slots_for(pages: list[int], start: int, end: int, page_size: int = PAGE_SIZE) -> list[int]:
    """KV slots of positions [start, end) of a sequence laid out on `pages`."""
    return [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]


class PageAllocator:
    """Reference-counted allocator over pages 0..num_pages-1.

    Contract: `alloc(n)` is all-or-nothing and returns pages with refcount 1 (or None if fewer than n
    are free); `incref` adds a holder to pages already allocated; `decref` drops one holder and frees
    pages that reach zero. Freeing an unallocated page is a bug and raises.
    """

    def __init__(self, num_pages: int, page_size: int = PAGE_SIZE):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        # Pop from the end: low page numbers are handed out first, which keeps tests readable.
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"incref of free page {p}")
            self._refs[p] += 1

    def decref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"decref of free page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)


class ReqToTokenPool:
    """Rows of the `req_to_token` table: row r, position i -> KV slot of request r's token i.

    Contract: `alloc()` returns a free row or None; `write(row, start, slots)` fills positions
    [start, start + len(slots)); `free(row)` returns it. Rows are not cleared on free: the attention
    kernels only read positions < seq_len, which the next owner writes first.
    """

    def __init__(self, max_reqs: int, max_context: int):
        self.max_reqs, self.max_context = max_reqs, max_context
        self.table = torch.zeros(max_reqs, max_context, dtype=torch.int64)
        self._table = self.table.numpy()   # shares the memory
        self._free = list(range(max_reqs - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        if row in self._free:
            raise ValueError(f"req_to_token row {row} freed twice")
        self._free.append(row)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        end = start + len(slots)
        if end > self.max_context:
            raise ValueError(f"position {end} exceeds max_context {self.max_context}")
        self._table[row, start:end] = slots   # the numpy view: no tensor made per write
