"""OpenAI-compatible HTTP server (FastAPI) over an `Engine`.

Routes: POST /v1/chat/completions, POST /v1/completions (SSE when `stream`), GET /v1/models,
GET /health, GET /metrics (Prometheus text). Every error, including malformed JSON and unknown
routes, comes back in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with a 4xx
status, or 503 + Retry-After when the waiting queue is full. A client that disconnects (streaming
or not) has its requests aborted, which frees their KV pages.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from glmc.runtime.engine import Engine, EventStream, InvalidRequest, Overloaded
from glmc.runtime.sampling import SamplingError, SamplingParams
from glmc.runtime.tokenizer import TemplateError

DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


ENGINE_FAILED = APIError(500, "the engine failed while running this request (see server log)",
                         None, "engine_error", "server_error")


class _SamplingFields(BaseModel):
    """Fields common to both generation endpoints; unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")
    model: str
    n: int | None = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str | int] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None


class ChatRequest(_SamplingFields):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False


def _sampling(body: _SamplingFields, max_tokens: int | None, logprobs: bool, top: int,
              seed: int | None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    d = SamplingParams()
    pick = lambda name: v if (v := getattr(body, name)) is not None else getattr(d, name)  # noqa
    return SamplingParams(
        max_tokens=max_tokens, **{k: pick(k) for k in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")},
        stop=[s for s in stop if isinstance(s, str)],
        stop_token_ids=[s for s in stop if isinstance(s, int)] + list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos, seed=seed, logprobs=logprobs, top_logprobs=top)


class _Api:
    """The route handlers of one app (one engine, one model name)."""

    def __init__(self, engine: Engine, model_name: str, max_n: int):
        self.engine, self.model_name, self.max_n = engine, model_name, max_n
        self.created = int(time.time())

    # -- request -> engine requests --------------------------------------------------------------

    def _prompts(self, body) -> list[list[int]]:
        tok = self.engine.tokenizer
        if isinstance(body, ChatRequest):
            if not body.messages:
                raise APIError(400, "messages must be a non-empty list", "messages")
            messages = [self._message(m, i) for i, m in enumerate(body.messages)]
            try:
                return [tok.encode(tok.apply_chat_template(messages))]
            except TemplateError as e:
                raise APIError(400, str(e), "messages") from e
        p = body.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)) or not p:
            p = [p]
        return [tok.encode(x) if isinstance(x, str) else list(x) for x in p]

    @staticmethod
    def _message(m: dict, i: int) -> dict:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: only text is understood here
            if any(not isinstance(c, dict) or c.get("type") != "text" for c in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               f"messages[{i}].content")
            content = "".join(c.get("text", "") for c in content)
        if not isinstance(m.get("role"), str) or not isinstance(content, (str, type(None))):
            raise APIError(400, f"messages[{i}] needs a string role and string content",
                           f"messages[{i}]")
        return {**m, "content": content or ""}

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
        for prompt in self._prompts(body):
            for _ in range(n):
                limit = max_tokens if max_tokens is not None else max(
                    1, self.engine.max_context - len(prompt))
                seed = None if body.seed is None else body.seed + len(reqs)
                try:
                    params = _sampling(body, limit, logprobs, top, seed)
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
            stream = self.engine.open_stream(reqs)
        except Overloaded as e:
            raise APIError(503, f"server overloaded: {e}; retry later", None, "overloaded",
                           "server_error", {"Retry-After": "1"}) from e
        chat, n = isinstance(body, ChatRequest), body.n or 1
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._sse(http, stream, rid, chat, usage, n),
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
        return JSONResponse(self._response(rid, chat, reqs, choices, counts, n))

    async def _sse(self, http, stream: EventStream, rid: str, chat: bool, usage: bool, n: int):
        async with stream:
            if chat:  # OpenAI opens each choice with the role
                for i in range(len(stream.reqs)):
                    yield self._chunk(rid, chat, i, {"role": "assistant", "content": ""}, None, None)
            counts = [None] * len(stream.reqs)
            async for i, ev in _events(http, stream):
                if ev.finish_reason == "error":
                    yield _sse_data(ENGINE_FAILED.body())
                    return
                counts[i] = ev
                if not (ev.text or ev.finish_reason or ev.logprobs):
                    continue  # text held back (partial UTF-8 or a possible stop string)
                lp = [(ev.token_id, ev.logprobs)] if ev.logprobs else None
                delta = {"content": ev.text} if chat else ev.text
                yield self._chunk(rid, chat, i, delta, ev.finish_reason, lp)
            if usage and stream.done:
                yield _sse_data({**self._head(rid, chat, True), "choices": [],
                                 "usage": _usage(counts, n)})
            if stream.done:
                yield "data: [DONE]\n\n"

    def _head(self, rid: str, chat: bool, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else \
            "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}

    def _chunk(self, rid, chat, index, delta, finish_reason, lp) -> str:
        choice = {"index": index, "finish_reason": finish_reason,
                  "logprobs": self._logprobs(lp, chat)}
        choice |= {"delta": delta} if chat else {"text": delta}
        return _sse_data({**self._head(rid, chat, True), "choices": [choice]})

    def _response(self, rid, chat, reqs, choices, counts, n) -> dict:
        out = []
        for i, c in enumerate(choices):
            choice = {"index": i, "finish_reason": c["finish_reason"],
                      "logprobs": self._logprobs(c["logprobs"] if reqs[i].params.logprobs
                                                 else None, chat)}
            choice |= ({"message": {"role": "assistant", "content": c["text"]}} if chat
                       else {"text": c["text"]})
            out.append(choice)
        return {**self._head(rid, chat, False), "choices": out,
                "usage": _usage(counts, n)}

    def _logprobs(self, items, chat: bool):
        """OpenAI logprobs: chat's `content` list, or the legacy completions layout."""
        if items is None:
            return None
        tok = self.engine.tokenizer
        name = tok.id_to_token

        def entry(t, lp):
            return {"token": name(t), "logprob": lp, "bytes": list(tok.token_bytes(t))}
        if chat:
            return {"content": [entry(t, lp.logprob) | {"top_logprobs": [
                entry(a, b) for a, b in lp.top]} for t, lp in items]}
        tokens = [name(t) for t, _ in items]
        offsets = [0, *itertools.accumulate(len(x) for x in tokens)][:len(tokens)]
        return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in items],
                "top_logprobs": [{name(a): b for a, b in lp.top} for _, lp in items],
                "text_offset": offsets}

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


def _sse_data(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(counts: list, n: int) -> dict:
    """Token counts; a prompt shared by `n` choices counts once, as OpenAI does."""
    done = [c for c in counts if c is not None]
    firsts = [c for i, c in enumerate(counts) if i % n == 0 and c is not None]
    prompt = sum(c.num_prompt_tokens for c in firsts)
    completion = sum(c.num_output_tokens for c in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)}}


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
    """Run the server in the foreground until interrupted (Ctrl-C)."""
    import uvicorn

    print(f"glmc: serving {model_name} at http://{host}:{port}/v1", flush=True)
    uvicorn.run(create_app(engine, model_name), host=host, port=port, log_level=log_level)
