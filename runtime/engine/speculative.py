"""Speculative decoding with the model's MTP layer: EAGLE-style chains of N draft tokens.

`Engine(runner, tokenizer, speculative_num_steps=N)` (N >= 1) runs every step through
`MtpSpeculator.step` instead of the plain loop. The runner must `supports_speculative` (a plan with
MTP phases on one rank: the torch target, or the CUDA target with verify and draft replayed from
CUDA graphs; the torch target on several ranks through `distributed.DistRunner`).

One read-back per cycle: acceptance (below), the tokens to emit and their logprobs are computed on
the device and read in one packed copy (`read_back`, counted in `MtpSpeculator.num_reads`); drafts
stay on the device (the host holds `UNREAD` placeholders and the count) and reach the draft chain
and the next verify as `ForwardBatch.device_ids`. Only a request that `reads_drafts` (a grammar,
or penalties over its history: the host builds their masks and counts from the tokens before each
position) reads its drafts as each chain step draws them.

Greedy cycles run whole on the device (`_run_on_device`, when every request of the step is
greedy without logprobs, bias, penalties or a grammar, and its next token is due): the verify, the
target's tokens and the accepted counts, a draft-extend over every verified position (fed the
target's token at each: the accepted draft, then the replacement; positions past the acceptance
get MTP KV that is overwritten before it is read) and the chain at positions and slots the device
computes from the counts are queued before the cycle's one read, on one rank as one CUDA graph
(`runner.cycle`). A request near its end pads its verify to N + 1 tokens. Tokens, drafts and
acceptance are what the general path below gives. A step that also carries prompts' chunks runs
those apart (`_split`): the cycles on the device first, then the chunks on the general path (a
second read). Device cycles chain (`_chain_next`, `overlap_cycles`): while every running request
is in the unread cycle, none waits and each has room, the next cycle is queued from its outputs on
the device (`runner.cycle_after`, or `model_runner.cycle_next` and the phases), then the unread
one is read, its tokens taken and streamed while the next runs (stop strings one cycle late).

Overlap (the general path): after the read the host rolls pages back, queues the draft-extend, takes the tokens
(their ids join the output: the drafts' RNG counters and the next cycle read them) and queues the
draft chain, none of it waiting for the device; then it streams the taken tokens (detokenize,
send, stop strings: `_stream`), ends the step, schedules the next and prepares its verify, all
while the drafts run. A request whose tokens end it (stop token, eos, length) or that has a
grammar appends and streams at once. What does not overlap: the host waits at the read for the
verify and acceptance, and the device waits from the read until the draft-extend is queued; the
next verify's inputs (positions, slots) follow the acceptance, so it is prepared after the read.

The MTP layer at position i reads the target's final hidden state at i and the token at i + 1 and
guesses the token at i + 2; its KV lives in its own pool layer at the slot of position i. One step,
for a request whose first n tokens have KV, token n pending and drafts d_1..d_D from the last step:

1. verify: one target forward over [t_n, d_1, .., d_D] at positions n..n+D (the `mtp_verify`
   phase: logits and hidden states at every position; prefill chunks of other requests share it);
2. accept: keep a prefix of the drafts (a of them: below; computed on the device, the cycle's
   read) and append them and one token of the target's at position n+a (the first rejected
   draft's replacement, or the bonus token); the target's KV of positions n+a+1.. is rejected: the scheduler rolls back to n+a+1 computed tokens
   (pages past the next token's freed, slots in the last page overwritten later; only pages full of
   accepted tokens reach the prefix cache);
3. draft-extend: the MTP layer over the positions the target just computed and kept (n..n+a, or a
   prefill chunk's), fed the target's hidden states there and the tokens one further: this writes
   the MTP layer's KV (its own indexer keys included) and its last position guesses d'_1;
4. draft: D' - 1 more MTP steps, one token each, fed the MTP layer's own hidden state (the input of
   the shared head, as SGLang's EAGLE worker does); positions n+a+1.. get MTP KV that the next
   draft-extend overwrites. D' = min(N, tokens the request may still generate); their pages are
   reserved now, and a request whose pages do not fit drafts nothing (it decodes plainly).

Greedy requests (temperature 0) draft the MTP layer's argmax and keep the longest prefix of
drafts equal to the target's own argmax: output equals the plain engine's token for token. Every
appended token is read at its position with the context, history (penalties) and RNG counter it
has there when every draft before it holds (`as_if_accepted`: counter + j at position n+j).

Sampled requests (temperature > 0) use standard speculative sampling (`spec_sampling.py`): drafts
are drawn from q, the MTP layer's distribution after the plain sampler's own processing for that
request (bias, penalties, temperature, top-k, top-p, min-p), and q is kept per draft; at verify
position j, p is the plain sampler's distribution there (`sampling.probabilities`), d_{j+1} is
accepted with probability min(1, p/q), the first rejection emits a draw from
normalize(max(0, p - q)), and when all drafts hold the bonus token is the plain sampler's draw.
The output distribution is the plain sampler's exactly (the tokens themselves differ from a plain
run with the same seed, and depend on the drafts: on N and on the MTP layer's KV); each random
choice is a counter-based hash of (seed, counter, stream), so a seeded request gives the same
output on a re-run whatever shares its batch. Logprobs are the target's raw ones for the token
emitted. Acceptance per draft is sum_x min(p(x), q(x)), against p(argmax q) for drafts that are the
argmax (what exact matching of argmax drafts to the plain sampler's draws, the rule before, got).
Drafts without q rows (none kept) are verified by that exact matching, which is exact for drafts
chosen any way; tests/test_spec_sampling.py measures the old rule's acceptance so.

Requests with a grammar (structured outputs) speculate too: every verified position is sampled
with the grammar's mask after the drafts before it (`grammar.token_bitmask` reads the request as
`as_if_accepted` leaves it), so the greedy argmax and p never give a token outside the grammar, a
draft the grammar forbids is rejected there, and drafts themselves are drawn inside it
(`spec_sampling.draw_drafts`). The grammar's state advances only as tokens are appended.

Approximations that only cost acceptance, never correctness: a prefix-cache hit reuses the MTP
KV of its pages as computed by the request that filled them (the last position of a page was fed
that request's next token; a request that a token ended skips its last draft-extend, so its
last step's positions keep the chain's MTP KV, while one a stop string ended runs it); draft steps k >= 1 see MTP KV of drafts, as in every
EAGLE chain.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from glmc.runtime.engine.request import Request
from glmc.runtime.engine.sampling import SamplingBatch, TokenLogprobs, sample_batch
from glmc.runtime.engine.spec_sampling import draw_drafts, verify_drafts
from glmc.runtime.engine.scheduler import ScheduledBatch, Scheduler
from glmc.runtime.worker.forward_batch import ForwardBatch, to_device
from glmc.runtime.worker.model_runner import cycle_accepted, cycle_chain_step, cycle_last_kept, cycle_next

UNREAD = -1   # the host's placeholder for a draft id that lives on the device only


class EngineView(Protocol):
    """What the speculative step uses of the engine that owns it (`engine.Engine`, which imports
    this module: the engine is seen through this contract, not imported)."""
    scheduler: Scheduler
    runner: Any       # the engine's runner: verify_dp, draft_dp, kernels
    metrics: Any      # the engine's metrics: step, verify

    def append_tokens(self, req: Request, emitted: list[tuple[int, TokenLogprobs | None]]) -> None:
        """Detokenize, stream and check stops for accepted tokens, as plain steps do one by one."""

    def update_gauges(self) -> None:
        """Refresh the engine's gauges after a step."""


class Ahead:
    """A request as the sampler sees it `len(draft)` tokens ahead (the `sampling.Sampled` contract
    and the grammar's: params, seed, prompt and output ids, grammar state): a view, the request
    unchanged; the output ids are built only when read (penalties, a grammar's mask)."""
    __slots__ = ("req", "draft")

    def __init__(self, req: Request, draft: list[int]):
        self.req, self.draft = req, draft

    params = property(lambda self: self.req.params)
    seed = property(lambda self: self.req.seed)
    prompt_ids = property(lambda self: self.req.prompt_ids)
    grammar_state = property(lambda self: self.req.grammar_state)
    output_ids = property(lambda self: self.req.output_ids + self.draft)
    num_generated = property(lambda self: self.req.num_generated + len(self.draft))


def as_if_accepted(req: Request, draft: list[int]) -> Request | Ahead:
    """`req` as the sampler sees it after `draft` was appended: its history (penalties) and RNG
    counter one further per draft token (`req` is not changed). Drafts the host has not read are
    `UNREAD`: only a request that `reads_drafts` has its draft ids looked at."""
    return Ahead(req, draft) if draft else req


def reads_drafts(req: Request) -> bool:
    """Whether the sampler reads `req`'s draft ids on the host: its grammar's mask and its
    penalties depend on the tokens before each position, so its drafts are read back as drawn."""
    return req.params.grammar is not None or req.params.needs_history


def read_back(packed: torch.Tensor) -> list:
    """The speculative loop's one way from the device to the host: `packed` as a list (waits for
    the work that computes it)."""
    return packed.tolist()


@dataclass
class _Verify:
    """One DP rank's verify step: its batch, each request's drafts (ids, `UNREAD` where only the
    device has them, and their device tokens) and whether its next token is due (a prefill chunk
    short of the prompt's end is not)."""
    s: Scheduler
    batch: ScheduledBatch
    drafts: list[list[int]]
    q: list[list[torch.Tensor]]   # per sampled request with drafts: each draft's q row
    own: list[int]   # tokens per request known for sure: the batch's minus the drafts
    ready: list[bool]
    fb: ForwardBatch


@dataclass
class _Outcome:
    """One DP rank's acceptance, computed on the device and packed for the cycle's one read:
    per ready request with picks (`reqs`, `picks` verified positions each, the first at `first`)
    the accepted count, then each pick's token to emit, then the raw logprobs of the picks that
    asked (`asked`: pick index -> alternatives wanted)."""
    reqs: list[int]
    first: list[int]
    asked: dict[int, int]
    num_picks: int
    num_top: int
    packed: torch.Tensor   # float64: [R] accepted | [K] tokens | [A] chosen | [A, top] values, ids


@dataclass
class _Cycle:
    """One DP rank's cycle queued phase by phase (`MtpSpeculator._queue_cycle`): R requests,
    each with N + 1 verified positions."""
    w: _Verify
    target: torch.Tensor     # [R * (N + 1)] the target's greedy token at every verified position
    accepted: torch.Tensor   # [R] drafts held (`model_runner.cycle_accepted`)
    table: torch.Tensor      # the cycle table on the device (`ModelRunner.cycle`)
    chain: ForwardBatch      # the chain steps' batch: positions and slots set on the device


@dataclass
class _Pending:
    """A device cycle queued whose read has started and is not waited for (`MtpSpeculator._pending`):
    the next cycle may be queued from its outputs on the device before it is read (`_chain_next`)."""
    work: list[_Verify | None]
    results: list[tuple]     # per rank: accepted [R], target [R (N + 1)], drafts [R, N] on the device
    tables: list             # per rank: its cycle table on the device, or None
    host: torch.Tensor       # every rank's counts then tokens, copied to the host
    done: Any                # that copy's CUDA event (None on the CPU: `host` is the device tensor)


@dataclass
class _Extend:
    """One DP rank's draft-extend: its unfinished requests, their batch and target hidden states."""
    s: Scheduler
    reqs: list[Request]
    fb: ForwardBatch
    hidden: torch.Tensor


class MtpSpeculator:
    """The engine's step in speculative mode (module docstring); owns no state of its own but the
    drafts' device tokens and the q rows of sampled requests' drafts (`draft_tokens`, `draft_q`):
    draft counts (and the ids of requests that `reads_drafts`) ride on `Request.draft_ids`, pages
    and rows on the engine's schedulers (one per attention-DP rank: every rank steps every
    forward, idle ones with an empty batch), and tokens reach clients through the engine's
    `append_tokens` (detokenize, stream, stop), as in plain steps. `num_reads` counts the device
    to host reads (`read_back`): one per cycle unless a request `reads_drafts`."""

    def __init__(self, engine: EngineView, num_steps: int):
        self.engine, self.num_steps = engine, num_steps
        self.draft_q: dict[Request, list[torch.Tensor]] = {}
        # per draft: (the device tokens [n] its chain step drew, its index there)
        self.draft_tokens: dict[Request, list[tuple[torch.Tensor, int]]] = {}
        self.num_reads = 0
        # cycles run whole on the device (`_run_on_device`); False: every cycle takes the general path
        self.device_cycles = True
        self.num_device_cycles = 0
        self._deferred = False   # this step's taken tokens stream while the next cycle runs
        # device cycles chain: the next is queued from an unread one's outputs (`_chain_next`)
        self.overlap_cycles = True
        self._pending: _Pending | None = None
        self._greedy: dict[tuple[int, str], SamplingBatch] = {}
        self.unstreamed: list[tuple[Scheduler, Request, list]] = []   # taken, streamed at the step end

    def read(self, packed: torch.Tensor) -> list:
        self.num_reads += 1
        return read_back(packed)

    def step(self) -> bool:
        """Schedule, verify + accept, draft; False when there was nothing to do."""
        e = self.engine
        self._deferred = False
        took = self._pending is not None
        if took and self._chain_next():
            e.update_gauges()
            return True
        batches = e.scheduler.schedule()
        if batches is not None:
            e.metrics.step([b for b in batches if b is not None])
            parts = [self._split(b) if b is not None and b.reqs else (None, None) for b in batches]
            if any(d for d, _ in parts) and any(c for _, c in parts):
                # prompts' chunks beside greedy cycles: the cycles on the device, the chunks apart
                ranks = e.scheduler.ranks
                cycles = [self._prepare(s, d) if d else None for s, (d, _) in zip(ranks, parts)]
                chunks = [self._prepare(s, c) if c else None for s, (_, c) in zip(ranks, parts)]
                if self._on_device(cycles):
                    self._run_on_device(cycles)
                else:   # pages for the chains fell short: both the general way
                    self._run(cycles)
                self._run(chunks)
            else:
                work = [self._prepare(s, b) if b is not None and b.reqs else None
                        for s, b in zip(e.scheduler.ranks, batches)]
                if any(work):
                    self._run(work)
        if not self._deferred:
            self._stream()
        # drafts a release dropped (retraction, abort) take their tokens and q rows with them
        self.draft_q = {r: q for r, q in self.draft_q.items() if r.draft_ids}
        self.draft_tokens = {r: t for r, t in self.draft_tokens.items() if r.draft_ids}
        e.update_gauges()
        return batches is not None or took

    def _split(self, b: ScheduledBatch) -> tuple[ScheduledBatch | None, ScheduledBatch | None]:
        """(b's requests that a greedy cycle could take whole on the device: next token due after
        one token of its own, `_simple`; the others: prompts' chunks), either None when empty.
        (None, b) when cycles do not run on the device or a request whose next token is due
        samples or reads its drafts: that step runs whole on the general path."""
        if not self.device_cycles:
            return None, b
        cycle, other = [], []
        for r, start, n in zip(b.reqs, b.prefix_lens, b.extend_lens):
            own = n - len(self._drafts_in(r, n))
            if own == 1 and start + own == r.num_tokens:
                if not self._simple(r):
                    return None, b
                cycle.append((r, start, n))
            else:
                other.append((r, start, n))
        if not other:
            return b, None
        return (ScheduledBatch(*map(list, zip(*cycle))) if cycle else None,
                ScheduledBatch(*map(list, zip(*other)), admitted=b.admitted, retracted=b.retracted))

    @staticmethod
    def _drafts_in(r: Request, n: int) -> list[int]:
        """The drafts among the `n` tokens a batch gives `r` (the rest are its own)."""
        return r.draft_ids[:max(n - r.num_pending, 0)]

    @staticmethod
    def _slots(w: _Verify, starts: list[int], first: int, end: int) -> torch.Tensor:
        """[R, end - first] the KV slots of positions start + first .. start + end - 1 of each of
        `w`'s requests (pages held)."""
        rows = torch.tensor([r.row for r in w.batch.reqs])[:, None]
        return w.s.req_pool.table[rows, torch.tensor(starts)[:, None] + torch.arange(first, end)]

    @staticmethod
    def _simple(r: Request) -> bool:
        """Greedy without logprobs, bias, penalties or a grammar: a request a device cycle can take."""
        p = r.params
        return p.greedy and not p.logprobs and not p.logit_bias and not reads_drafts(r)

    def _stream(self) -> None:
        """Stream the tokens this cycle took (`_append`): each through the engine's
        `append_tokens` (detokenize, send, stop strings), as if appended then; a request a stop
        string ends there keeps only the tokens up to it. Runs at the end of the step, while the
        device runs the drafts queued before it (their work for a request stopped here is dropped
        with its pages), and before the next step schedules."""
        for s, req, emitted in self.unstreamed:
            if req.finished:   # aborted since: its taken tokens stay, unsent
                continue
            del req.output_ids[len(req.output_ids) - len(emitted):]
            self._append_now(s, req, emitted)
        self.unstreamed = []

    def _idle(self) -> list[ForwardBatch]:
        return [ForwardBatch.idle(s.req_pool.table) for s in self.engine.scheduler.ranks]

    def _prepare(self, s: Scheduler, batch: ScheduledBatch) -> _Verify:
        reqs = batch.reqs
        drafts = [self._drafts_in(r, n) for r, n in zip(reqs, batch.extend_lens)]
        q = [self.draft_q.pop(r, [])[:len(d)] for r, d in zip(reqs, drafts)]
        q = [rows if len(rows) == len(d) else [] for rows, d in zip(q, drafts)]   # none kept: matching
        tokens = [self.draft_tokens.pop(r, [])[:len(d)] for r, d in zip(reqs, drafts)]
        if any(len(t) != len(d) for t, d in zip(tokens, drafts)):
            raise RuntimeError("a draft without its device token")   # UNREAD would be run as an id
        own = [n - len(d) for n, d in zip(batch.extend_lens, drafts)]
        ready = [p + n == r.num_tokens for r, p, n in zip(reqs, batch.prefix_lens, own)]
        for r in reqs:
            r.draft_ids = []
        fb = ForwardBatch.build(batch.mode, [r.all_ids[p:p + n] + d for r, p, n, d in
                                             zip(reqs, batch.prefix_lens, own, drafts)],
                                [r.row for r in reqs], batch.prefix_lens, s.req_pool.table)
        # the device holds every row's earlier positions unless a request just came in on cached pages
        fb.rows_on_device = not any(r.num_cached_tokens for r in batch.admitted)
        return _Verify(s, batch, drafts, q, own, ready, self._with_drafts(fb, own, tokens))

    @staticmethod
    def _with_drafts(fb: ForwardBatch, own: list[int], tokens: list[list[tuple[torch.Tensor, int]]]) -> ForwardBatch:
        """`fb` with its drafts' ids taken from their device tokens (`device_ids`): one gather over
        the chain steps' token vectors."""
        where = [start + own[i] + j for i, start, _ in fb.token_ranges() for j in range(len(tokens[i]))]
        if not where:
            return fb
        pairs = [p for ts in tokens for p in ts]
        sources, offset = {}, 0   # each chain step's tokens once, at its offset in their concatenation
        for t, _ in pairs:
            if id(t) not in sources:
                sources[id(t)] = (t, offset)
                offset += t.numel()
        joined = torch.cat([t for t, _ in sources.values()])
        dev = joined.device
        drafts = joined.index_select(0, to_device(torch.tensor([sources[id(t)][1] + j for t, j in pairs]), dev))
        ids = to_device(fb.input_ids, dev).index_copy(0, to_device(torch.tensor(where), dev), drafts)
        return dataclasses.replace(fb, device_ids=ids)

    def _on_device(self, work: list[_Verify | None]) -> bool:
        """Whether this cycle can run whole on the device (`_run_on_device`): every request of
        every rank is greedy without logprobs, bias, penalties or a grammar, its next token is
        due after one token of its own and up to N drafts (fewer near its end: the cycle pads
        them), and positions and pages for N + 1 tokens and a chain of N after them fit its
        context (`reserve` holds the pages now: a rollback returns those past what the target
        keeps)."""
        N = self.num_steps
        if not self.device_cycles:
            return False
        for w in work:
            for r, own, ready, start in zip(w.batch.reqs, w.own, w.ready, w.batch.prefix_lens) if w else ():
                if not (ready and own == 1 and self._simple(r) and start + 2 * N + 2 <= r.max_context):
                    return False
        return all(w.s.reserve(r, start + 2 * N + 2) for w in work if w
                   for r, start in zip(w.batch.reqs, w.batch.prefix_lens))

    def _run_on_device(self, work: list[_Verify | None]) -> None:
        """A greedy cycle queued whole before its one read (`_on_device` says when): verify; the
        target's tokens and the accepted counts on the device; the draft-extend over every
        verified position, fed the target's token there (where a draft held it is the draft, at
        the first miss the target's replacement: the token one further, whatever the count; the
        positions past the acceptance get MTP KV that the chain and the next draft-extend
        overwrite before anything reads it); the first draft from each request's last kept
        position; the chain at positions the device computes from the count. A runner that
        `supports_cycle` (one rank) does it in one call, on a GPU one graph replay; else it is
        queued here phase by phase on every DP rank. While it runs, the cycle before's tokens
        stream (`_stream`: a stop string among them ends its request one cycle late, its tokens
        of this cycle dropped); then one read (counts and tokens) and the host's part: rollback,
        drafts, the taken tokens, streamed during the next cycle (or at the end of the next step
        when no cycle runs on the device). Tokens, drafts and acceptance are the general path's."""
        N, e = self.num_steps, self.engine
        self.num_device_cycles += 1
        e.metrics.cycle("device")
        tables = []   # per rank: the cycle table (`ModelRunner.cycle`)
        for i, w in enumerate(work):
            if w is not None:
                w.s.commit(w.batch)
                if any(len(d) < N for d in w.drafts):   # near its end: padded to N drafts
                    work[i] = w = self._padded(w)
                starts = list(w.batch.prefix_lens)
                slots = self._slots(w, starts, 1, 2 * N)
                tables.append(torch.cat([torch.tensor([starts, [len(d) for d in w.drafts]]).T, slots], 1))
            else:
                tables.append(None)
        self._pending = self._queue_device(work, tables)
        self._stream()   # the cycle before's tokens, while this one runs
        self._deferred = True
        if not self.overlap_cycles:
            self._finish()

    def _queue_device(self, work: list[_Verify | None], tables: list, window: torch.Tensor | None = None) -> _Pending:
        """Queue a greedy cycle on every rank (one call on a runner that `supports_cycle`; with
        `window`, the cycle after its last one: `cycle_after`) and the copy of its counts and
        tokens to the host; nothing waits."""
        N, e = self.num_steps, self.engine
        if window is not None:
            results = [e.runner.cycle_after(window, N)]
        elif e.runner.supports_cycle:
            results = [e.runner.cycle(work[0].fb, tables[0], N)]
        else:
            results = self._queue_cycle(work, tables)
        packed = torch.cat([torch.cat([a, t]) for a, t, _ in results if a is not None])
        dev, done = packed.device, None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host = packed
        return _Pending(work, results, [to_device(t, dev) if t is not None and not e.runner.supports_cycle else None
                                        for t in tables], host, done)

    def _finish(self, hold: bool = False) -> list:
        """Wait for the pending cycle's read (`num_reads`) and take its tokens (`_take`; `hold`:
        the cycle after is queued already). -> per rank its accepted counts, or None."""
        p, self._pending = self._pending, None
        if p.done is not None:
            p.done.synchronize()
        values, counts = self.read(p.host), []
        for w, (_, _, drafts) in zip(p.work, p.results):
            counts.append(values[:len(w.batch.reqs)] if w is not None else None)
            if w is not None:
                values = self._take(w, drafts.flatten(), values, hold)
        return counts

    def _chainable(self, p: _Pending) -> bool:
        """Whether the cycle after `p` can be queued before `p` is read: overlap is on; every
        rank's decoding requests are all in `p` (others may wait or be mid-prompt: their chunks
        run beside the chained cycle), none of `p`'s has ended; each had N drafts and positions
        for N + 1 more after `p`'s fit its context (their pages are held now, `reserve`). A
        request that ends within `p` or the next cycle is dropped there, its tokens past its end
        with it, as a stop string would."""
        N, e = self.num_steps, self.engine
        if not self.overlap_cycles:
            return False
        for s, w in zip(e.scheduler.ranks, p.work):
            reqs = set(w.batch.reqs) if w is not None else set()
            if any(r.is_decoding and r not in reqs for r in s.running):
                return False
            for r, start, d in zip(w.batch.reqs, w.batch.prefix_lens, w.drafts) if w else ():
                if r.finished or len(d) != N or start + 3 * N + 3 > r.max_context:
                    return False
        return all(w.s.reserve(r, start + 3 * N + 3) for w in p.work if w
                   for r, start in zip(w.batch.reqs, w.batch.prefix_lens))

    def _chain_next(self) -> bool:
        """Overlap of device cycles: queue the cycle after the pending one from its outputs on the
        device (`cycle_next`: ids, positions, slots and table follow its unread counts), then wait
        for the pending one's read and take its tokens, then stream them while the next runs.
        False (the pending cycle only read and taken) when it cannot chain (`_chainable`)."""
        p, N, e = self._pending, self.num_steps, self.engine
        if not self._chainable(p):
            self._finish()
            return False
        work, tables, windows = [], [], []
        one_call = e.runner.supports_cycle   # the runner makes the next inputs itself (`cycle_after`)
        for w, (accepted, target, drafts), table in zip(p.work, p.results, p.tables):
            if w is None:
                work.append(None)
                tables.append(None)
                continue
            reqs, starts, R = w.batch.reqs, list(w.batch.prefix_lens), len(w.batch.reqs)
            rows = [r.row for r in reqs]
            window = self._slots(w, starts, 1, 3 * N + 1)
            furthest = [s + N + 1 for s in starts]   # host bounds until the counts are read
            fb = None
            if one_call:
                windows.append(window)
                tables.append(None)
            else:
                ids, positions, loc, nxt = cycle_next(table, accepted, target, drafts,
                                                      to_device(window, accepted.device), N)
                fb = ForwardBatch.build("extend", [[0] * (N + 1)] * R, rows, furthest, w.s.req_pool.table)
                fb = dataclasses.replace(fb, device_ids=ids, device_positions=positions, device_loc=loc,
                                         rows_on_device=True)
                tables.append(nxt)
            work.append(_Verify(w.s, ScheduledBatch(list(reqs), furthest, [N + 1] * R),
                                [[UNREAD] * N for _ in reqs], [[] for _ in reqs], [1] * R, [True] * R, fb))
        self.num_device_cycles += 1
        e.metrics.cycle("chained")
        nxt = self._queue_device(work, tables, windows[0] if one_call else None)
        counts = self._finish(hold=True)
        for w, before, a in zip(nxt.work, p.work, counts):
            if w is not None:   # where each request really starts, now that the counts are read
                w.batch.prefix_lens = [s + 1 + n for s, n in zip(before.batch.prefix_lens, a)]
                live = [(r, s) for r, s in zip(w.batch.reqs, w.batch.prefix_lens) if not r.finished]
                w.s.commit(ScheduledBatch([r for r, _ in live], [s for _, s in live], [N + 1] * len(live)))
        e.metrics.step([w.batch for w in nxt.work if w is not None])
        self._pending = nxt
        self._stream()   # the pending cycle's tokens, while the next runs
        self._deferred = True
        self._chunks(frozenset(r for w in nxt.work if w is not None for r in w.batch.reqs))
        return True

    def _chunks(self, busy: frozenset[Request]) -> None:
        """Prompts' chunks (and admissions) beside a chained cycle, its requests `busy`: through the
        general path after it on the device; their first tokens stream now."""
        e = self.engine
        batches = e.scheduler.schedule(busy)
        if batches is None:
            return
        e.metrics.step([b for b in batches if b is not None])
        work = [self._prepare(s, b) if b is not None and b.reqs else None
                for s, b in zip(e.scheduler.ranks, batches)]
        if any(work):
            self._run(work)
            self._stream()

    def _padded(self, w: _Verify) -> _Verify:
        """`w` with every request's verify N + 1 tokens long: a request with fewer drafts (near
        its end) gets token 0 after them, at positions whose pages `_on_device` held; the
        cycle's acceptance stops at its own drafts (`cycle` reads their count)."""
        N = self.num_steps
        own = [r.all_ids[p:p + 1] for r, p in zip(w.batch.reqs, w.batch.prefix_lens)]
        fb = ForwardBatch.build("extend", [o + [0] * N for o in own], [r.row for r in w.batch.reqs],
                                w.batch.prefix_lens, w.s.req_pool.table)
        fb.rows_on_device = w.fb.rows_on_device
        ids = fb.input_ids if w.fb.device_ids is None else to_device(fb.input_ids, w.fb.device_ids.device)
        src = w.fb.device_ids if w.fb.device_ids is not None else w.fb.input_ids
        # each request's own token and drafts, from where the scheduler's batch had them
        at = [(i * (N + 1) + j, start + j) for i, start, end in w.fb.token_ranges() for j in range(end - start)]
        dst, where = (torch.tensor(x) for x in zip(*at))
        ids = ids.index_copy(0, to_device(dst, ids.device), src.index_select(0, to_device(where, src.device)))
        fb = dataclasses.replace(fb, device_ids=ids) if w.fb.device_ids is not None else \
            dataclasses.replace(fb, input_ids=ids)
        return dataclasses.replace(w, fb=fb)

    def _queue_cycle(self, work: list[_Verify | None], tables: list) -> list[tuple]:
        """`_run_on_device`'s device work through the runner's verify and draft steps on every
        DP rank: -> per rank (accepted [R], target tokens [R (N + 1)], drafts [R, N]), or Nones."""
        N, e = self.num_steps, self.engine
        idle = self._idle()
        outs = e.runner.verify_dp([w.fb if w else i for w, i in zip(work, idle)])
        cycles = [self._accept(w, logits, table) if w else None
                  for w, table, (logits, _) in zip(work, tables, outs)]
        some = next(h for c, (_, h) in zip(cycles, outs) if c)
        empty = some.new_zeros(0, some.shape[1])
        extended = e.runner.draft_dp(
            [dataclasses.replace(c.w.fb, device_ids=c.target, rows_on_device=True) if c else i
             for c, i in zip(cycles, idle)], [h if c else empty for c, (_, h) in zip(cycles, outs)])
        heads = []   # per rank: the last drafts [R] and the MTP hidden rows they came with
        for c, (logits, hidden) in zip(cycles, extended):
            if c is not None:
                rows = cycle_last_kept(c.accepted, N)
                heads.append((logits.index_select(0, rows).argmax(-1), hidden.index_select(0, rows)))
            else:
                heads.append(None)
        drafts = [[h[0]] if h else [] for h in heads]
        for k in range(1, N):
            fbs = [self._chain_step(c, h[0], k) if c else i for c, h, i in zip(cycles, heads, idle)]
            stepped = e.runner.draft_dp(fbs, [h[1] if c else empty for c, h in zip(cycles, heads)])
            heads = [(logits.argmax(-1), hidden[:c.accepted.numel()]) if c else None
                     for c, (logits, hidden) in zip(cycles, stepped)]
            for d, h in zip(drafts, heads):
                if h is not None:
                    d.append(h[0])
        return [(c.accepted, c.target, torch.stack(d, 1)) if c else (None, None, None)
                for c, d in zip(cycles, drafts)]

    @staticmethod
    def _chain_step(c: _Cycle, tokens: torch.Tensor, k: int) -> ForwardBatch:
        """Chain step k's batch: the last drafts `tokens` at positions and slots the device computes."""
        positions, loc = cycle_chain_step(c.table, c.accepted, k)
        return dataclasses.replace(c.chain, device_ids=tokens, device_positions=positions, device_loc=loc)

    def _accept(self, w: _Verify, logits: torch.Tensor, table: torch.Tensor) -> _Cycle:
        """The target's greedy token at every verified position and the drafts each request
        keeps, on the device; the chain's batch and slots (`table`, pages `_on_device` held)."""
        N, dev = self.num_steps, logits.device
        R, T = len(w.batch.reqs), logits.shape[0]
        key = (T, str(dev))
        if key not in self._greedy:
            self._greedy[key] = SamplingBatch.greedy(T, dev)
        target = sample_batch(logits, self._greedy[key], kernels=self.engine.runner.kernels).token_ids
        ids = w.fb.device_ids if w.fb.device_ids is not None else to_device(w.fb.input_ids, dev)
        starts = w.batch.prefix_lens   # (after an unread cycle: the furthest each may start at)
        # host positions and slots: the furthest the chain may reach (workspace bounds, valid slots)
        chain = ForwardBatch.build("extend", [[UNREAD]] * R, [r.row for r in w.batch.reqs],
                                   [p + 2 * N - 1 for p in starts], w.s.req_pool.table)
        chain.rows_on_device = True
        table = to_device(table, dev)
        return _Cycle(w, target, cycle_accepted(target, ids, table, N), table, chain)

    def _take(self, w: _Verify, drafts: torch.Tensor, values: list, hold: bool = False) -> list:
        """The host's part of a device cycle for one rank, from the read `values` (counts, then
        tokens; -> what follows them): roll each request back to what the target kept, give the
        ones that go on as many of their N drafts (`drafts`, [R * N] on the device) as the
        general path would draft, take the tokens. `hold`: the cycle after is queued already
        (`_chain_next`): it took the drafts, and the pages of its positions stay."""
        N = self.num_steps
        R = len(w.batch.reqs)
        target = values[R:R + R * (N + 1)]
        # the drafts the general path gives: none past the request's end (a chained cycle has N)
        drafts_in = [min(len(d), r.max_total_tokens - start - 1)
                     for r, start, d in zip(w.batch.reqs, w.batch.prefix_lens, w.drafts)]
        accepted = [min(a, n) for a, n in zip(values[:R], drafts_in)]
        verified = [(n, a) for r, n, a in zip(w.batch.reqs, drafts_in, accepted) if n > 0 and not r.finished]
        self.engine.metrics.verify([n for n, _ in verified], [a for _, a in verified])
        for i, (r, start, d) in enumerate(zip(w.batch.reqs, w.batch.prefix_lens, w.drafts)):
            if r.finished:   # a stop string in the cycle before's tokens, found as they streamed
                continue
            a = accepted[i]
            tokens = target[i * (N + 1):i * (N + 1) + a + 1]
            w.s.rollback(r, start + 1 + a, hold=start + 3 * N + 3 if hold else 0)
            length = min(N, r.max_total_tokens - (r.num_tokens + len(tokens)))   # the general path's
            if not hold and not r.would_end(tokens) and length > 0:
                r.draft_ids = [UNREAD] * length
                self.draft_tokens[r] = [(drafts, i * N + k) for k in range(length)]
            self._append(w.s, r, [(t, None) for t in tokens])
        return values[R + R * (N + 1):]

    def _run(self, work: list[_Verify | None]) -> None:
        """Verify, the cycle's one read, then the draft-extend and the draft chains queued; the
        tokens are taken in between and streamed after (`_stream`). A greedy cycle runs whole on
        the device instead (`_run_on_device`)."""
        if self._on_device(work):
            self._run_on_device(work)
            return
        fbs = [w.fb if w else idle for w, idle in zip(work, self._idle())]
        outs = self.engine.runner.verify_dp(fbs)
        found = []
        for w, (logits, _) in zip(work, outs):
            if w is not None:
                w.s.commit(w.batch)
            found.append(self._sample(logits, w) if w is not None else None)
        packed = [f.packed for f in found if f is not None]
        values = self.read(torch.cat(packed)) if packed else []
        accepted = []
        for f in found:
            accepted.append(self._unpack(f, values) if f is not None else {})
            values = values[f.packed.numel():] if f is not None else values
        extends = [self._extend(w, acc, hidden) if w else None
                   for w, acc, (_, hidden) in zip(work, accepted, outs)]
        drafted = self._draft_extend(extends) if any(extends) else None
        verified = [(len(w.drafts[i]), a) for w, acc in zip(work, accepted) for i, (a, _) in acc.items()
                    if w.drafts[i]]
        self.engine.metrics.verify([n for n, _ in verified], [a for _, a in verified])
        if verified:
            self.engine.metrics.cycle("general")
        for w, acc in zip(work, accepted):
            for i, (_, emitted) in (acc.items() if w else ()):
                self._append(w.s, w.batch.reqs[i], emitted)
        if drafted is not None:
            self._draft(extends, drafted)   # queued: `_stream` runs while they do

    def _sample(self, logits: torch.Tensor, w: _Verify) -> _Outcome | None:
        """Acceptance on the device, no read: the plain sampler reads every verified position as
        the request stands there; greedy drafts (and drafts without q rows) are kept while they
        equal its token, sampled ones go through the rejection rule (`spec_sampling.verify_drafts`)."""
        picks = [(i, start + w.own[i] - 1 + j, j) for i, start, _ in w.fb.token_ranges() if w.ready[i]
                 for j in range(len(w.drafts[i]) + 1)]
        if not picks:
            return None
        dev = logits.device
        rows = to_device(torch.tensor([row for _, row, _ in picks]), dev)
        seen = [as_if_accepted(w.batch.reqs[i], w.drafts[i][:j]) for i, _, j in picks]
        sb = SamplingBatch.from_requests(seen, dev)
        picked = logits.index_select(0, rows)
        tokens = sample_batch(picked, dataclasses.replace(sb, top_logprobs=(None,) * len(picks)),
                              kernels=self.engine.runner.kernels).token_ids
        # the draft after each verified position is the verify's own next input id
        ids = w.fb.device_ids if w.fb.device_ids is not None else w.fb.input_ids
        ids = to_device(ids, dev) if ids.device != dev else ids
        nxt = ids.index_select(0, (rows + 1).clamp_max(ids.numel() - 1))
        has_draft = to_device(torch.tensor([j < len(w.drafts[i]) for i, _, j in picks]), dev)
        ok = has_draft & (tokens == nxt)
        rule = [k for k, (i, _, j) in enumerate(picks) if j < len(w.q[i])]
        if rule:
            where = to_device(torch.tensor(rule), dev)
            accept, emit = verify_drafts(picked.index_select(0, where), [seen[k] for k in rule],
                                         nxt.index_select(0, where),
                                         torch.stack([w.q[picks[k][0]][picks[k][2]] for k in rule]))
            ok, tokens = ok.index_copy(0, where, accept), tokens.index_copy(0, where, emit)
        return self._pack(picks, ok, tokens, picked, sb.top_logprobs)

    @staticmethod
    def _pack(picks: list, ok: torch.Tensor, tokens: torch.Tensor, picked: torch.Tensor,
              top_logprobs: tuple) -> _Outcome:
        """The accepted count per request (the leading run of held drafts), the tokens and the
        logprobs asked for, in one float64 tensor (ids and fp32 values are exact in it)."""
        first, span = {}, {}   # per request: its first pick, its number of picks (contiguous)
        for k, (i, _, _) in enumerate(picks):
            first.setdefault(i, k)
            span[i] = span.get(i, 0) + 1
        reqs = sorted(first)
        width = max(span.values())
        # each request's picks in a row, padded past the end (index len(picks): False)
        lanes = [k for i in reqs for k in [*range(first[i], first[i] + span[i]), *[len(picks)] * (width - span[i])]]
        held = torch.cat([ok, ok.new_zeros(1)]).index_select(0, to_device(torch.tensor(lanes), ok.device))
        accepted = held.view(len(reqs), width).long().cumprod(1).sum(1)
        parts = [accepted.double(), tokens.double()]
        asked = {k: n for k, n in enumerate(top_logprobs) if n is not None}
        num_top = max(asked.values(), default=0)
        if asked:
            where = to_device(torch.tensor(list(asked)), ok.device)
            raw = torch.log_softmax(picked.index_select(0, where).float(), -1)
            parts.append(raw.gather(1, tokens.index_select(0, where)[:, None])[:, 0].double())
            if num_top:
                top = torch.topk(raw, num_top)
                parts += [top.values.double().flatten(), top.indices.double().flatten()]
        return _Outcome(reqs, [first[i] for i in reqs], asked, len(picks), num_top, torch.cat(parts))

    @staticmethod
    def _unpack(f: _Outcome, values: list) -> dict[int, tuple[int, list]]:
        """Per ready request: (drafts accepted, [(token, logprobs)] to append)."""
        R, A, K = len(f.reqs), len(f.asked), f.num_picks
        tokens, rest = values[R:R + K], values[R + K:]
        chosen, top_v, top_i = rest[:A], rest[A:A + A * f.num_top], rest[A + A * f.num_top:]
        lps: dict[int, TokenLogprobs] = {}
        for a, (k, n) in enumerate(f.asked.items()):
            row = slice(a * f.num_top, a * f.num_top + n)
            lps[k] = TokenLogprobs(chosen[a], [(int(t), v) for t, v in zip(top_i[row], top_v[row])])
        out = {}
        for n, i in enumerate(f.reqs):
            accepted = int(values[n])
            out[i] = (accepted, [(int(tokens[k]), lps.get(k)) for k in
                                 range(f.first[n], f.first[n] + accepted + 1)])
        return out

    def _append(self, s: Scheduler, req: Request, emitted: list) -> None:
        """Take the accepted drafts and the target's token after them: their ids join the
        request's output now (the drafts read them) and they are streamed at the step's end
        (`_stream`), after this cycle's drafts are queued. A request they
        end by a token (`Request.would_end`) or with a grammar (its state must advance before its drafts'
        masks) appends them at once (detokenize, stream, stop) and offers its pages."""
        if req.params.grammar is None and not req.would_end([t for t, _ in emitted]):
            req.output_ids.extend(t for t, _ in emitted)
            self.unstreamed.append((s, req, emitted))
            return
        self._append_now(s, req, emitted)

    def _append_now(self, s: Scheduler, req: Request, emitted: list) -> None:
        """Append `emitted` [(token, logprobs)] to `req` (detokenize, send, stop) up to where it
        finishes, then offer its pages to the prefix cache if it goes on."""
        self.engine.append_tokens(req, emitted)
        if not req.finished:
            s.offer_pages(req)

    @staticmethod
    def _extend(w: _Verify, accepted: dict[int, tuple[int, list]], hidden: torch.Tensor) -> _Extend | None:
        """Roll each request's KV back to what the target kept (its own tokens and the accepted
        drafts) and make the draft-extend over those positions: the token one further at each,
        with the target's hidden state there. Requests that the emitted tokens end (a stop token,
        eos, the length) are left out; one a stop string ends is found only when appended."""
        reqs, starts, ranges = w.batch.reqs, w.batch.prefix_lens, w.fb.token_ranges()
        kept, ids = {}, {}
        for i, (r, start, own) in enumerate(zip(reqs, starts, w.own)):
            num_accepted, emitted = accepted.get(i, (0, []))
            tokens = [t for t, _ in emitted]
            if not w.ready[i]:
                kept[i] = own
            elif not r.would_end(tokens):
                w.s.rollback(r, start + own + num_accepted)
                kept[i] = own + num_accepted
            else:
                w.s.rollback(r, start + own + num_accepted)
                continue
            ids[i] = (r.all_ids + tokens)[start + 1:start + kept[i] + 1]
        if not kept:
            return None
        idx = list(kept)
        fb = ForwardBatch.build("extend", [ids[i] for i in idx], [reqs[i].row for i in idx],
                                [starts[i] for i in idx], w.s.req_pool.table)
        fb.rows_on_device = True   # the verify's positions and those below them
        rows = torch.cat([torch.arange(ranges[i][1], ranges[i][1] + kept[i]) for i in idx])
        return _Extend(w.s, [reqs[i] for i in idx], fb, hidden.index_select(0, to_device(rows, hidden.device)))

    def _draft_extend(self, extends: list[_Extend | None]) -> list:
        """Queue the MTP layer over every DP rank's kept positions; -> per rank (logits, hidden)."""
        some = next(x.hidden for x in extends if x)
        empty = some.new_zeros(0, some.shape[1])
        return self.engine.runner.draft_dp([x.fb if x else idle for x, idle in zip(extends, self._idle())],
                                           [x.hidden if x else empty for x in extends])

    def _draft(self, extends: list[_Extend | None], outs: list) -> None:
        """After the draft-extend (`outs`), requests still running whose next token is pending
        get a chain of drafts (as many as they may still generate and their pages allow)."""
        some = next(x.hidden for x in extends if x)
        empty = some.new_zeros(0, some.shape[1])
        chains = []   # per DP rank: (drafting requests, their draft lengths, last drafts [n], MTP hidden rows [n, H])
        for x, (logits, out) in zip(extends, outs):
            drafting, lengths = [], []
            if x is not None:
                last = (torch.cumsum(x.fb.extend_lens, 0) - 1).tolist()   # host tensor
                for j, req in enumerate(x.reqs):
                    length = min(self.num_steps, req.max_total_tokens - req.num_tokens)
                    if (not req.finished and req.num_pending == 1 and length > 0
                            and x.s.reserve(req, req.num_computed + length + 1)):
                        drafting.append(j)
                        lengths.append(length)
            if not drafting:
                chains.append(([], [], None, empty))
                continue
            rows = to_device(torch.tensor([last[j] for j in drafting]), logits.device)
            reqs = [x.reqs[j] for j in drafting]
            chains.append((reqs, lengths, self._add_drafts(reqs, logits.index_select(0, rows)),
                           out.index_select(0, rows)))
        self._chain(chains, empty)

    def _add_drafts(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """Append one draft per request from the MTP layer's logits (`spec_sampling.draw_drafts`:
        the argmax, or for sampled requests a draw from q, whose row is kept for the verify). The
        tokens stay on the device; only requests that `reads_drafts` read theirs (one read).
        -> the drafts [len(reqs)] (device)."""
        tokens, q_rows = draw_drafts(logits, [as_if_accepted(r, r.draft_ids) for r in reqs])
        host = self.read(tokens) if any(reads_drafts(r) for r in reqs) else [UNREAD] * len(reqs)
        for j, (r, q) in enumerate(zip(reqs, q_rows)):
            r.draft_ids.append(host[j] if reads_drafts(r) else UNREAD)
            self.draft_tokens.setdefault(r, []).append((tokens, j))
            if q is not None:
                self.draft_q.setdefault(r, []).append(q)
        return tokens

    def _chain(self, chains: list, empty: torch.Tensor) -> None:
        """Draft steps 1..N-1 on every DP rank (`chains`: per rank the drafting requests, their
        draft lengths, their last drafts and MTP hidden rows): each request's last draft at its
        position (its id from the device), fed the MTP layer's own hidden state from the step
        before; writes MTP KV on the pages `reserve` gave. A request leaves the chain after its
        length (the rows of those that stay are gathered once)."""
        ranks = self.engine.scheduler.ranks
        for k in range(1, self.num_steps):
            for d, (reqs, lengths, tokens, hidden) in enumerate(chains):
                keep = [i for i, n in enumerate(lengths) if n > k]
                if len(keep) < len(reqs):
                    idx = to_device(torch.tensor(keep, dtype=torch.int64), hidden.device)
                    chains[d] = ([reqs[i] for i in keep], [lengths[i] for i in keep],
                                 tokens.index_select(0, idx), hidden.index_select(0, idx))
            if not any(reqs for reqs, _, _, _ in chains):
                return
            fbs = [dataclasses.replace(ForwardBatch.build(
                "extend", [[UNREAD] for _ in rs], [r.row for r in rs],
                [r.num_computed - 1 + k for r in rs], s.req_pool.table), device_ids=tokens, rows_on_device=True)
                   if rs else ForwardBatch.idle(s.req_pool.table) for s, (rs, _, tokens, _) in zip(ranks, chains)]
            outs = self.engine.runner.draft_dp(fbs, [hidden if rs else empty for rs, _, _, hidden in chains])
            chains = [(rs, lengths, self._add_drafts(rs, logits), out[:len(rs)]) if rs else (rs, lengths, tokens, empty)
                      for (rs, lengths, tokens, _), (logits, out) in zip(chains, outs)]
