"""The one stable text form of the IR (the printer; `ir/parser.py` reads it back, round-trip).

    # glmc ir v1
    #! phase = "decode"
    %L3.o = linear(%L3.attn) {in_features=16384, parallel=row, tp=8} : [T, 6144] bf16 @ {attn_tp=P}  # L3

One op per line in topological order, attributes sorted, a type (`?` before shape inference) and a
placement (omitted before sharding) for every result, the layer as a trailing comment.
"""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from .ops import Op
from .types import Placement, TensorType

if TYPE_CHECKING:  # the graph imports the printer for its repr
    from .graph import Graph

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
