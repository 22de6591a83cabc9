"""Request state: the scheduler's ledger for one sequence.

A request's tokens are `prompt_ids + output_ids`, then `num_inflight` tokens that a launched step
is still sampling on the device (each stands as `FUTURE_TOKEN` in `all_ids`: the runner reads the
real id from the device, see `ModelRunner.record_tokens`); the first `num_computed` of them have KV in the
pool, on `pages` (slot of position i = pages[i // 64] * 64 + i % 64). A step computes some of the
rest; when it reaches the last token, the step's logits give the next output token. So a decode is
just a request with one pending token, a chunked prefill one with many, and a retracted request
(pages released, `num_computed` reset) resumes by prefilling prompt and outputs so far.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from glmc.runtime.engine.grammar import GrammarState
from glmc.runtime.engine.sampling import SamplingParams, TokenLogprobs

_ids = itertools.count()
FUTURE_TOKEN = -1  # an input id the device fills in: the token last sampled for the request's row


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated (one of the `n` choices of an API call)."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    eos_token_ids: frozenset[int] = frozenset()
    max_context: int = 1 << 30  # model context limit; generation stops with "length" there
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    output_text: str = ""  # detokenized, cut at a stop string
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # KV bookkeeping (owned by the scheduler)
    pages: list[int] = field(default_factory=list)
    row: int | None = None
    dp_rank: int = 0  # the attention-DP rank whose pages and rows the request uses
    num_computed: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit of the latest admission
    num_retractions: int = 0
    num_inflight: int = 0  # tokens sampled by launched steps whose ids the host has not read yet
    num_offered_pages: int = 0  # leading full pages offered to the prefix cache since admission
    # Speculative decoding: the MTP layer's guesses for the tokens after the pending one; the next
    # step verifies them with the pending token (the scheduler grants up to 1 + len(draft_ids)).
    draft_ids: list[int] = field(default_factory=list)
    # The sampler's RNG seed (int64): the request's own, or one drawn when the engine made it.
    # With the number of output tokens as counter, a seeded request's draws do not depend on
    # what else shares its batches.
    seed: int = 0
    # Structured outputs: the place in `params.grammar` after `output_ids`, made by the engine when
    # it takes the request in (None: no grammar)
    grammar_state: GrammarState | None = None
    # Timing for metrics
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids + [FUTURE_TOKEN] * self.num_inflight

    def ids(self, start: int, stop: int) -> list[int]:
        """`all_ids[start:stop]` (0 <= start <= stop) without building `all_ids`: a step's
        inputs are usually one token of a long sequence."""
        p, o = len(self.prompt_ids), len(self.output_ids)
        out = self.prompt_ids[start:stop] if start < p else []
        if stop > p and start < p + o:
            out = out + self.output_ids[max(start - p, 0):stop - p]
        end = min(stop, p + o + self.num_inflight)
        if end > max(start, p + o):
            out = out + [FUTURE_TOKEN] * (end - max(start, p + o))
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, read or still in flight (the sampler's RNG counter)."""
        return len(self.output_ids) + self.num_inflight

    @property
    def num_pending(self) -> int:
        """Tokens whose KV the next steps must compute before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_pending == 1 and self.num_generated > 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """Largest sequence this request can reach (prompt + max_tokens, capped by the context)."""
        return min(len(self.prompt_ids) + self.params.max_tokens, self.max_context)

    def would_end(self, tokens: list[int]) -> bool:
        """Whether appending `tokens` ends the request by a token (a stop token, eos) or by its
        length; a stop string or its grammar's end is found only as the tokens are appended."""
        return (any(self.check_stop_token(t) == "stop" for t in tokens)
                or len(self.output_ids) + len(tokens) >= self.params.max_tokens
                or self.num_tokens + len(tokens) >= self.max_context)

    def check_stop_token(self, token: int) -> str | None:
        """Finish reason after appending `token` (stop strings are the detokenizer's business)."""
        if token in self.params.stop_token_ids or (
                token in self.eos_token_ids and not self.params.ignore_eos):
            return "stop"
        if (len(self.output_ids) >= self.params.max_tokens
                or len(self.prompt_ids) + len(self.output_ids) >= self.max_context):
            return "length"
        return None
