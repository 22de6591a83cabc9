"""Continuous-batching scheduler: which requests compute how many tokens in the next step.

Each step gets a token budget (`max_batch_tokens`, also the chunked-prefill size). Running requests
go first, oldest first: a decode costs one token, an unfinished prefill takes what budget is left
(a chunk). While any request is decoding, the step's prefill tokens are capped at
`mixed_prefill_tokens` (default: a quarter of the budget): a step that carries decodes stays short,
so a long prompt arriving never stalls the running streams for a whole full-size chunk, and a
prompt alone still prefills at full chunk size. Then waiting requests are admitted FIFO while
budget, request rows and KV pages allow: admission needs pages for the whole remaining prompt plus
one page of headroom per running request, counting pages the prefix cache could evict. Pages are
allocated per step as sequences grow; when the pool runs dry, the newest running request is
retracted (its computed pages go to the prefix cache, the rest is freed) and later resumes by
prefilling prompt and outputs so far.

Speculative decoding: a decoding request with `draft_ids` asks for its pending token plus the
drafts (verified in one step). The engine `reserve`s the drafts' pages when it drafts (never
retracting anyone: no pages, no draft), and after verification `rollback`s to the accepted length:
rejected positions' pages wholly past the sequence are freed, slots inside its last page are
overwritten by the next step, and only pages full of accepted tokens ever reach the prefix cache.

Pure Python; the engine turns a `ScheduledBatch` into a `ForwardBatch`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from glmc.runtime.engine.pages import (
    PageAllocator,
    ReqToTokenPool,
    num_pages_for,
    slots_for,
)
from glmc.runtime.engine.prefix_cache import PrefixCache
from glmc.runtime.engine.request import Request, Status

from glmc.run_config import RunConfig


@dataclass
class ScheduledBatch:
    """One step's work: request i computes positions [prefix_lens[i], prefix_lens[i] +
    extend_lens[i]), whose KV slots are already written into its req_to_token row."""

    reqs: list[Request] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)

    @property
    def mode(self) -> str:
        """`decode` when every request feeds back its last sampled token, else `extend` (which
        also covers mixed prefill + decode batches)."""
        decode = all(n == 1 and r.num_generated for r, n in zip(self.reqs, self.extend_lens))
        return "decode" if decode else "extend"

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def add(self, req: Request, n: int) -> None:
        self.reqs.append(req)
        self.prefix_lens.append(req.num_computed)
        self.extend_lens.append(n)


class Scheduler:
    """Waiting queue + running set over a page allocator, a req_to_token pool and a prefix cache."""

    def __init__(self, allocator: PageAllocator, req_pool: ReqToTokenPool, cache: PrefixCache, *,
                 max_running: int = RunConfig.max_running,
                 max_batch_tokens: int = RunConfig.max_batch_tokens,
                 mixed_prefill_tokens: int | None = None):
        if max_batch_tokens < 1 or max_running < 1:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) and max_running "
                             f"({max_running}) must be >= 1")
        self.allocator, self.req_pool, self.cache = allocator, req_pool, cache
        self.page_size = allocator.page_size
        self.max_running = min(max_running, req_pool.max_reqs)
        self.max_batch_tokens = max_batch_tokens
        self.mixed_prefill_tokens = max(1, mixed_prefill_tokens or max_batch_tokens // 4)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # -- queue -----------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark `req` done, cache its computed pages and free everything it holds."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._release(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status, req.finish_reason = Status.FINISHED, reason

    @property
    def num_pages_held(self) -> int:
        """Pages some request holds (a page shared with the cache counts here, not as cached)."""
        return len({p for r in self.running for p in r.pages})

    # -- one step --------------------------------------------------------------------------------

    def schedule(self, busy: frozenset[Request] = frozenset()) -> ScheduledBatch | None:
        """The next batch: every running request's next tokens (decodes with their drafts, then
        prompts' chunks within the mixed-prefill budget), then admissions from the queue. `busy`:
        running requests with work queued already (a speculative cycle chained on the device):
        left out, counted as decoding for the prefill budget, never retracted."""
        batch, budget = ScheduledBatch(), self.max_batch_tokens
        decoding = sum(r.is_decoding or r in busy for r in self.running)
        prefill = min(budget, self.mixed_prefill_tokens) if decoding else budget  # prefill tokens left
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req in busy:
                i += 1
                continue
            want = (min(1 + len(req.draft_ids), budget) if req.is_decoding else    # drafts ride along
                    min(req.num_pending, prefill, budget - decoding))
            n = self._grow(req, max(want, 0), batch, busy) if want > 0 else 0
            if n:
                batch.add(req, n)
                budget -= n
                decoding -= req.is_decoding
                prefill -= 0 if req.is_decoding else n
            i += 1 if n or want <= 0 else 0
        while (not batch.retracted and prefill > 0 and budget > 0 and self.waiting
               and len(self.running) < self.max_running):
            req = self.waiting[0]
            n = self._admit(req, min(budget, prefill))
            if not n:
                break
            self.waiting.popleft()
            self.running.append(req)
            batch.admitted.append(req)
            batch.add(req, n)
            budget -= n
            prefill -= n
        return batch if batch.reqs or batch.retracted else None

    def commit(self, batch: ScheduledBatch) -> None:
        """Record that the batch's KV is written; newly completed pages become cacheable."""
        for req, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            req.num_computed = start + n
            if req.num_computed // self.page_size > start // self.page_size:
                self._cache_pages(req)

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Hold pages for positions < `num_tokens` of running `req` (its draft tokens) if the pool
        (free or evictable pages) has them; never retracts. False: nothing changed."""
        need = num_pages_for(num_tokens, self.page_size) - len(req.pages)
        # the cache's evictable pages are counted (a walk of its tree) only when the free ones fall short
        if need > self.allocator.num_free and need > self.allocator.num_free + self.cache.num_evictable_pages():
            return False
        return self._ensure_pages(req, num_tokens)

    def rollback(self, req: Request, num_computed: int, hold: int = 0) -> None:
        """After verification: only the first `num_computed` positions of `req` hold accepted KV.
        Pages past the one its next token goes to are freed (they were never cached: only pages
        full of computed, known tokens are), except those of positions < `hold` (a cycle queued
        since writes there)."""
        req.num_computed = num_computed
        keep = num_pages_for(max(num_computed + 1, hold), self.page_size)
        if len(req.pages) > keep:
            self.allocator.decref(req.pages[keep:])
            req.pages = req.pages[:keep]

    def offer_pages(self, req: Request) -> None:
        """Offer `req`'s pages that are now full of computed, known tokens to the prefix cache
        (after a rollback and the accepted tokens' append: `commit` saw the drafts as unknown)."""
        self._cache_pages(req)

    # -- internals -------------------------------------------------------------------------------

    def _grow(self, req: Request, n: int, batch: ScheduledBatch, busy: frozenset[Request] = frozenset()) -> int:
        """Get pages for `n` more tokens of running `req`; shrink a prefill chunk or retract newer
        requests (not `busy` ones) when the pool is dry. Returns tokens granted (0 if `req` itself
        was retracted, or none but busy ones could make room)."""
        while not self._ensure_pages(req, req.num_computed + n):
            room = (len(req.pages) + self.allocator.num_free + self.cache.num_evictable_pages()
                    ) * self.page_size - req.num_computed
            if 0 < room < n:
                n = room  # a smaller prefill chunk fits: no need to retract anyone
                continue
            victim = next((r for r in reversed(self.running) if r not in busy), None)
            if victim is None:
                return 0
            self._retract(victim, batch)
            if victim is req:
                return 0
        return n

    def _admit(self, req: Request, budget: int) -> int:
        row = self.req_pool.alloc()
        if row is None:
            return 0
        # Leave at least one token to compute: its logits give the next token.
        pages = self.cache.match(req.all_ids[:req.num_tokens - 1])
        need = num_pages_for(req.num_tokens, self.page_size) - len(pages)
        available = self.allocator.num_free + self.cache.num_evictable_pages()
        if need + len(self.running) > available:
            self.allocator.decref(pages)
            self.req_pool.free(row)
            return 0
        req.row, req.pages, req.status = row, pages, Status.RUNNING
        req.num_computed = req.num_cached_tokens = len(pages) * self.page_size
        if req.num_computed:
            self.req_pool.write(row, 0, slots_for(pages, 0, req.num_computed, self.page_size))
        n = min(req.num_pending, budget)
        ok = self._ensure_pages(req, req.num_computed + n)
        assert ok, "admission checked free + evictable pages"
        return n

    def _ensure_pages(self, req: Request, num_tokens: int) -> bool:
        """Hold pages for `num_tokens` tokens of `req` and write their req_to_token slots."""
        need = num_pages_for(num_tokens, self.page_size) - len(req.pages)
        if need > 0:
            if need > self.allocator.num_free:
                self.cache.evict(need - self.allocator.num_free)
            new = self.allocator.alloc(need)
            if new is None:
                return False
            req.pages += new
        start = req.num_computed
        self.req_pool.write(req.row, start, slots_for(req.pages, start, num_tokens, self.page_size))
        return True

    def _retract(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_retractions += 1
        self.waiting.appendleft(req)  # newest retracted first, so older ones end up in front
        batch.retracted.append(req)

    def _cache_pages(self, req: Request, again: bool = False) -> None:
        """Offer the request's full computed pages to the prefix cache, as far as their token ids
        are known (a token still in flight has KV but no id yet: its page waits for the release).
        Only when a page has filled since the last offer (a decode offers every step), unless
        `again` (the release: the cache may have dropped its own copy of a prefix since)."""
        full = min(req.num_computed, req.num_tokens - req.num_inflight) // self.page_size
        if full and (again or full > req.num_offered_pages):
            self.cache.insert(req.ids(0, full * self.page_size), req.pages[:full])
            req.num_offered_pages = full

    def _release(self, req: Request) -> None:
        req.draft_ids = []   # drafts live in the MTP layer's KV on these pages
        self._cache_pages(req, again=True)
        req.num_offered_pages = 0
        self.allocator.decref(req.pages)
        self.req_pool.free(req.row)
        req.pages, req.row, req.num_computed = [], None, 0


class DataParallelScheduler:
    """One `Scheduler` per attention-DP rank (each over its own pages, req_to_token rows and prefix
    cache) behind the queue interface of one: `add` routes a request to the rank with the fewest
    requests, among those the one whose prefix cache holds most of its prompt, then the lowest,
    and records it in `req.dp_rank`; `schedule` returns every rank's batch (None for a rank with
    nothing to do). With one rank it is a plain `Scheduler`."""

    def __init__(self, ranks: list[Scheduler]):
        self.ranks = ranks

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.ranks for r in s.waiting]

    @property
    def running(self) -> list[Request]:
        return [r for s in self.ranks for r in s.running]

    @property
    def num_pages_held(self) -> int:
        return sum(s.num_pages_held for s in self.ranks)

    def add(self, req: Request) -> None:
        if len(self.ranks) > 1:
            req.dp_rank = min(range(len(self.ranks)), key=lambda i: (
                len(self.ranks[i].running) + len(self.ranks[i].waiting), -self._hit(i, req), i))
        self.ranks[req.dp_rank].add(req)

    def _hit(self, rank: int, req: Request) -> int:
        """Prompt pages rank `rank`'s prefix cache holds (admission would match the same)."""
        s = self.ranks[rank]
        pages = s.cache.match(req.all_ids[:req.num_tokens - 1])
        s.allocator.decref(pages)
        return len(pages)

    def finish(self, req: Request, reason: str) -> None:
        self.ranks[req.dp_rank].finish(req, reason)

    def schedule(self, busy: frozenset[Request] = frozenset()) -> list[ScheduledBatch | None] | None:
        """Every rank's batch (`Scheduler.schedule`), or None when no rank has anything to do."""
        batches = [s.schedule(busy) for s in self.ranks]
        return None if all(b is None for b in batches) else batches
