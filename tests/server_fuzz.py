"""A fuzzer for the OpenAI-compatible server: seeded, bounded, loopback only.

Generates request bodies (valid shapes with out-of-range values, wrong types, unicode edge cases,
huge and empty fields, random JSON, truncated and non-UTF-8 bodies, wrong content types, paths and
methods), sends them concurrently and checks every answer: no 5xx, every error in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`, every 200 well-formed (SSE streams too). After
the run the server must be healthy, idle, and its requests must hold no KV pages.

    python tests/server_fuzz.py --n 100000 --seed 1       # the long run, on its own tiny server
    python tests/server_fuzz.py --url http://127.0.0.1:8000 --n 5000   # against `glmc run`

`tests/test_server_fuzz.py` runs a short one (about a minute) in CI. Not collected by pytest.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

MODEL = "glmc-tiny"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
STRANGE_TEXT = ["", " ", "\u0000", "\ud800", "a\udfffb", "\uffff", "\ue000", "\ue0001\ue001",
                "😀" * 3, "مرحبا", "e\u0301", "\u202e", "<|user|>", "<|assistant|>", "<think>",
                "</think>", "<tool_call>x<arg_key>a</arg_key>", "[gMASK]<sop>", "你好，世界",
                "\\", '"', "\n" * 5, "{{ 7*7 }}", "{% for x in range(10**9) %}{% endfor %}"]
NUMBERS = [0, -1, 1, 2, 3, 16, 17, 20, 21, 255, 256, 4096, 10**6, 2**31, 2**63 - 1, 2**63,
           2**64 - 1, 2**64, -(2**63) - 1, 10**30, 0.5, -0.0, 1e-300, 1.5, 2.0000001, 1e308,
           float("nan"), float("inf"), -float("inf")]
FIELDS = ["model", "messages", "prompt", "n", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "stop", "stop_token_ids", "ignore_eos", "seed", "stream", "stream_options", "logprobs",
          "top_logprobs", "echo", "tools", "tool_choice", "chat_template_kwargs", "logit_bias",
          "parse_special_tokens", "user", "response_format"]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


class Gen:
    """Request bodies from one seeded random stream."""

    def __init__(self, rng: random.Random, max_tokens: int):
        self.rng, self.max_tokens = rng, max_tokens

    def text(self) -> str:
        r = self.rng
        if r.random() < 0.3:
            return r.choice(STRANGE_TEXT)
        return "".join(r.choice("abc xyz.,!?\n") for _ in range(r.randint(1, 40)))

    def value(self, depth: int = 0):
        """Random JSON-ish value (may hold NaN or lone surrogates, which json.dumps writes)."""
        r = self.rng
        kind = r.randrange(8 if depth < 4 else 5)
        if kind == 0:
            return None
        if kind == 1:
            return r.random() < 0.5
        if kind == 2:
            return r.choice(NUMBERS)
        if kind in (3, 4):
            return self.text()
        if kind == 5:
            return [self.value(depth + 1) for _ in range(r.randint(0, 4))]
        if kind == 6:
            return {self.text(): self.value(depth + 1) for _ in range(r.randint(0, 4))}
        return r.choice([[], {}, "", [[[[[]]]]]])

    def message(self) -> dict:
        r = self.rng
        role = r.choice(["user", "user", "system", "assistant", "tool", "developer"])
        content = self.text() if r.random() < 0.8 else [{"type": "text", "text": self.text()}]
        m = {"role": role, "content": content}
        if role == "assistant" and r.random() < 0.3:
            m["tool_calls"] = [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": self.text()})}}]
        if role == "assistant" and r.random() < 0.2:
            m["reasoning_content"] = self.text()
        return m

    def valid(self, chat: bool) -> dict:
        r = self.rng
        body = {"model": MODEL, "max_tokens": r.randint(1, self.max_tokens)}
        if chat:
            body["messages"] = [self.message() for _ in range(r.randint(1, 4))]
            body["messages"][-1]["role"] = "user"
            if r.random() < 0.3:
                body["tools"] = [TOOL]
                body["tool_choice"] = r.choice(["auto", "none"])
            if r.random() < 0.3:
                body["chat_template_kwargs"] = {"enable_thinking": r.random() < 0.5}
            if r.random() < 0.3:
                body["logprobs"] = True
                body["top_logprobs"] = r.randint(0, 5)
        else:
            body["prompt"] = r.choice([
                self.text() or "x", [self.text() or "x" for _ in range(r.randint(1, 3))],
                [r.randrange(512) for _ in range(r.randint(1, 30))],
                [[r.randrange(512) for _ in range(r.randint(1, 10))] for _ in range(2)]])
            if r.random() < 0.3:
                body["logprobs"] = r.randint(0, 5)
        for name, make in (("n", lambda: r.randint(1, 3)), ("temperature", lambda: r.random() * 2),
                           ("top_p", lambda: r.random() or 1.0), ("top_k", lambda: r.randint(-1, 50)),
                           ("seed", lambda: r.randrange(2**64)), ("stream", lambda: True),
                           ("stop", lambda: [self.text() or "x"]), ("ignore_eos", lambda: True),
                           ("presence_penalty", lambda: r.uniform(-2, 2)),
                           ("stream_options", lambda: {"include_usage": True})):
            if r.random() < 0.25:
                body[name] = make()
        return body

    def mutated(self, body: dict) -> dict:
        r = self.rng
        body = dict(body)
        for _ in range(r.randint(1, 3)):
            name = r.choice(FIELDS + list(body))
            choice = r.randrange(6)
            if choice == 0:
                body.pop(name, None)
            elif choice == 1:
                body[name] = r.choice(NUMBERS)
            elif choice == 2:
                body[name] = self.value()
            elif choice == 3:  # huge or empty
                body[name] = r.choice(["x" * r.randint(10**4, 3 * 10**5), [1] * r.randint(10**3,
                                       10**5), "", [], {}, ["a"] * 300, [[1]] * 300])
            elif choice == 4:
                body[name] = r.choice(STRANGE_TEXT)
            elif name in ("messages", "prompt") and isinstance(body.get(name), list):
                body[name] = body[name] + [self.value()]
        return body

    def request(self) -> tuple[str, str, bytes, dict]:
        """(method, path, raw body, headers) of one fuzz case."""
        r = self.rng
        chat = r.random() < 0.55
        path = CHAT if chat else COMPLETIONS
        headers = {"content-type": "application/json"}
        kind = r.random()
        if kind < 0.35:
            obj = self.valid(chat)
        elif kind < 0.8:
            obj = self.mutated(self.valid(chat))
        elif kind < 0.88:
            obj = self.value()
        else:
            obj = None
        raw = json.dumps(obj).encode() if obj is not None else b""
        if obj is None:  # bytes that are not (all) JSON
            raw = r.choice([b"", b"{", b'{"model": "glmc-tiny", "prompt": "a', b"\xff\xfe{}",
                            b"[" * 10**4 + b"]" * 10**4, b'{"a": 1' + b", " * 5000, b"null",
                            json.dumps(self.valid(chat)).encode()[:r.randint(1, 60)],
                            b'{"model": "glmc-tiny", "prompt": "' + b"\xc3" + b'"}'])
        method = "POST"
        if r.random() < 0.03:
            headers = r.choice([{}, {"content-type": "text/plain"},
                                {"content-type": "application/x-www-form-urlencoded"}])
        if r.random() < 0.02:
            method, path = r.choice([("GET", CHAT), ("PUT", COMPLETIONS), ("POST", "/v1/models"),
                                     ("POST", "/v1/nothing"), ("GET", "/v1/models/x")])
        return method, path, raw, headers


@dataclass
class Report:
    """What a run saw: answers by status, and every answer that broke a rule."""

    sent: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def fail(self, case: str, why: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(f"{why}\n    request: {case[:300]}")


def check_error(body: dict) -> str | None:
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"error not in OpenAI's shape: {str(body)[:200]}"
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)):
        return f"error message/type missing: {err}"
    if not all(err[k] is None or isinstance(err[k], str) for k in ("param", "code")):
        return f"error param/code not strings: {err}"
    return None


async def one(client: httpx.AsyncClient, case, report: Report) -> None:
    method, path, raw, headers = case
    desc = f"{method} {path} {headers.get('content-type')} {raw[:300]!r}"
    try:
        async with client.stream(method, path, content=raw, headers=headers) as r:
            text = (await r.aread()).decode("utf-8")
    except httpx.HTTPError as e:
        report.fail(desc, f"transport error: {type(e).__name__}: {e}")
        return
    report.sent += 1
    report.statuses[r.status_code] = report.statuses.get(r.status_code, 0) + 1
    if r.status_code >= 500:
        report.fail(desc, f"{r.status_code}: {text[:300]}")
    elif r.status_code >= 400:
        try:
            why = check_error(json.loads(text))
        except ValueError:
            why = f"error body is not JSON: {text[:200]}"
        if why:
            report.fail(desc, why)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        why = check_stream(text)
        if why:
            report.fail(desc, why)
    else:
        try:
            json.loads(text)
        except ValueError:
            report.fail(desc, f"200 body is not JSON: {text[:200]}")


def check_stream(text: str) -> str | None:
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    if not events:
        return "empty SSE stream"
    for i, data in enumerate(events):
        if data == "[DONE]":
            return None if i == len(events) - 1 else "data after [DONE]"
        obj = json.loads(data)
        if "error" in obj:
            return check_error(obj) or (None if i == len(events) - 1 else "data after an error")
        if not isinstance(obj.get("choices"), list):
            return f"chunk without choices: {data[:200]}"
    return "stream ended without [DONE]"


async def fuzz(url: str, n: int, seed: int, concurrency: int = 8, max_tokens: int = 6) -> Report:
    """Send `n` generated cases to the server at `url`, `concurrency` at a time."""
    gen, report = Gen(random.Random(seed), max_tokens), Report()
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def bounded(case):
            async with sem:
                await one(client, case, report)
        cases = (gen.request() for _ in range(n))
        pending = set()
        for case in cases:
            pending.add(asyncio.create_task(bounded(case)))
            if len(pending) >= 4 * concurrency:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*pending)
    return report


def settled(url: str, timeout: float = 60.0) -> str | None:
    """None once the server is healthy, idle, and requests hold no KV pages; else why not."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health", timeout=10)
        metrics = {}
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("glmc_") and " " in line and "{" not in line:
                name, value = line.rsplit(" ", 1)
                metrics[name] = float(value)
        busy = {k: metrics.get(k) for k in ("glmc_num_requests_running",
                                             "glmc_num_requests_waiting", "glmc_kv_pages_used")}
        if health.status_code == 200 and not any(busy.values()):
            return None
        if time.monotonic() > deadline:
            return f"/health {health.status_code}, {busy}"
        time.sleep(0.2)


def _serve_tiny():
    """A tiny-model server on a free loopback port, in this process (for the long run)."""
    from glmc.api import build_engine
    from glmc.runtime.serving.server import create_app
    from glmc.tiny import default_cache_dir, make_tiny_checkpoint
    from test_server import Server
    engine = build_engine(make_tiny_checkpoint(default_cache_dir() / "tiny"), warmup=False,
                          num_pages=32, max_context=256, max_running=16, max_waiting=4096)
    return Server(create_app(engine, MODEL))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start the tiny model here)")
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    a = ap.parse_args(argv)
    server = None
    if a.url is None:
        server = _serve_tiny()
        server.__enter__()
    url = a.url or server.url
    try:
        t0 = time.monotonic()
        report = asyncio.run(fuzz(url, a.n, a.seed, a.concurrency))
        after = settled(url)
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    print(f"{report.sent} answers in {time.monotonic() - t0:.0f} s: {sorted(report.statuses.items())}")
    for f in report.failures:
        print("FAIL", f)
    if after:
        print("FAIL after the run:", after)
    return 1 if report.failures or after else 0


if __name__ == "__main__":
    sys.exit(main())
