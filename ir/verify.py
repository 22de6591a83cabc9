"""The verifier: an invariant of the pipeline, run after every pass.

Checks that every op kind is registered, every operand is defined before use (the Graph
constructor), stored result types equal what the op infers from its operands, placements only
name mesh axes of size > 1, and collectives change placement on exactly their group.
"""
from __future__ import annotations

from .graph import Graph
from .ops import IRError, infer_types, opdef

_COLL_SRC = {"comm.all_reduce": "P", "comm.reduce_scatter": "P", "comm.all_gather": "S(0)"}


def verify(graph: Graph) -> Graph:
    """Raise IRError naming the op (and layer) on the first violation; return the graph."""
    mesh = graph.meta.get("mesh", {})
    for op in graph.ops:
        opdef(op.kind)
        _check_types(graph, op)
        for p in op.placements:
            for axis, _ in (p.items if p is not None else ()):
                if mesh.get(axis, 1) <= 1:
                    raise IRError(f"{op.where()}: placement on axis {axis!r} of size "
                                  f"{mesh.get(axis, 1)}")
        if op.kind in _COLL_SRC:
            _check_collective(graph, op)
    return graph


def _check_types(graph: Graph, op) -> None:
    ins = [graph.type_of(v) for v in op.operands]
    if any(t is None for t in ins) or any(t is None for t in op.types):
        return
    want = infer_types(op, ins)
    for name, have, exp in zip(op.results, op.types, want):
        if have != exp:
            raise IRError(f"{op.where()}: %{name} has type {have}, op infers {exp}")


def _check_collective(graph: Graph, op) -> None:
    src = graph.placement_of(op.operands[0])
    dst = op.placements[0]
    if src is None or dst is None:
        return
    axes = op.attr("group")
    need = _COLL_SRC[op.kind].replace("0", str(op.attr("dim", 0)))
    if not any(src.get(a) == need for a in axes) and "world" not in axes:
        raise IRError(f"{op.where()}: input placement {src} has no {need} on group [{', '.join(axes)}]")
