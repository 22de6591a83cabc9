"""infer-shapes: give every result its type from the op registry.

Assumes: ops in topological order, types unknown or stale. Guarantees: every result has a type;
a shape mismatch fails naming the layer and op.

Example (GLM-5.3, tp1, decode):

    %L0.kv = mem.kv_write(%L0.c_kv, %L0.k_pe) {dtype=fp8} : ?  # L0
    %L0.q = linear(%L0.q_c) {in_features=2048, out_features=16384, parallel=column, ...} : ?  # L0
 -> %L0.kv = mem.kv_write(%L0.c_kv, %L0.k_pe) {dtype=fp8} : [S, 576] fp8  # L0
    %L0.q = linear(%L0.q_c) {...} : [T, 16384] bf16  # L0
"""
from __future__ import annotations

from glmc.ir import Graph
from glmc.ir.ops import infer_types

from .base import Pass, PassContext


def retype(graph: Graph) -> Graph:
    """Re-infer every op's result types in order (placements kept)."""
    types: dict[str, object] = {}
    ops = []
    for op in graph.ops:
        out = infer_types(op, [types[v] for v in op.operands])
        types.update(zip(op.results, out))
        ops.append(op.with_types(out))
    return graph.with_ops(ops)


class InferShapes(Pass):
    name = "infer-shapes"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        return retype(graph)
