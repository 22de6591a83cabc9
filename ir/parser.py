"""The parser of the IR's text form (`ir/printer.py`); the two round-trip."""
from __future__ import annotations

import json
import re

from .graph import Graph
from .ops import IRError, Op
from .printer import HEADER
from .types import Placement, TensorType, parse_dim

_TOKEN = re.compile(r'\s*("(?:[^"\\]|\\.)*"|[\[\]{},=]|[^\s\[\]{},=]+)')


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or not m.group(1):
            if text[pos:].strip():
                raise ValueError(f"cannot read {text[pos:]!r}")
            break
        out.append(m.group(1))
        pos = m.end()
    return out


def _value(toks: list[str]):
    tok = toks.pop(0)
    if tok == "[":
        items = []
        while toks[0] != "]":
            items.append(_value(toks))
            if toks[0] == ",":
                toks.pop(0)
        toks.pop(0)
        return tuple(items)
    if tok.startswith('"'):
        return json.loads(tok)
    if tok in ("true", "false"):
        return tok == "true"
    for conv in (int, float):
        try:
            return conv(tok)
        except ValueError:
            pass
    return tok


def _attrs(text: str) -> dict:
    toks, out = _tokens(text), {}
    while toks:
        key = toks.pop(0)
        if toks.pop(0) != "=":
            raise ValueError(f"expected = after {key}")
        out[key] = _value(toks)
        if toks and toks[0] == ",":
            toks.pop(0)
    return out


def _split_top(text: str) -> list[str]:
    """Split on commas that are outside brackets and braces."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur] if cur.strip() else parts


def _placement(text: str) -> Placement:
    text = text.strip()
    if text == "R":
        return Placement()
    inner = text.strip("{}")
    return Placement.of(dict(item.strip().split("=") for item in _split_top(inner)))


def _result(text: str) -> tuple[TensorType | None, Placement | None]:
    ty, _, pl = text.partition("@")
    ty = ty.strip()
    p = _placement(pl) if pl.strip() else None
    if ty == "?":
        return None, p
    m = re.match(r"^\[(.*)\]\s+(\w+)$", ty)
    if not m:
        raise ValueError(f"bad type {ty!r}")
    shape = [parse_dim(d) for d in m.group(1).split(",")] if m.group(1).strip() else []
    return TensorType(tuple(shape), m.group(2)), p


_LINE = re.compile(r"^(?P<lhs>%[^=]+?)\s*=\s*(?P<kind>[\w.]+)\((?P<args>[^)]*)\)"
                   r"(?:\s*\{(?P<attrs>.*?)\})?\s*:\s+(?P<types>.*?)(?:\s+#\s*L(?P<layer>\d+))?$")


def parse_op(line: str) -> Op:
    m = _LINE.match(line.strip())
    if not m:
        raise ValueError("not an op line")
    results = [r.strip().lstrip("%") for r in m.group("lhs").split(",")]
    args = [a.strip().lstrip("%") for a in m.group("args").split(",") if a.strip()]
    typed = [_result(t) for t in _split_top(m.group("types"))]
    layer = int(m.group("layer")) if m.group("layer") else None
    return Op.make(m.group("kind"), results, args, _attrs(m.group("attrs") or ""), layer,
                   [t for t, _ in typed], [p for _, p in typed])


def parse(text: str) -> Graph:
    """Parse the text form back into a Graph; errors give the line number."""
    ops, meta = [], {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.strip() == HEADER:
            continue
        try:
            if line.startswith("#!"):
                key, _, val = line[2:].partition("=")
                meta[key.strip()] = json.loads(val)
            elif not line.startswith("#"):
                ops.append(parse_op(line))
        except (ValueError, json.JSONDecodeError) as e:
            raise IRError(f"line {n}: {e}: {line.strip()[:120]}") from e
    return Graph(ops, meta)
