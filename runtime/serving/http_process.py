"""`serve(engine)`: the engine in this process, the HTTP server in a process of its own.

The engine thread keeps this process's GIL to itself; the server process (`http_main`, started
with spawn, in its own session) parses, tokenises, formats and writes, and talks to the engine over
one pipe (`runtime/serving/engine_link.py`). Signals: this process takes `signals` and forwards
each to the server process, which applies glmc's rules (`runtime/serving/signals.py`): the first
starts a graceful shutdown (in-flight requests get `shutdown_timeout_s`, then are aborted), the
second exits at once. A terminal's Ctrl-C reaches only this process once the server has its own
session, so it is forwarded once. Before that (while the server process starts: its interpreter,
its imports) it ignores both signals, and what this process gets meanwhile is counted instead of
forwarded: the server reads the count once its handlers are in, so a signal then stops it before
it serves. `serve` returns when the server process has exited; a server process whose engine
process died exits on its own (the pipe closes).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

from glmc.runtime.engine.admission import Admission
from glmc.runtime.engine.engine import Engine
from glmc.runtime.engine.tokenizer import Tokenizer
from glmc.runtime.serving.engine_link import EngineHost, RemoteEngine
from glmc.runtime.serving.server import ServerOptions, create_app
from glmc.runtime.serving.signals import SignalledServer


@dataclass
class HttpSpec:
    """What the server process needs (picklable)."""

    model_name: str
    host: str
    port: int
    log_level: str
    options: ServerOptions
    tokenizer: Tokenizer
    admission: Admission
    max_waiting: int


class ServerProcessFailed(RuntimeError):
    """The HTTP server process exited with an error (its traceback is on stderr)."""


def serve(engine: Engine, model_name: str = "glmc-tiny", host: str = "127.0.0.1",
          port: int = 8000, log_level: str = "info", options: ServerOptions = ServerOptions(),
          signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Serve `engine` in the foreground until one of `signals` (see the module docstring). The
    URL is printed once the server answers and a start-up request went through it, so a client
    that read it is served at full speed; port 0 picks a free one."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    spec = HttpSpec(model_name, host, port, log_level, options, engine.tokenizer, engine.admission,
                    engine.max_waiting)
    early = ctx.Value("i", 0)  # signals got before the server process took them; -1 once it has
    proc = ctx.Process(target=http_main, args=(theirs, spec, early), name="glmc-http")
    link = EngineHost(engine, ours)
    forwarded: list[int] = []

    def forward(signum, frame) -> None:
        forwarded.append(signum)
        with early.get_lock():  # a re-entrant lock: a signal during this handler waits for nothing
            if early.value >= 0:
                early.value += 1
                return
        try:
            os.kill(proc.pid, signum)
        except ProcessLookupError:
            pass
    main = threading.current_thread() is threading.main_thread()
    previous = {}
    try:
        if main:
            previous = _start_ignoring(proc, {s: forward for s in signals})
        else:
            proc.start()
        theirs.close()
        link.start()
        engine.start()
        proc.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        link.close()
        engine.stop()
        if proc.is_alive():
            proc.kill()
            proc.join()
        ours.close()
    if proc.exitcode != 0 and not forwarded:
        raise ServerProcessFailed(f"the HTTP server process exited with status {proc.exitcode}")


def _start_ignoring(proc, handlers: dict) -> dict:
    """Start `proc` with SIGINT and SIGTERM ignored (ignored dispositions survive its exec; a
    signal mask would not: the spawn start method clears it), then install `handlers` here.
    Returns the handlers they replaced. A signal that comes during the start itself (a few ms:
    pickling the arguments, fork and exec) is lost; one that comes later reaches `handlers`."""
    before = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc.start()
    finally:
        for s, handler in before.items():
            signal.signal(s, handlers.get(s, handler))
    return {s: before[s] for s in handlers}


def http_main(conn, spec: HttpSpec, early) -> None:
    """The server process: uvicorn over a `RemoteEngine` on `conn` until told to stop, /health
    answering 503 until the start-up requests are answered, HTTP/1.0 streams close-delimited
    (`http10.py`). It starts with SIGINT and SIGTERM ignored (`_start_ignoring`); `early` counts
    the signals its engine's process got until this one takes them."""
    os.setsid()   # a terminal's signals go to the engine's process, which forwards them
    import uvicorn

    from glmc.runtime.serving.http10 import Http10Protocol

    sock = listen(spec.host, spec.port)
    url = f"http://{'[' + spec.host + ']' if ':' in spec.host else spec.host}:{sock.getsockname()[1]}"
    remote = RemoteEngine(conn, spec.tokenizer, spec.admission, spec.max_waiting, on_lost=_engine_lost)
    app = create_app(remote, spec.model_name, spec.options)
    grace = spec.options.shutdown_timeout_s
    # uvicorn cancels what is left a little after our own deadline (which ends requests cleanly)
    config = uvicorn.Config(app, log_level=spec.log_level, timeout_graceful_shutdown=grace + 5,
                            http=Http10Protocol)

    def on_stop():
        print(f"glmc: shutting down: in-flight requests have {grace:g} s to finish (signal again "
              "to exit now)", flush=True)
        app.state.api.begin_shutdown()
    handled = (signal.SIGINT, signal.SIGTERM)
    server = SignalledServer(config, handled, {s: signal.getsignal(s) for s in handled}, on_stop)
    for s in handled:
        signal.signal(s, server.record)
    with early.get_lock():
        got, early.value = early.value, -1  # from now on the engine's process forwards them
    if got:
        server.record(handled[0], None)
    app.state.api.warming_up = True   # until the start-up requests are answered
    threading.Thread(target=_warm_then_announce, args=(server.server, app.state.api, url),
                     name="glmc-http-warmup", daemon=True).start()
    server.run(sock)
    print(f"glmc: stopped serving {spec.model_name}", flush=True)


def _engine_lost() -> None:
    """Nothing can be answered any more (open streams just got an error event): exit now, as the
    engine's process did, without unwinding the server."""
    print("glmc: the engine's process is gone; the server exits", flush=True)
    os._exit(1)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket for uvicorn, with TCP_NODELAY (inherited by accepted connections;
    uvicorn sets it only on sockets it makes itself): without it Nagle's algorithm and delayed
    ACKs add ~40 ms to every response written in two parts (headers, then body)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _warm_then_announce(server, api, url: str) -> None:
    """Once uvicorn runs: one streamed chat request and one completion through the whole HTTP path,
    then forget them (metrics, prefix cache), end `api`'s warm-up (/health answers 200 from now on)
    and print the URL. The first request a server answers pays one-time costs no engine warm-up
    reaches (the chat template's compile, validators', the SSE path's first use: ~90 ms of the
    first TTFT on an H200); this request pays them instead, as SGLang's start-up request does. A
    failure is logged, never fatal."""
    engine, model_name = api.engine, api.model_name
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.01)
    t0 = time.perf_counter()
    try:
        import httpx
        with httpx.Client(base_url=url + "/v1", timeout=300) as c:
            for path, body in (("/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "stream": True}),
                               ("/completions", {"prompt": "hi"})):
                with c.stream("POST", path, json={"model": model_name, "max_tokens": 2, **body}) as r:
                    r.read()
        engine.flush_cache()
        engine.reset_metrics()
        print(f"glmc: start-up requests answered in {(time.perf_counter() - t0) * 1e3:.0f} ms",
              flush=True)
    except Exception as e:  # noqa: BLE001 - serving goes on; the first request pays the costs instead
        print(f"glmc: start-up request failed ({type(e).__name__}: {e}); serving anyway", flush=True)
    api.warming_up = False
    print(f"glmc: serving {model_name} at {url}/v1", flush=True)
