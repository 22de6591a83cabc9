"""The sampler: one semantics, batched over requests, on the device that holds the logits.

Per request, in this order (the order of Hugging Face `generate`'s logits processors and warpers,
with OpenAI's meaning of each field):

1. logprobs, when asked for, come from the raw model distribution, log_softmax(logits), before
   any of the steps below (as vLLM reports them by default); grammar, bias, penalties and filters
   change which token is drawn, not the reported probabilities.
   grammar (structured outputs, `grammar.py`): tokens the request's grammar does not allow next
   get logit -inf, before every step below, so no later step can bring them back.
2. logit_bias: bias[t] is added to logit t (OpenAI: token id -> value in [-100, 100]).
3. repetition_penalty r (HF/CTRL) on every token of prompt + output: x > 0 -> x / r, else x * r.
4. presence and frequency penalties (OpenAI) on output tokens:
   x -= frequency * count + presence * (count > 0).
5. temperature 0: greedy, argmax of the result (ties: the lowest token id). Nothing below applies.
6. temperature T > 0: p_i is proportional to exp((x_i - max x) / T). Tokens are ordered by (logit
   descending, token id ascending): that total order breaks every tie by the lowest id.
7. top_k: the first k tokens (top_k <= 0 or >= vocab: off).
8. top_p: on the distribution top-k left (renormalised), the smallest prefix whose mass reaches
   top_p; at least one token; top_p = 1: off.
9. min_p: on the distribution top-p left, tokens with p >= min_p * p_max (renormalising leaves the
   ratio alone, so this is exp((x_i - max x) / T) >= min_p).
10. draw from the kept tokens with probability proportional to p_i, by an exponential race: the
    token with the largest (x_i - max x) / T - log(-log u_i), u_i a counter-based hash of (seed,
    step, token id) (`torch_ref.sample_uniform`). The seed is the request's (a random one drawn once
    when the request is made, if it gave none); step is the number of tokens it has generated.

Example: p = [.3, .3, .2, .2], top_k=2, top_p=.5 keeps {0}: top-k leaves [.5, .5], and token 0
alone reaches .5. (Judging top-p on the unfiltered distribution, as SGLang does, would keep {0, 1}.)

Why this order: it is what HF `generate` applies (processors, then temperature, top-k, top-p,
min-p), so users get the distribution its documentation describes, and each filter sees the
distribution the previous one left, so a filter's parameter means the same thing whatever else
is set. Min-p after top-p changes nothing (it is scale-free); top-p after top-k does. Why the race:
it needs no sort and no cumulative sum over the vocabulary, and noise that is a pure function of
(seed, step, token id) makes a seeded request draw the same tokens whatever shares its batch,
after a retraction, and in both implementations.

Implementations: `sample_batch(logits, SamplingBatch)` runs steps 1-4 as a torch pre-pass on the
logits' device (the grammar's bitmask unpacked, scatter of bias entries, token counts), then steps
5-10 with `torch_ref.sample` on CPU or the Triton kernel `triton_launch.sample` on CUDA; both
compute the same integer hash and the same float steps, so they keep the same sets and draw the
same token (the Triton interpreter matches torch exactly; a GPU's fast exp/log can differ only
where two candidates are within float rounding). Only token ids and the asked-for logprobs leave
the device. The IR's `sample.tokens` is this sampler at its defaults, greedy (`sample_greedy`); the
engine samples the logits the plan returns with each request's parameters.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch
from glmc.codegen import torch_ref
from glmc.runtime.engine.grammar import allowed_tokens, token_bitmask
from glmc.runtime.worker.forward_batch import to_device


class SamplingError(ValueError):
    """An invalid sampling value; `param` names the OpenAI request field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingError(param, f"{param}: {message}")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str | None = None  # an llguidance grammar the output must follow (`grammar.py`)

    def validate(self, vocab_size: int) -> SamplingParams:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens!r}")
        for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
                             ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            _check(_is_number(v) and lo <= v <= hi, name, f"must be a number in [{lo}, {hi}], got {v!r}")
        _check(self.top_p > 0.0, "top_p", "must be > 0")
        _check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
               "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty!r}")
        _check(isinstance(self.top_k, int) and (self.top_k >= -1), "top_k",
               f"must be -1 (off) or a positive integer, got {self.top_k!r}")
        bad = [(t, b) for t, b in self.logit_bias.items() if not (
            isinstance(t, int) and 0 <= t < vocab_size and _is_number(b) and -100 <= b <= 100)]
        _check(not bad, "logit_bias", f"needs token ids in [0, {vocab_size}) mapped to numbers in "
               f"[-100, 100]; got {bad[:3]}")
        _check(len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be up to 16 non-empty strings")
        _check(all(isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids),
               "stop_token_ids", f"must be token ids in [0, {vocab_size})")
        _check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        _check(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= 20,
               "top_logprobs", f"must be in [0, 20], got {self.top_logprobs!r}")
        _check(self.grammar is None or isinstance(self.grammar, str), "grammar", "must be a string")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """Whether the draw depends on the output so far through penalties: the engine must have
        read every earlier token of the request before it schedules the next. (A grammar needs
        them only before the draw: `Engine._launch` reads them between forward and sampling.)"""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty)


@dataclass
class TokenLogprobs:
    """Logprob of the chosen token and the `top_logprobs` most likely alternatives."""

    logprob: float
    top: list[tuple[int, float]]


def request_seed(seed: int | None) -> int:
    """A request's RNG seed as an int64: the one it asked for (mod 2^64), else one drawn now."""
    s = secrets.randbits(64) if seed is None else seed % (1 << 64)
    return s - (1 << 64) if s >= 1 << 63 else s


def _ids(rows_ids: list[tuple[int, list[int]]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors of every (row, ids) pair, for a scatter into [B, V]."""
    rows = [r for r, ids in rows_ids for _ in ids]
    return (to_device(torch.tensor(rows, dtype=torch.int64), device),
            to_device(torch.tensor([t for _, ids in rows_ids for t in ids], dtype=torch.int64), device))


class Sampled(Protocol):
    """What the sampler reads of a request (`request.Request`, which imports this module for its
    parameter types: requests are seen through this contract, not imported)."""
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    seed: int

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far (the RNG counter of the next draw)."""


@dataclass(frozen=True)
class SamplingBatch:
    """The sampling inputs of one step's requests: [B] tensors on the logits' device, plus the
    grammar's bitmask and the sparse entries of bias and penalties (None when no request of the
    batch uses them)."""

    temperature: torch.Tensor  # fp32
    top_k: torch.Tensor  # int64; <= 0: off
    top_p: torch.Tensor  # fp32
    min_p: torch.Tensor  # fp32
    seed: torch.Tensor  # int64
    step: torch.Tensor  # int64: tokens the request has generated, the RNG counter
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    repetition: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # ([B] r, rows, ids seen)
    occurrence: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    # ([B] presence, [B] frequency, rows, output ids): one entry per occurrence
    top_logprobs: tuple[int | None, ...]  # per request: None (no logprobs) or alternatives wanted
    allowed: torch.Tensor | None = None  # [B, ceil(V / 32)] int32: bit t % 32 of word t // 32 set
    # where token t may come next (`grammar.token_bitmask`; all ones for unconstrained rows)

    @classmethod
    def greedy(cls, n: int, device) -> SamplingBatch:
        """`n` greedy rows without bias, penalties, grammar or logprobs: what `from_requests` gives
        for such requests, whatever their seeds and counters (a greedy draw reads neither)."""
        zeros = torch.zeros(n, dtype=torch.int64, device=device)
        fzeros = torch.zeros(n, dtype=torch.float32, device=device)
        return cls(fzeros, zeros, fzeros + 1.0, fzeros, zeros, zeros, None, None, None, (None,) * n)

    @classmethod
    def from_requests(cls, reqs: list[Sampled], device) -> SamplingBatch:
        """The batch of `reqs` as they stand (a request's grammar mask is the one after its
        `output_ids`, drafts included: `grammar.token_bitmask`)."""
        ps = [r.params for r in reqs]

        def col(values, dtype):
            return to_device(torch.tensor(values, dtype=dtype), device)
        bias = [(i, p.logit_bias) for i, p in enumerate(ps) if p.logit_bias]
        rep = [(i, sorted(set(r.prompt_ids) | set(r.output_ids))) for i, r in enumerate(reqs)
               if r.params.repetition_penalty != 1.0]
        occ = [(i, r.output_ids) for i, r in enumerate(reqs)
               if r.params.presence_penalty or r.params.frequency_penalty]
        # the per-request columns travel as two tensors (one copy each to a GPU), then split; rows
        # padded to 4 entries so each starts 16-byte aligned (Triton compiles again for a pointer
        # that is not)
        pad = [0] * (-len(reqs) % 4)
        floats = col([[p.temperature for p in ps] + pad, [p.top_p for p in ps] + pad,
                      [p.min_p for p in ps] + pad], torch.float32)[:, :len(reqs)]
        ints = col([[p.top_k for p in ps] + pad, [r.seed for r in reqs] + pad,
                    [r.num_generated for r in reqs] + pad], torch.int64)[:, :len(reqs)]
        allowed = token_bitmask(reqs) if any(p.grammar is not None for p in ps) else None
        return cls(
            floats[0], ints[0], floats[1], floats[2], ints[1], ints[2],
            bias=(*_ids([(i, list(b)) for i, b in bias], device),
                  col([v for _, b in bias for v in b.values()], torch.float32)) if bias else None,
            repetition=(col([p.repetition_penalty for p in ps], torch.float32), *_ids(rep, device))
            if rep else None,
            occurrence=(col([p.presence_penalty for p in ps], torch.float32),
                        col([p.frequency_penalty for p in ps], torch.float32), *_ids(occ, device))
            if occ else None,
            top_logprobs=tuple(p.top_logprobs if p.logprobs else None for p in ps),
            allowed=None if allowed is None else to_device(allowed, device))


def bias_and_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The grammar's mask and steps 2-4 on fp32 logits [B, V] (a new tensor; `logits` is not
    changed)."""
    x = logits.float().clone()
    if batch.allowed is not None:
        x.masked_fill_(~allowed_tokens(batch.allowed, x.shape[1]), float("-inf"))
    if batch.bias is not None:
        rows, ids, values = batch.bias
        x.index_put_((rows, ids), values, accumulate=True)
    if batch.repetition is not None:
        r, rows, ids = batch.repetition
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[rows, ids] = True
        r = r[:, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if batch.occurrence is not None:
        presence, frequency, rows, ids = batch.occurrence
        counts = torch.zeros_like(x).index_put_((rows, ids), torch.ones_like(ids, dtype=x.dtype),
                                                accumulate=True)
        x -= frequency[:, None] * counts + presence[:, None] * (counts > 0)
    return x


@dataclass
class SampledTokens:
    """What leaves the device: token ids [B] int64 and, for the requests that asked, the raw
    logprob of the chosen token and the top alternatives (None where no request asked).

    `start_copy()` queues the copies to pinned host memory behind the sampling kernels and returns
    at once; `to_host` then waits for those copies only (not for work queued after them, such as
    the next step's forward). Without `start_copy`, `to_host` reads the tensors directly."""

    token_ids: torch.Tensor
    logprob_rows: torch.Tensor | None = None  # [R] int64: the rows that asked
    chosen_logprobs: torch.Tensor | None = None  # [R] fp32
    top_logprobs: torch.return_types.topk | None = None  # values/indices [R, max asked]
    _host: tuple | None = None
    _copied: object = None  # torch.cuda.Event after the copies

    def _tensors(self) -> tuple:
        top = (self.top_logprobs.values, self.top_logprobs.indices) if self.top_logprobs is not None else ()
        rest = (self.logprob_rows, self.chosen_logprobs) if self.logprob_rows is not None else ()
        return (self.token_ids, *rest, *top)

    def start_copy(self) -> SampledTokens:
        if self.token_ids.is_cuda:
            self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                               for t in self._tensors())
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self

    def to_host(self, top_logprobs: tuple[int | None, ...]) -> list[tuple[int, TokenLogprobs | None]]:
        if self._copied is not None:
            self._copied.synchronize()
        host = self._host or self._tensors()
        tokens = host[0].tolist()
        lps: list[TokenLogprobs | None] = [None] * len(tokens)
        if self.logprob_rows is not None:
            rows, chosen = host[1].tolist(), host[2].tolist()
            top_v, top_i = (host[3].tolist(), host[4].tolist()) if len(host) > 3 else (None, None)
            for j, row in enumerate(rows):
                n = top_logprobs[row]
                top = list(zip(top_i[j][:n], top_v[j][:n])) if top_v is not None else []
                lps[row] = TokenLogprobs(chosen[j], top)
        return list(zip(tokens, lps))


def sample_batch(logits: torch.Tensor, batch: SamplingBatch, use_triton: bool | None = None,
                 kernels=None) -> SampledTokens:
    """Sample one token per row of logits [B, V] (any device); see the module docstring.

    use_triton: the Triton kernel (default on CUDA) or `torch_ref.sample` (default elsewhere); tests
    set it to run the kernel in the Triton interpreter on CPU. `kernels`: the plan's KernelLibrary
    to take the kernel from (default: rendered on demand).
    """
    x = bias_and_penalties(logits, batch)
    if use_triton is None:
        use_triton = logits.is_cuda
    if use_triton:
        from glmc.codegen import triton_launch
        draw = partial(triton_launch.sample, lib=kernels or triton_launch.JIT)
    else:
        draw = torch_ref.sample
    tokens = draw(x, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seed, batch.step)
    asked = [i for i, n in enumerate(batch.top_logprobs) if n is not None]
    if not asked:
        return SampledTokens(tokens)
    rows = to_device(torch.tensor(asked, dtype=torch.int64), logits.device)
    raw = torch.log_softmax(logits[rows].float(), -1)
    num_top = max(batch.top_logprobs[i] for i in asked)
    return SampledTokens(tokens, rows, raw.gather(1, tokens[rows, None])[:, 0],
                         torch.topk(raw, num_top) if num_top else None)


def sample_requests(logits: torch.Tensor, reqs: list[Sampled], kernels=None
                    ) -> list[tuple[int, TokenLogprobs | None]]:
    """One step's token (and logprobs, if asked) for each request, row i of logits [B, V] being
    reqs[i]'s: the batch is built once, sampled on the logits' device (CUDA: with `kernels`, the
    plan's library), and only the results move."""
    batch = SamplingBatch.from_requests(reqs, logits.device)
    return sample_batch(logits, batch, kernels=kernels).to_host(batch.top_logprobs)


def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution `sample_batch` draws row i from: [B, V] fp32 (on the logits' device),
    steps 2-9 of the module docstring, p_i proportional to exp((x_i - max x) / T) over the kept
    tokens and 0 elsewhere; a greedy row is the point mass on its argmax. Speculative sampling
    (`spec_sampling.py`) reads it as the target's p and, on the MTP layer's logits, as the draft's q."""
    x = bias_and_penalties(logits, batch)
    kept = torch_ref.kept_tokens(x, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    inv_t = 1.0 / torch.where(batch.temperature > 0, batch.temperature, 1.0)[:, None]
    e = torch.where(kept, torch.exp((x - x.max(-1, keepdim=True).values) * inv_t), 0.0)
    return e / e.sum(-1, keepdim=True)
