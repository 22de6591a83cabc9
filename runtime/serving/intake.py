"""Request intake: an HTTP body -> validated engine `Request`s, with the slow parts off the loop.

On the event loop only the body is read, up to `max_body_bytes` (larger: 413, the rest drained so
the client sees the answer). Everything else runs on a worker thread (`Intake.prepare`): JSON
parsing (`JsonParser`: no long GIL holds, huge arrays refused as they are met), a scan for invalid
strings, depth and oversized arrays, the pydantic model, the chat template and the tokenizer
(`runtime/serving/prompts.py`), and `Engine.make_request`. Any bad input ends as an `APIError`.
"""
from __future__ import annotations

import json
import json.decoder
import json.scanner
from dataclasses import dataclass

from glmc.runtime.engine.admission import InvalidRequest
from glmc.runtime.engine.engine import Engine
from glmc.runtime.engine.request import Request
from glmc.runtime.engine.sampling import SamplingError
from glmc.runtime.serving.prompts import Prompts, chat_prompts, completion_prompts
from glmc.runtime.serving.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    choice_seed,
    refuse_unsupported,
    sampling_params,
)
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

MAX_DEPTH = 64
MAX_ITEMS = 4096  # longest array besides `prompt` and `messages`, whose bound is the context
DRAIN_FACTOR = 4  # read (and drop) up to this many times the limit of a too-large body
# The sampler works in fp32: logits are divided by the first two, and a top_p below fp32's range
# reads as 0, which drops every token. Past these, one request's draw failed its whole batch.
MIN_TEMPERATURE = 1e-5  # below it, greedy (vLLM's rule)
MIN_REPETITION_PENALTY = 1e-5
MIN_TOP_P = 1e-6  # keeps only the most likely token, as any smaller top_p does


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


class JsonParser:
    """JSON for request bodies, without long holds of the GIL.

    The C parser holds the GIL for a whole call; it takes bodies of up to C_JSON_MAX_VALUES
    values (estimated by their commas), ~35 ms of work at worst. Larger ones go to the Python
    scanner, which lets other threads in every few milliseconds and stops at the first array or
    object with more than `max_items` members (rather than build millions of values first).
    NaN, Infinity and numbers beyond float range are not JSON: refused.
    """

    C_JSON_MAX_VALUES = 100_000

    def __init__(self, max_items: int):
        self.max_items = max_items
        self.c = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)
        self.py = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)
        self.py.parse_array = self._bounded(json.decoder.JSONArray, 1)
        self.py.parse_object = self._bounded(json.decoder.JSONObject, 2)
        self.py.scan_once = json.scanner.py_make_scanner(self.py)

    def _bounded(self, parse, scan_arg: int):
        """`parse` (json.decoder's JSONArray or JSONObject) refusing more than max_items
        members: its `scan_once` argument (at `scan_arg`) is counted."""
        def bounded(*args, **kwargs):
            args, count = list(args), 0
            scan_once = args[scan_arg]

            def one(text, idx):
                nonlocal count
                count += 1
                if count > self.max_items:
                    raise ValueError(f"an array or object at char {idx} has more than "
                                     f"{self.max_items} members")
                return scan_once(text, idx)
            args[scan_arg] = one
            return parse(*args, **kwargs)
        return bounded

    def parse(self, raw: bytes):
        """The JSON value of a body (400 if it is not UTF-8 JSON, or too deep for the parser)."""
        try:
            text = raw.decode("utf-8")
            fast = raw.count(b",") < self.C_JSON_MAX_VALUES
            return (self.c if fast else self.py).decode(text)
        except UnicodeDecodeError as e:
            raise APIError(400, f"malformed JSON body: not UTF-8 ({e.reason} at byte {e.start})",
                           None, "invalid_json") from None
        except RecursionError:
            raise APIError(400, "malformed JSON body: nested too deeply", None,
                           "invalid_json") from None
        except ValueError as e:  # JSONDecodeError, NaN, integers past Python's digit limit, size
            raise APIError(400, f"malformed JSON body: {e}", None, "invalid_json") from None


def scan(body, max_long_items: int) -> None:
    """Refuse what would make later steps slow or fail: lone surrogates (not encodable text),
    nesting deeper than MAX_DEPTH, arrays longer than MAX_ITEMS (`prompt`, `messages` and their
    items: `max_long_items`). Iterative, so any depth is safe; errors name the path."""
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", None, "invalid_json")
    stack = [(v, (k,), 1) for k, v in body.items()]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (list, dict)):
            if depth > MAX_DEPTH:
                raise APIError(400, f"{_dotted(path)}: nested deeper than {MAX_DEPTH} levels",
                               _dotted(path))
            if isinstance(value, list):
                long = path[0] in ("prompt", "messages") and len(path) <= 2  # [[ids]] too
                limit = max_long_items if long else MAX_ITEMS
                if len(value) > limit:
                    raise APIError(400, f"{_dotted(path)}: {len(value)} items, more than "
                                   f"{limit}", _dotted(path))
                stack += [(v, (*path, i), depth + 1) for i, v in enumerate(value)
                          if not isinstance(v, (int, float))]
            else:
                for k, v in value.items():
                    _check_text(k, (*path, k))
                    stack.append((v, (*path, k), depth + 1))


def _check_text(s: str, path: tuple) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"{_dotted(path)}: invalid Unicode (a lone surrogate "
                           f"\\u{ord(s[e.start]):04x} at {e.start})", _dotted(path)) from None


def _dotted(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


@dataclass
class Prepared:
    """A validated API call: its body, one engine `Request` per (prompt, choice), the prompts."""

    body: ChatRequest | CompletionRequest
    reqs: list[Request]
    prompts: Prompts

    @property
    def chat(self) -> bool:
        return isinstance(self.body, ChatRequest)

    @property
    def n(self) -> int:
        return self.body.n or 1


class Intake:
    """Turns bodies into `Prepared` calls for one engine and model name (thread-safe)."""

    def __init__(self, engine: Engine, model_name: str, max_n: int):
        self.engine, self.model_name, self.max_n = engine, model_name, max_n
        self.max_long_items = max(engine.max_context, engine.max_waiting)
        self.json = JsonParser(max(self.max_long_items, MAX_ITEMS))

    def prepare(self, raw: bytes, chat: bool) -> Prepared:
        """Parse and validate one body (call on a worker thread); raises `APIError`."""
        engine = self.engine
        obj = self.json.parse(raw)
        scan(obj, self.max_long_items)
        try:
            body = (ChatRequest if chat else CompletionRequest).model_validate(obj)
        except ValidationError as e:
            raise APIError.invalid(e) from None
        refuse_unsupported(body)
        if body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist.", "model",
                           "model_not_found")
        n = 1 if body.n is None else body.n
        if not 1 <= n <= self.max_n:
            raise APIError(400, f"n must be in [1, {self.max_n}], got {n}", "n")
        if chat:
            prompts = chat_prompts(body, engine.tokenizer, engine.max_context,
                                   engine.admission.vocab_size)
        else:
            if body.echo:
                raise APIError(400, "echo is not supported", "echo")
            prompts = completion_prompts(body, engine.tokenizer, engine.max_context,
                                         engine.max_waiting)
        return Prepared(body, self._requests(body, prompts, n), prompts)

    def _requests(self, body, prompts: Prompts, n: int) -> list[Request]:
        total = len(prompts.ids) * n
        if total > self.engine.max_waiting:  # could never be queued: a 503 would lie
            raise APIError(400, f"this request asks for {total} sequences; at most "
                           f"{self.engine.max_waiting} can be queued (--max-waiting)",
                           "n" if len(prompts.ids) == 1 else "prompt", "too_many_sequences")
        chat = isinstance(body, ChatRequest)
        if chat:
            logprobs, top = bool(body.logprobs), body.top_logprobs or 0
            if top and not logprobs:
                raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
            max_tokens = body.max_tokens if body.max_completion_tokens is None \
                else body.max_completion_tokens
        else:
            logprobs, top = body.logprobs is not None, body.logprobs or 0
            max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        reqs = []
        for prompt in prompts.ids:
            for _ in range(n):
                limit = max_tokens if max_tokens is not None else max(
                    1, self.engine.max_context - len(prompt))
                try:
                    params = sampling_params(body, limit, logprobs, top,
                                             choice_seed(body, len(reqs)), prompts.grammar)
                    reqs.append(self.engine.make_request(prompt, _fp32_safe(params)))
                except SamplingError as e:
                    raise APIError(400, str(e), _api_name(body, e.param)) from e
                except InvalidRequest as e:
                    raise APIError(400, str(e), e.param, e.code) from e
        return reqs


def _fp32_safe(params):
    """`params` with a temperature too small to divide by made greedy and a tiny top_p raised to
    one with the same effect; a repetition penalty that small is refused (400)."""
    if 0.0 < params.temperature < MIN_TEMPERATURE:
        params.temperature = 0.0
    if 0.0 < params.top_p < MIN_TOP_P:
        params.top_p = MIN_TOP_P
    if 0.0 < params.repetition_penalty < MIN_REPETITION_PENALTY:
        raise APIError(400, f"repetition_penalty: must be >= {MIN_REPETITION_PENALTY} (logits are "
                       f"divided by it), got {params.repetition_penalty}", "repetition_penalty")
    return params


def _api_name(body, param: str) -> str:
    """The request field a sampling parameter came from."""
    if param == "top_logprobs" and isinstance(body, CompletionRequest):
        return "logprobs"  # completions call top_logprobs `logprobs`
    if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    return param


async def read_body(http, max_bytes: int) -> bytes:
    """The request body, or 413 when it is over `max_bytes` (the rest is read and dropped, up to
    DRAIN_FACTOR times the limit, so the client is not cut off before it can read the answer)."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        await _drain(http, max_bytes)
        raise _too_large(int(declared), max_bytes)
    body, drained = bytearray(), 0
    async for chunk in _chunks(http):
        if len(body) + len(chunk) > max_bytes:
            drained += len(chunk)
            if drained > DRAIN_FACTOR * max_bytes:
                break
            continue
        body += chunk
    if drained:
        raise _too_large(len(body) + drained, max_bytes)
    return bytes(body)


async def _drain(http, max_bytes: int) -> None:
    seen = 0
    async for chunk in _chunks(http):
        seen += len(chunk)
        if seen > DRAIN_FACTOR * max_bytes:
            return


async def _chunks(http):
    try:
        async for chunk in http.stream():
            yield chunk
    except ClientDisconnect:  # nobody will read the answer; it only has to be a 4xx
        raise APIError(400, "the client disconnected before sending the whole body") from None


def _too_large(size: int, max_bytes: int) -> APIError:
    return APIError(413, f"request body is {size} bytes, over this server's limit of "
                    f"{max_bytes} (--max-body-mb)", None, "request_too_large")


def check_content_type(http) -> None:
    kind = http.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/") and
                                            kind.endswith("+json")):
        raise APIError(415, f"Content-Type must be application/json, got {kind or 'none'!r} "
                       "(curl: add -H 'Content-Type: application/json')", None,
                       "unsupported_media_type")
