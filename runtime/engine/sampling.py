"""Sampling: validated per-request parameters and the logits -> token step, in torch.

Order per step (vLLM's): logprobs are taken from the raw model distribution; then repetition,
presence and frequency penalties; temperature; top-k, top-p and min-p filters; then a draw from the
request's own generator (seeded requests are reproducible whatever else shares the batch).
Temperature 0 is greedy: argmax after penalties.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """An invalid sampling value; `param` names the OpenAI request field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingError(param, f"{param}: {message}")


@dataclass
class SamplingParams:
    """Per-request sampling and stopping controls, validated by `validate()`."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k filter
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def validate(self, vocab_size: int) -> SamplingParams:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens!r}")
        for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
                             ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and math.isfinite(v) and lo <= v <= hi, name,
                   f"must be a number in [{lo}, {hi}], got {v!r}")
        _check(self.top_p > 0.0, "top_p", "must be > 0")
        _check(isinstance(self.repetition_penalty, (int, float))
               and 0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               f"must be in (0, 2], got {self.repetition_penalty!r}")
        _check(isinstance(self.top_k, int) and (self.top_k >= -1), "top_k",
               f"must be -1 (off) or a positive integer, got {self.top_k!r}")
        _check(len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be up to 16 non-empty strings")
        _check(all(isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids),
               "stop_token_ids", f"must be token ids in [0, {vocab_size})")
        _check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        _check(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= 20,
               "top_logprobs", f"must be in [0, 20], got {self.top_logprobs!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class TokenLogprobs:
    """Logprob of the chosen token and the `top_logprobs` most likely alternatives."""

    logprob: float
    top: list[tuple[int, float]]


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else torch.seed())
    return g


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """Penalise one row of logits [V] in place; returns it.

    Repetition penalty (HF/CTRL) covers prompt and output tokens; presence and frequency penalties
    (OpenAI) cover generated tokens only.
    """
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty,
                                       vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids), minlength=vocab)[:vocab].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p: removed tokens get -inf. One row [V]."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = (cum - torch.softmax(sorted_logits, -1)) >= params.top_p  # keeps the first token
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
               output_ids: list[int], generator: torch.Generator | None
               ) -> tuple[int, TokenLogprobs | None]:
    """Pick the next token from one fp32 row of logits [V]."""
    lp = None
    if params.logprobs:
        raw = torch.log_softmax(logits.float(), -1)
        top = torch.topk(raw, params.top_logprobs) if params.top_logprobs else None
        lp = (raw, [] if top is None else list(zip(top.indices.tolist(), top.values.tolist())))
    logits = apply_penalties(logits.float().clone(), params, prompt_ids, output_ids)
    if params.greedy:
        token = int(torch.argmax(logits))
    else:
        probs = torch.softmax(filter_logits(logits, params), -1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    if lp is not None:
        lp = TokenLogprobs(float(lp[0][token]), lp[1])
    return token, lp
