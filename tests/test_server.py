"""The OpenAI-compatible server, for real: uvicorn on a loopback port, the official `openai` client
(sync, streaming, async), httpx for malformed requests, the tiny model behind it. Every test runs
twice: the app over the engine in this process, and over a `RemoteEngine` whose engine is at the
other end of a real pipe (`EngineHost`), as `glmc run`'s server process sees it."""
import asyncio
import json
import multiprocessing
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from glmc.runtime.engine.sampling import SamplingParams
from glmc.runtime.serving.engine_link import EngineHost, RemoteEngine
from glmc.runtime.serving.http_process import listen
from glmc.runtime.serving.server import create_app

from glmc.api import build_engine

MODEL = "glmc-tiny"
SYSTEM = "You are a helpful assistant. " * 12  # > 64 tokens: a shared, cacheable prefix


class Server:
    """uvicorn serving `app` from a background thread on a free loopback port."""

    def __init__(self, app):
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextmanager
def serving(engine, mode: str, options=None, model: str = MODEL):
    """`Server` over `engine` serving `model`: in this process ("local") or through the pipe
    ("linked"), as under `glmc run`."""
    kwargs = {} if options is None else {"options": options}
    if mode == "local":
        with Server(create_app(engine, model, **kwargs)) as server:
            yield server
        return
    ours, theirs = multiprocessing.Pipe()
    host = EngineHost(engine, ours)
    host.start()
    engine.start()
    remote = RemoteEngine(theirs, engine.tokenizer, engine.admission, engine.max_waiting)
    try:
        with Server(create_app(remote, model, **kwargs)) as server:
            yield server
    finally:
        host.close()
        engine.stop()
        ours.close()
        theirs.close()


MODES = ["local", "linked"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt


@pytest.fixture(scope="module", params=MODES)
def served(ckpt, request):
    engine = build_engine(ckpt, warmup=False, num_pages=64, max_running=16, max_batch_tokens=128,
                          max_waiting=32)
    with serving(engine, request.param) as server:
        yield engine, server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="none", max_retries=0)


def chat(text):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def wait_idle(engine, timeout=20.0):
    deadline = time.monotonic() + timeout
    while engine.scheduler.running or engine.scheduler.waiting or engine._inbox:
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.05)
    time.sleep(0.1)  # let the engine thread finish its bookkeeping for the last step


def test_models_health_metrics(served, client):
    engine, server = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    # ignore_eos: a sampled eos would end it with "stop" (the tiny model draws one ~5% of runs)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_waiting", "num_requests_running", "generation_tokens_per_second",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "kv_usage_ratio", "kv_pages_used", "prefix_cache_hit_rate", "prefill_tokens_total"):
        assert f"glmc_{name}" in text
    assert 'glmc_requests_finished_total{finish_reason="length"}' in text


def test_kv_usage_counts_pages_requests_hold_not_the_prefix_cache(served, client):
    engine, server = served
    client.chat.completions.create(model=MODEL, messages=chat("Fill the cache."), max_tokens=4)
    wait_idle(engine)
    gauges = {f.name: f.samples[0].value for f in
              text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
              if f.type == "gauge"}
    assert gauges["glmc_kv_pages_cached"] >= 2   # the system prompt's page and the rest
    assert gauges["glmc_kv_pages_used"] == 0 and gauges["glmc_kv_usage_ratio"] == 0.0


def test_greedy_chat_equals_engine_and_stream_equals_whole(served, client, ckpt):
    engine, _ = served
    messages = chat("Count to ten.")
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                           temperature=0, extra_body={"ignore_eos": True})
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    offline = build_engine(ckpt, warmup=False).generate(
        [ids], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert whole.choices[0].message.content == offline.output_text
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 10
    assert whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline.output_text
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-2].choices[0].finish_reason == "length"


def test_repeated_prefix_hits_the_cache(served, client):
    engine, _ = served
    before = engine.metrics.counters["prefix_cache_hit_tokens_total"]
    kw = dict(model=MODEL, messages=chat("What is the capital of France?"), max_tokens=6,
              temperature=0)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert b.usage.prompt_tokens_details.cached_tokens >= 64
    assert engine.metrics.counters["prefix_cache_hit_tokens_total"] > before
    assert a.choices[0].message.content == b.choices[0].message.content


def test_sampling_controls(served, client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.9,
              presence_penalty=0.5, frequency_penalty=0.5,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    a = client.completions.create(seed=123, **kw)
    assert a.choices[0].text == client.completions.create(seed=123, **kw).choices[0].text
    several = client.completions.create(seed=5, n=3, **kw)
    assert [c.index for c in several.choices] == [0, 1, 2] and several.usage.completion_tokens > 0
    greedy = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                       temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = greedy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 8 and all(len(t) == 2 for t in lp.top_logprobs)


def test_stop_strings_and_stop_token_ids(served, client, ckpt):
    engine, server = served
    kw = dict(model=MODEL, prompt="Tell me a story", max_tokens=12, temperature=0)
    text = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    ids = build_engine(ckpt, warmup=False).generate(
        [engine.tokenizer.encode("Tell me a story")],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].output_ids
    k = next(i for i in range(2, 12) if ids[i] not in ids[:i])  # first fresh token after two
    for extra in ({"stop_token_ids": [ids[k]]}, {"stop": ["\u0000never", ids[k]]}):
        r = post(server, {**kw, "ignore_eos": True, **extra}).json()
        assert r["choices"][0]["finish_reason"] == "stop", extra
        assert r["usage"]["completion_tokens"] == k + 1  # the stop token counts, its text does not
        assert text.startswith(r["choices"][0]["text"])


def test_chat_logprobs(served, client):
    r = client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)


def post(server, body, path="/v1/completions"):
    raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize("body,status,param", [
    ('{"model": "glmc-tiny", "prompt": ', 400, None),  # malformed JSON
    ("[1, 2]", 400, None),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi " * 5000}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": "most"}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "top_k": -5}, 400, "top_k"),
    ({"model": MODEL, "prompt": "hi", "n": 100}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "stream": "maybe"}, 400, "stream"),
    ({"model": MODEL, "prompt": [1, 2, 100000]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
])
def test_bad_requests_get_openai_errors(served, body, status, param):
    r = post(served[1], body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_bad_chat_requests_and_unknown_routes(served, client):
    server = served[1]
    assert post(server, {"model": MODEL, "messages": []}, "/v1/chat/completions").status_code == 400
    r = post(server, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
             "/v1/chat/completions")
    assert r.status_code == 400 and "unknown role" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["message"] == "Not Found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=chat("x"))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=chat("x"), top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).choices


def test_client_disconnect_aborts_and_frees_pages(served):
    engine, server = served
    wait_idle(engine)
    aborted = engine.metrics.finished.get("abort", 0)
    body = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 2000, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # leaving the block closes the connection mid-stream
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    wait_idle(engine)
    assert engine.metrics.finished.get("abort", 0) == aborted + 2
    assert engine.scheduler.num_pages_held == 0


@pytest.mark.parametrize("mode", MODES)
def test_overload_gets_503_with_retry_after(ckpt, mode):
    engine = build_engine(ckpt, warmup=False, max_running=1, max_waiting=1)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 60, "ignore_eos": True}
    with serving(engine, mode) as server:
        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(6)))
        answers = asyncio.run(burst())
        codes = sorted(r.status_code for r in answers)
        # at least the one request the waiting queue holds is served (more if the engine admits it
        # into the running set before the rest arrive), the rest are refused
        assert codes.count(200) >= 1 and 503 in codes and set(codes) <= {200, 503}
        refused = next(r for r in answers if r.status_code == 503)
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "overloaded"
        assert httpx.get(server.url + "/health").status_code == 200
        # the queue is empty again: taken (over the pipe: the engine's waiting count came back down)
        assert httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2},
                          timeout=60).status_code == 200


def test_linked_server_ends_streams_when_the_engine_process_goes(ckpt):
    """The engine's end of the pipe closes mid-stream (its process died): the open stream ends with
    an error event, /health says 503, and the server is told (`on_lost`: `glmc run` exits)."""
    engine = build_engine(ckpt, warmup=False, num_pages=32, max_running=4)
    ours, theirs = multiprocessing.Pipe()
    host, lost = EngineHost(engine, ours), threading.Event()
    host.start()
    engine.start()
    remote = RemoteEngine(theirs, engine.tokenizer, engine.admission, engine.max_waiting, lost.set)
    with Server(create_app(remote, MODEL)) as server:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            host.close()
            engine.stop()
            ours.close()
            rest = [line for line in lines if line.startswith("data: ")]
        assert "error" in json.loads(rest[-1][6:]) and lost.wait(10)
        assert httpx.get(server.url + "/health").status_code == 503


def test_load_64_streaming_clients_some_disconnecting(served):
    engine, server = served
    wait_idle(engine)

    async def one(c, i):
        try:
            stream = await c.chat.completions.create(
                model=MODEL, messages=chat(f"Question number {i}?"), max_tokens=8,
                temperature=0.7, seed=i, stream=True)
        except openai.APIStatusError as e:
            assert e.status_code == 503 and e.body["code"] == "overloaded"
            return "refused"
        chunks = 0
        async for chunk in stream:
            chunks += 1
            if i % 4 == 0 and chunks == 2:
                await stream.close()
                return "disconnected"
            if chunk.choices and chunk.choices[0].finish_reason:
                return "answered"
        raise AssertionError(f"client {i}: stream ended without a finish_reason")

    async def load():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        try:
            return await asyncio.gather(*(one(c, i) for i in range(64)))
        finally:
            await c.close()

    outcomes = asyncio.run(load())
    assert outcomes.count("answered") >= 16 and len(outcomes) == 64
    wait_idle(engine)
    assert engine.scheduler.num_pages_held == 0 and engine.req_pool.num_free == 16
    engine.flush_cache()
    assert engine.allocator.num_free == engine.allocator.num_pages
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("mode", MODES)
def test_start_profile_traces_engine_steps(ckpt, tmp_path, mode):
    """POST /start_profile: 404 unless --profile-dir, 400 on a bad num_steps, else the trace of
    the next steps with work (here: a streamed request runs meanwhile)."""
    from glmc.runtime.serving.server import ServerOptions
    engine = build_engine(ckpt, warmup=False, num_pages=32, max_running=4, max_batch_tokens=64)
    for options, ok in ((ServerOptions(), False), (ServerOptions(profile_dir=str(tmp_path)), True)):
        with serving(engine, mode, options) as server:
            if not ok:
                r = post(server, {"num_steps": 2}, "/start_profile")
                assert r.status_code == 404 and r.json()["error"]["code"] == "profiling_disabled"
                continue
            assert post(server, {"num_steps": 0}, "/start_profile").status_code == 400
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
            stream = c.completions.create(model=MODEL, prompt="hello", max_tokens=40, stream=True,
                                          extra_body={"ignore_eos": True})
            r = post(server, {"num_steps": 2}, "/start_profile")
            assert r.status_code == 200, r.text
            assert list(stream)[-1].choices[0].finish_reason == "length"
            trace = json.loads(open(r.json()["trace"]).read())
            names = {e.get("name") for e in trace["traceEvents"]}
            assert "glmc.engine.step" in names
            assert "glmc.engine.step" in open(r.json()["table"]).read()
