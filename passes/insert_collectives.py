"""insert-collectives: lower each `comm.reshard` to the collective that realises it.

Assumes: propagate-sharding ran. Guarantees: no `comm.reshard` remains; P->R is `comm.all_reduce`,
P->S is `comm.reduce_scatter`, S->R is `comm.all_gather`, R->S is `tensor.shard` (no traffic);
with `--topk-broadcast` and attn_tp > 1, full layers' top-k is broadcast from attn_tp rank 0.
At tp1 the graph is unchanged.

Example (GLM-5.3, tp8, decode):

    %L0.o.ar = comm.reshard(%L0.o) {dim=0, dst=R, group=[attn_tp], kind=all_reduce, size=8, ...} : ...
 -> %L0.o.ar = comm.all_reduce(%L0.o) {group=[attn_tp], size=8} : [T, 6144] bf16 @ R  # L0
"""
from __future__ import annotations

from glmc.ir import Graph, Op

from .base import Pass, PassContext
from .rewrite import Rewrite, apply_patterns

_KINDS = {"all_reduce": "comm.all_reduce", "all_gather": "comm.all_gather",
          "reduce_scatter": "comm.reduce_scatter", "shard": "tensor.shard"}


def _lower(op: Op, graph: Graph):
    # reshard(kind=k) -> the collective k over the same group: same type, same placement
    if op.kind != "comm.reshard":
        return None
    attrs = {"group": op.attr("group"), "size": op.attr("size")}
    if op.attr("dim"):
        attrs["dim"] = op.attr("dim")
    new = Op.make(_KINDS[op.attr("kind")], op.results, op.operands, attrs, op.layer,
                  op.types, op.placements)
    return Rewrite([new])


def _broadcast_topk(size: int):
    def rule(op: Op, graph: Graph):
        # topk -> broadcast_from_rank0(topk): every attn_tp rank attends to the same keys
        if op.kind != "idx.topk":
            return None
        name = op.result + ".bc"
        bc = Op.make("comm.broadcast", name, [op.result], {"group": ("attn_tp",), "size": size},
                     op.layer, op.types, op.placements)
        return Rewrite([op, bc], rename={op.result: name})
    return rule


class InsertCollectives(Pass):
    name = "insert-collectives"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        rules = [("lower-reshard", _lower)]
        graph = apply_patterns(graph, rules)
        if ctx.options.topk_broadcast and ctx.parallel.attn_tp > 1:
            graph = apply_patterns(graph, [("broadcast-topk", _broadcast_topk(ctx.parallel.attn_tp))])
        return graph
