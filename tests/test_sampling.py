"""Sampling parameters and their validation, the sampler's pre-pass (logit_bias, penalties) and
logprobs through the batched entry point, and streaming detokenization with stop strings.
(The sampler's filters, seeds and the Triton kernel: tests/test_sampler.py.)"""
import math
from pathlib import Path

import pytest
import torch
from glmc.runtime.engine.request import Request
from glmc.runtime.engine.sampling import (
    SamplingBatch,
    SamplingError,
    SamplingParams,
    bias_and_penalties,
    request_seed,
    sample_requests,
)
from glmc.runtime.engine.tokenizer import Detokenizer, Tokenizer

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("min_p", 1.1), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("max_tokens", 0),
    ("stop_token_ids", [512]), ("stop", [""]), ("top_logprobs", 21), ("seed", 1.5),
    ("logit_bias", {512: 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {3: 100.5}),
    ("logit_bias", {3: float("inf")})])
def test_invalid_values_name_their_field(field, value):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{field: value}).validate(vocab_size=512)
    assert e.value.param == field and field in str(e.value)


def req(params, prompt=(), output=(), seed=0):
    return Request(list(prompt), params, output_ids=list(output), seed=seed)


def test_greedy_is_argmax_and_reports_raw_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2, logit_bias={3: 2.0})
    [(token, lp)] = sample_requests(logits, [req(params)])
    raw = torch.log_softmax(logits[0], -1)
    assert token == 3  # the bias decides the token ...
    assert math.isclose(lp.logprob, raw[3].item(), rel_tol=1e-6)  # ... not the reported logprobs
    assert [t for t, _ in lp.top] == [1, 3]


def test_logprobs_only_for_the_requests_that_asked():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    reqs = [req(SamplingParams(temperature=0.0)), req(SamplingParams(temperature=0.0, logprobs=True)),
            req(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3))]
    (t0, lp0), (t1, lp1), (t2, lp2) = sample_requests(logits, reqs)
    assert (t0, t1, t2) == (1, 0, 2) and lp0 is None and lp1.top == [] and len(lp2.top) == 3


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]] * 3)
    reqs = [req(SamplingParams(repetition_penalty=2.0), [0], [1]),
            req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [3], [2, 2, 0]),
            req(SamplingParams(logit_bias={1: 3.0}, repetition_penalty=2.0), [1])]
    out = bias_and_penalties(logits, SamplingBatch.from_requests(reqs, "cpu"))
    assert out[0].tolist() == [1.0, -4.0, 1.0, 1.0]  # positive logits divided, negative multiplied
    assert out[1].tolist() == [2.0 - 0.75, -2.0, 1.0 - 1.0, 1.0]  # prompt tokens are not penalised
    assert out[2].tolist() == [2.0, 0.5, 1.0, 1.0]  # bias first (-2 + 3 = 1), then the penalty
    assert logits[0].tolist() == [2.0, -2.0, 1.0, 1.0]  # the caller's logits are left alone
    [(token, _)] = sample_requests(logits[:1], [req(SamplingParams(temperature=0.0,
                                                                   frequency_penalty=2.0), [], [0, 0])])
    assert token == 2  # 0 is penalised below 2 and 3; of the tied 2 and 3 the lowest id wins


def test_logit_bias_forces_a_token():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    pinned = {t: -100.0 for t in range(64) if t != 17}
    reqs = [req(SamplingParams(logit_bias=pinned), seed=s) for s in range(2)] + \
           [req(SamplingParams(logit_bias={42: 100.0}, temperature=2.0), seed=s) for s in range(2)]
    assert [t for t, _ in sample_requests(logits, reqs)] == [17, 17, 42, 42]


def test_request_seed_is_an_int64():
    assert request_seed(5) == 5 and request_seed(-1) == -1 and request_seed(2**64 + 3) == 3
    assert request_seed(2**63) == -2**63
    assert len({request_seed(None) for _ in range(8)}) == 8  # unseeded: drawn at random


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(TINY)


def test_tiny_tokenizer_and_chat_template(tok):
    assert tok.vocab_size <= 512 and len(tok.eos_token_ids) == 3
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hello, world!"}])
    assert text == "[gMASK]<sop><|system|>Be brief.<|user|>Hello, world!<|assistant|><think></think>"
    ids = tok.encode(text)
    assert ids[:2] == [tok.tok.token_to_id("[gMASK]"), tok.tok.token_to_id("<sop>")]
    assert tok.decode(ids) == "Be brief.Hello, world!<think></think>"  # markers stay, roles go
    # logprobs report each token's raw bytes; byte-level pieces of one character join back up
    assert b"".join(tok.token_bytes(t) for t in tok.encode("Hi 你好")).decode() == "Hi 你好"
    with pytest.raises(ValueError, match="unknown role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


def stream(tok, text, stop):
    d = Detokenizer(tok, stop)
    pieces = [d.add(t) for t in tok.encode(text)]
    return pieces, d


def test_detokenizer_streams_utf8_whole(tok):
    text = "Hello 你好, world é!"
    pieces, d = stream(tok, text, [])
    assert "".join(pieces) + d.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_text_and_holds_back_prefixes(tok):
    pieces, d = stream(tok, "one, two, three, four", ["three"])
    assert d.stopped and d.text == "one, two, "
    assert "".join(pieces) == "one, two, " and "thr" not in "".join(pieces)
    # a partial match that does not complete is released at the end
    pieces, d = stream(tok, "one, two, thr", ["three"])
    assert not d.stopped and "".join(pieces) + d.flush() == "one, two, thr"
