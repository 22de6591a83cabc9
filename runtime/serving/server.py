"""OpenAI-compatible HTTP server (FastAPI) over an `Engine`.

Routes: POST /v1/chat/completions, POST /v1/completions (SSE when `stream`), GET /v1/models,
GET /health, GET /metrics (Prometheus text). Every error, including malformed JSON and unknown
routes, comes back in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with a 4xx
status, or 503 + Retry-After when the waiting queue is full. A client that disconnects (streaming
or not) has its requests aborted, which frees their KV pages. The wire format itself (bodies,
responses, chunks) is `runtime/serving/protocol.py`.
"""
from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from glmc.runtime.engine.engine import Engine, InvalidRequest, Overloaded, StreamEvent
from glmc.runtime.engine.request import Request
from glmc.runtime.engine.sampling import SamplingError
from glmc.runtime.serving.protocol import (
    ENGINE_FAILED,
    APIError,
    ChatRequest,
    CompletionRequest,
    Formatter,
    prompt_ids,
    sampling_params,
    sse_data,
    usage,
)
from starlette.exceptions import HTTPException

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



class _Api:
    """The route handlers of one app (one engine, one model name)."""

    def __init__(self, engine: Engine, model_name: str, max_n: int):
        self.engine, self.model_name, self.max_n = engine, model_name, max_n
        self.created = int(time.time())
        self.fmt = Formatter(model_name, engine.tokenizer)

    # -- request -> engine requests --------------------------------------------------------------

    def _requests(self, body) -> list:
        if body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist.", "model",
                           "model_not_found")
        n = 1 if body.n is None else body.n
        if not 1 <= n <= self.max_n:
            raise APIError(400, f"n must be in [1, {self.max_n}], got {n}", "n")
        chat = isinstance(body, ChatRequest)
        if chat:
            logprobs, top = bool(body.logprobs), body.top_logprobs or 0
            if top and not logprobs:
                raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
            max_tokens = body.max_completion_tokens or body.max_tokens
        else:
            if body.echo:
                raise APIError(400, "echo is not supported", "echo")
            logprobs, top = body.logprobs is not None, body.logprobs or 0
            max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        reqs = []
        for prompt in prompt_ids(body, self.engine.tokenizer):
            for _ in range(n):
                limit = max_tokens if max_tokens is not None else max(
                    1, self.engine.max_context - len(prompt))
                seed = None if body.seed is None else body.seed + len(reqs)
                try:
                    params = sampling_params(body, limit, logprobs, top, seed)
                    reqs.append(self.engine.make_request(prompt, params))
                except SamplingError as e:  # completions call top_logprobs `logprobs`
                    param = "logprobs" if e.param == "top_logprobs" and not chat else e.param
                    raise APIError(400, str(e), param) from e
                except InvalidRequest as e:
                    raise APIError(400, str(e), e.param, e.code) from e
        return reqs

    # -- handlers --------------------------------------------------------------------------------

    async def generate(self, http: HTTPRequest, body) -> Response:
        reqs = self._requests(body)
        try:
            stream = EventStream.open(self.engine, reqs)
        except Overloaded as e:
            raise APIError(503, f"server overloaded: {e}; retry later", None, "overloaded",
                           "server_error", {"Retry-After": "1"}) from e
        chat, n = isinstance(body, ChatRequest), body.n or 1
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            with_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._sse(http, stream, rid, chat, with_usage, n),
                                     media_type="text/event-stream")
        async with stream:
            choices = [{"text": "", "logprobs": [], "finish_reason": None} for _ in reqs]
            counts = [None] * len(reqs)
            async for i, ev in _events(http, stream):
                choices[i]["text"] += ev.text
                choices[i]["finish_reason"] = ev.finish_reason
                choices[i]["logprobs"] += [(ev.token_id, ev.logprobs)] if ev.logprobs else []
                counts[i] = ev
            if not stream.done:
                return Response(status_code=499)  # client went away; nobody reads this
        if any(c["finish_reason"] == "error" for c in choices):
            raise ENGINE_FAILED
        return JSONResponse(self.fmt.response(rid, chat, reqs, choices, counts, n))

    async def _sse(self, http, stream: EventStream, rid: str, chat: bool, with_usage: bool,
                   n: int):
        async with stream:
            if chat:  # OpenAI opens each choice with the role
                for i in range(len(stream.reqs)):
                    role = {"role": "assistant", "content": ""}
                    yield self.fmt.chunk(rid, chat, i, role, None, None)
            counts = [None] * len(stream.reqs)
            async for i, ev in _events(http, stream):
                if ev.finish_reason == "error":
                    yield sse_data(ENGINE_FAILED.body())
                    return
                counts[i] = ev
                if not (ev.text or ev.finish_reason or ev.logprobs):
                    continue  # text held back (partial UTF-8 or a possible stop string)
                lp = [(ev.token_id, ev.logprobs)] if ev.logprobs else None
                delta = {"content": ev.text} if chat else ev.text
                yield self.fmt.chunk(rid, chat, i, delta, ev.finish_reason, lp)
            if with_usage and stream.done:
                yield sse_data({**self.fmt.head(rid, chat, True), "choices": [],
                                 "usage": usage(counts, n)})
            if stream.done:
                yield "data: [DONE]\n\n"

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "glmc",
            "max_model_len": self.engine.max_context}]}


async def _events(http: HTTPRequest, stream: EventStream):
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


def _error_handlers(app: FastAPI, engine: Engine) -> None:
    def answer(e: APIError) -> JSONResponse:
        engine.metrics.inc("requests_rejected_total")
        return e.response()

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return answer(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        if err.get("type") == "json_invalid":
            return answer(APIError(400, f"malformed JSON body: {err.get('msg')}", None,
                                   "invalid_json"))
        param = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or None
        return answer(APIError(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}",
                               param))

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return answer(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def internal(_, e: Exception):
        return answer(APIError(500, f"internal error: {type(e).__name__}: {e}", None, None,
                               "server_error"))


def create_app(engine: Engine, model_name: str = "glmc-tiny", *, max_n: int = 16) -> FastAPI:
    """The FastAPI app; starting it starts the engine thread, stopping it stops the thread."""

    @asynccontextmanager
    async def lifespan(_):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="glmc", lifespan=lifespan)
    api = _Api(engine, model_name, max_n)
    _error_handlers(app, engine)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest, body: ChatRequest):
        return await api.generate(http, body)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest, body: CompletionRequest):
        return await api.generate(http, body)

    @app.get("/v1/models")
    async def models():
        return api.models()

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise APIError(503, "engine thread is not running", None, "engine_dead",
                           "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def serve(engine: Engine, model_name: str = "glmc-tiny", host: str = "127.0.0.1",
          port: int = 8000, log_level: str = "info") -> None:
    """Serve in the foreground until SIGINT or SIGTERM (then shut down cleanly). The port is bound
    before the URL is printed, so a client that read the URL can connect; port 0 picks a free one."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{sock.getsockname()[1]}"
    print(f"glmc: serving {model_name} at {url}/v1", flush=True)
    config = uvicorn.Config(create_app(engine, model_name), log_level=log_level)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler
    # it found: make that one a no-op so serve() returns and callers can clean up.
    main = threading.current_thread() is threading.main_thread()
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda *_: None) for s in sigs} if main else {}
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(f"glmc: stopped serving {model_name}", flush=True)
