"""GLM-5 chat features: tools rendered by the chat template, tool calls parsed into `tool_calls`,
the thinking part returned as `reasoning_content`, streaming and not.

The parsers are fed GLM-5-style output text (whole, and one character at a time). End to end, the
tiny model's real chat template, tokenizer, engine and server run with the `openai` client; where
output must contain a tool call, which random weights never write, `ScriptedModel` stands in for
the weights: it emits a fixed token sequence after each prompt (everything else is real)."""
import json

import openai
import pytest
import torch
from glmc.api import build_engine
from glmc.runtime.engine.engine import Engine
from glmc.runtime.engine.sampling import SamplingParams
from glmc.runtime.engine.tokenizer import Tokenizer
from glmc.runtime.serving.glm_output import ChatOutput, ReasoningParser, ToolCallParser
from glmc.runtime.serving.responses import merge
from glmc.runtime.serving.server import create_app
from glmc.runtime.worker.model_runner import ModelRunner
from test_server import MODEL, Server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "units": {"type": "string", "enum": ["C", "F"]}, "detail": {"type": "object"}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
CALLS = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
         "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>units</arg_key>"
         "<arg_value>C</arg_value><arg_key>detail</arg_key><arg_value>{\"wind\": true}"
         "</arg_value></tool_call><tool_call>get_time<arg_key>zone</arg_key><arg_value>123"
         "</arg_value></tool_call>")
WANT_ARGS = [{"city": "Paris", "days": 3, "units": "C", "detail": {"wind": True}},
             {"zone": "123"}]  # a string-typed value stays a string even when it looks numeric


def read(text: str, thinking: bool, tools, step: int | None) -> dict:
    """Feed `text` whole (step None) or `step` characters at a time; the merged deltas."""
    out, got = ChatOutput(thinking, tools), {}
    pieces = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]
    for p in pieces:
        got = merge(got, out.feed(p))
    return merge(got, out.finish())


@pytest.mark.parametrize("step", [None, 1, 3])
def test_parsers_read_glm5_output_whole_and_streamed(step):
    text = "The user wants weather.\n</think>\n\nLet me check." + CALLS
    got = read(text, thinking=True, tools=[WEATHER, TIME], step=step)
    assert got["reasoning_content"] == "The user wants weather.\n"
    assert got["content"] == "Let me check."
    assert [c["function"]["name"] for c in got["tool_calls"]] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in got["tool_calls"]] == WANT_ARGS
    assert [c["index"] for c in got["tool_calls"]] == [0, 1]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got["tool_calls"])


@pytest.mark.parametrize("step", [None, 1])
def test_reasoning_only_where_the_model_or_the_prompt_opened_it(step):
    # thinking off in the prompt, but the model opens a block itself
    assert read("  <think>hmm</think>Hi", False, None, step) == \
        {"reasoning_content": "hmm", "content": "Hi"}
    assert read("<thin", False, None, step) == {"content": "<thin"}  # never completed
    assert read("Hi <think>x</think>", False, None, step) == {"content": "Hi <think>x</think>"}
    # thinking on and cut off before </think>: everything is reasoning
    assert read("still thinking </thi", True, None, step) == \
        {"reasoning_content": "still thinking </thi"}


def test_tool_parser_edge_cases():
    p = ToolCallParser([WEATHER])
    assert p.feed("a <tool_c") == ("a ", [])  # a possible marker is held back
    assert p.feed("all>get_weather<arg_key>city") == ("", [])
    assert p.finish() == ("<tool_call>get_weather<arg_key>city", [])  # unclosed: stays text
    call = ToolCallParser([WEATHER]).parse_call("get_weather\n<arg_key>days</arg_key>\n"
                                                "<arg_value>three</arg_value>\n")
    assert json.loads(call.arguments) == {"days": "three"}  # not JSON: kept as text
    assert ToolCallParser([]).parse_call("unknown_tool").arguments == "{}"
    r = ReasoningParser(thinking=True)
    assert r.feed("a</think>   ") == ("a", "") and r.feed("  b") == ("", "b")


def test_tools_and_tool_history_render_in_glm5_format(tiny_ckpt):
    tok = Tokenizer.from_dir(tiny_ckpt)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Call it.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = tok.render_chat(messages, tools=[WEATHER]).text
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions")
    assert "<tools>\n" + json.dumps(WEATHER["function"]) + "\n</tools>" in text
    assert text.endswith(
        "<|user|>Weather in Paris?<|assistant|><think>Call it.</think><tool_call>get_weather"
        "<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3"
        "</arg_value></tool_call><|observation|><tool_response>sunny</tool_response>"
        "<|assistant|><think></think>")
    assert tok.render_chat(messages[:1], enable_thinking=True).text.endswith(
        "<|assistant|><think>")


class ScriptedModel(ModelRunner):
    """Stands in for the weights: after each prompt, emits `script` token by token (then eos).
    No KV is kept; a sequence is known by its req_to_token row (no prefix cache: each request
    prefills from position 0 in one step, which sets where its output starts)."""

    def __init__(self, vocab_size: int, script: list[int], eos: int):
        self.vocab_size, self.num_pages, self.max_context = vocab_size, 64, 4096
        self.script, self.eos = script, eos
        self.prompt_len: dict[int, int] = {}

    def forward(self, batch):
        logits = torch.zeros(batch.batch_size, self.vocab_size)
        for i in range(batch.batch_size):
            row, seq_len = int(batch.req_pool_indices[i]), int(batch.seq_lens[i])
            if batch.mode != "decode" and int(batch.prefix_lens[i]) == 0:
                self.prompt_len[row] = seq_len
            done = seq_len - self.prompt_len[row]
            logits[i, self.script[done] if done < len(self.script) else self.eos] = 100.0
        return logits


@pytest.fixture(scope="module")
def scripted(tiny_ckpt):
    tok = Tokenizer.from_dir(tiny_ckpt)
    output = "Paris, then.</think>Let me check." + CALLS
    runner = ScriptedModel(tok.vocab_size, tok.encode(output), min(tok.eos_token_ids))
    engine = Engine(runner, tok, max_batch_tokens=4096, enable_prefix_cache=False)
    with Server(create_app(engine, MODEL)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def ask(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER, TIME], extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        max_tokens=200, **kw)


def test_tool_calls_and_reasoning_end_to_end(scripted):
    r = ask(scripted)
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert msg.reasoning_content == "Paris, then." and msg.content == "Let me check."
    assert [json.loads(c.function.arguments) for c in msg.tool_calls] == WANT_ARGS
    stream = list(ask(scripted, stream=True))
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.reasoning_content or "" for d in deltas
                   if hasattr(d, "reasoning_content")) == "Paris, then."
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [tc.index for tc in calls] == [0, 1]
    assert [json.loads(tc.function.arguments) for tc in calls] == WANT_ARGS
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    # the calls and their results go back in the next turn, as OpenAI clients send them
    follow = scripted.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=3,
                                              messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": msg.content, "tool_calls": [
            c.model_dump() for c in msg.tool_calls]},
        *[{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in msg.tool_calls]])
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens


def test_tool_choice_none_and_bad_choices(scripted):
    plain = ask(scripted, tool_choice="none")  # tools neither rendered nor parsed
    assert plain.choices[0].message.tool_calls is None
    assert "<tool_call>get_weather" in plain.choices[0].message.content
    assert plain.usage.prompt_tokens < ask(scripted).usage.prompt_tokens
    for choice, param in (({"type": "function", "function": {"name": "no_such_tool"}}, "tool_choice"),
                          ({"type": "function", "function": {}}, "tool_choice.function.name")):
        with pytest.raises(openai.BadRequestError) as e:
            ask(scripted, tool_choice=choice)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:   # a call required, no tool to call
        scripted.chat.completions.create(model=MODEL, tool_choice="required", messages=[
            {"role": "user", "content": "x"}])
    assert e.value.body["param"] == "tool_choice"
    bad = dict(WEATHER, function={**WEATHER["function"], "name": "get weather!"})
    with pytest.raises(openai.BadRequestError):
        scripted.chat.completions.create(model=MODEL, tools=[bad], messages=[
            {"role": "user", "content": "x"}])


def test_thinking_with_the_real_tiny_model(tiny_ckpt):
    """Random weights never close </think>: with thinking on, the whole answer is reasoning;
    off (the tiny template's default), it is all content; either way the offline engine's text."""
    engine = build_engine(tiny_ckpt, warmup=False, num_pages=32)
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "Think about it."}]
    with Server(create_app(engine, MODEL)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for thinking in (True, False):
            r = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True,
                            "chat_template_kwargs": {"enable_thinking": thinking}})
            ids = tok.encode_chat(tok.render_chat(messages, enable_thinking=thinking))
            offline = build_engine(tiny_ckpt, warmup=False, num_pages=32).generate(
                [ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
            msg = r.choices[0].message
            got = (msg.reasoning_content, msg.content) if thinking else (None, msg.content)
            assert got == ((offline.output_text, "") if thinking else (None, offline.output_text))


@pytest.mark.parametrize("choice,script,name", [
    ({"type": "function", "function": {"name": "get_weather"}},
     "<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", "get_weather"),
    ("required", "get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value></tool_call>", "get_time"),
])
def test_forced_tool_choice(tiny_ckpt, choice, script, name):
    """tool_choice "required" or a named function: the server opens the call in the assistant's
    turn (after closing <think>), the model writes the rest, the call comes back in tool_calls."""
    tok = Tokenizer.from_dir(tiny_ckpt)
    runner = ScriptedModel(tok.vocab_size, tok.encode(script), min(tok.eos_token_ids))
    engine = Engine(runner, tok, max_batch_tokens=4096, enable_prefix_cache=False)
    with Server(create_app(engine, MODEL)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        auto = ask(client)
        for stream in (False, True):
            r = ask(client, tool_choice=choice, stream=stream)
            if stream:
                chunks = list(r)
                calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
                assert chunks[-1].choices[0].finish_reason == "tool_calls"
                assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                calls, msg = r.choices[0].message.tool_calls, r.choices[0].message
                assert r.choices[0].finish_reason == "tool_calls" and not msg.content
                assert not getattr(msg, "reasoning_content", None)   # <think> closed for the call
                forced = "</think><tool_call>" + (name if isinstance(choice, dict) else "")
                assert r.usage.prompt_tokens == auto.usage.prompt_tokens + len(tok.encode(forced))
            assert [c.function.name for c in calls] == [name]
            assert len(json.loads(calls[0].function.arguments)) == 1
