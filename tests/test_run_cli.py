"""`glmc run` for real: a subprocess serving the packaged small model (the default), the tiny one
(made on first run into a cache dir) or a compiled plan with a checkpoint, called with the official
`openai` client, then stopped with SIGTERM, which must end it (and every process it started)
cleanly."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from glmc.runtime.engine.sampling import SamplingParams

from glmc.api import build_engine
from glmc.cli import main as glmc
from glmc.tiny import SMALL_DIR, SMALL_NAME, TINY_NAME, make_tiny_checkpoint

START_TIMEOUT_S = 120
GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc: ppid links)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d.name))
        except (ValueError, OSError, IndexError):
            continue
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class GlmcRun:
    """`glmc run ARGS` in its own session; `url` once it printed it. Leaving the block sends SIGTERM
    and checks a clean exit; on any failure the whole session is killed, so nothing outlives it."""

    stop_signal = signal.SIGTERM   # SIGINT: what Ctrl-C sends

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        # One intra-op thread: the tiny model's ops are too small to split over 2 shared cores.
        self.args, self.log = args, log
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}

    def __enter__(self):
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "glmc.cli", "run", *self.args],
                                     stdout=self.out, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (m := re.search(r"serving (\S+) at (http://\S+/v1)", self.log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"glmc run did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.model, self.url = m.group(1), m.group(2)
        self.client = openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=60)
        return self

    def stop(self) -> list[int]:
        """SIGTERM (or `stop_signal`), wait; returns the processes it had started (all of which
        must be gone)."""
        started = descendants(self.proc.pid)
        self.proc.send_signal(self.stop_signal)
        self.proc.wait(timeout=60)
        return started

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session this test started
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def __exit__(self, exc_type, *_):
        try:
            if exc_type is None:
                started = self.stop()
                text = self.log.read_text()
                assert self.proc.returncode == 0, text[-3000:]
                assert "stopped serving" in text
                deadline = time.monotonic() + 10
                while any(alive(p) for p in started) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert not [p for p in started if alive(p)], "processes outlived glmc run"
        finally:
            if self.proc.poll() is None or exc_type is not None:
                self.kill()
            self.out.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline(ckpt, prompt_ids: list[int], max_tokens: int = 8) -> str:
    """Greedy text of the same model in this process (tp1 plan)."""
    engine = build_engine(ckpt, warmup=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate([prompt_ids], params)[0].output_text


def test_glmc_run_serves_the_trained_small_model_by_default(tmp_path):
    port = free_port()
    with GlmcRun(["--port", str(port), "--log-level", "warning"], tmp_path / "log") as run:
        assert run.url == f"http://127.0.0.1:{port}/v1"
        # the start-up requests went through the HTTP path before the URL was printed, then
        # were forgotten: the counters start at zero
        text = run.log.read_text()
        assert text.index("start-up requests answered") < text.index("serving ")
        metrics = httpx.get(run.url.removesuffix("/v1") + "/metrics").text
        assert re.search(r"^glmc_generation_tokens_total 0\.0$", metrics, re.M)
        c = run.client
        assert [m.id for m in c.models.list().data] == [SMALL_NAME]
        prompt = "import os\nimport sys\n\n\ndef main():\n    "
        got = c.completions.create(model=SMALL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                   extra_body={"ignore_eos": True})
        engine = build_engine(SMALL_DIR, warmup=False)
        assert got.choices[0].text == offline(SMALL_DIR, engine.tokenizer.encode(prompt), 24)
        assert got.usage.completion_tokens == 24 and got.choices[0].text.strip()
        chunks = list(c.completions.create(model=SMALL_NAME, prompt=prompt, stream=True, **GREEDY))
        whole = c.completions.create(model=SMALL_NAME, prompt=prompt, **GREEDY)
        assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text


def test_glmc_run_serves_the_tiny_model_by_name(tmp_path):
    cache, port = tmp_path / "cache", free_port()
    with GlmcRun(["--weights", TINY_NAME, "--port", str(port), "--log-level", "warning"],
                 tmp_path / "log", {"GLMC_CACHE": str(cache)}) as run:
        assert (cache / "tiny" / "model.safetensors").exists()  # made at first run
        c = run.client
        assert [m.id for m in c.models.list().data] == [TINY_NAME]
        messages = [{"role": "user", "content": "Say something."}]
        got = c.chat.completions.create(model=TINY_NAME, messages=messages, **GREEDY)
        engine = build_engine(cache / "tiny", warmup=False)
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
        assert got.choices[0].message.content == offline(cache / "tiny", ids)
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 8
    # work of one step is one line in the log, not a progress bar's carriage returns
    lines = (tmp_path / "log").read_text().split("\n")
    for what in ("compiling tp1 (cpu)", "loading weights"):
        assert [line for line in lines if what in line] == [f"glmc: {what}"], what


class HealthPoller(threading.Thread):
    """GET /health on `port` every 10 ms from before the server listens until it answers 200:
    the answers in order, as (status, JSON body)."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.url, self.answers = f"http://127.0.0.1:{port}/health", []

    def run(self):
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and not (self.answers and self.answers[-1][0] == 200):
            try:
                r = httpx.get(self.url, timeout=30)
                self.answers.append((r.status_code, r.json()))
            except httpx.TransportError:   # not listening yet
                pass
            time.sleep(0.01)


def http10_stream(port: int, body: dict) -> tuple[bytes, bytes]:
    """POST /v1/completions as an HTTP/1.0 client: (response head, body read until the server
    closes the connection)."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    return head.lower(), payload


def test_health_is_503_while_warming_up_and_http10_streams_are_not_chunked(tmp_path):
    """/health polled from before `glmc run` listens: connections wait in the socket's backlog
    until uvicorn takes them, as its start-up requests begin, so the first answer comes during
    the warm-up: 503 `warming_up` until it ends, then 200. A streamed reply to an HTTP/1.0 client
    has no chunked framing (HTTP/1.0 has none): its SSE lines end where the connection closes."""
    port = free_port()
    poller = HealthPoller(port)
    poller.start()
    with GlmcRun(["--weights", TINY_NAME, "--cache-dir", str(tmp_path / "cache"), "--port",
                  str(port), "--log-level", "warning"], tmp_path / "log"):
        poller.join(START_TIMEOUT_S)
        statuses = [status for status, _ in poller.answers]
        assert statuses[0] == 503 and statuses[-1] == 200, poller.answers
        assert set(statuses[:statuses.index(200)]) == {503}
        err = poller.answers[0][1]["error"]
        assert err["code"] == "warming_up" and "warming up" in err["message"]
        assert httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}

        head, payload = http10_stream(port, {"model": TINY_NAME, "prompt": "hi", "max_tokens": 4,
                                             "stream": True, "ignore_eos": True})
        assert head.startswith(b"http/1.1 200") and b"transfer-encoding" not in head, head
        assert b"connection: close" in head
        events = payload.split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""], payload
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]   # each one whole
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", payload
        head, payload = http10_stream(port, {"model": TINY_NAME, "prompt": "hi", "max_tokens": 2})
        assert b"content-length: %d" % len(payload) in head
        assert json.loads(payload)["usage"]["completion_tokens"] == 2


def test_glmc_run_serves_a_compiled_plan_with_a_checkpoint(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "my-glm")  # an HF checkpoint dir with a tokenizer
    assert glmc(["compile", "--model", str(ckpt), "--parallel", "tp1", "--device", "cpu",
                 "-o", str(tmp_path / "plan")]) == 0
    with GlmcRun([str(tmp_path / "plan"), "--weights", str(ckpt), "--port", "0",
                  "--log-level", "warning", "--num-pages", "16"], tmp_path / "log") as run:
        assert run.model == "my-glm"
        got = run.client.completions.create(model="my-glm", prompt=[5, 6, 7, 8], **GREEDY)
        assert got.choices[0].text == offline(ckpt, [5, 6, 7, 8])


def test_glmc_run_refuses_a_plan_of_another_model(tmp_path, capsys):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    assert glmc(["compile", "--model", "glm_moe_dsa", "--parallel", "tp1",
                 "-o", str(tmp_path / "plan")]) == 0
    assert glmc(["run", str(tmp_path / "plan"), "--weights", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "compiled for another model" in err and "in the plan" in err
    assert glmc(["run", "--weights", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _no_stray_servers():
    """A failing test must not leave `glmc run` processes behind (GlmcRun kills its session)."""
    before = descendants(os.getpid())
    yield
    assert descendants(os.getpid()) <= before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_run_on_cuda_without_a_gpu_fails_clearly(capsys):
    """`glmc run --device cuda` needs a GPU torch can see: without one it stops at once (before
    compiling or loading anything), exit status 2, saying why, for one rank or many."""
    for extra in ([], ["--parallel", "dp2ep2"]):
        assert glmc(["run", "--device", "cuda", *extra]) == 2
        assert "--device cuda: torch" in capsys.readouterr().err
