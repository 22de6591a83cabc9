"""The OpenAI wire format of requests: bodies in, errors out.

Pydantic models for `/v1/chat/completions` and `/v1/completions` bodies (unknown fields ignored,
as OpenAI does; types strict, so `"stream": "yes"` or `"n": "2"` is a 400, not a guess), their
translation to `SamplingParams`, and `APIError`, every error in OpenAI's shape. `messages` and
`prompt` are shape-checked by `runtime/serving/prompts.py` (fail-fast, with the offending index),
responses and SSE chunks are `runtime/serving/responses.py`. No engine, no HTTP here.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from fastapi.responses import JSONResponse
from glmc.runtime.engine.sampling import SamplingError, SamplingParams
from pydantic import BaseModel, ConfigDict, ValidationError

SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes: [lo, hi)


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
        """The first problem pydantic found, naming the field as a dotted path."""
        err = (e.errors() or [{}])[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        return cls(400, f"{param or 'body'}: {err.get('msg', 'invalid value')}", param)


def _printable(text: str | None) -> str | None:
    """`text` as valid UTF-8: a lone surrogate echoed from a request is written as `\\udfff`."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


ENGINE_FAILED = APIError(500, "the engine failed while running this request (see server log)",
                         None, "engine_error", "server_error")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields common to both generation endpoints; unknown fields are ignored, as OpenAI does."""

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


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema (an object's `properties` type the arguments)
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: dict


class ChatRequest(_SamplingFields):
    messages: Any  # a list of message objects, checked by prompts.chat_messages
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict | None = None  # e.g. {"enable_thinking": true} (vLLM, SGLang)


class CompletionRequest(_SamplingFields):
    prompt: Any  # str | list[int] | list[str] | list[list[int]], checked by prompts.completion_ids
    logprobs: int | None = None
    echo: bool | None = False
    # Read special-token text in the prompt (`<|user|>`) as those tokens; off: it is plain text.
    parse_special_tokens: bool = False


def sampling_params(body: _SamplingFields, max_tokens: int | None, logprobs: bool, top: int,
                    seed: int | None) -> SamplingParams:
    """The body's sampling fields, defaults where absent (raises `SamplingError` when validated)."""
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
        logit_bias=logit_bias(body.logit_bias))


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
        raise APIError(400, f"seed: must be an integer in [-2**63, 2**64), got {body.seed}",
                       "seed")
    return (body.seed + k) % 2**64
