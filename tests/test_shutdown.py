"""Stopping `glmc run` for real (subprocesses, signals): in-flight requests get the grace period
(`--shutdown-timeout`), then are aborted; a second signal exits at once; Ctrl-C to the whole
process group (as a terminal sends it) stops a multi-rank server once, gracefully; Ctrl-C during
start-up ends every rank within seconds, without a traceback or a "rank died" report."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_run_cli import GlmcRun, alive, descendants

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LONG = {"model": "glmc-tiny", "prompt": "Once upon a time", "max_tokens": 3000,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


class Stream(threading.Thread):
    """Reads one streaming completion in the background: chunks seen, whether [DONE] came, the
    tokens the usage chunk reports."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.chunks, self.done, self.error, self.started = 0, False, None, threading.Event()
        self.tokens = None

    def run(self):
        try:
            with httpx.stream("POST", self.url + "/completions", json=self.body, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.chunks += 1
                        self.tokens = (json.loads(line[6:]).get("usage") or {}).get(
                            "completion_tokens", self.tokens)
                        self.started.set()
        except httpx.HTTPError as e:  # the server closed the stream when it aborted it
            self.error = e
        finally:
            self.started.set()


def start(args: list[str], log, cache) -> GlmcRun:
    run = GlmcRun(["--port", "0", "--log-level", "warning", "--num-pages", "64",
                   "--weights", "glmc-tiny", "--cache-dir", str(cache), *args], log)
    return run.__enter__()


def wait_exit(run: GlmcRun, within: float) -> float:
    """Seconds until `glmc run` exited (and every process it started); fails after `within`."""
    t0, started = time.monotonic(), descendants(run.proc.pid)
    try:
        run.proc.wait(timeout=within)
        while any(alive(p) for p in started):
            assert time.monotonic() - t0 < within, "ranks outlived glmc run"
            time.sleep(0.05)
        return time.monotonic() - t0
    finally:
        if run.proc.poll() is None or any(alive(p) for p in started):
            run.kill()
        run.out.close()


def test_grace_period_then_abort(tmp_path, cache):
    run = start(["--shutdown-timeout", "2"], tmp_path / "log", cache)
    long = Stream(run.url, LONG)
    long.start()
    assert long.started.wait(60) and long.chunks
    run.proc.send_signal(signal.SIGTERM)
    took = wait_exit(run, 30)
    long.join(10)
    assert not long.done and 2 <= took < 20  # aborted after the grace period, not before
    log = (tmp_path / "log").read_text()
    assert run.proc.returncode == 0 and "stopped serving" in log and "Traceback" not in log


def long_and_short(run: GlmcRun, short_tokens: int) -> tuple[Stream, Stream]:
    """A long stream and a short one, both generating when this returns."""
    long = Stream(run.url, LONG)
    short = Stream(run.url, {**LONG, "max_tokens": short_tokens})
    for s in (long, short):
        s.start()
        assert s.started.wait(60)
    return long, short


def test_in_flight_requests_finish_in_the_grace_period_and_a_second_signal_exits(tmp_path,
                                                                                  cache):
    run = start(["--shutdown-timeout", "120"], tmp_path / "log", cache)
    long, short = long_and_short(run, 40)
    run.proc.send_signal(signal.SIGTERM)
    short.join(60)
    assert short.done and short.tokens == 40  # finished during the grace period
    assert long.is_alive()  # still being served
    run.proc.send_signal(signal.SIGTERM)
    assert wait_exit(run, 10) < 10
    assert "second signal" in (tmp_path / "log").read_text()


def _rank_processes(pid: int) -> list[int]:
    """The rank processes below `pid` (multiprocessing's spawn children), as soon as they exist."""
    out = []
    for p in descendants(pid):
        try:
            if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read():
                out.append(p)
        except OSError:
            continue
    return out


@pytest.mark.parametrize("parallel,when", [("tp1", "compiling"), ("tp2", "loading weights"),
                                           ("tp2", "ranks born")])
def test_start_up_interrupted_cleanly(tmp_path, cache, parallel, when):
    """Ctrl-C while `glmc run` starts (tp1: once it compiles; tp2: once its ranks load weights, or
    as soon as both rank processes exist, while the launcher is still starting them): exit 130 with
    every rank gone, no traceback; a start-up that finished just before the signal (glmc-tiny
    starts in ~1 s on an idle host) stops as a server does, status 0. The "ranks born" case is a
    signal that comes while the launcher is still starting the ranks: it must not be lost."""
    log = tmp_path / "log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "glmc.cli", "run", "--parallel", parallel,
                                 "--port", "0", "--weights", "glmc-tiny", "--cache-dir", str(cache)],
                                stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            # tp1: start-up is under way (it lasts ~1 s here); tp2: the ranks joined their process
            # group and load weights, or they were just born (their interpreters start)
            deadline = time.monotonic() + 120
            while (len(_rank_processes(proc.pid)) < 2 if when == "ranks born" else when not in log.read_text()):
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.005 if when == "ranks born" else 0.02)
            started = descendants(proc.pid)
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole group
            t0 = time.monotonic()
            proc.wait(timeout=20)
            while any(alive(p) for p in started):
                assert time.monotonic() - t0 < 20, "ranks outlived glmc run"
                time.sleep(0.05)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text()
    assert "died" not in text and "Traceback" not in text and "KeyboardInterrupt" not in text
    assert took < 10, text[-3000:]
    if "Started server process" in text:      # start-up had just ended: the server's clean stop
        assert proc.returncode == 0 and "glmc: stopped serving" in text, text[-3000:]
    else:
        assert proc.returncode == 130 and "glmc run: interrupted" in text, text[-3000:]


def test_interrupt_inside_generated_code_still_exits_130(tmp_path):
    """Ctrl-C that lands while an import runs a dataclass's generated source (an `exec`): under
    `python -m` CPython would turn the handled interrupt into death by SIGINT at exit (status -2,
    not 130)."""
    (tmp_path / "interrupted_run.py").write_text(
        "import sys\nfrom glmc import cli\n"
        "def interrupted(a):\n"
        "    exec('import os, signal; os.kill(os.getpid(), signal.SIGINT); import time; time.sleep(5)')\n"
        "cli.cmd_run = interrupted\nsys.exit(cli.main(['run']))\n")
    proc = subprocess.run([sys.executable, "-m", "interrupted_run"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip() == "glmc run: interrupted"


def test_multi_rank_ctrl_c_stops_gracefully_once_then_a_second_forces(tmp_path, cache):
    run = start(["--parallel", "tp2", "--shutdown-timeout", "120"], tmp_path / "log", cache)
    long, short = long_and_short(run, 30)
    os.killpg(run.proc.pid, signal.SIGINT)  # every process of the group gets it
    short.join(60)
    assert short.done and short.tokens == 30 and long.is_alive()
    os.killpg(run.proc.pid, signal.SIGINT)
    assert wait_exit(run, 15) < 15
    text = (tmp_path / "log").read_text()
    assert "died" not in text and "Traceback" not in text, text[-3000:]
