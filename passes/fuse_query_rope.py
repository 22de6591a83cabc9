"""fuse-query-rope: the indexer and the attention turn their query by RoPE as they load it.

Assumes: fusions of the layer's keys ran (fuse-qkv-norm-rope), so the only `rope.apply` ops left
turn queries. Guarantees: on the cuda device, a `rope.apply(q, positions)` whose one reader is a
query reader (`ir.dialect.ROPE_READERS`: `idx.topk` by its q, `attn.*` by its q_pe) and whose
positions are the step's `positions` input is gone: the reader takes q as it is, the positions as
its last operand and the rope's attributes prefixed `rope_` (dims, interleaved, theta, scaling),
and turns q in the kernel that reads it, with the rope kernel's arithmetic (one launch and one
[T, heads, dim] round trip through memory fewer per rope). Elsewhere (the torch target on cpu, where
a rope is no launch of its own) the graph is unchanged.

Example (GLM-5.3, tp1, decode):

    %L2.iq = rope.apply(%L2.iq_h, %positions) {dims=64, interleaved=true, theta=8000000.0} : ...
    %L2.topk = idx.topk(%L2.iq, %L2.iw, %L2.icache) {head_dim=128, heads=32, k=2048} : [T, 2048] i32 @ R  # L2
    %L2.q_pe = rope.apply(%L2.q_pe_a, %positions) {dims=64, interleaved=true, theta=8000000.0} : ...
    %L2.attn = attn.sparse_mla(%L2.q_nope, %L2.q_pe, %L2.kv, %L2.topk) {...} : [T, 16384] bf16 @ R  # L2
 -> %L2.topk = idx.topk(%L2.iq_h, %L2.iw, %L2.icache, %positions) {head_dim=128, heads=32, k=2048,
    ... rope_dims=64, rope_interleaved=true, rope_theta=8000000.0} : [T, 2048] i32 @ R  # L2
    %L2.attn = attn.sparse_mla(%L2.q_nope, %L2.q_pe_a, %L2.kv, %L2.topk, %positions) {...
    ... rope_dims=64, rope_interleaved=true, rope_theta=8000000.0, ...} : [T, 16384] bf16 @ R  # L2
"""
from __future__ import annotations

from dataclasses import replace

from glmc.ir import Graph, Op
from glmc.ir.dialect import ROPE_READERS

from .base import Pass, PassContext
from .rewrite import Rewrite, apply_patterns, producer_if, single_use


def _step_positions(graph: Graph, value: str) -> bool:
    op = graph.producer(value)
    return op.kind == "io.input" and op.attr("name") == "positions"


def fold_query_rope(op: Op, graph: Graph):
    # reader(.., rope(q, pos), ..) -> reader(.., q, .., pos) {rope_*}: the reader turns q as it loads it
    if op.kind not in ROPE_READERS or op.attr("rope_dims") is not None:
        return None
    i, _ = ROPE_READERS[op.kind]
    rope = producer_if(graph, op.operands[i], "rope.apply")
    if rope is None or not single_use(graph, rope.result) or not _step_positions(graph, rope.operands[1]):
        return None
    operands = list(op.operands)
    operands[i] = rope.operands[0]
    reader = op.with_attrs(**{f"rope_{k}": v for k, v in rope.attrs})
    return Rewrite([replace(reader, operands=(*operands, rope.operands[1]))], dead={rope.result})


class FuseQueryRope(Pass):
    name = "fuse-query-rope"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        if ctx.options.device != "cuda":
            return graph
        return apply_patterns(graph, [("q rope+indexer/attention", fold_query_rope)])
