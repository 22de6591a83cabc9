"""Structured outputs: a grammar per request, its state as tokens are accepted, and token masks.

A request's grammar travels as text, `SamplingParams.grammar`: an llguidance grammar (a JSON
schema or a Lark grammar, made by `runtime/serving/structured.py` and checked there with `check`),
so it crosses the pipe to the engine's process as a string. The engine gives the request a
`GrammarState` when it takes it in (`Engine._drain_inbox`); every accepted token advances it
(`Engine.append_token`), and a grammar that can take no further token ends the request (finish
reason "stop"). Before each draw the sampler builds one bitmask row per request
(`token_bitmask`: bit t of word t // 32 set where token t may come next; rows of unconstrained
requests all ones, no bitmask at all when no request of the batch has a grammar) and masks the
logits with it on their device before any other step (`sampling.bias_and_penalties`).

A request as the sampler sees it may be ahead of its state: the speculative step reads positions
after drafted tokens (`speculative.as_if_accepted`). Its mask is the state's after its output
tokens beyond those the state consumed, which are then rolled back; where those tokens leave the
grammar the position can never be emitted (the draft before it is rejected: the target's mask gives
it probability 0), and its row allows every token.

Why llguidance (`python -m bench.structured_bench`; docs/performance.md has the numbers): on
glmc-small's tokenizer it compiles a JSON schema in ~0.75 ms (xgrammar ~1.6 ms), imports in 0.04 s
(3 s) and its wheel needs no other package (xgrammar needs transformers, triton and
apache-tvm-ffi); xgrammar's mask is faster on a schema (2 against 14 us a token), slower on
json_object (8 against 2 us).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import torch

_TOKENIZERS: dict[tuple[int, int], tuple[object, llguidance.LLTokenizer]] = {}
_LOCK = threading.Lock()
# Compiled grammars, as matchers at their start: a new request's matcher is a copy of one (~1 us
# on glmc-small's tokenizer against ~1 ms to compile the tests' person schema), so requests that
# share a schema (n choices, a client's repeated format) compile it once per process.
MAX_CACHED_GRAMMARS = 64
_MATCHERS: OrderedDict[tuple[str, int], llguidance.LLMatcher] = OrderedDict()


def ll_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` (a `tokenizer.Tokenizer`: its tokenizer.json and eos ids)
    over the model's `vocab_size` ids (ids past the tokenizer's are never allowed); made once per
    tokenizer (~15 ms on glmc-small's)."""
    key = (id(tokenizer), vocab_size)
    with _LOCK:
        hit = _TOKENIZERS.get(key)
        if hit is None or hit[0] is not tokenizer:
            eos = sorted(tokenizer.eos_token_ids) or None
            hit = (tokenizer, llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size,
                                                     eos_token=eos))
            _TOKENIZERS[key] = hit
    return hit[1]


def json_schema_grammar(schema: dict) -> str:
    """The grammar of JSON text that validates against `schema`, written compactly (no whitespace
    between tokens: `{"a":1}`), so a model cannot spend its tokens on blanks. Raises ValueError
    where `schema` is not JSON; `check` finds what else is wrong with it."""
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, overrides={"whitespace_flexible": False})


def lark_grammar(lark: str) -> str:
    """The grammar of a Lark text (llguidance's dialect: `%json{...}` and `<[id]>` tokens)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


def start_matcher(grammar: str, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A matcher of `grammar` at its start, compiled once per grammar and tokenizer and copied
    (it may be in its error state: `is_error`, `get_error`)."""
    key = (grammar, id(tokenizer))
    with _LOCK:
        start = _MATCHERS.get(key)
        if start is not None:
            _MATCHERS.move_to_end(key)
    if start is None:
        start = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        with _LOCK:
            _MATCHERS[key] = start
            while len(_MATCHERS) > MAX_CACHED_GRAMMARS:
                _MATCHERS.popitem(last=False)
    return start.deep_copy()


def check(grammar: str, tokenizer, vocab_size: int) -> str | None:
    """Why `grammar` cannot constrain this tokenizer's output (None: it can)."""
    matcher = start_matcher(grammar, ll_tokenizer(tokenizer, vocab_size))
    return (matcher.get_error() or "the grammar does not compile") if matcher.is_error() else None


class GrammarState:
    """One request's place in its grammar: the tokens accepted so far (engine thread only)."""

    def __init__(self, grammar: str, tokenizer: llguidance.LLTokenizer):
        self.matcher = start_matcher(grammar, tokenizer)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")
        self.num_words = (tokenizer.vocab_size + 31) // 32
        self.num_consumed = 0

    def advance(self, token: int) -> bool:
        """Accept `token`; -> whether the grammar has ended (it allows no further token, or
        `token` was outside it, which the sampler's mask never lets happen)."""
        self.matcher.consume_token(token)
        self.num_consumed += 1
        return self.matcher.is_stopped()

    def fill(self, mask: torch.Tensor, i: int, ahead: list[int]) -> None:
        """The bitmask of the tokens allowed after the accepted ones and then `ahead` into row i
        of `mask` ([B, num_words] int32, contiguous, on the host; left as it is, all ones, where
        `ahead` leaves the grammar: see the module docstring)."""
        row_bytes = mask.shape[1] * 4
        if not ahead:   # the common case, without a tensor view per row
            self.matcher.unsafe_compute_mask_ptr(mask.data_ptr() + i * row_bytes, row_bytes)
            return
        n = self.matcher.try_consume_tokens(ahead)
        if n == len(ahead):
            self.matcher.unsafe_compute_mask_ptr(mask.data_ptr() + i * row_bytes, row_bytes)
        if n:
            self.matcher.rollback(n)


def token_bitmask(reqs: list) -> torch.Tensor | None:
    """[B, words] int32 on the host: row i the tokens reqs[i] may draw next (all ones for a
    request without a grammar); None when none of them has one. A request is read through its
    `grammar_state` and `output_ids` (the tokens past those the state consumed are ahead of it)."""
    states = [getattr(r, "grammar_state", None) for r in reqs]
    live = [(i, s) for i, s in enumerate(states) if s is not None]
    if not live:
        return None
    mask = torch.full((len(reqs), max(s.num_words for _, s in live)), -1, dtype=torch.int32)
    for i, s in live:
        s.fill(mask, i, reqs[i].output_ids[s.num_consumed:])
    return mask


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bitmask [B, words] int32 (any device) as [B, vocab_size] bool, on the same device;
    tokens past its words are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1).bool()
    if allowed.shape[1] < vocab_size:
        return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    return allowed[:, :vocab_size]
