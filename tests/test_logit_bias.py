"""logit_bias through the real server (uvicorn, the official `openai` client, httpx for bad bodies):
the sampler applies it, and a malformed one is a 400 in OpenAI's shape naming `logit_bias`."""
import httpx
import openai
import pytest
from glmc.api import build_engine
from glmc.runtime.serving.server import create_app
from test_server import MODEL, Server

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served(tiny_ckpt):
    engine = build_engine(tiny_ckpt, warmup=False, num_pages=16, max_running=4, max_batch_tokens=64)
    with Server(create_app(engine, MODEL)) as server:
        yield engine, server


def test_logit_bias_forces_tokens(served):
    engine, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    the = engine.tokenizer.encode(" the")[0]
    a = engine.tokenizer.encode("a")[0]
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=1.0, seed=3)
    only_the = {str(t): -100 for t in range(engine.runner.vocab_size) if t != the}
    assert client.completions.create(logit_bias=only_the, **kw).choices[0].text == " the" * 4
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=1.5, logit_bias={str(a): 100})
    assert chat.choices[0].message.content == "aaa"
    unbiased = client.completions.create(**kw).choices[0].text
    assert unbiased != " the" * 4  # without the bias, the same seed draws something else


@pytest.mark.parametrize("bias", [{"x1": 5}, {"3": 101}, {"3": -100.5}, {"512": 1}, {"-1": 1},
                                  {"3": "much"}, {"3": True}, [3, 4]])
def test_bad_logit_bias_is_a_400_naming_it(served, bias):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": bias}
    r = httpx.post(served[1].url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and err["type"] == "invalid_request_error", err
