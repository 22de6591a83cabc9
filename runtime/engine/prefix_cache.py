"""Prefix cache: reuse the KV pages of token prefixes that earlier requests already computed.

Matching is page-aligned: only whole pages (64 tokens) are shared, because a partly filled page
would be written by two owners. Pages carry both the MLA latent KV and the DSA indexer keys, so a
hit skips both. Holders are counted in the `PageAllocator`: the cache holds one reference on every
page it stores, and a page can be evicted only when the cache is its last holder.
"""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod

from glmc.runtime.engine.pages import PageAllocator


class PrefixCache(ABC):
    """A store of page-aligned token prefixes and the pages holding their KV.

    Contract:
    - `match(tokens)` returns `pages` for the longest cached prefix of whole pages; the caller
      receives one new reference on each page (it must `decref` them when done).
      `len(pages) * page_size <= len(tokens)`.
    - `insert(tokens, pages)` stores `tokens` (a multiple of page_size long, one page per
      page_size tokens); the cache takes its own reference on pages it newly stores and ignores
      the part already cached. The caller keeps its references.
    - `evict(num_pages)` frees up to `num_pages` pages that no request holds, least recently used
      first, and returns how many it freed.
    - `reset()` drops every page the cache holds (pages requests still hold stay allocated).
    """

    @abstractmethod
    def match(self, tokens: list[int]) -> list[int]: ...

    @abstractmethod
    def insert(self, tokens: list[int], pages: list[int]) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> int: ...

    @abstractmethod
    def reset(self) -> None: ...

    @property
    @abstractmethod
    def num_cached_pages(self) -> int: ...

    @abstractmethod
    def num_evictable_pages(self) -> int: ...


class NoPrefixCache(PrefixCache):
    """Caches nothing: every request computes its whole prompt."""

    def match(self, tokens):
        return []

    def insert(self, tokens, pages):
        pass

    def evict(self, num_pages):
        return 0

    def reset(self):
        pass

    @property
    def num_cached_pages(self):
        return 0

    def num_evictable_pages(self):
        return 0


class _Node:
    """An edge of the radix tree: `key` tokens (whole pages) stored on `pages`."""

    __slots__ = ("key", "pages", "children", "parent", "last_access")

    def __init__(self, key: tuple, pages: list[int], parent: _Node | None):
        self.key, self.pages, self.parent = key, pages, parent
        self.children: dict[tuple, _Node] = {}
        self.last_access = 0


class RadixCache(PrefixCache):
    """Radix tree over pages; children are keyed by their first page of tokens."""

    def __init__(self, allocator: PageAllocator):
        self.allocator, self.page_size = allocator, allocator.page_size
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        if getattr(self, "root", None) is not None:
            for node in self._nodes():
                self.allocator.decref(node.pages)
        self.root = _Node((), [], None)
        self._num_pages = 0

    @property
    def num_cached_pages(self) -> int:
        return self._num_pages

    def match(self, tokens: list[int]) -> list[int]:
        node, pages, pos = self.root, [], 0
        while (child := node.children.get(self._page_key(tokens, pos))) is not None:
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = next(self._clock)
            pages += child.pages
            pos += len(child.key)
            node = child
        self.allocator.incref(pages)
        return pages

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(f"insert: {len(tokens)} tokens for {len(pages)} pages "
                             f"of {self.page_size}")
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                new = pages[pos // self.page_size:]
                self.allocator.incref(new)
                child = _Node(tuple(tokens[pos:]), new, node)
                node.children[child.key[:self.page_size]] = child
                self._num_pages += len(new)
                child.last_access = next(self._clock)
                return
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = next(self._clock)
            pos += len(child.key)
            node = child

    def evict(self, num_pages: int) -> int:
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            self.allocator.decref(node.pages)
            freed += len(node.pages)
            self._num_pages -= len(node.pages)
            parent = node.parent
            del parent.children[node.key[:self.page_size]]
            if parent is not self.root and self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def num_evictable_pages(self) -> int:
        # A node whose pages only the cache holds is evictable once its subtree is gone, so count
        # every such node whose whole subtree is unheld too.
        def walk(node: _Node) -> tuple[int, bool]:
            total, free_below = 0, True
            for child in node.children.values():
                n, ok = walk(child)
                total, free_below = total + n, free_below and ok
            ok = free_below and self._unheld(node)
            return total + (len(node.pages) if ok else 0), ok
        return sum(walk(c)[0] for c in self.root.children.values())

    # -- helpers ---------------------------------------------------------------------------------

    def _page_key(self, tokens: list[int], pos: int) -> tuple:
        key = tuple(tokens[pos:pos + self.page_size])
        return key if len(key) == self.page_size else ()  # a partial page never matches

    def _common_pages(self, key: tuple, tokens: list[int], pos: int) -> int:
        """Whole pages shared by `key` and `tokens[pos:]` (the first page is known to match)."""
        ps, n = self.page_size, 1
        while (n < len(key) // ps
               and key[n * ps:(n + 1) * ps] == tuple(tokens[pos + n * ps:pos + (n + 1) * ps])):
            n += 1
        return n

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut `node` after `num_pages` pages; returns the new upper half (keeps node's slot)."""
        cut = num_pages * self.page_size
        upper = _Node(node.key[:cut], node.pages[:num_pages], node.parent)
        upper.last_access = node.last_access
        node.parent.children[upper.key[:self.page_size]] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], upper
        upper.children[node.key[:self.page_size]] = node
        return upper

    def _unheld(self, node: _Node) -> bool:
        return all(self.allocator.refcount(p) == 1 for p in node.pages)

    def _evictable(self, node: _Node) -> bool:
        return not node.children and self._unheld(node)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node
