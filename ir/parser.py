"""The parser of the IR's text form (`ir/printer.py` describes it); the two round-trip."""
from __future__ import annotations

import re

from .fold import unfold
from .graph import Graph
from .ops import IRError, Op
from .printer import VERSION
from .text_values import read_attrs, read_layers, read_value
from .types import Placement, TensorType, parse_dim


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
    """One op line (`print_op`'s form; inside a layers block, with relative names and no layer)."""
    m = _LINE.match(line.strip())
    if not m:
        raise ValueError("not an op line")
    results = [r.strip().lstrip("%") for r in m.group("lhs").split(",")]
    args = [a.strip().lstrip("%") for a in m.group("args").split(",") if a.strip()]
    typed = [_result(t) for t in _split_top(m.group("types"))]
    layer = int(m.group("layer")) if m.group("layer") else None
    return Op.make(m.group("kind"), results, args, read_attrs(m.group("attrs") or ""), layer,
                   [t for t, _ in typed], [p for _, p in typed])


_BLOCK = re.compile(r"^layers (?P<layers>[^{]+) \{$")
_VERSION = re.compile(r"^# glmc ir v(\d+)$")


class _Reader:
    """Lines -> ops and metadata. Op lines outside blocks are taken as they are; consecutive
    `layers <set> {` blocks expand together (`ir/fold.py`) at the next op line or the end; a `#!`
    metadata entry continues on further `#!` lines until its brackets close."""

    def __init__(self):
        self.ops: list[Op] = []
        self.meta: dict = {}
        self.blocks: list[tuple[list[int], list[Op]]] = []   # closed blocks not yet expanded
        self.block: tuple[list[int], list[Op]] | None = None  # the open block
        self.entry: tuple[str, str] | None = None            # the open metadata entry: key, text

    def line(self, text: str) -> None:
        if self.entry is not None:
            if not text.startswith("#!"):
                raise ValueError(f"metadata {self.entry[0]!r} does not close")
            self._meta(*self.entry, text[2:])
        elif text.startswith("#!"):
            key, eq, value = text[2:].partition("=")
            if not eq:
                raise ValueError("expected `#! key = value`")
            self._meta(key.strip(), "", value)
        elif (m := _VERSION.match(text)) and int(m[1]) != VERSION:
            raise ValueError(f"IR written as v{m[1]}; this glmc reads v{VERSION}: recompile the plan")
        elif not text or text.startswith("#"):
            return
        elif self.block is not None:
            self._in_block(text)
        elif m := _BLOCK.match(text):
            self.block = (read_layers(m["layers"]), [])
        else:
            self.expand_blocks()
            self.ops.append(parse_op(text))

    def _meta(self, key: str, text: str, more: str) -> None:
        text += " " + more
        self.entry = None if _closed(text) else (key, text)
        if self.entry is None:
            self.meta[key] = read_value(text)

    def _in_block(self, text: str) -> None:
        if text != "}":
            self.block[1].append(parse_op(text))
            return
        if not self.block[1]:
            raise ValueError("empty layers block")
        self.blocks.append(self.block)
        self.block = None

    def expand_blocks(self) -> None:
        self.ops += unfold(self.blocks)
        self.blocks = []

    def end(self) -> None:
        if self.block is not None:
            raise ValueError("the text ends inside a layers block")
        if self.entry is not None:
            raise ValueError(f"the text ends inside metadata {self.entry[0]!r}")
        self.expand_blocks()


def _closed(text: str) -> bool:
    """True when every bracket opened in `text` (outside strings) is closed."""
    depth = 0
    for tok in re.findall(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(tok, 0)
    return depth <= 0


def parse(text: str) -> Graph:
    """Parse the text form (folded or not) back into a Graph; errors give the line number."""
    reader, lines = _Reader(), text.splitlines()
    for n, line in enumerate(lines, 1):
        try:
            reader.line(line.strip())
        except ValueError as e:
            raise IRError(f"line {n}: {e}: {line.strip()[:120]}") from e
    try:
        reader.end()
    except ValueError as e:
        raise IRError(f"line {len(lines)}: {e}") from e
    return Graph(reader.ops, reader.meta)
