"""OpenAI-compatible HTTP server (FastAPI) over an `Engine` in this process (tests, embedding) or
a `RemoteEngine` in the HTTP process `glmc run` starts (`runtime/serving/http_process.py`).

Routes: POST /v1/chat/completions, POST /v1/completions (SSE when `stream`), GET /v1/models,
GET /v1/models/{id}, GET /health, GET /metrics (Prometheus, `prometheus-client`). Every error,
including malformed JSON, bodies over the size limit and unknown routes, comes back in OpenAI's
shape `{"error": {"message", "type", "param", "code"}}` with a 4xx status, or 503 + Retry-After
when the waiting queue is momentarily full. Bodies are parsed, validated and tokenised on worker
threads (`runtime/serving/intake.py`), so neither a huge body nor a long prompt stalls `/health`
or other streams. A client that disconnects (streaming or not) has its requests aborted, which
frees their KV pages. Chat output is split into reasoning, content and tool calls
(`runtime/serving/glm_output.py`). `begin_shutdown` gives in-flight requests `shutdown_timeout_s`
to finish, then aborts them (`http_process` calls it at the first SIGINT/SIGTERM).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from glmc.runtime.engine.engine import Engine, Overloaded
from glmc.runtime.serving.event_stream import EventStream, events
from glmc.runtime.serving.glm_output import ChatOutput
from glmc.runtime.serving.intake import Intake, Prepared, check_content_type, read_body
from glmc.runtime.serving.protocol import ENGINE_FAILED, APIError
from glmc.runtime.serving.responses import (
    Formatter,
    finish_reason,
    merge,
    sse_data,
    usage,
)
from starlette.exceptions import HTTPException

SHUT_DOWN = APIError(503, "the server shut down before this request finished (its shutdown "
                     "timeout passed)", None, "shutdown", "server_error")

WARMING_UP = APIError(503, "warming up: the server's start-up requests are still running; retry "
                      "shortly", None, "warming_up", "server_error", {"Retry-After": "1"})


@dataclass(frozen=True)
class ServerOptions:
    """Limits and shutdown behaviour of one server (`glmc run` flags)."""

    max_body_bytes: int = 8 << 20  # --max-body-mb: larger bodies get 413
    shutdown_timeout_s: float = 30.0  # --shutdown-timeout: grace for in-flight requests
    max_n: int = 16  # choices per request
    intake_threads: int = 4  # bodies parsed and tokenised at once
    profile_dir: str | None = None  # --profile-dir: POST /start_profile writes traces there


class _Api:
    """The route handlers of one app (one engine, one model name)."""

    def __init__(self, engine: Engine, model_name: str, options: ServerOptions):
        self.engine, self.model_name, self.options = engine, model_name, options
        self.created = int(time.time())
        self.fmt = Formatter(model_name, engine.tokenizer)
        self.intake = Intake(engine, model_name, options.max_n)
        self.pool = ThreadPoolExecutor(options.intake_threads, thread_name_prefix="glmc-intake")
        self.live: set[EventStream] = set()  # calls being answered
        self.loop: asyncio.AbstractEventLoop | None = None
        self.shut_down = False  # in-flight requests were aborted: the server is stopping
        self.warming_up = False  # /health answers 503 while set (`glmc run`'s start-up requests)

    def begin_shutdown(self) -> None:
        """(Any thread.) In-flight requests get `shutdown_timeout_s`, then are aborted: each gets
        an error (503, or an SSE error event) and its connection ends, so the server can stop."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(
                self.loop.call_later, self.options.shutdown_timeout_s, self.abort_in_flight)

    def abort_in_flight(self) -> None:
        self.shut_down = True
        for stream in list(self.live):
            stream.close()

    @contextmanager
    def answering(self, stream: EventStream):
        """`stream` counts as in flight inside the block; leaving early aborts its requests."""
        self.live.add(stream)
        try:
            yield stream
        finally:
            self.live.discard(stream)
            stream.close()

    async def generate(self, http: HTTPRequest, chat: bool) -> Response:
        raw = await read_body(http, self.options.max_body_bytes)
        check_content_type(http)
        call = await asyncio.get_running_loop().run_in_executor(
            self.pool, self.intake.prepare, raw, chat)
        if self.shut_down:  # its grace period ran out while it was being taken in
            raise SHUT_DOWN
        try:
            stream = EventStream.open(self.engine, call.reqs)
        except Overloaded as e:
            raise APIError(503, f"server overloaded: {e}; retry later", None, "overloaded",
                           "server_error", {"Retry-After": "1"}) from e
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        outputs = [ChatOutput(call.prompts.thinking, call.prompts.tools, call.prompts.forced)
                   if chat else None
                   for _ in call.reqs]
        if call.body.stream:
            options = call.body.stream_options
            with_usage = bool(options and options.include_usage)
            return StreamingResponse(self._sse(http, stream, rid, call, outputs, with_usage),
                                     media_type="text/event-stream")
        return await self._whole(http, stream, rid, call, outputs)

    async def _whole(self, http, stream: EventStream, rid: str, call: Prepared, outputs):
        with self.answering(stream):
            choices = [{"text": "", "logprobs": [], "finish_reason": None} for _ in call.reqs]
            counts = [None] * len(call.reqs)
            async for batch in events(http, stream):
                for i, ev in batch:
                    choices[i]["text"] += ev.text
                    choices[i]["finish_reason"] = ev.finish_reason
                    choices[i]["logprobs"] += [(ev.token_id, ev.logprobs)] if ev.logprobs else []
                    counts[i] = ev
            if not stream.done:
                return Response(status_code=499)  # client went away; nobody reads this
        if any(c["finish_reason"] == "error" for c in choices):
            raise ENGINE_FAILED
        if self.shut_down and any(c["finish_reason"] == "abort" for c in choices):
            raise SHUT_DOWN
        return JSONResponse(self.fmt.response(rid, call.chat, call.reqs, choices, counts, call.n,
                                              outputs))

    async def _sse(self, http, stream: EventStream, rid: str, call: Prepared, outputs,
                   with_usage: bool):
        """The SSE body: every event that arrived since the last write goes out as one write
        (each its own chunk), so a stream costs one send per engine step at most."""
        chat = call.chat
        head = self.fmt.head(rid, chat, True)   # one `created` for every chunk, as OpenAI's
        with self.answering(stream):
            if chat:  # OpenAI opens each choice with the role
                yield "".join(self.fmt.chunk(head, chat, i, {"role": "assistant", "content": ""}, None, None)
                              for i in range(len(stream.reqs)))
            counts = [None] * len(stream.reqs)
            async for batch in events(http, stream):
                parts = []
                for i, ev in batch:
                    if ev.finish_reason == "error" or (ev.finish_reason == "abort" and self.shut_down):
                        yield "".join(parts) + sse_data((SHUT_DOWN if self.shut_down else ENGINE_FAILED).body())
                        return
                    counts[i] = ev
                    delta = ev.text
                    if chat:
                        delta = outputs[i].feed(ev.text)
                        delta = merge(delta, outputs[i].finish()) if ev.finish_reason else delta
                    if not (delta or ev.finish_reason or ev.logprobs):
                        continue  # text held back (partial UTF-8, a possible stop string or marker)
                    lp = [(ev.token_id, ev.logprobs)] if ev.logprobs else None
                    parts.append(self.fmt.chunk(head, chat, i, delta, finish_reason(ev.finish_reason, outputs[i]),
                                                lp))
                if parts:
                    yield "".join(parts)
            tail = []
            if with_usage and stream.done:
                tail.append(sse_data({**head, "choices": [], "usage": usage(counts, call.n)}))
            if stream.done:
                tail.append("data: [DONE]\n\n")
            if tail:
                yield "".join(tail)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "glmc", "max_model_len": self.engine.max_context}


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
        param = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or None
        return answer(APIError(400, f"{param or 'request'}: {err.get('msg', 'invalid value')}",
                               param))

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return answer(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def internal(_, e: Exception):
        return answer(APIError(500, f"internal error: {type(e).__name__}: {e}", None, None,
                               "server_error"))


def create_app(engine: Engine, model_name: str = "glmc-tiny",
               options: ServerOptions = ServerOptions()) -> FastAPI:
    """The FastAPI app; starting it starts the engine thread, stopping it stops the thread."""
    api = _Api(engine, model_name, options)

    @asynccontextmanager
    async def lifespan(_):
        api.loop = asyncio.get_running_loop()
        engine.start()
        try:
            yield
        finally:
            engine.stop()
            api.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="glmc", lifespan=lifespan)
    app.state.api = api
    _error_handlers(app, engine)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await api.generate(http, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await api.generate(http, chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model",
                           "model_not_found")
        return api.model_card()

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise APIError(503, "engine thread is not running", None, "engine_dead",
                           "server_error")
        if api.warming_up:  # answered, not raised: a health probe is no rejected request
            return WARMING_UP.response()
        return {"status": "ok"}

    @app.post("/start_profile")
    async def start_profile(http: HTTPRequest):
        """Profile the next `num_steps` (body, default 3) engine steps with work; answers when the
        trace is written (under --profile-dir) with its path."""
        if options.profile_dir is None:
            raise APIError(404, "profiling is off: start the server with --profile-dir DIR", None,
                           "profiling_disabled")
        try:
            body = await http.json() if await http.body() else {}
        except ValueError:
            raise APIError(400, "the body must be JSON, e.g. {\"num_steps\": 3}", None, "invalid_json") from None
        steps = body.get("num_steps", 3) if isinstance(body, dict) else None
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 1000:
            raise APIError(400, f"num_steps must be an integer in [1, 1000], got {steps!r}", "num_steps",
                           "invalid_value")
        path = str(Path(options.profile_dir) / f"engine_steps_{int(time.time() * 1000)}.json")
        Path(options.profile_dir).mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(engine.profile, steps, path)
        return {"trace": path, "table": path + ".txt", "num_steps": steps}

    @app.get("/metrics")
    async def metrics():   # off the loop: a remote engine's metrics come over its pipe
        body, content_type = await asyncio.to_thread(engine.metrics.exposition)
        return Response(body, media_type=content_type)

    return app
