"""uvicorn under glmc's signal rules (`runtime/serving/server.py` `serve` runs it).

The first signal starts a graceful shutdown (the server's `on_stop` gives in-flight requests their
grace period); the second of either kind forces exit (uvicorn alone: only a second SIGINT); a
signal that came before uvicorn started still stops it; signals outside `accepted` go to the
handler that was installed before (rank 0 of a multi-process server leaves Ctrl-C to the launcher,
`runtime/engine/distributed.py`).
"""
from __future__ import annotations

import logging
import socket


class SignalledServer:
    """A `uvicorn.Server` (`.server`) and the handlers that apply the module's rules."""

    def __init__(self, config, accepted: tuple[int, ...], before: dict, on_stop):
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                if sig in accepted:
                    outer.on_signal(self)
                elif callable(before.get(sig)):
                    before[sig](sig, frame)

        self.server, self.accepted, self.before, self.early = Server(config), accepted, before, False
        self.on_stop = on_stop  # called at the first signal

    def on_signal(self, server) -> None:
        if server.should_exit:
            print("glmc: second signal: exiting now", flush=True)
            # the requests still running are cancelled with the event loop: expected, not news
            logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
            server.force_exit = True
        else:
            self.on_stop()
        server.should_exit = True

    def record(self, signum, frame) -> None:
        """Handler before uvicorn takes the signals over, and after it gives them back."""
        if signum not in self.accepted:
            if callable(self.before.get(signum)):
                self.before[signum](signum, frame)
        elif not self.server.started:
            self.early = True

    def run(self, sock: socket.socket) -> None:
        self.server.should_exit = self.early
        self.server.run(sockets=[sock])
