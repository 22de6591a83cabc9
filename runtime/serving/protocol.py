"""The OpenAI wire format of requests: bodies in, errors out.

Pydantic models for `/v1/chat/completions` and `/v1/completions` bodies, their translation to
`SamplingParams`, and `APIError`, every error in OpenAI's shape. Every field is honoured or
refused with a 400 naming it: unknown fields (a typo such as `temprature`) are refused as OpenAI
refuses them, types are strict (`"stream": "yes"` or `"n": "2"` is a 400, not a guess), and fields
OpenAI defines that glmc does not implement are refused where a request sets them to anything but
their no-op value (`refuse_unsupported`: `suffix`, `best_of` other than `n`,
`parallel_tool_calls: false`, strict tools under tool_choice "auto"; `response_format` is read by
`runtime/serving/structured.py`). `messages` and `prompt` are
shape-checked by `runtime/serving/prompts.py` (fail-fast, with the offending index), responses and
SSE chunks are `runtime/serving/responses.py`. No engine, no HTTP here.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from fastapi.responses import JSONResponse
from glmc.runtime.engine.sampling import SamplingError, SamplingParams
from pydantic import BaseModel, ConfigDict, ValidationError

SEED_RANGE = (0, 2**64)  # [lo, hi): the sampler's 64-bit seeds, each drawing its own tokens
# Fields OpenAI defines that glmc refuses whenever a request sets them, and why.
NOT_SUPPORTED = {
    "reasoning_effort": "GLM's thinking is on or off: chat_template_kwargs {\"enable_thinking\": "
                        "true|false}",
    "functions": "use tools", "function_call": "use tool_choice",
    "modalities": "text only", "audio": "text only", "prediction": "no predicted outputs",
    "store": "nothing is stored", "metadata": "nothing is stored",
    "web_search_options": "no web search", "service_tier": "one tier",
}


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type, headers

    def body(self) -> dict:
        return {"error": {"message": _printable(self.message), "type": self.type,
                          "param": _printable(self.param), "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def invalid(cls, e: ValidationError) -> APIError:
        """The first field pydantic found wrong, named as a path (`tools[0].function`). Where it
        tried the branches of a union (`tool_choice`: a string or an object), the error of the
        branch that got furthest into the value, the branch names left out of the path."""
        errors = e.errors() or [{"loc": ()}]
        field = [x for x in errors if x["loc"][:1] == errors[0]["loc"][:1]]
        err = max(field, key=lambda x: len(_path(x["loc"])))   # the first of the deepest
        loc = _path(err["loc"])
        param = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or None
        if err.get("type") == "extra_forbidden":
            why = NOT_SUPPORTED.get(param) if len(loc) == 1 else None
            return cls(400, f"{param}: not supported by this server ({why})" if why else
                       f"Unrecognized request argument supplied: {param}", param,
                       "unsupported_parameter" if why else "unknown_parameter")
        return cls(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param)


_UNION_BRANCH = re.compile(r"^(str|int|float|bool|dict|list|none|[a-z-]+\[.*\]|[A-Z]\w*)$")


def _path(loc: tuple) -> tuple:
    """A pydantic error location without its union branch names (`str`, `literal[...]`, a model's
    class name): request fields are snake_case."""
    return tuple(x for x in loc if isinstance(x, int) or not _UNION_BRANCH.match(x))


def _printable(text: str | None) -> str | None:
    """`text` as valid UTF-8: a lone surrogate echoed from a request is written as `\\udfff`."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


ENGINE_FAILED = APIError(500, "the engine failed while running this request (see server log)",
                         None, "engine_error", "server_error")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields common to both generation endpoints (beyond OpenAI's: vLLM's and SGLang's `top_k`,
    `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`, token ids in `stop`)."""

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
    logit_bias: dict | None = None  # OpenAI: {"token id": bias in [-100, 100]}; see logit_bias()
    stop: str | list[str | int] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's records: it changes no output


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema (an object's `properties` type the arguments)
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolName


class ChatRequest(_SamplingFields):
    messages: Any  # a list of message objects, checked by prompts.chat_messages
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # true (or unset): every call the model writes
    response_format: dict | None = None  # text, json_object or json_schema: `structured.py`
    chat_template_kwargs: dict | None = None  # e.g. {"enable_thinking": true} (vLLM, SGLang)


class CompletionRequest(_SamplingFields):
    prompt: Any  # str | list[int] | list[str] | list[list[int]], checked by prompts.completion_ids
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None  # refused unless empty: GLM has no fill-in-the-middle
    best_of: int | None = None  # refused unless n: no server-side candidates to rank
    # Read special-token text in the prompt (`<|user|>`) as those tokens; off: it is plain text.
    parse_special_tokens: bool = False


def refuse_unsupported(body: _SamplingFields) -> None:
    """A 400 naming the field for each OpenAI field set to what glmc does not do."""
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", "stream_options")
    if isinstance(body, ChatRequest):
        _refuse_chat(body)
    else:
        _refuse_completion(body)


def _refuse_chat(body: ChatRequest) -> None:
    if body.parallel_tool_calls is False:
        raise APIError(400, "parallel_tool_calls: false is not supported (the model may write "
                       "several calls; all are returned)", "parallel_tool_calls", "unsupported_value")
    forced = body.tool_choice not in (None, "auto", "none")
    for k, tool in enumerate(body.tools or []):
        if tool.function.strict and not forced:
            raise APIError(400, f"tools[{k}].function.strict: strict tools need constrained "
                           "decoding, which this server applies to calls only under tool_choice "
                           "\"required\" or a named function", f"tools[{k}].function.strict",
                           "unsupported_value")


def _refuse_completion(body: CompletionRequest) -> None:
    if body.suffix:
        raise APIError(400, "suffix: not supported (the model has no fill-in-the-middle)", "suffix",
                       "unsupported_value")
    n = 1 if body.n is None else body.n
    if body.best_of is not None and body.best_of != n:
        why = "must be >= n" if body.best_of < n else \
            "only best_of = n is supported (no extra candidates are generated and ranked)"
        raise APIError(400, f"best_of: {why}, got best_of={body.best_of}, n={n}", "best_of",
                       None if body.best_of < n else "unsupported_value")


def sampling_params(body: _SamplingFields, max_tokens: int | None, logprobs: bool, top: int,
                    seed: int | None, grammar: str | None = None) -> SamplingParams:
    """The body's sampling fields, defaults where absent (raises `SamplingError` when validated);
    `grammar`: what the output must follow (`structured.py`)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    d = SamplingParams()
    pick = lambda name: v if (v := getattr(body, name)) is not None else getattr(d, name)  # noqa
    return SamplingParams(
        max_tokens=max_tokens, **{k: pick(k) for k in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")},
        stop=[s for s in stop if isinstance(s, str)],
        stop_token_ids=[s for s in stop if isinstance(s, int)] + list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos, seed=seed, logprobs=logprobs, top_logprobs=top,
        logit_bias=logit_bias(body.logit_bias), grammar=grammar)


def logit_bias(raw: dict | None) -> dict[int, float]:
    """OpenAI's logit_bias, {"token id": number}, as {token id: bias}; raises `SamplingError`
    (param "logit_bias") on a key that is not a token id or a value that is not a number. The
    range checks (ids below the vocabulary size, values in [-100, 100]) are SamplingParams.validate's."""
    out = {}
    for key, value in (raw or {}).items():
        if not (isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key)):
            raise SamplingError("logit_bias", f"logit_bias: keys must be token ids, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SamplingError("logit_bias", f"logit_bias[{key!r}]: must be a number, got {value!r}")
        out[int(key)] = float(value)
    return out


def choice_seed(body: _SamplingFields, k: int) -> int | None:
    """The seed of the k-th sequence of a request: `seed + k`, wrapped into the generator's 64
    bits (so `2**64 - 1` with `n: 2` still works); None when unseeded."""
    if body.seed is None:
        return None
    lo, hi = SEED_RANGE
    if not lo <= body.seed < hi:
        raise APIError(400, f"seed: must be an integer in [0, 2**64), got {body.seed}", "seed")
    return (body.seed + k) % 2**64
