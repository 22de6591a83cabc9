"""The bridge between the engine thread and asyncio: one API call's token events as an async
queue, aborted when the caller leaves early (a disconnect, a cancelled task at shutdown)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi import Request as HTTPRequest
from glmc.runtime.engine.engine import Engine, StreamEvent
from glmc.runtime.engine.request import Request

DISCONNECT_POLL_S = 0.5


class EventStream:
    """Events of requests submitted together (the `n` choices / prompts of one API call), as
    (index, event) pairs in arrival order via `get()` until `done`. Use as `async with`: leaving
    early aborts the requests that have not finished, which frees their pages."""

    @classmethod
    def open(cls, engine: Engine, reqs: list[Request]) -> EventStream:
        """Submit `reqs` to `engine` (call from the event loop); raises `Overloaded`."""
        stream = cls(engine, reqs)
        engine.submit_many(reqs, [stream.sink(i) for i in range(len(reqs))])
        return stream

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


async def events(http: HTTPRequest, stream: EventStream):
    """(index, event) until every request finished, or until the client disconnects (checked
    every DISCONNECT_POLL_S, busy or not)."""
    next_check = time.monotonic() + DISCONNECT_POLL_S
    while not stream.done:
        item = await stream.get(timeout=DISCONNECT_POLL_S)
        if item is not None:
            yield item
        if time.monotonic() >= next_check:
            if await http.is_disconnected():
                return
            next_check = time.monotonic() + DISCONNECT_POLL_S
