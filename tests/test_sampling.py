"""Sampling parameters, logits processing and streaming detokenization with stop strings."""
import math
from pathlib import Path

import pytest
import torch
from glmc.runtime.engine.sampling import (
    SamplingError,
    SamplingParams,
    apply_penalties,
    filter_logits,
    make_generator,
    sample_row,
)
from glmc.runtime.engine.tokenizer import Detokenizer, Tokenizer

TINY = Path(__file__).resolve().parent.parent / "models" / "tiny"


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("min_p", 1.1), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("max_tokens", 0),
    ("stop_token_ids", [512]), ("stop", [""]), ("top_logprobs", 21), ("seed", 1.5)])
def test_invalid_values_name_their_field(field, value):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{field: value}).validate(vocab_size=512)
    assert e.value.param == field and field in str(e.value)


def test_greedy_is_argmax_and_reports_raw_logprobs():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    token, lp = sample_row(logits, SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
                           [], [], None)
    raw = torch.log_softmax(logits, -1)
    assert token == 1 and math.isclose(lp.logprob, raw[1].item(), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [1, 3]


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0])
    rep = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), [0], [1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 1.0]  # positive logits divided, negative multiplied
    pf = apply_penalties(logits.clone(), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                         [3], [2, 2, 0])
    assert pf.tolist() == [2.0 - 0.75, -2.0, 1.0 - 1.0, 1.0]  # prompt tokens are not penalised
    token, _ = sample_row(logits, SamplingParams(temperature=0.0, frequency_penalty=2.0), [], [0, 0],
                          None)
    assert token in (2, 3)


def test_filters_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits, SamplingParams(**kw))).tolist()  # noqa
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.7) == [True, True, False, False]
    assert kept(top_p=0.1) == [True, False, False, False]  # the top token always survives
    assert kept(min_p=0.5) == [True, True, False, False]  # >= 0.5 * 0.5
    # temperature sharpens before the nucleus is taken
    assert kept(temperature=0.1, top_p=0.9) == [True, False, False, False]


def test_seeded_sampling_repeats_and_follows_the_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    params = SamplingParams(temperature=1.0, seed=7)
    draw = lambda g: [sample_row(logits, params, [], [], g)[0] for _ in range(2000)]  # noqa
    a, b = draw(make_generator(7)), draw(make_generator(7))
    assert a == b
    freq = [a.count(i) / len(a) for i in range(3)]
    assert all(abs(f - p) < 0.05 for f, p in zip(freq, [0.6, 0.3, 0.1]))


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
