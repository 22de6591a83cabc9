"""The bridge between the engine thread and asyncio: one API call's token events, taken by the
event loop in batches, aborted when the caller leaves early (a disconnect, a cancelled task at
shutdown).

Why batches: a step of the engine emits one event per running request, and the event loop shares
the GIL with the engine thread, so the loop's work per token is taken from the engine's steps.
One `call_soon_threadsafe` per event is a self-pipe write and a loop wake-up each, and one queue
hand-off per event is a task wake-up each. Here a burst of events wakes the loop once (`_Waker`), each
stream's events wait in a deque (appends are atomic under the GIL), and a consumer takes all that
arrived at once, so a stream that lags a step writes its tokens in one response chunk.
"""
from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from fastapi import Request as HTTPRequest
from glmc.runtime.engine.engine import Engine, StreamEvent
from glmc.runtime.engine.request import Request

DISCONNECT_POLL_S = 0.5


class _Waker:
    """Wakes streams on one event loop from other threads: the first `notify` of a burst schedules
    one loop callback, which sets the ready flag of every stream notified until it runs."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self._lock, self._due = loop, threading.Lock(), []

    def notify(self, stream: EventStream) -> None:
        with self._lock:
            self._due.append(stream)
            if len(self._due) > 1:   # a wake-up is already scheduled and has not run yet
                return
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:   # the event loop is gone; nobody is listening any more
            pass

    def _wake(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for stream in due:
            stream._ready.set()


_WAKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # event loop -> its _Waker


class EventStream:
    """Events of requests submitted together (the `n` choices / prompts of one API call), as
    (index, event) pairs in arrival order via `next_batch()` until `done`. Use as `async with`:
    leaving early aborts the requests that have not finished, which frees their pages."""

    @classmethod
    def open(cls, engine: Engine, reqs: list[Request]) -> EventStream:
        """Submit `reqs` to `engine` (call from the event loop); raises `Overloaded`."""
        stream = cls(engine, reqs)
        engine.submit_many(reqs, [stream.sink(i) for i in range(len(reqs))])
        return stream

    def __init__(self, engine: Engine, reqs: list[Request]):
        self.engine, self.reqs = engine, reqs
        loop = asyncio.get_running_loop()
        self._waker = _WAKERS.get(loop) or _WAKERS.setdefault(loop, _Waker(loop))
        self._items: deque[tuple[int, StreamEvent]] = deque()
        self._ready = asyncio.Event()
        self._open = len(reqs)

    def sink(self, index: int) -> Callable[[StreamEvent], None]:
        """The engine thread's callback for request `index`."""
        def put(event: StreamEvent) -> None:
            self._items.append((index, event))
            self._waker.notify(self)
        return put

    @property
    def done(self) -> bool:
        return self._open == 0

    async def next_batch(self, timeout: float | None = None) -> list[tuple[int, StreamEvent]]:
        """Every (index, event) that arrived, in order, waiting up to `timeout` seconds for the
        first; [] if none came."""
        if not self._items:
            self._ready.clear()
            if not self._items:   # appended between the check and the clear: its wake-up may have run
                try:
                    async with asyncio.timeout(timeout):
                        await self._ready.wait()
                except TimeoutError:
                    return []
        items = []
        while self._items:
            items.append(self._items.popleft())
        self._open -= sum(event.finish_reason is not None for _, event in items)
        return items

    def close(self) -> None:
        for req in self.reqs:
            if not req.finished:
                self.engine.abort(req.rid)

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


async def events(http: HTTPRequest, stream: EventStream):
    """Batches of (index, event) until every request finished, or until the client disconnects
    (checked every DISCONNECT_POLL_S, busy or not)."""
    next_check = time.monotonic() + DISCONNECT_POLL_S
    while not stream.done:
        batch = await stream.next_batch(timeout=DISCONNECT_POLL_S)
        if batch:
            yield batch
        if time.monotonic() >= next_check:
            if await http.is_disconnected():
                return
            next_check = time.monotonic() + DISCONNECT_POLL_S
