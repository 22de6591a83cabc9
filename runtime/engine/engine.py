"""The engine loop: scheduler + model runner + sampler, with thread-safe submission.

One engine thread owns all scheduling state and runs `step()` in a loop: take new requests and
aborts from the inbox, schedule, run the model, sample (one batched sampler call per DP rank, on
the device holding the logits: `sampling.sample_batch`, with the plan's kernel on a GPU), detokenize
and hand `StreamEvent`s to each request's sink.

Overlap (`overlap=True`, the default where the runner `supports_overlap`): a step queues its
forward and sampling on the device and returns; the tokens are read one step later, after the next
step is scheduled and queued, so the host's work (scheduling, building inputs, detokenizing,
streaming) runs while the device computes. The request a step samples for carries the token as
`num_inflight` (a `FUTURE_TOKEN` input id the runner fills in on the device). What this costs:
a request that stops (eos, stop string, abort) is found one step late, so one more of its tokens is
computed and dropped; pages are freed at that point. A request whose draws depend on its history
(repetition/presence/frequency penalties) is never sampled with a token in flight: while one runs,
each step's tokens are read before the next step is scheduled.

Structured outputs (`grammar.py`): a request with a grammar gets its `GrammarState` when the
engine takes it in; the sampler masks the tokens the grammar does not allow next, `append_token`
advances the state, and a grammar that allows no further token ends the request ("stop"). Its
mask needs its last token: with overlap, a step whose batch has a grammar queues its forward, then
reads the step before's tokens (advancing the grammars while the forward runs), then samples.

The HTTP server (asyncio) talks to the engine only through `submit_many` and `abort` (its
`EventStream` turns sinks into an async queue), so a slow forward never blocks the event loop.
Tests may instead call `step()`/`generate()` directly with no thread.

With attention data parallelism (`runner.num_dp` > 1) every DP rank has its own pages,
req_to_token rows, prefix cache and `Scheduler`; a new request goes to the least loaded rank, and
each step runs every rank's batch at once (`ModelRunner.forward_dp`; idle ranks step too).
The settings (`glmc.run_config.RunConfig`: `max_running`, `max_batch_tokens`, `max_waiting`,
`enable_prefix_cache`, `overlap`, `mixed_prefill_tokens`, `speculative_num_steps`) come as one
value, or as its fields by keyword. Speculative decoding (`speculative_num_steps=N` > 0): each step verifies the MTP layer's N draft
tokens per request and drafts the next ones (`runtime/engine/speculative.py`); it needs a
runner that `supports_speculative` and runs without the plain loop's overlap: the speculative
cycle reads the device once (its acceptance) and queues its drafts without waiting for them, so the
next cycle is scheduled and prepared while they run.
Engines are started by `runtime/engine/startup.py`; runners live in `runtime/worker/`.
"""
from __future__ import annotations

import sys
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from glmc.runtime.engine.admission import Admission, InvalidRequest
from glmc.runtime.engine.grammar import GrammarState, check, ll_tokenizer
from glmc.runtime.engine.metrics import Metrics
from glmc.runtime.engine.pages import PAGE_SIZE, PageAllocator, ReqToTokenPool
from glmc.runtime.engine.prefix_cache import NoPrefixCache, RadixCache
from glmc.runtime.engine.request import Request
from glmc.runtime.engine.sampling import (
    SamplingBatch,
    SamplingParams,
    TokenLogprobs,
    sample_batch,
)
from glmc.runtime.engine.scheduler import (
    DataParallelScheduler,
    ScheduledBatch,
    Scheduler,
)
from glmc.runtime.engine.tokenizer import Detokenizer, Tokenizer
from glmc.runtime.worker.forward_batch import ForwardBatch, to_device
from glmc.runtime.worker.model_runner import ModelRunner

from glmc.run_config import RunConfig, with_settings

__all__ = ["Engine", "InvalidRequest", "ModelRunner", "Overloaded", "StreamEvent"]


class Overloaded(RuntimeError):
    """The waiting queue is full; retry later."""


@dataclass
class StreamEvent:
    """A request's new token (its id; of a speculative cycle's run appended at once, the last),
    the text now safe to send, and the finish reason."""

    token_id: int
    text: str
    logprobs: TokenLogprobs | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


class Engine:
    """Continuous-batching engine over a `ModelRunner`; see the module docstring."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, run: RunConfig | None = None,
                 **settings):
        run = with_settings(run, **settings)
        if runner.page_size != PAGE_SIZE:
            raise ValueError(f"runner page_size {runner.page_size} != runtime PAGE_SIZE {PAGE_SIZE}")
        if tokenizer.vocab_size > runner.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens, model vocab_size is "
                             f"{runner.vocab_size}")
        self.runner, self.tokenizer, self.max_waiting = runner, tokenizer, run.max_waiting
        self.scheduler = DataParallelScheduler([  # one per DP rank: pages, rows, cache
            _rank_scheduler(runner, run) for _ in range(runner.num_dp)])
        self.metrics = Metrics()
        self.max_context = runner.max_context
        rank = self.scheduler.ranks[0]   # every DP rank has the same pool
        self.admission = Admission(runner.vocab_size, runner.max_context, rank.allocator.num_pages,
                                   PAGE_SIZE, rank.req_pool.max_context, tokenizer.eos_token_ids)
        self.after_step: Callable[[], None] | None = None   # called on the engine thread after each step
        self._inbox: deque = deque()
        self._sinks: dict[str, Callable[[StreamEvent], None]] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._live: dict[str, Request] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        if run.overlap and not runner.supports_overlap:
            raise ValueError(f"{type(runner).__name__} cannot overlap steps (overlap=True)")
        self.overlap = runner.supports_overlap if run.overlap is None else run.overlap
        self.speculator = self._speculator(runner, run.speculative_num_steps)
        self._inflight: list | None = None   # the queued step whose tokens are not read yet
        self._profile: _StepProfile | None = None
        self._serving_kernels: dict | None = None   # binaries per kernel since warm-up (reset_metrics)
        self.update_gauges()

    # -- submission (any thread) -----------------------------------------------------------------

    def make_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Validate a prompt and its parameters into a `Request` (raises `InvalidRequest`)."""
        req = self.admission.make_request(prompt_ids, params)
        if params.grammar is not None and (
                why := check(params.grammar, self.tokenizer, self.runner.vocab_size)):
            raise InvalidRequest(f"grammar: {why}", "grammar")
        return req

    def submit(self, req: Request, sink: Callable[[StreamEvent], None] | None = None) -> None:
        """Queue `req`; `sink` receives its events on the engine thread. Raises `Overloaded`."""
        self.submit_many([req], [sink])

    def submit_many(self, reqs: list[Request], sinks: list) -> None:
        """Queue all of `reqs` or none of them (raises `Overloaded` when the queue is full)."""
        if self.num_waiting + len(reqs) > self.max_waiting:
            raise Overloaded(f"{self.max_waiting} requests already waiting")
        self.enqueue(reqs, sinks)

    def enqueue(self, reqs: list[Request], sinks: list) -> None:
        """Queue `reqs` whatever the queue's length (a caller that checked it itself)."""
        self._inbox.extend(("add", r, s) for r, s in zip(reqs, sinks))
        self._wake.set()

    def abort(self, rid: str) -> None:
        """Stop a request (e.g. its client went away); its pages are freed on the engine thread."""
        self._inbox.append(("abort", rid, None))
        self._wake.set()

    # -- the loop --------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="glmc-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        _name_os_thread(b"glmc-engine")
        while not self._stop:
            try:
                busy = self.step()
            except Exception:  # a bug in a step must not hang every client: fail them all
                traceback.print_exc()
                self._inflight = None
                for req in [*self.scheduler.running, *self.scheduler.waiting]:
                    self._finish(req, "error")
                busy = True
            if self.after_step is not None:
                self.after_step()
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
        """Run `prompts` to completion on the calling thread (tests, offline use)."""
        if self._thread is not None:
            raise RuntimeError("generate() runs the loop itself; stop() the engine thread first")
        reqs = [self.make_request(p, params) for p in prompts]
        for r in reqs:
            self.submit(r)
        while not all(r.finished for r in reqs):
            self.step()
        return reqs

    def step(self) -> bool:
        """One iteration; returns False when there was nothing to do. With overlap it queues this
        step's work and then reads the previous step's tokens (see the module docstring)."""
        self._drain_inbox()
        if self._profile is not None:
            busy = self._profile.record(self._step)
            if self._profile.finished:
                self._profile = None
            return busy
        return self._step()

    def _step(self) -> bool:
        if self.speculator is not None:
            return self.speculator.step()
        if self._inflight is not None and any(r.params.needs_history for r in self.scheduler.running):
            self._read(self._inflight)   # a penalised request needs every earlier token first
            self._inflight = None
        batches = self.scheduler.schedule()
        launched = None
        if batches is not None:
            self.metrics.step([b for b in batches if b is not None])
            launched = self._launch(batches)
        if self._inflight is not None:
            self._read(self._inflight)
        self._inflight = launched if self.overlap else None
        if launched is not None and not self.overlap:
            self._read(launched)
        self.update_gauges()
        return batches is not None or self._inflight is not None

    def _launch(self, batches) -> list:
        """Run every DP rank's batch and queue the sampling of its ready requests on the device;
        -> per rank (requests, top_logprobs asked, SampledTokens) for `_read`."""
        work = [b if b is not None and b.reqs else None for b in batches]
        if not any(work):  # only retractions happened
            return []
        launched, outs = [], []
        ranks = self.scheduler.ranks
        fbs = [self._forward_batch(s, b) for s, b in zip(ranks, work)]
        for s, batch, logits in zip(ranks, work, self.runner.forward_dp(fbs)):
            if batch is None:
                continue
            s.commit(batch)
            # the requests whose prompt is fully computed get a token (a chunked prefill's rows wait)
            ready = [i for i, r in enumerate(batch.reqs) if r.num_pending == 0]
            if ready:
                outs.append((batch, ready, logits))
        if self._inflight is not None and any(
                batch.reqs[i].params.grammar is not None for batch, ready, _ in outs for i in ready):
            # a grammar's mask needs the tokens in flight: read them while this forward runs
            self._read(self._inflight)
            self._inflight = None
        for batch, ready, logits in outs:
            ready = [i for i in ready if not batch.reqs[i].finished]
            if not ready:
                continue
            reqs = [batch.reqs[i] for i in ready]
            if len(ready) < len(batch.reqs):
                logits = logits.index_select(0, to_device(torch.tensor(ready), logits.device))
            sb = SamplingBatch.from_requests(reqs, logits.device)
            sampled = sample_batch(logits, sb, kernels=self.runner.kernels)
            if self.overlap:
                self.runner.record_tokens([r.row for r in reqs], sampled.token_ids)
            for r in reqs:
                r.num_inflight += 1
            launched.append((reqs, sb.top_logprobs, sampled.start_copy()))
        return launched

    def _read(self, launched: list) -> None:
        """Take a queued step's tokens: append, detokenize, stream, stop."""
        for reqs, top_logprobs, sampled in launched:
            for req, (token, lp) in zip(reqs, sampled.to_host(top_logprobs)):
                if req.finished:   # stopped or aborted while this token was computed
                    continue
                req.num_inflight -= 1
                self.append_token(req, token, lp)

    @staticmethod
    def _forward_batch(s: Scheduler, batch: ScheduledBatch | None) -> ForwardBatch:
        if batch is None:  # this DP rank has nothing to do but must still step
            return ForwardBatch.idle(s.req_pool.table)
        return ForwardBatch.build(
            batch.mode, [r.ids(p, p + n) for r, p, n in
                         zip(batch.reqs, batch.prefix_lens, batch.extend_lens)],
            [r.row for r in batch.reqs], batch.prefix_lens, s.req_pool.table)

    def reset_metrics(self) -> None:
        """Start counting afresh (e.g. after warm-up); from now on a kernel compile is logged."""
        self.metrics = Metrics()
        if self.runner.kernels is not None:
            self._serving_kernels = self.runner.kernels.compiled_by_kernel()
        self.update_gauges()

    def flush_cache(self, timeout: float = 10.0) -> None:
        """Drop the prefix cache; with the engine thread running, it does it between steps."""
        if not self.alive:
            self._reset_caches()
            self.update_gauges()
            return
        done = threading.Event()
        self._inbox.append(("flush", done, None))
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError("engine thread did not flush the prefix cache")

    def profile(self, num_steps: int, path: str, timeout: float = 120.0) -> str:
        """Record the next `num_steps` steps that have work with torch.profiler (host and, on a GPU,
        device timelines) and write a Chrome trace to `path` (open it in Perfetto) and the
        per-op table to `path` + ".txt"; blocks until written. -> path."""
        if self.alive:
            done = threading.Event()
            self._inbox.append(("profile", (num_steps, path, done), None))
            self._wake.set()
            if not done.wait(timeout):   # stop it where it is (no trace), so no later step runs profiled
                self._inbox.append(("profile", None, None))
                self._wake.set()
                raise TimeoutError(f"profile: {num_steps} steps did not run within {timeout:g} s")
            return path
        self._profile = _StepProfile(num_steps, path, None)
        while self._profile is not None and self.step():
            pass
        return path

    # -- internals -------------------------------------------------------------------------------

    def _speculator(self, runner: ModelRunner, num_steps: int):
        """The MTP speculator for `num_steps` > 0 (None: plain decoding); turns overlap off
        (`RunConfig.validate` refused overlap=True with it)."""
        if not num_steps:
            return None
        if not runner.supports_speculative:
            raise ValueError(f"{type(runner).__name__} cannot run speculative decoding: it needs a "
                             "plan with MTP phases (mtp_draft, mtp_verify) run on the torch target "
                             "(the CUDA target: not yet)")
        from glmc.runtime.engine.speculative import MtpSpeculator

        self.overlap = False
        return MtpSpeculator(self, num_steps)

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, item, sink = self._inbox.popleft()
            if kind == "add":
                if item.params.grammar is not None and item.grammar_state is None:
                    item.grammar_state = GrammarState(
                        item.params.grammar, ll_tokenizer(self.tokenizer, self.runner.vocab_size))
                self._live[item.rid], self._sinks[item.rid] = item, sink
                self._detok[item.rid] = Detokenizer(self.tokenizer, item.params.stop)
                self.scheduler.add(item)
            elif kind == "flush":
                self._reset_caches()
                item.set()
            elif kind == "profile":
                if item is None:      # cancelled (the caller timed out)
                    if self._profile is not None:
                        self._profile.cancel()
                    self._profile = None
                else:
                    self._profile = _StepProfile(*item)
            elif (req := self._live.get(item)) is not None:
                self._finish(req, "abort")

    def append_token(self, req: Request, token: int, lp: TokenLogprobs | None) -> None:
        req.output_ids.append(token)
        if lp is not None:
            req.output_logprobs.append(lp)
        self.metrics.token(req)
        reason = req.check_stop_token(token)
        ended = req.grammar_state is not None and req.grammar_state.advance(token)
        detok = self._detok[req.rid]
        if reason == "stop":  # a stop/eos token: its text is not part of the output
            text = detok.flush()
        else:
            text = detok.add(token)
            reason = "stop" if detok.stopped or ended else reason
            text += detok.flush() if reason else ""
        req.output_text += text
        event = StreamEvent(token, text, lp, reason, len(req.prompt_ids), req.num_cached_tokens,
                            len(req.output_ids))
        if reason:
            self._finish(req, reason, event)
        else:
            self._emit(req, event)

    def append_tokens(self, req: Request, emitted: list[tuple[int, TokenLogprobs | None]]) -> None:
        """Append a speculative cycle's tokens [(token, logprobs)] to `req` as `append_token` would
        one by one, up to where it finishes. A run that nothing but a stop string could end mid-way
        (no logprobs, grammar or stop strings, none of it a stop token or past a length) goes as
        one: one detokenizer pass, one metrics record, one `StreamEvent` with the run's text (one
        chunk for a streaming client)."""
        tokens = [t for t, _ in emitted]
        if (len(tokens) == 1 or any(lp is not None for _, lp in emitted) or req.params.stop
                or req.grammar_state is not None or req.would_end(tokens)):
            for token, lp in emitted:
                self.append_token(req, token, lp)
                if req.finished:
                    return
            return
        req.output_ids.extend(tokens)
        self.metrics.token(req, len(tokens))
        text = self._detok[req.rid].add(*tokens)
        req.output_text += text
        self._emit(req, StreamEvent(tokens[-1], text, None, None, len(req.prompt_ids), req.num_cached_tokens,
                                    len(req.output_ids)))

    def _emit(self, req: Request, event: StreamEvent) -> None:
        sink = self._sinks.get(req.rid)
        if sink is not None:
            sink(event)

    def _finish(self, req: Request, reason: str, last: StreamEvent | None = None) -> None:
        """Free and count `req`, then send its last event (`last`, or an empty one for abort and
        error): a client that has seen the end also sees it in the metrics."""
        req.num_inflight = 0   # tokens still computing for it are dropped when read
        self.scheduler.finish(req, reason)
        self.metrics.finish(req, reason)
        self._emit(req, last or StreamEvent(-1, "", None, reason, len(req.prompt_ids),
                                            req.num_cached_tokens, len(req.output_ids)))
        for table in (self._live, self._sinks, self._detok):
            table.pop(req.rid, None)

    def _reset_caches(self) -> None:
        for s in self.scheduler.ranks:
            s.cache.reset()

    def update_gauges(self) -> None:
        ss = self.scheduler.ranks
        total, held = sum(s.allocator.num_pages for s in ss), self.scheduler.num_pages_held
        self.metrics.set_gauges(
            num_requests_waiting=self.num_waiting,
            num_requests_running=len(self.scheduler.running), kv_pages_total=total,
            kv_pages_used=held, kv_pages_cached=sum(s.cache.num_cached_pages for s in ss),
            kv_usage_ratio=held / total,
            kernel_binaries_compiled=self._kernel_binaries())

    def _kernel_binaries(self) -> int:
        """Triton binaries compiled so far; after warm-up (`reset_metrics`) a new one is a request
        that waited for a compile: say which kernel on stderr."""
        if self.runner.kernels is None:
            return 0
        n = self.runner.kernels.num_compiled()
        seen = self._serving_kernels
        if seen is not None and n != sum(seen.values()):
            now = self.runner.kernels.compiled_by_kernel()
            new = {k: v - seen.get(k, 0) for k, v in now.items() if v != seen.get(k, 0)}
            print(f"glmc: compiled while serving (a request waited): {new}", file=sys.stderr, flush=True)
            self._serving_kernels = now
        return n

    # -- DP rank 0's parts (the only ones unless runner.num_dp > 1) ------------------------------

    @property
    def allocator(self) -> PageAllocator:
        return self.scheduler.ranks[0].allocator

    @property
    def req_pool(self) -> ReqToTokenPool:
        return self.scheduler.ranks[0].req_pool

    @property
    def cache(self):
        return self.scheduler.ranks[0].cache

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox)


class _StepProfile:
    """torch.profiler over the next `num_steps` engine steps that have work."""

    def __init__(self, num_steps: int, path: str, done: threading.Event | None):
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.left, self.path, self.done = num_steps, path, done
        self.prof = profile(activities=acts, record_shapes=False, with_stack=False)
        self.prof.__enter__()
        self.finished = False

    def cancel(self) -> None:
        self.prof.__exit__(None, None, None)

    def record(self, step) -> bool:
        with torch.profiler.record_function("glmc.engine.step"):
            busy = step()
        self.left -= busy
        if self.left <= 0:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.prof.export_chrome_trace(self.path)
            with open(self.path + ".txt", "w") as f:
                f.write(self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
            self.finished = True
            if self.done is not None:
                self.done.set()
        return busy


def _rank_scheduler(runner: ModelRunner, run: RunConfig) -> Scheduler:
    allocator = PageAllocator(runner.num_pages)
    cache = RadixCache(allocator) if run.enable_prefix_cache else NoPrefixCache()
    return Scheduler(allocator, ReqToTokenPool(run.max_running, runner.max_context), cache,
                     max_running=run.max_running, max_batch_tokens=run.max_batch_tokens,
                     mixed_prefill_tokens=run.mixed_prefill_tokens)


def _name_os_thread(name: bytes) -> None:
    """Give the calling thread `name` in the OS (Linux: /proc/<pid>/task/<tid>/comm, top -H), so
    the engine thread's CPU time can be told from the server's; elsewhere nothing."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)   # PR_SET_NAME
        except (OSError, AttributeError):
            pass
