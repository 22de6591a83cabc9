"""Structured outputs of chat requests: `response_format` and forced tool calls -> a grammar.

`response_format` `{"type": "json_object"}` is any JSON object, `{"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}` JSON that validates against the
schema (`grammar.json_schema_grammar`: written compactly, `{"a":1}`). `tool_choice` "required" or
a named function: the server has already begun the assistant's turn with GLM's call marker (and
the name; `prompts._forced_call`), and the grammar is the rest of one GLM-5 call,

    name<arg_key>key</arg_key><arg_value>value</arg_value>...</tool_call>

with the tool's `parameters` properties in their schema's order (required ones always, others at
most once), each value as `glm_output.ToolCallParser` reads it back: raw text for a string-typed
argument (its enum or const, or text without `<` within its minLength/maxLength), compact JSON
valid against the argument's schema otherwise. The markers are the tokenizer's added tokens where
it has them. One call, then the grammar ends, and so does the request.

Every grammar is checked against the tokenizer before the request is queued: a schema llguidance
cannot compile is a 400 naming the field. Runs on an intake thread (`intake.py`).
"""
from __future__ import annotations

import json

from glmc.runtime.engine.grammar import check, json_schema_grammar, lark_grammar
from glmc.runtime.serving.glm_output import ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END, CALL_END
from glmc.runtime.serving.protocol import APIError, ChatRequest

FORMAT_FIELDS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
JSON_SCHEMA_FIELDS = {"name", "schema", "strict", "description"}
RAW_STRING_UNSUPPORTED = ("pattern", "format")   # of string arguments, written as raw text


def wants_json(body: ChatRequest) -> bool:
    fmt = body.response_format
    return isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")


def chat_grammar(body: ChatRequest, tools: list[dict] | None, tok, vocab_size: int) -> str | None:
    """The grammar a chat request's output must follow (None: free text); raises APIError."""
    fmt = response_schema(body.response_format)
    forced = body.tool_choice not in (None, "auto", "none")
    if fmt is not None and forced:
        raise APIError(400, "response_format: a JSON response cannot be combined with tool_choice "
                       "\"required\" or a named function (the output is a tool call)",
                       "response_format")
    if fmt is not None:
        return _checked(_json_grammar(fmt), tok, vocab_size, "response_format")
    if forced and tools:
        name = None if body.tool_choice == "required" else body.tool_choice.function.name
        return tool_call_grammar(tools, name, tok, vocab_size)
    return None


def response_schema(fmt) -> dict | None:
    """The JSON schema `response_format` asks for (None: text); its shape checked as OpenAI's."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in FORMAT_FIELDS:
        raise APIError(400, "response_format.type: must be 'text', 'json_object' or "
                       f"'json_schema', got {kind!r}", "response_format.type")
    extra = sorted(fmt.keys() - FORMAT_FIELDS[kind])
    if extra:
        raise APIError(400, f"response_format: {extra[0]!r} is not a field of a {kind} format "
                       f"(it has {', '.join(sorted(FORMAT_FIELDS[kind]))})", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = fmt.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise APIError(400, f"{where}: required, an object with name and schema", where)
    extra = sorted(spec.keys() - JSON_SCHEMA_FIELDS)
    if extra:
        raise APIError(400, f"{where}.{extra[0]}: not a field of json_schema (it has "
                       f"{', '.join(sorted(JSON_SCHEMA_FIELDS))})", f"{where}.{extra[0]}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise APIError(400, f"{where}.name: required, a non-empty string", f"{where}.name")
    for key, kinds in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise APIError(400, f"{where}.{key}: must be a {kinds.__name__}", f"{where}.{key}")
    if not isinstance(spec.get("schema"), dict):
        raise APIError(400, f"{where}.schema: required, a JSON schema object", f"{where}.schema")
    return spec["schema"]


def _json_grammar(schema: dict) -> str:
    try:
        return json_schema_grammar(schema)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"response_format: the schema is not usable JSON: {e}",
                       "response_format") from None


def _checked(grammar: str, tok, vocab_size: int, param: str) -> str:
    why = check(grammar, tok, vocab_size)
    if why:
        raise APIError(400, f"{param}: the schema cannot be enforced: {why}", param)
    return grammar


# -- GLM-5 tool calls ---------------------------------------------------------------------------


def tool_call_grammar(tools: list[dict], name: str | None, tok, vocab_size: int) -> str:
    """The rest of one call to the tool `name` (its name already written), or, name None, to any
    of `tools` (its name first); each tool's schema checked on its own, so a 400 names it."""
    marks = {m: _marker(tok, m) for m in (ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END, CALL_END)}
    rules, starts = [], []
    for k, tool in enumerate(tools):
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        tool_rules, args = _tool_rules(k, fn.get("parameters"), marks)
        head = "" if name is not None else json.dumps(fn["name"]) + " "
        body = f"{head}{args} {marks[CALL_END]}".strip()
        _checked(lark_grammar("\n".join([f"start: {body}", *tool_rules])), tok, vocab_size,
                 f"tools[{k}].function.parameters")
        rules += tool_rules
        starts.append(body)
    return lark_grammar("\n".join(["start: " + " | ".join(f"({s})" for s in starts), *rules]))


def _marker(tok, text: str) -> str:
    """A Lark item for a GLM marker: its token where the tokenizer has one, else the text."""
    token = tok.added_tokens.get(text)
    return json.dumps(text) if token is None else f"<[{token}]>"


def _tool_rules(k: int, params, marks: dict) -> tuple[list[str], str]:
    """(Lark rules, the argument sequence) of tool k's `parameters` schema."""
    where = f"tools[{k}].function.parameters"
    if params is None:
        return [], ""
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        raise APIError(400, f"{where}.properties: must be an object", f"{where}.properties")
    required = params.get("required") or []
    if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise APIError(400, f"{where}.required: must be a list of property names", f"{where}.required")
    rules, seq = [], []
    for j, (key, schema) in enumerate(props.items()):
        if not isinstance(schema, dict):
            raise APIError(400, f"{where}.properties.{key}: must be a schema object",
                           f"{where}.properties.{key}")
        rule = f"t{k}_a{j}"
        rules.append(f"{rule}: {marks[ARG_KEY]} {json.dumps(key)} {marks[ARG_KEY_END]} "
                     f"{marks[ARG_VALUE]} {_value(schema, params, f'{where}.properties.{key}')} "
                     f"{marks[ARG_VALUE_END]}")
        seq.append(rule if key in required else f"{rule}?")
    return rules, " ".join(seq)


def _value(schema: dict, params: dict, where: str) -> str:
    """The Lark item of one argument's value: raw text for a string type, else compact JSON."""
    if schema.get("type") not in ("string", ["string"]):
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        return "%json" + json.dumps({**schema, **defs, "x-guidance": {"whitespace_flexible": False}})
    bad = [k for k in RAW_STRING_UNSUPPORTED if k in schema]
    if bad:
        raise APIError(400, f"{where}.{bad[0]}: not supported for a string argument (GLM writes it "
                       "as raw text)", where)
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not (isinstance(values, list) and values and all(isinstance(v, str) for v in values)):
            raise APIError(400, f"{where}: a string argument's enum or const needs strings", where)
        return "(" + " | ".join(json.dumps(v) for v in values) + ")"
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(lo, int) or not (hi is None or isinstance(hi, int)):
        raise APIError(400, f"{where}: minLength and maxLength must be integers", where)
    return f"/[^<]{{{lo},{'' if hi is None else hi}}}/"
