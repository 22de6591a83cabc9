"""The engine loop: scheduler + model runner + sampler, with thread-safe submission and async streams.

One engine thread owns all scheduling state and runs `step()` in a loop: take new requests and aborts
from the inbox, schedule, run the model, sample, detokenize and hand `StreamEvent`s to each request's
sink. The HTTP server (asyncio) talks to it only through `open_stream` and `abort`, so a slow
forward never blocks the event loop. Tests may instead call `step()`/`generate()` directly with no
thread.

`ModelRunner` is the seam to the device: the torch `ReferenceModel` today, compiled plans later.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import threading
import traceback
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from glmc.runtime.forward_batch import ForwardBatch
from glmc.runtime.metrics import Metrics
from glmc.runtime.pages import PAGE_SIZE, PageAllocator, ReqToTokenPool
from glmc.runtime.prefix_cache import NoPrefixCache, RadixCache
from glmc.runtime.request import Request
from glmc.runtime.sampling import SamplingParams, TokenLogprobs, make_generator, sample_row
from glmc.runtime.scheduler import ScheduledBatch, Scheduler
from glmc.runtime.tokenizer import Detokenizer, Tokenizer


class ModelRunner(ABC):
    """Runs one `ForwardBatch` on a device that owns the paged KV memory.

    Contract: `forward(batch)` writes the KV (and indexer keys) of every new token at
    `batch.out_cache_loc`, reads earlier tokens through `batch.req_to_token`, and returns fp32 logits
    [B, vocab_size] of each request's last new token. The runner never allocates slots: the
    scheduler hands out pages 0..num_pages-1 (of `page_size` tokens) and positions below
    `max_context`; a runner that needs scratch slots (e.g. padding tokens of a compiled plan)
    keeps them in pages numbered num_pages and above.
    """

    vocab_size: int
    num_pages: int
    max_context: int
    page_size: int = PAGE_SIZE

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


class InvalidRequest(ValueError):
    """A request the engine cannot take; `param` names the API field, `code` is OpenAI's code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class Overloaded(RuntimeError):
    """The waiting queue is full; retry later."""


@dataclass
class StreamEvent:
    """One new token of a request: its id, the text now safe to send, and the finish reason."""

    token_id: int
    text: str
    logprobs: TokenLogprobs | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


class EventStream:
    """Events of requests submitted together (the `n` choices / prompts of one API call), as
    (index, event) pairs in arrival order via `get()` until `done`. Use as `async with`: leaving
    early aborts the requests that have not finished, which frees their pages."""

    def __init__(self, engine: Engine, reqs: list[Request]):
        self.engine, self.reqs = engine, reqs
        self._loop, self._queue = asyncio.get_running_loop(), asyncio.Queue()
        self._open = len(reqs)

    def sink(self, index: int) -> Callable[[StreamEvent], None]:
        def put(event: StreamEvent) -> None:
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, event))
            except RuntimeError:  # the event loop is gone; nobody is listening any more
                pass
        return put

    @property
    def done(self) -> bool:
        return self._open == 0

    async def get(self, timeout: float | None = None) -> tuple[int, StreamEvent] | None:
        """The next (index, event), or None if nothing arrived within `timeout` seconds."""
        try:
            index, event = await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None
        self._open -= event.finish_reason is not None
        return index, event

    def close(self) -> None:
        for req in self.reqs:
            if not req.finished:
                self.engine.abort(req.rid)

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class Engine:
    """Continuous-batching engine over a `ModelRunner`; see the module docstring."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, max_running: int = 32,
                 max_batch_tokens: int = 256, max_waiting: int = 256,
                 enable_prefix_cache: bool = True):
        if runner.page_size != PAGE_SIZE:
            raise ValueError(f"runner page_size {runner.page_size} != runtime PAGE_SIZE {PAGE_SIZE}")
        if tokenizer.vocab_size > runner.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens, model vocab_size is "
                             f"{runner.vocab_size}")
        self.runner, self.tokenizer, self.max_waiting = runner, tokenizer, max_waiting
        self.allocator = PageAllocator(runner.num_pages)
        self.req_pool = ReqToTokenPool(max_running, runner.max_context)
        self.cache = RadixCache(self.allocator) if enable_prefix_cache else NoPrefixCache()
        self.scheduler = Scheduler(self.allocator, self.req_pool, self.cache,
                                   max_running=max_running, max_batch_tokens=max_batch_tokens)
        self.metrics = Metrics()
        self.max_context = runner.max_context
        self._inbox: deque = deque()
        self._sinks: dict[str, Callable[[StreamEvent], None]] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._live: dict[str, Request] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._update_gauges()

    # -- submission (any thread) -----------------------------------------------------------------

    def make_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Validate a prompt and its parameters into a `Request` (raises `InvalidRequest`)."""
        if not prompt_ids:
            raise InvalidRequest("prompt is empty", "prompt", "empty_prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids {bad[:5]} outside [0, {self.runner.vocab_size})",
                                 "prompt", "invalid_token")
        params.validate(self.runner.vocab_size)
        room = self.max_context - len(prompt_ids)
        if room < 1 or params.max_tokens > room:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_context} tokens. However, you "
                f"requested {len(prompt_ids) + params.max_tokens} tokens ({len(prompt_ids)} in the "
                f"prompt, {params.max_tokens} for the completion).", "max_tokens"
                if room >= 1 else "prompt", "context_length_exceeded")
        req = Request(list(prompt_ids), params, eos_token_ids=self.tokenizer.eos_token_ids,
                      max_context=self.max_context, generator=make_generator(params.seed))
        if not self.scheduler.fits(req):
            raise InvalidRequest(f"request needs {req.max_total_tokens} tokens of KV, more than the "
                                 f"pool's {self.allocator.num_pages * PAGE_SIZE}", "max_tokens",
                                 "context_length_exceeded")
        return req

    def submit(self, req: Request, sink: Callable[[StreamEvent], None] | None = None) -> None:
        """Queue `req`; `sink` receives its events on the engine thread. Raises `Overloaded`."""
        self.submit_many([req], [sink])

    def submit_many(self, reqs: list[Request], sinks: list) -> None:
        """Queue all of `reqs` or none of them (raises `Overloaded` when the queue is full)."""
        if len(self.scheduler.waiting) + len(self._inbox) + len(reqs) > self.max_waiting:
            raise Overloaded(f"{self.max_waiting} requests already waiting")
        self._inbox.extend(("add", r, s) for r, s in zip(reqs, sinks))
        self._wake.set()

    def abort(self, rid: str) -> None:
        """Stop a request (e.g. its client went away); its pages are freed on the engine thread."""
        self._inbox.append(("abort", rid, None))
        self._wake.set()

    def open_stream(self, reqs: list[Request]) -> EventStream:
        """Submit `reqs` now (call from the event loop) and return their merged event stream."""
        stream = EventStream(self, reqs)
        self.submit_many(reqs, [stream.sink(i) for i in range(len(reqs))])
        return stream

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
        while not self._stop:
            try:
                busy = self.step()
            except Exception:  # a bug in a step must not hang every client: fail them all
                traceback.print_exc()
                for req in [*self.scheduler.running, *self.scheduler.waiting]:
                    self._finish(req, "error")
                busy = True
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
        """One iteration; returns False when there was nothing to do."""
        self._drain_inbox()
        batch = self.scheduler.schedule()
        if batch is None:
            self._update_gauges()
            return False
        self._account(batch)
        if batch.reqs:
            fb = ForwardBatch.build(
                batch.mode, [r.all_ids[s:s + n] for r, s, n in
                             zip(batch.reqs, batch.prefix_lens, batch.extend_lens)],
                [r.row for r in batch.reqs], batch.prefix_lens, self.req_pool.table)
            logits = self.runner.forward(fb)
            self.scheduler.commit(batch)
            for i, req in enumerate(batch.reqs):
                if req.num_pending == 0:
                    self._sample(req, logits[i])
        self._update_gauges()
        return True

    def flush_cache(self, timeout: float = 10.0) -> None:
        """Drop the prefix cache; with the engine thread running, it does it between steps."""
        if not self.alive:
            self.cache.reset()
            self._update_gauges()
            return
        done = threading.Event()
        self._inbox.append(("flush", done, None))
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError("engine thread did not flush the prefix cache")

    # -- internals -------------------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, item, sink = self._inbox.popleft()
            if kind == "add":
                self._live[item.rid], self._sinks[item.rid] = item, sink
                self._detok[item.rid] = Detokenizer(self.tokenizer, item.params.stop)
                self.scheduler.add(item)
            elif kind == "flush":
                self.cache.reset()
                item.set()
            elif (req := self._live.get(item)) is not None:
                self._finish(req, "abort")

    def _account(self, batch: ScheduledBatch) -> None:
        m = self.metrics
        m.inc("steps_total")
        m.inc("requests_retracted_total", len(batch.retracted))
        for req in batch.admitted:
            m.inc("prompt_tokens_total", req.num_tokens)
            m.inc("prefix_cache_hit_tokens_total", req.num_cached_tokens)
        m.inc("prefill_tokens_total", sum(n for r, n in zip(batch.reqs, batch.extend_lens)
                                          if not r.is_decoding))

    def _sample(self, req: Request, logits: torch.Tensor) -> None:
        token, lp = sample_row(logits, req.params, req.prompt_ids, req.output_ids, req.generator)
        req.output_ids.append(token)
        if lp is not None:
            req.output_logprobs.append(lp)
        self._timing(req)
        reason = req.check_stop_token(token)
        detok = self._detok[req.rid]
        if reason == "stop":  # a stop/eos token: its text is not part of the output
            text = detok.flush()
        else:
            text = detok.add(token)
            reason = "stop" if detok.stopped else reason
            text += detok.flush() if reason else ""
        req.output_text += text
        self._emit(req, StreamEvent(token, text, lp, reason, len(req.prompt_ids),
                                    req.num_cached_tokens, len(req.output_ids)))
        if reason:
            self._finish(req, reason)

    def _timing(self, req: Request) -> None:
        now, m = time.monotonic(), self.metrics
        if req.first_token_time is None:
            req.first_token_time = now
            m.observe("time_to_first_token_seconds", now - req.arrival_time)
        else:
            m.observe("inter_token_latency_seconds", now - req.last_token_time)
        req.last_token_time = now
        m.tokens(1)

    def _emit(self, req: Request, event: StreamEvent) -> None:
        sink = self._sinks.get(req.rid)
        if sink is not None:
            sink(event)

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        if reason in ("abort", "error"):
            self._emit(req, StreamEvent(-1, "", None, reason, len(req.prompt_ids),
                                        req.num_cached_tokens, len(req.output_ids)))
        self.metrics.finish(reason)
        if req.first_token_time is not None:
            self.metrics.observe("e2e_request_latency_seconds", time.monotonic() - req.arrival_time)
        for table in (self._live, self._sinks, self._detok):
            table.pop(req.rid, None)

    def _update_gauges(self) -> None:
        held, cached = self.scheduler.num_pages_held, self.cache.num_cached_pages
        total = self.allocator.num_pages
        self.metrics.set_gauges(
            num_requests_waiting=len(self.scheduler.waiting) + len(self._inbox),
            num_requests_running=len(self.scheduler.running), kv_pages_total=total,
            kv_pages_used=held, kv_pages_cached=cached,
            kv_usage_ratio=self.allocator.num_used / total)

    def warmup(self) -> None:
        """Run one short request through every phase (prefill, decode), then forget it."""
        from tqdm import tqdm

        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        req = self.make_request(list(range(min(8, self.runner.vocab_size))), params)
        self.submit(req)
        with tqdm(total=params.max_tokens, desc="warm-up", unit="tok", leave=False) as bar:
            while not req.finished:
                self.step()
                bar.n = len(req.output_ids)
                bar.refresh()
        self.flush_cache()
        self.metrics = Metrics()
        self._update_gauges()


class ReferenceRunner(ModelRunner):
    """`ModelRunner` over the fp32 torch `ReferenceModel` and its own `KVPool`."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor], num_pages: int,
                 max_context: int | None = None):
        from glmc.runtime.kv_cache import PAGE_SIZE as POOL_PAGE_SIZE, KVPool
        from glmc.runtime.reference_model import ReferenceModel
        from glmc.runtime.weights import resolve_config

        if POOL_PAGE_SIZE != PAGE_SIZE:
            raise ValueError(f"kv_cache.PAGE_SIZE {POOL_PAGE_SIZE} != pages.PAGE_SIZE {PAGE_SIZE}")
        c = resolve_config(config)
        mtp = f"model.layers.{c.num_hidden_layers}.eh_proj.weight" in weights
        num_layers = c.num_hidden_layers + mtp  # the MTP block gets a KV layer of its own
        full = set(c.full_layers) | ({c.num_hidden_layers} if mtp else set())
        self.pool = KVPool(num_layers, full, num_pages, c.kv_lora_rank, c.qk_rope_head_dim,
                           c.index_head_dim)
        self.model = ReferenceModel(config, weights, self.pool)
        self.vocab_size, self.num_pages = c.vocab_size, num_pages
        limit = min(c.max_position_embeddings, num_pages * PAGE_SIZE)
        self.max_context = min(max_context or limit, limit)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch)


# -- building engines ----------------------------------------------------------------------------

TINY_DIR = Path(__file__).resolve().parent.parent / "models" / "tiny"
TINY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
TINY_SEED = 0
TINY_STAMP = f"glmc tiny weights: seed {TINY_SEED}, init v1\n"  # bump when _tiny_init changes


def make_tiny_checkpoint(ckpt_dir: str | Path) -> Path:
    """Write the tiny GLM (models/tiny/config.json, same architecture as GLM-5) as an HF checkpoint
    with deterministic random weights, plus the tiny tokenizer. Reuses an up-to-date directory."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from glmc.runtime.weights import expected_tensors

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    fresh = all((ckpt_dir / f).exists() and (ckpt_dir / f).read_bytes() == (TINY_DIR / f).read_bytes()
                for f in TINY_FILES)
    stamp = ckpt_dir / "glmc_tiny.txt"
    if fresh and stamp.exists() and stamp.read_text() == TINY_STAMP:
        return ckpt_dir
    config = json.loads((TINY_DIR / "config.json").read_text())
    gen, tensors = torch.Generator().manual_seed(TINY_SEED), {}
    for name, shape in tqdm(sorted(expected_tensors(config).items()), desc="tiny weights",
                            unit="tensor", leave=False):
        tensors[name] = _tiny_init(name, shape, gen)
    tmp = ckpt_dir / f"model.safetensors.tmp{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, ckpt_dir / "model.safetensors")  # atomic: concurrent builders agree
    for f in TINY_FILES:
        shutil.copyfile(TINY_DIR / f, ckpt_dir / f)
    stamp.write_text(TINY_STAMP)  # last: a half-written directory is never taken as fresh
    return ckpt_dir


def _tiny_init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Norm weights 1, biases small, embeddings N(0, 1), matrices with std 2/sqrt(fan_in): the
    activations stay O(1) and the logits are peaked enough that greedy decoding has clear winners."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if len(shape) == 1:
        return 0.01 * torch.randn(shape, generator=gen)
    scale = 1.0 if name.endswith("embed_tokens.weight") else 2.0 / math.sqrt(shape[1])
    return scale * torch.randn(shape, generator=gen)


def build_engine(ckpt_dir: str | Path, *, num_pages: int = 256, max_context: int | None = None,
                 warmup: bool = True, **engine_kwargs) -> Engine:
    """An engine over the reference model of an HF glm_moe_dsa checkpoint directory (config.json,
    safetensors, tokenizer.json, tokenizer_config.json)."""
    from tqdm import tqdm

    from glmc.runtime.weights import detect_mtp, expected_tensors, load_checkpoint

    ckpt_dir = Path(ckpt_dir)
    config = json.loads((ckpt_dir / "config.json").read_text())
    expected = expected_tensors(config, **detect_mtp(ckpt_dir))
    with tqdm(total=len(expected), desc="loading weights", unit="tensor", leave=False) as bar:
        weights = load_checkpoint(ckpt_dir, expected)  # no per-tensor hook: one jump at the end
        bar.update(len(weights))
    runner = ReferenceRunner(config, weights, num_pages, max_context)
    engine = Engine(runner, Tokenizer.from_dir(ckpt_dir), **engine_kwargs)
    if warmup:
        engine.warmup()
    return engine


def build_tiny_engine(cache_dir: str | Path | None = None, **kwargs) -> Engine:
    """The default tiny model: random weights made on first use under `cache_dir`
    (default $GLMC_CACHE/tiny or ~/.cache/glmc/tiny), tokenizer and chat template from models/tiny."""
    if cache_dir is None:
        root = os.environ.get("GLMC_CACHE") or Path.home() / ".cache" / "glmc"
        cache_dir = Path(root) / "tiny"
    return build_engine(make_tiny_checkpoint(cache_dir), **kwargs)
