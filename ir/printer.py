"""The one stable text form of the IR (the printer; `ir/parser.py` reads it back, round-trip).

    # glmc ir v2
    #! phase = decode
    #! indexer = {full_layers: [0..2, 6..74 step 4], shared_from: {3..5: 2, 7..9: 6, ...}}
    %x = embed.lookup(%input_ids) {dtype=bf16, hidden=6144, tp=8, vocab=154880, ...} : [T, 6144] bf16 @ {attn_tp=P}
    layers 1, 2 {
      %L.xn, %L-1.x_out = fused.allreduce_add_rms(%L-1.ffn, %L-1.h) {eps=1e-05, group=[attn_tp], ...} : ...
      %L.o = linear(%L.attn) {in_features=16384, parallel=row, tp=8, weight=.self_attn.o_proj.weight} : ...
    }
    layers 3..75 step 4 {
      ...
    }
    %logits = lm.head(%xf) {...} : [T, 154880] fp32 @ {attn_tp=S(1)}

One op per line in topological order, attributes sorted, a type (`?` before shape inference) and a
placement (omitted before sharding) for every result; graph metadata as `#! key = value` lines
(`ir/text_values.py`: JSON-like, ranges for layer lists, one entry per line when wide).

Decoder layers fold (`ir/fold.py`): each class of layers whose ops are identical up to the layer
index prints once, inside `layers <set> { ... }`, with names relative to the layer (`%L.q`,
`%L-1.x_out`, `weight=.self_attn.o_proj.weight`). Why a folded text rather than a `glmc diff` that
groups equal hunks: the text is what a reviewer reads everywhere (goldens, plan directories,
`--dump-after`, review diffs of goldens with plain `git diff`), so it shrinks (GLM-5.3 decode: 78
layers in six or seven classes) and a change to one lowering shows once per class of layers, each hunk
under the block that names its layers; the parser expands the blocks, so the text still is the
graph (`parse(print_graph(g)) == g`). Classes rather than contiguous ranges, because GLM-5.3's
shared-indexer layers repeat with period four, not in runs.

`print_graph(g, fold=False)` prints every op on its own line with absolute names and its layer as
a trailing `# L<n>`: the form pass docstrings and tests grep for one layer's ops, and what a graph
prints as when its layers cannot fold (a layer's ops not contiguous). The parser reads both.
"""
from __future__ import annotations

from itertools import groupby
from typing import Protocol, Sequence

from .fold import fold as fold_layers
from .ops import Op
from .text_values import WIDTH, format_layers, format_lines, format_value
from .types import Placement, TensorType


class Printable(Protocol):
    """What the printer reads of a graph (`ir.graph.Graph`, which imports the printer for its repr)."""
    ops: Sequence[Op]
    meta: dict


VERSION = 2
HEADER = f"# glmc ir v{VERSION}"
META = "#! "


def _fmt_result(t: TensorType | None, p: Placement | None) -> str:
    s = str(t) if t is not None else "?"
    return s + (f" @ {p}" if p is not None else "")


def print_op(op: Op) -> str:
    """One op on one line: results, kind, operands, sorted attributes, `type @ placement` per result,
    and `# L<n>` when it has a layer (a folded block's ops have none: the block gives it)."""
    lhs = ", ".join(f"%{r}" for r in op.results)
    args = ", ".join(f"%{v}" for v in op.operands)
    attrs = ", ".join(f"{k}={format_value(v)}" for k, v in op.attrs)
    line = f"{lhs} = {op.kind}({args})" + (f" {{{attrs}}}" if attrs else "")
    line += " : " + ", ".join(_fmt_result(t, p) for t, p in zip(op.types, op.placements))
    return line + (f"  # L{op.layer}" if op.layer is not None else "")


def print_meta(meta: dict) -> list[str]:
    """`#! key = value` lines, sorted by key; a value wider than the line continues on `#!` lines."""
    return [META + line for key in sorted(meta)
            for line in format_lines(meta[key], f"{key} = ", WIDTH - len(META))]


def print_graph(graph: Printable, fold: bool = True) -> str:
    """The graph as text; `fold` prints identical decoder layers once (see the module docstring)."""
    lines = [HEADER, *print_meta(graph.meta)]
    for layered, run in groupby(graph.ops, key=lambda op: op.layer is not None):
        run = list(run)
        blocks = fold_layers(run) if fold and layered else None
        if blocks is None:
            lines += [print_op(op) for op in run]
            continue
        for layers, body in blocks:
            lines += [f"layers {format_layers(layers)} {{", *(f"  {print_op(op)}" for op in body), "}"]
    return "\n".join(lines) + "\n"
