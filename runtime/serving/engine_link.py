"""The pipe between the engine's process and the HTTP server's process (`server.serve`).

Why two processes: the event loop's work per streamed token (SSE formatting, writes, the loop
itself) and the engine thread's host work share one GIL in one process; at concurrency 32 on the
H200 the loop's ~55 us of CPU per token stretched each decode step from ~1.2x to ~1.8x its graph
replay. SGLang splits the same way (tokenizer manager / scheduler).

- `EngineHost` (the engine's process) takes submissions, aborts and calls off the pipe on its own
  thread, and after every engine step sends the step's events as one message (`Engine.after_step`),
  with the engine's waiting count.
- `RemoteEngine` (the HTTP process) is what the app sees of the engine: the same attributes and
  methods the serving code uses (`tokenizer`, `max_context`, `max_waiting`, `make_request`,
  `submit_many`, `abort`, `metrics.inc/exposition`, `profile`, `flush_cache`, `reset_metrics`,
  `alive`). Requests are validated here by the engine's own `Admission`; `submit_many` refuses
  (`Overloaded`) from the last waiting count the engine sent plus what was submitted since, which
  is never below the engine's own count. Blocking calls (`call`) must come from other threads.

Both ends keep the pipe blocking and give it threads of their own. The HTTP process reads on one
thread, which hands each step's events to their streams as the engine thread does in one process,
and writes on another, so the event loop never waits for the engine to take a large message (a
request with megabytes of stop strings) and nothing else touches the socket's mode. (Watching the
pipe with the loop's `add_reader` made uvloop switch the socket, which serves both directions, to
non-blocking: a message larger than its buffer, ~200 KB, then failed with `BlockingIOError`.) The
engine's process is gone only when the pipe reaches its end (`EOFError`): then every open stream
ends with an error and `on_lost` is called (`glmc run`'s server exits, status 1).

Messages (tuples, pickled): HTTP -> engine: ("submit", seq, [Request]), ("abort", rid),
("inc", counter, value), ("call", id, name, args); engine -> HTTP: ("events", waiting, seq, [event
tuple]), ("reply", id, ok, value), ("alive", bool).
"""
from __future__ import annotations

import itertools
import queue
import threading
import traceback
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection

from glmc.runtime.engine.admission import Admission
from glmc.runtime.engine.engine import Engine, Overloaded, StreamEvent
from glmc.runtime.engine.request import Request
from glmc.runtime.engine.tokenizer import Tokenizer

ALIVE_POLL_S = 0.5   # how often the host checks that the engine thread still runs
CALLS = ("exposition", "inc", "profile", "flush_cache", "reset_metrics")


class EngineHost:
    """The engine's end of the pipe (see the module docstring). `start()` hooks the engine and
    starts the reading thread; `close()` unhooks it."""

    def __init__(self, engine: Engine, conn: Connection):
        self.engine, self.conn = engine, conn
        self._send_lock = threading.Lock()
        self._out: list[tuple] = []     # this step's events (engine thread only)
        self._seq = 0                   # the last submission put into the engine's inbox
        self._sent_waiting = -1
        self._thread = threading.Thread(target=self._read, name="glmc-link", daemon=True)

    def start(self) -> None:
        self.engine.after_step = self._flush
        self._thread.start()

    def close(self) -> None:
        self.engine.after_step = None

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):   # the HTTP process is gone; the reader sees it too
                pass

    def _sink(self, rid: str):
        out = self._out

        def put(ev: StreamEvent) -> None:
            out.append((rid, ev.token_id, ev.text, ev.logprobs, ev.finish_reason,
                        ev.num_prompt_tokens, ev.num_cached_tokens, ev.num_output_tokens))
        return put

    def _flush(self) -> None:
        """After a step (engine thread): its events in one message, or the waiting count alone
        when that changed (so the HTTP side's estimate comes back down)."""
        seq = self._seq                       # read before the count: never under-counted
        waiting = self.engine.num_waiting
        if not self._out and waiting == self._sent_waiting:
            return
        out = self._out[:]
        self._out.clear()   # in place: the sinks hold this list
        self._sent_waiting = waiting
        self._send(("events", waiting, seq, out))

    def _read(self) -> None:
        alive = True
        while True:
            try:
                if not self.conn.poll(ALIVE_POLL_S):
                    if self.engine.alive != alive:
                        alive = self.engine.alive
                        self._send(("alive", alive))
                    continue
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            self._handle(msg)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            _, seq, reqs = msg
            self.engine.enqueue(reqs, [self._sink(r.rid) for r in reqs])
            self._seq = seq
        elif kind == "abort":
            self.engine.abort(msg[1])
        elif kind == "inc":
            self.engine.metrics.inc(msg[1], msg[2])
        elif kind == "call":   # may block (a flush waits for the engine): off this thread
            threading.Thread(target=self._call, args=msg[1:], daemon=True).start()

    def _call(self, cid: int, name: str, args: tuple) -> None:
        engine = self.engine
        try:
            if name not in CALLS:
                raise ValueError(f"unknown engine call {name!r}")
            target = getattr(engine.metrics if name in ("exposition", "inc") else engine, name)
            self._send(("reply", cid, True, target(*args)))
        except Exception as e:  # noqa: BLE001 - the caller re-raises it in the HTTP process
            self._send(("reply", cid, False, f"{type(e).__name__}: {e}"))


class RemoteEngine:
    """The HTTP process's view of the engine (see the module docstring)."""

    def __init__(self, conn: Connection, tokenizer: Tokenizer, admission: Admission,
                 max_waiting: int, on_lost=None):
        self.conn, self.tokenizer, self.admission = conn, tokenizer, admission
        self.max_context, self.max_waiting = admission.max_context, max_waiting
        self.metrics = _RemoteMetrics(self)
        self.on_lost = on_lost                 # called (reader thread) if the engine's process goes
        self._lock = threading.Lock()          # the sinks and the waiting count (loop and reader)
        self._sinks: dict[str, object] = {}
        self._ids = itertools.count()
        self._seq, self._waiting, self._unseen = 0, 0, deque()   # (seq, count) not yet reported
        self._calls: dict[int, Future] = {}
        self._engine_alive, self._lost, self._stopping = True, False, False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._write, name="glmc-link-write", daemon=True),
                         threading.Thread(target=self._read, name="glmc-link-read", daemon=True)]

    # -- the engine's interface ------------------------------------------------------------------

    def make_request(self, prompt_ids: list[int], params) -> Request:
        req = self.admission.make_request(prompt_ids, params)
        req.rid = f"http-{next(self._ids)}"   # the engine's process numbers its own requests
        return req

    def submit_many(self, reqs: list[Request], sinks: list) -> None:
        """Queue all of `reqs` or none (`Overloaded` when the queue is full)."""
        with self._lock:
            if self._lost:
                raise Overloaded("the engine's process is gone")
            waiting = self._waiting + sum(n for _, n in self._unseen)
            if waiting + len(reqs) > self.max_waiting:
                raise Overloaded(f"{self.max_waiting} requests already waiting")
            self._seq += 1
            self._unseen.append((self._seq, len(reqs)))
            self._sinks.update((r.rid, s) for r, s in zip(reqs, sinks))
            self._send(("submit", self._seq, reqs))

    def abort(self, rid: str) -> None:
        self._send(("abort", rid))

    @property
    def alive(self) -> bool:
        return self._engine_alive and not self._lost

    def start(self) -> None:
        """Start the pipe's reading and writing threads."""
        for t in self._threads:
            if not t.is_alive():
                t.start()

    def stop(self) -> None:
        """Stop writing once what was sent so far is written; the end of the pipe from now on is
        this server's own shutdown, not a lost engine."""
        self._stopping = True
        self._outbox.put(None)

    def flush_cache(self, timeout: float = 10.0) -> None:
        self.call("flush_cache", timeout)

    def reset_metrics(self) -> None:
        self.call("reset_metrics")

    def profile(self, num_steps: int, path: str, timeout: float = 120.0) -> str:
        return self.call("profile", num_steps, path, timeout, timeout=timeout + 10)

    def call(self, name: str, *args, timeout: float = 60.0):
        """(Not the event loop's thread.) Run `Engine.<name>(*args)` in the engine's process."""
        future: Future = Future()
        cid = next(self._ids)
        self._calls[cid] = future
        if self._lost:   # checked after the entry is in: a loss from now on fails it
            raise RuntimeError("the engine's process is gone")
        self._send(("call", cid, name, args))
        try:
            return future.result(timeout)
        finally:
            self._calls.pop(cid, None)

    # -- the pipe --------------------------------------------------------------------------------

    def _send(self, msg: tuple) -> None:
        """(Any thread, never blocks.) The writing thread sends `msg` after what came before."""
        self._outbox.put(msg)

    def _write(self) -> None:
        """The writing thread: blocking sends, in order. A failed send means the engine's end is
        closed; the reading thread sees the same and reports it."""
        while (msg := self._outbox.get()) is not None:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                return
            except Exception:  # noqa: BLE001 - a message that does not pickle: fail its callers
                traceback.print_exc()
                self._fail(msg)

    def _fail(self, msg: tuple) -> None:
        if msg[0] == "submit":
            with self._lock:
                sinks = [self._sinks.pop(r.rid, None) for r in msg[2]]
            for sink in filter(None, sinks):
                sink(StreamEvent(-1, "", None, "error", 0, 0, 0))
        elif msg[0] == "call" and (future := self._calls.get(msg[1])) is not None:
            future.set_exception(RuntimeError("the engine call could not be sent"))

    def _read(self) -> None:
        """The reading thread: every message as it arrives, until the engine's end closes."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            self._dispatch(msg)
        if not self._stopping:
            self._connection_lost()

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "events":
            _, waiting, seq, events = msg
            with self._lock:
                self._waiting = waiting
                while self._unseen and self._unseen[0][0] <= seq:
                    self._unseen.popleft()
                sinks = [self._sinks.pop(rid) if fields[3] is not None else self._sinks.get(rid)
                         for rid, *fields in events]
            for sink, (_, *fields) in zip(sinks, events):
                if sink is not None:
                    sink(StreamEvent(*fields))
        elif kind == "reply":
            _, cid, ok, value = msg
            future = self._calls.get(cid)
            if future is not None:
                future.set_result(value) if ok else future.set_exception(RuntimeError(value))
        elif kind == "alive":
            self._engine_alive = msg[1]

    def _connection_lost(self) -> None:
        with self._lock:
            self._lost = True
            sinks, self._sinks = list(self._sinks.values()), {}
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(RuntimeError("the engine's process is gone"))
        for sink in sinks:   # every open stream ends with an error
            sink(StreamEvent(-1, "", None, "error", 0, 0, 0))
        if self.on_lost is not None:
            self.on_lost()


class _RemoteMetrics:
    """`Engine.metrics` as the server uses it, over the pipe."""

    def __init__(self, remote: RemoteEngine):
        self.remote = remote

    def inc(self, name: str, value: int = 1) -> None:
        self.remote._send(("inc", name, value))

    def exposition(self) -> tuple[bytes, str]:
        """(Not the event loop's thread.)"""
        return self.remote.call("exposition")
