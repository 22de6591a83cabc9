"""Structured outputs for real: glmc-small (the trained model `glmc run` serves by default) behind
the server as `glmc run` runs it (the engine at the other end of a pipe), the official `openai`
client, sampling at temperature 1.0 over several seeds. Every JSON answer must parse and validate
against its schema, every forced tool call must carry arguments valid for its tool; the mask itself
is checked in the sampler (masked tokens never drawn, greedy or not) and under MTP speculation."""
import json

import httpx
import openai
import pytest
import torch
from bench.structured_bench import PERSON   # the schema the bench times is the one these tests enforce
from glmc.api import build_engine
from glmc.runtime.engine.grammar import GrammarState, json_schema_grammar, ll_tokenizer, token_bitmask
from glmc.runtime.engine.sampling import SamplingBatch, SamplingParams, probabilities, sample_batch
from glmc.tiny import SMALL_DIR, SMALL_NAME
from test_server import serving

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"type": "string", "enum": ["C", "F"]},
        "detail": {"type": "object", "properties": {"wind": {"type": "boolean"}},
                   "required": ["wind"], "additionalProperties": False}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"]}}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER_ASK = [{"role": "user", "content": "Weather in Paris?"}]
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def check(schema: dict, value, path="$") -> None:
    """A JSON schema check of the keywords the tests use (type, properties, required,
    additionalProperties, enum, items, maxItems, min/maxLength, minimum/maximum)."""
    kind = schema.get("type")
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), (path, value)
    elif kind is not None:
        assert isinstance(value, TYPES[kind]), (path, value)
    if "enum" in schema:
        assert value in schema["enum"], (path, value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        assert set(schema.get("required", [])) <= value.keys(), (path, value)
        if schema.get("additionalProperties") is False:
            assert value.keys() <= props.keys(), (path, value)
        for k, v in value.items():
            if k in props:
                check(props[k], v, f"{path}.{k}")
    if isinstance(value, list):
        assert len(value) <= schema.get("maxItems", len(value)), (path, value)
        for i, v in enumerate(value):
            check(schema.get("items", {}), v, f"{path}[{i}]")
    if isinstance(value, str):
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)), path
    if isinstance(value, int) and not isinstance(value, bool):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), (path, value)


@pytest.fixture(scope="module")
def engine():
    return build_engine(SMALL_DIR, warmup=False, max_running=16)


@pytest.fixture(scope="module")
def client(engine):
    with serving(engine, "linked", model=SMALL_NAME) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def answers(client, stream: bool, **kw) -> list[tuple[str, object, list]]:
    """(finish_reason, content, tool_calls [(name, arguments)]) per choice, streamed or not."""
    r = client.chat.completions.create(model=SMALL_NAME, temperature=1.0, stream=stream, **kw)
    if not stream:
        return [(c.finish_reason, c.message.content, [(t.function.name, t.function.arguments)
                                                       for t in c.message.tool_calls or []])
                for c in r.choices]
    out: dict[int, list] = {}
    for chunk in r:
        for c in chunk.choices:
            got = out.setdefault(c.index, [None, "", []])
            got[0] = c.finish_reason or got[0]
            got[1] += c.delta.content or ""
            got[2] += [(t.function.name, t.function.arguments) for t in c.delta.tool_calls or []]
    return [tuple(out[i]) for i in sorted(out)]


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_answers_parse(client, stream):
    got = answers(client, stream, messages=ASK, response_format={"type": "json_object"}, n=4,
                  seed=15 if stream else 1, max_tokens=400)
    for finish, content, _ in got:
        assert finish == "stop", content
        assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    got = answers(client, stream, messages=ASK, response_format=fmt, n=6, seed=20 if stream else 30,
                  max_tokens=400)
    for finish, content, _ in got:
        assert finish == "stop", content
        check(PERSON, json.loads(content))


def test_json_answer_closes_thinking_first(client):
    r = client.chat.completions.create(
        model=SMALL_NAME, messages=ASK, max_tokens=400, seed=1, response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert not getattr(r.choices[0].message, "reasoning_content", None)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}},
                                    "required"])
def test_forced_tool_calls_have_valid_arguments(client, choice, stream):
    got = answers(client, stream, messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice=choice,
                  n=4, seed=3 if stream else 4, max_tokens=200)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for finish, content, calls in got:
        assert finish == "tool_calls" and not content and len(calls) == 1, (content, calls)
        name, arguments = calls[0]
        assert name == "get_weather" if isinstance(choice, dict) else name in schemas
        check(schemas[name], json.loads(arguments))


def test_bad_schemas_are_refused_by_field(client):
    for fmt, param in (
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
             "response_format"),
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "properties": {"a": {"$ref": "#/$defs/missing"}}}}}, "response_format"),
            ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=SMALL_NAME, messages=ASK, max_tokens=4,
                                           response_format=fmt)
        assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    for params, param in (({"type": "object", "properties": {"n": {"type": "integr"}}}, ""),
                          ({"type": "object", "properties": {"n": {"type": "string"}}, "required": 5},
                           ".required"),
                          ({"properties": {"n": {"type": "string", "pattern": "^a$"}}},
                           ".properties.n")):
        bad = {"type": "function", "function": {"name": "f", "parameters": params}}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=SMALL_NAME, messages=ASK, max_tokens=4, tools=[bad],
                                           tool_choice="required")
        assert e.value.body["param"] == "tools[0].function.parameters" + param
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SMALL_NAME, messages=ASK, max_tokens=4, tools=[WEATHER],
                                       tool_choice="required", response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"
    assert client.chat.completions.create(model=SMALL_NAME, messages=ASK, max_tokens=2).choices


ODD_SCHEMAS = [
    {"type": 5}, {"type": ["string", "null"]}, {"$ref": "#"}, {"type": "string", "pattern": "("},
    {"type": "string", "minLength": 5, "maxLength": 2}, {"enum": []}, {"anyOf": []},
    {"type": "integer", "minimum": "a"}, {"allOf": [{"type": "string"}, {"type": "integer"}]},
    {"type": "array", "items": [1]}, {"type": "number", "multipleOf": 0}, {"required": {"a": 1}},
    {"properties": []}, {"oneOf": [{"type": "object"}, {"type": "object"}]},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, {"type": "string", "maxLength": 10**12},
    {"const": {"a": [1, 2]}}, {"enum": ["a" * 10000]}, {"properties": {"é": {"type": "string"}}}, True]
ODD_PARAMETERS = [
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": 5},
    {"type": "object", "properties": {"a": 5}}, {"type": "object", "properties": 5},
    {"properties": {"a": {"type": "string", "minLength": "x"}}},
    {"properties": {"a": {"type": "string", "enum": "ab"}}}, {"properties": {"a": {"type": True}}},
    {"properties": {"a": {"type": "string", "minLength": 3, "maxLength": 1}}},
    {"properties": {"é\"<": {"type": "string", "enum": ["ü", "a\"b\\c"]}}, "required": ["é\"<"]}, {}]


def test_odd_schemas_get_answers_or_400s_never_5xx(client):
    """Schemas llguidance rejects, cannot satisfy or must take apart are 400s naming the field or
    answers; the server keeps serving."""
    url = str(client.base_url).rstrip("/") + "/chat/completions"
    base = {"model": SMALL_NAME, "messages": ASK, "max_tokens": 3}
    bodies = [{**base, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}
              for s in ODD_SCHEMAS]
    bodies += [{**base, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": p}}]} for p in ODD_PARAMETERS]
    for body in bodies:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code in (200, 400), (body, r.text)
        if r.status_code == 400:
            param = r.json()["error"]["param"]
            assert param.startswith("response_format" if "response_format" in body else "tools[0]"), r.text
    assert client.chat.completions.create(model=SMALL_NAME, messages=ASK, max_tokens=2).choices


# -- the mask in the sampler --------------------------------------------------------------------


def batch_with_mask(allowed: torch.Tensor, temperature: list[float], **kw) -> SamplingBatch:
    """A SamplingBatch of len(temperature) rows whose grammar mask is `allowed` [B, V] bool."""
    B, V = allowed.shape
    words = torch.zeros(B, (V + 31) // 32 * 32, dtype=torch.int64)
    words[:, :V] = allowed.long()
    bits = (words.view(B, -1, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    reqs = [type("R", (), dict(params=SamplingParams(temperature=t, **kw), prompt_ids=[1],
                               output_ids=[], seed=s, num_generated=0))() for s, t in enumerate(temperature)]
    batch = SamplingBatch.from_requests(reqs, "cpu")
    return SamplingBatch(**{**batch.__dict__, "allowed": bitmask})


@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"top_p": 0.5, "min_p": 0.1}])
def test_masked_tokens_are_never_sampled(filters):
    g = torch.Generator().manual_seed(0)
    B, V = 8, 1000
    allowed = torch.rand(B, V, generator=g) < 0.05
    allowed[:, 999] = True   # the last word's tail: bits past V
    temperature = [0.0, 1.0, 1.5, 0.7] * 2
    for step in range(20):
        logits = torch.randn(B, V, generator=g) * 3
        logits[~allowed] += 10.0   # the forbidden tokens are the likeliest
        batch = batch_with_mask(allowed, temperature, **filters)
        batch = SamplingBatch(**{**batch.__dict__, "step": batch.step + step})
        tokens = sample_batch(logits, batch).token_ids
        assert allowed[torch.arange(B), tokens].all()
        best = torch.where(allowed, logits, float("-inf")).argmax(-1)
        assert torch.equal(tokens[::4], best[::4])   # greedy rows: the best allowed token
        p = probabilities(logits, batch)
        assert (p[~allowed] == 0).all() and torch.allclose(p.sum(-1), torch.ones(B))


def test_masked_logits_draw_alike_in_the_triton_kernel():
    """-inf logits (the mask) through the CUDA path's kernel, in the interpreter: the same tokens."""
    g = torch.Generator().manual_seed(1)
    allowed = torch.rand(4, 64, generator=g) < 0.2
    allowed[:, 7] = True
    logits = torch.randn(4, 64, generator=g) * 2 + (~allowed) * 5.0
    batch = batch_with_mask(allowed, [0.0, 1.0, 1.3, 0.8], top_k=8, top_p=0.9)
    got = sample_batch(logits, batch, use_triton=False).token_ids
    assert torch.equal(got, sample_batch(logits, batch, use_triton=True).token_ids)
    assert allowed[torch.arange(4), got].all()


def test_unconstrained_batches_carry_no_mask(engine):
    plain = SamplingParams(temperature=1.0)
    batch = SamplingBatch.from_requests([engine.make_request([5, 6], plain)], "cpu")
    assert batch.allowed is None


def test_mask_ahead_of_the_state_is_the_advanced_state(engine):
    """A request read with drafts past its state (the speculative verify) gets the mask of the
    state advanced through them, and the state itself does not move."""
    tok = engine.tokenizer
    grammar = json_schema_grammar(PERSON)
    lt = ll_tokenizer(tok, engine.runner.vocab_size)
    ids = tok.encode('{"name":"Ada","age":3')
    state, walked = GrammarState(grammar, lt), GrammarState(grammar, lt)
    for t in ids:
        walked.advance(t)
    req = type("R", (), {"grammar_state": state, "output_ids": ids})()
    want = type("R", (), {"grammar_state": walked, "output_ids": ids})()
    assert torch.equal(token_bitmask([req]), token_bitmask([want]))
    assert state.num_consumed == 0
    bad = type("R", (), {"grammar_state": state, "output_ids": tok.encode("[1]")})()
    assert (token_bitmask([bad]) == -1).all()   # a draft outside the grammar: never emitted


# -- the engine --------------------------------------------------------------------------------


def run(engine, params: list[SamplingParams], prompt: list[int]) -> list:
    reqs = [engine.make_request(prompt, p) for p in params]
    for r in reqs:
        engine.submit(r)
    while not all(r.finished for r in reqs):
        engine.step()
    return reqs


def test_overlapped_steps_draw_what_plain_steps_draw():
    """With overlap a step's grammars advance while its forward runs (the tokens in flight are read
    between forward and draw): constrained and free requests get the same tokens as without."""
    plain, overlapped = (build_engine(SMALL_DIR, warmup=False, overlap=o) for o in (False, True))
    assert overlapped.overlap
    tok = plain.tokenizer
    prompt = tok.encode_chat(tok.render_chat(ASK))
    grammar = json_schema_grammar(PERSON)
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=s, grammar=grammar) for s in range(3)]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=7),
               SamplingParams(max_tokens=300, temperature=0.0, grammar=grammar)]
    want, got = (run(e, params, prompt) for e in (plain, overlapped))
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.finish_reason for r in got] == ["stop"] * 3 + ["length", "stop"]


def test_speculative_decoding_keeps_the_grammar(engine):
    """With MTP drafts (2 per step), greedy constrained output equals plain constrained decoding
    token for token, and sampled output still validates: the target's mask rejects any draft the
    grammar forbids. A request without a grammar in the same batch is not changed by the others'."""
    tok = engine.tokenizer
    prompt = tok.encode_chat(tok.render_chat(ASK))
    grammar = json_schema_grammar(PERSON)
    greedy = SamplingParams(max_tokens=300, temperature=0.0, grammar=grammar)
    sampled = [SamplingParams(max_tokens=300, temperature=1.0, seed=s, grammar=grammar) for s in range(3)]
    free = SamplingParams(max_tokens=24, temperature=0.0)
    plain = build_engine(SMALL_DIR, warmup=False, overlap=False)
    want = run(plain, [greedy, free], prompt)
    alone = run(plain, [free], prompt)[0]
    spec = build_engine(SMALL_DIR, warmup=False, speculative_num_steps=2)
    got = run(spec, [greedy, free, *sampled], prompt)
    assert got[0].output_ids == want[0].output_ids and got[0].finish_reason == "stop"
    assert want[1].output_ids == alone.output_ids == got[1].output_ids
    for r in [got[0], *got[2:]]:
        assert r.finish_reason == "stop", r.output_text
        check(PERSON, json.loads(r.output_text))
    assert spec.metrics.counters["spec_draft_tokens_total"] > 0
