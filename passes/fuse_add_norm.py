"""fuse-add-norm: residual add + RMSNorm in one op, with the pending reduction folded in.

Assumes: collectives are explicit. Guarantees: every `norm.rms(elt.add(a, b))` whose add feeds the
residual becomes one fused op keeping both names (normed, sum); a single-use all-reduce or
reduce-scatter of `a` moves inside it (the deferred reduction of o_proj / MoE partial sums, done
where the residual needs it); else a single-use plain (not residual) add producing `a` moves inside
it as a third operand (an MoE layer's shared + routed experts: one launch and one pass over the rows
fewer; the kernel rounds a + b to the dtype as that add did, so the bits stay the same).

Example (GLM-5.3, tp8, decode):

    %L0.o.ar = comm.all_reduce(%L0.o) {group=[attn_tp], size=8} : [T, 6144] bf16 @ R  # L0
    %L0.h = elt.add(%L0.o.ar, %x.ar) {residual=true} : [T, 6144] bf16 @ R  # L0
    %L0.hn = norm.rms(%L0.h) {eps=1e-05, weight=...} : [T, 6144] bf16 @ R  # L0
 -> %L0.hn, %L0.h = fused.allreduce_add_rms(%L0.o, %x.ar) {eps=1e-05, group=[attn_tp], size=8, weight=...

Example (GLM-5.3, tp1, decode):

    %L3.ffn = elt.add(%L3.shared, %L3.routed) : [T, 6144] bf16 @ R  # L3
    %L3.x_out = elt.add(%L3.ffn, %L3.h) {residual=true} : [T, 6144] bf16 @ R  # L3
    %L4.xn = norm.rms(%L3.x_out) {eps=1e-05, weight=model.layers.4.input_layernorm.weight}
 -> %L4.xn, %L3.x_out = fused.add_rms(%L3.shared, %L3.routed, %L3.h) {eps=1e-05, weight=...
"""
from __future__ import annotations

from dataclasses import replace

from glmc.ir import Graph, Op

from .base import Pass, PassContext
from .rewrite import Rewrite, apply_patterns, single_use

_FUSED = {"comm.all_reduce": "fused.allreduce_add_rms",
          "comm.reduce_scatter": "fused.reduce_scatter_add_rms"}


def _add_under_norm(op: Op, graph: Graph) -> Op | None:
    if op.kind != "norm.rms":
        return None
    add = graph.producer(op.operands[0])
    return add if add.kind == "elt.add" else None


def _fused(kind: str, norm: Op, add: Op, operands, extra: dict) -> Op:
    attrs = {**dict(norm.attrs), **extra}
    return Op.make(kind, [norm.result, add.result], operands, attrs, norm.layer,
                   [norm.types[0], add.types[0]], [norm.placements[0], add.placements[0]])


def comm_add_norm(op: Op, graph: Graph):
    # rms(reduce(a) + b) -> fused reduce + add + rms, when reduce(a) has no other use
    add = _add_under_norm(op, graph)
    if add is None:
        return None
    coll = graph.producer(add.operands[0])
    if coll.kind not in _FUSED or not single_use(graph, coll.result):
        return None
    extra = {"group": coll.attr("group"), "size": coll.attr("size")}
    fused = _fused(_FUSED[coll.kind], op, add, [coll.operands[0], add.operands[1]], extra)
    return Rewrite([fused], dead={coll.result, add.result})


def add_norm(op: Op, graph: Graph):
    # rms(a + b) -> fused add + rms (returns both: the sum is the next residual)
    add = _add_under_norm(op, graph)
    if add is None:
        return None
    return Rewrite([_fused("fused.add_rms", op, add, list(add.operands), {})], dead={add.result})


def add_into_add_norm(op: Op, graph: Graph):
    # fused add + rms of (a + b) and r -> of a, b and r, when a + b is a plain add with no other use
    if op.kind != "fused.add_rms" or len(op.operands) != 2:
        return None
    add = graph.producer(op.operands[0])
    if add.kind != "elt.add" or add.attr("residual") or not single_use(graph, add.result):
        return None
    return Rewrite([replace(op, operands=(*add.operands, op.operands[1]))], dead={add.result})


class FuseAddNorm(Pass):
    name = "fuse-add-norm"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        graph = apply_patterns(graph, [("allreduce/reduce-scatter+add+rmsnorm", comm_add_norm),
                                       ("add+rmsnorm", add_norm)])
        return apply_patterns(graph, [("add+add+rmsnorm", add_into_add_norm)])
