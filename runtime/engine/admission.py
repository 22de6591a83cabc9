"""Which requests an engine takes: a prompt and its parameters against the model and the KV pool.

`Admission` is plain data (picklable), so the HTTP process validates requests exactly as the
engine would, without asking it (`runtime/serving/engine_link.py`); `Engine.make_request` is the
same check in the engine's own process.
"""
from __future__ import annotations

from dataclasses import dataclass

from glmc.runtime.engine.pages import num_pages_for
from glmc.runtime.engine.request import Request
from glmc.runtime.engine.sampling import SamplingParams, request_seed


class InvalidRequest(ValueError):
    """A request the engine cannot take; `param` names the API field, `code` is OpenAI's code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Admission:
    """The limits a new request is checked against (every DP rank has the same pool)."""

    vocab_size: int
    max_context: int       # the model's context: prompt + output tokens
    num_pages: int         # KV pages of one rank's pool
    page_size: int
    max_row_context: int   # tokens one req_to_token row holds
    eos_token_ids: frozenset[int]

    def make_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Validate a prompt and its parameters into a `Request` (raises `InvalidRequest`)."""
        if not prompt_ids:
            raise InvalidRequest("prompt is empty", "prompt", "empty_prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids {bad[:5]} outside [0, {self.vocab_size})",
                                 "prompt", "invalid_token")
        params.validate(self.vocab_size)
        room = self.max_context - len(prompt_ids)
        if room < 1 or params.max_tokens > room:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_context} tokens. However, you "
                f"requested {len(prompt_ids) + params.max_tokens} tokens ({len(prompt_ids)} in the "
                f"prompt, {params.max_tokens} for the completion).", "max_tokens"
                if room >= 1 else "prompt", "context_length_exceeded")
        req = Request(list(prompt_ids), params, eos_token_ids=self.eos_token_ids,
                      max_context=self.max_context, seed=request_seed(params.seed))
        if not self.fits(req):
            raise InvalidRequest(f"request needs {req.max_total_tokens} tokens of KV, more than the "
                                 f"pool's {self.num_pages * self.page_size}", "max_tokens",
                                 "context_length_exceeded")
        return req

    def fits(self, req: Request) -> bool:
        """Whether `req` could ever run alone: its longest sequence fits the pool and a row."""
        return (num_pages_for(req.max_total_tokens, self.page_size) <= self.num_pages
                and req.max_total_tokens <= self.max_row_context)
