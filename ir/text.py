"""The one stable text form of the IR, and its parser (they round-trip).

    # glmc ir v1
    #! phase = "decode"
    %L3.o = linear(%L3.attn) {in_features=16384, parallel=row, tp=8} : [T, 6144] bf16 @ {attn_tp=P}  # L3

One op per line in topological order, attributes sorted, a type (`?` before shape inference) and a
placement (omitted before sharding) for every result, the layer as a trailing comment.
"""
from __future__ import annotations

import json
import re

from .graph import Graph
from .ops import IRError, Op
from .types import Placement, TensorType, parse_dim

HEADER = "# glmc ir v1"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


def _fmt_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(_fmt_value(x) for x in v) + "]"
    if _IDENT.match(v) and v not in ("true", "false"):
        return v
    return json.dumps(v)


def _fmt_result(t: TensorType | None, p: Placement | None) -> str:
    s = str(t) if t is not None else "?"
    return s + (f" @ {p}" if p is not None else "")


def print_op(op: Op) -> str:
    lhs = ", ".join(f"%{r}" for r in op.results)
    args = ", ".join(f"%{v}" for v in op.operands)
    attrs = ", ".join(f"{k}={_fmt_value(v)}" for k, v in op.attrs)
    line = f"{lhs} = {op.kind}({args})" + (f" {{{attrs}}}" if attrs else "")
    line += " : " + ", ".join(_fmt_result(t, p) for t, p in zip(op.types, op.placements))
    return line + (f"  # L{op.layer}" if op.layer is not None else "")


def print_graph(graph: Graph) -> str:
    lines = [HEADER]
    lines += [f"#! {k} = {json.dumps(graph.meta[k], sort_keys=True)}" for k in sorted(graph.meta)]
    lines += [print_op(op) for op in graph.ops]
    return "\n".join(lines) + "\n"


# ---- parser -------------------------------------------------------------------------------

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
