"""HTTP/1.0 clients get a response of unknown length close-delimited, as HTTP/1.0 frames it.

uvicorn's httptools protocol (the fast one `glmc run` serves with) frames every response that has
no Content-Length, a streamed one, with `Transfer-Encoding: chunked`, whatever the request's
version. HTTP/1.0 has no chunked encoding: an HTTP/1.0 client (`curl --http1.0`, a proxy that
speaks 1.0 upstream) reads the chunk sizes as part of the body. `Http10Protocol` is that protocol
with one change, for HTTP/1.0 requests only: such a response goes out bare and ends where the
connection closes (uvicorn keeps no HTTP/1.0 connection alive and says `Connection: close`).
HTTP/1.1 requests take uvicorn's path unchanged.
"""
from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class Http10Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, HTTP/1.0 responses of unknown length close-delimited."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if self.scope.get("http_version") == "1.0" and cycle is not None and cycle.scope is self.scope:
            _close_delimited(cycle)


def _close_delimited(cycle) -> None:
    """Make `cycle` (uvicorn's `RequestResponseCycle` of one HTTP/1.0 request) send a response
    without Content-Length as bare bytes: with `chunked_encoding` False uvicorn adds no chunked
    framing, and each body message is given its own length as what is left to send, so uvicorn's
    length check (no bytes past a Content-Length) lets it through and the last one completes it."""
    send = cycle.send
    bare = False

    async def send_bare(message) -> None:
        nonlocal bare
        if message["type"] == "http.response.start":
            names = {name.lower() for name, _ in message.get("headers", [])}
            bare = not names & {b"content-length", b"transfer-encoding"}
            if bare:
                cycle.chunked_encoding = False
        elif message["type"] == "http.response.body" and bare:
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)
    cycle.send = send_bare
