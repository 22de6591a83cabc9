"""Every request field is honoured or refused with a 400 that names it, as OpenAI does: through a
real server (uvicorn on a loopback port, the tiny model), with the official `openai` client where
it can send the request and raw HTTP where it cannot. Each refusal is checked beside the accepted
form of the same field, and the server keeps serving."""
import httpx
import openai
import pytest
from glmc.api import build_engine
from glmc.runtime.serving.server import create_app
from test_server import MODEL, Server

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tiny_ckpt):
    engine = build_engine(tiny_ckpt, warmup=False, num_pages=32, max_running=8, max_waiting=16)
    with Server(create_app(engine, MODEL)) as server:
        yield engine, server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="none", max_retries=0)


def post(served, body: dict, path="/v1/chat/completions") -> httpx.Response:
    return httpx.post(served[1].url + path, json={"model": MODEL, "max_tokens": 2, **body},
                      timeout=60)


def refused(r: httpx.Response, param: str) -> str:
    """The message of a 400 in OpenAI's shape whose param is `param`."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    return err["message"]


def chat(served, **fields) -> httpx.Response:
    return post(served, {"messages": USER, **fields})


def test_unknown_fields_are_refused_by_name(served, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                       extra_body={"temprature": 0.5})
    assert e.value.body["param"] == "temprature"
    assert e.value.body["message"] == "Unrecognized request argument supplied: temprature"
    assert "stream_options.include_usag" in refused(
        chat(served, stream=True, stream_options={"include_usag": True}), "stream_options.include_usag")
    bad_tool = {"type": "function", "function": {**TOOL["function"], "strictly": True}}
    refused(chat(served, tools=[bad_tool]), "tools[0].function.strictly")
    refused(chat(served, tool_choice={"type": "function", "function": {"name": "get_weather",
                                                                       "x": 1}}, tools=[TOOL]),
            "tool_choice.function.x")
    refused(post(served, {"prompt": "hi", "max_tokenz": 3}, "/v1/completions"), "max_tokenz")
    assert chat(served, temperature=0.5).status_code == 200


def test_openai_fields_glmc_does_not_implement_are_refused_with_the_reason(served, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                       reasoning_effort="low")
    assert e.value.body["param"] == "reasoning_effort" and "enable_thinking" in e.value.body["message"]
    for name, value in (("functions", [TOOL["function"]]), ("store", True), ("modalities", ["text"])):
        assert "not supported" in refused(chat(served, **{name: value}), name)


def test_response_format_shapes(served, client):
    """text, json_object and json_schema are served (tests/test_structured_outputs.py checks the
    JSON); anything else about the field is a 400 naming it."""
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                       response_format={"type": "text"})
    assert r.choices[0].finish_reason
    for fmt in ({"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}):
        r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                           response_format=fmt)
        assert r.choices[0].message.content.startswith("{")
    assert "'yaml'" in refused(chat(served, response_format={"type": "yaml"}), "response_format.type")
    refused(chat(served, response_format={"type": "text", "strict": True}), "response_format")
    schema = "response_format.json_schema"
    for spec, param in (({"schema": {}}, f"{schema}.name"), ({"name": "x"}, f"{schema}.schema"),
                        ({"name": "x", "schema": {}, "strict": "yes"}, f"{schema}.strict"),
                        ({"name": "x", "schema": {}, "schemas": {}}, f"{schema}.schemas"),
                        ({"name": "x", "schema": {"type": "objekt"}}, "response_format")):
        refused(chat(served, response_format={"type": "json_schema", "json_schema": spec}), param)
    refused(post(served, {"prompt": "hi", "response_format": {"type": "json_object"}},
                 "/v1/completions"), "response_format")


def test_stream_options_only_with_stream(served, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                       stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"
    refused(post(served, {"prompt": "hi", "stream_options": {"include_usage": True}},
                 "/v1/completions"), "stream_options")
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens >= 1


def test_tools_parallel_calls_and_strict(served, client):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, tools=[TOOL],
                                       parallel_tool_calls=True)
    assert r.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, tools=[TOOL],
                                       parallel_tool_calls=False)
    assert e.value.body["param"] == "parallel_tool_calls"
    strict = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    assert "constrained decoding" in refused(chat(served, tools=[strict]), "tools[0].function.strict")
    assert chat(served, tools=[strict], tool_choice="required").status_code == 200   # enforced
    lax = {"type": "function", "function": {**TOOL["function"], "strict": False}}
    assert chat(served, tools=[lax]).status_code == 200


def test_suffix_and_best_of(served, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="def f(", suffix="    return x\n", max_tokens=2)
    assert e.value.body["param"] == "suffix"
    assert client.completions.create(model=MODEL, prompt="hi", suffix="", max_tokens=2).choices
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", best_of=3, max_tokens=2)
    assert e.value.body["param"] == "best_of" and "best_of = n" in e.value.body["message"]
    assert "must be >= n" in refused(post(served, {"prompt": "hi", "n": 2, "best_of": 1},
                                          "/v1/completions"), "best_of")
    r = client.completions.create(model=MODEL, prompt="hi", n=2, best_of=2, max_tokens=2)
    assert len(r.choices) == 2


def test_seed_is_an_unsigned_64_bit_integer(served, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", seed=-1, max_tokens=2)
    assert e.value.body["param"] == "seed" and "[0, 2**64)" in e.value.body["message"]
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
              extra_body={"ignore_eos": True})
    assert client.completions.create(seed=0, **kw).choices[0].text == \
        client.completions.create(seed=0, **kw).choices[0].text


def test_user_is_accepted(served, client):
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                          user="user-1234").choices


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "system", "content": None}, *USER], "messages[0].content"),
    ([*USER, {"role": "assistant", "content": None}, *USER], "messages[1].content"),
    ([*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
      {"role": "tool", "content": "sunny"}], "messages[2].tool_call_id"),
    ([{"role": "user", "content": "hi", "name": "ann"}], "messages[0].name"),
    ([{"role": "user", "content": "hi", "tool_call_id": "call_1"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi", "cache": 1}]}], "messages[0].content"),
    ([*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}", "x": 1}}]}, *USER],
     "messages[1].tool_calls[0].function.x"),
    ([{"role": "function", "content": "hi"}], "messages[0].role"),
])
def test_message_fields_follow_openai(served, messages, param):
    refused(post(served, {"messages": messages}), param)


def test_valid_conversations_are_served(served, client):
    """An assistant turn with tool calls and no content, the tool's answer with its id, text
    parts, fields set to null (as a client's model_dump writes them), the developer role."""
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather in Paris?", "name": None},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], max_tokens=2)
    assert r.choices[0].finish_reason


def test_chat_template_kwargs_are_the_templates_variables(served, client):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason
    message = refused(chat(served, chat_template_kwargs={"enable_thinkng": True}),
                      "chat_template_kwargs")
    assert "'enable_thinkng'" in message and "enable_thinking" in message
    refused(chat(served, chat_template_kwargs={"tools": []}), "chat_template_kwargs")
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).choices
