"""The pipe between `glmc run`'s engine process and its HTTP process, for real: `glmc run` serving
the tiny model (uvicorn on uvloop in a process of its own), called over HTTP. Messages of
megabytes cross the pipe whole while /health keeps answering; the server exits (status 1) when,
and only when, the engine's process is gone."""
import asyncio
import ctypes
import os
import signal
import time

import httpx
import pytest
from test_run_cli import GlmcRun, descendants
from test_server_hardening import health_latencies

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MODEL = "glmc-tiny"
PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def tiny_run(tmp_path, cache, *args) -> GlmcRun:
    return GlmcRun(["--weights", MODEL, "--cache-dir", str(cache), "--port", "0",
                    "--log-level", "warning", "--num-pages", "64", *args], tmp_path / "log")


def test_megabyte_messages_cross_the_pipe_and_health_stays_fast(tmp_path, cache):
    """16 stop strings of 64 KiB (1 MiB: the engine gets them all) and a 7 MB prompt (refused
    before the engine: it cannot fit the context) are answered; /health answers 200 meanwhile,
    in 50 ms at the median and never in more than 0.5 s, and the server keeps serving."""
    stops = [chr(0x4e00 + k) * 65536 for k in range(16)]
    with tiny_run(tmp_path, cache) as run:
        base = run.url.removesuffix("/v1")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                "ignore_eos": True}

        async def work(c):
            return await asyncio.gather(
                c.post("/v1/chat/completions", json={**chat, "stop": stops}),
                c.post("/v1/completions", json={"model": MODEL, "prompt": "a b " * 1_750_000}),
                c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                "stop": ["x" * 250_000], "stream": True}))
        times, (stopped, huge, streamed) = asyncio.run(health_latencies(base, work))
        assert stopped.status_code == 200, stopped.text
        assert stopped.json()["usage"]["completion_tokens"] == 8
        assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded"
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        times.sort()   # every one a 200 (health_latencies checks); on a shared host, a few slow
        assert times[len(times) // 2] < 0.05 and times[-1] < 0.5, times
        assert httpx.get(base + "/health").json() == {"status": "ok"}
        assert run.client.completions.create(model=MODEL, prompt="still", max_tokens=2).choices


def _subreaper(on: bool) -> None:
    """Make this process the reaper of orphaned descendants (Linux), so the test can read the exit
    status of the HTTP process once its parent, the engine's process, is gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0, os.strerror(ctypes.get_errno())


def test_the_server_exits_with_status_1_when_the_engine_process_dies(tmp_path, cache):
    """SIGKILL to the engine's process (`glmc run` itself) mid-stream: the HTTP process, in a
    session of its own, exits with status 1 within seconds rather than answering 503."""
    _subreaper(True)
    run, others = tiny_run(tmp_path, cache).__enter__(), set()
    try:
        others = descendants(run.proc.pid)
        http_pid = next(p for p in others if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read())
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3000, "ignore_eos": True,
                "stream": True}
        lines = []
        with httpx.stream("POST", run.url + "/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    run.proc.send_signal(signal.SIGKILL)
                    run.proc.wait(10)
                    break
        assert _exit_code(http_pid, within=10) == 1   # reparented to this process
        assert "the engine's process is gone; the server exits" in run.log.read_text()
        with pytest.raises(httpx.ConnectError):
            httpx.get(run.url.removesuffix("/v1") + "/health")
    finally:
        run.kill()
        run.out.close()
        _reap(others, within=10)
        _subreaper(False)


def _exit_code(pid: int, within: float) -> int | None:
    """The exit code of child `pid` once it exits; None if it still runs after `within` s."""
    deadline = time.monotonic() + within
    while (got := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return os.waitstatus_to_exitcode(got[1])


def _reap(pids: set[int], within: float) -> None:
    """Wait for `pids` (this process's children, orphans among them) to exit and reap them; kill
    what is still running after `within` seconds."""
    deadline = time.monotonic() + within
    for pid in pids:
        try:
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
        except ChildProcessError:   # not this process's child, or reaped already
            pass
