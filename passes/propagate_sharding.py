"""propagate-sharding: choose every value's placement, shard weights, make placement changes explicit.

Assumes: inferred (logical) types. Guarantees: every result has a placement over the mesh axes of
size > 1 and a per-rank type; weight-sharded ops carry `tp` (or `ep`/`moe_tp` for experts), and an
op the spec leaves whole loses its `parallel` (column / row / dense / shared: how it would split over
tp, meaningless unsplit; codegen reads it only beside `tp`); where an
operand's placement differs from what its op needs, a `comm.reshard {kind, group, size, src, dst}`
sits between them (lowered by insert-collectives). At tp1 every value is R and no reshard is
inserted. Under tp8, o_proj is row-parallel: its partial sums (P) are all-reduced before the
residual add, whose other operand (the vocab-parallel embedding's sum) is reduced too:

Example (GLM-5.3, tp8, decode):

    %L0.o = linear(%L0.attn) {... parallel=row, ...} : [T, 6144] bf16  # L0
    %L0.h = elt.add(%L0.o, %x) {residual=true} : [T, 6144] bf16  # L0
 -> %L0.o = linear(%L0.attn) {... parallel=row, tp=8, ...} : [T, 6144] bf16 @ {attn_tp=P}  # L0
    %L0.o.ar = comm.reshard(%L0.o) {dim=0, dst=R, group=[attn_tp], kind=all_reduce, size=8, ...} : ... @ R
    %L0.h = elt.add(%L0.o.ar, %x.ar) {residual=true} : [T, 6144] bf16 @ R  # L0

Under dp8ep8 attention is data-parallel (attn_tp 1): o_proj stays whole.

Example (GLM-5.3, dp8ep8, decode):

    %L0.o = linear(%L0.attn) {in_features=16384, out_features=6144, parallel=row, weight=...
 -> %L0.o = linear(%L0.attn) {in_features=16384, out_features=6144, weight=...} : ... @ {attn_dp=S(0)}  # L0
"""
from __future__ import annotations

import math

from glmc.ir import Graph, Op, Placement
from glmc.ir.ops import infer_types

from .base import Pass, PassContext, PassError
from .layouts import Layouts

SHORT = {"all_reduce": "ar", "all_gather": "ag", "reduce_scatter": "rs", "shard": "sh"}


def reshard_kind(src: Placement, dst: Placement, mesh: dict) -> tuple[str, tuple[str, ...], int, int]:
    """(kind, group axes, group size, tensor dim) turning src into dst."""
    axes = [a for a in mesh if mesh[a] > 1 and src.get(a) != dst.get(a)]
    reduce = [a for a in axes if src.get(a) == "P"]
    gather = [a for a in axes if src.get(a).startswith("S") and dst.get(a) == "R"]
    scatter = [a for a in axes if dst.get(a).startswith("S")]
    size = lambda group: math.prod(mesh[a] for a in group)  # noqa: E731
    dim = lambda p, group: int(p.get(group[0])[2])  # noqa: E731
    if reduce and scatter and size(reduce) == size(scatter) and not gather:
        group = tuple(dict.fromkeys(reduce + scatter))
        return "reduce_scatter", group, size(reduce), dim(dst, scatter)
    if reduce and not (gather or scatter):
        return "all_reduce", tuple(reduce), size(reduce), 0
    if gather and not (reduce or scatter):
        return "all_gather", tuple(gather), size(gather), dim(src, gather)
    if scatter and not (reduce or gather):
        return "shard", tuple(scatter), size(scatter), dim(dst, scatter)
    raise ValueError(f"no single collective turns {src} into {dst}")


def group_name(axes: tuple[str, ...], size: int, world: int) -> tuple[str, ...]:
    """Axes of the group, or `(world,)` when it spans different axes over all ranks (the attention
    and MoE factorisations of one world: attn_dp with ep under dp8ep8)."""
    return ("world",) if size == world and len(axes) > 1 else axes


def _unsplit_drops_parallel(attrs: dict) -> dict:
    """`parallel` says how an op splits over tp; without `tp` it would mean nothing."""
    return attrs if "tp" in attrs else {k: v for k, v in attrs.items() if k != "parallel"}


class PropagateSharding(Pass):
    name = "propagate-sharding"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        from .sharding_rules import RULES, default_rule
        lay, mesh = Layouts(ctx.parallel), ctx.parallel.mesh
        place: dict[str, Placement] = {}
        types: dict[str, object] = {}
        ops: list[Op] = []
        resharded: dict[tuple[str, Placement], str] = {}
        for op in graph.ops:
            ins = [place[v] for v in op.operands]
            try:
                want, outs, attrs = RULES.get(op.kind, default_rule)(op, ins, lay, ctx)
                operands = [self._reshard(v, w, place, types, ops, resharded, mesh, op)
                            for v, w in zip(op.operands, want)]
            except ValueError as e:
                raise PassError(f"propagate-sharding: {op.where()}: {e}") from e
            new = Op.make(op.kind, op.results, operands, _unsplit_drops_parallel({**dict(op.attrs), **attrs}),
                          op.layer)
            out_types = infer_types(new, [types[v] for v in operands])
            ops.append(new.with_types(out_types, outs))
            types.update(zip(op.results, out_types))
            place.update(zip(op.results, outs))
        return graph.with_ops(ops)

    def _reshard(self, v, want, place, types, ops, cache, mesh, user) -> str:
        if want is None or want == place[v]:
            return v
        if (v, want) in cache:
            return cache[(v, want)]
        kind, axes, size, dim = reshard_kind(place[v], want, mesh)
        name = f"{v}.{SHORT[kind]}"
        attrs = {"kind": kind, "group": group_name(axes, size, math.prod(
            mesh[a] for a in ("attn_dp", "attn_tp"))), "size": size, "src": str(place[v]),
            "dst": str(want), "dim": dim}
        op = Op.make("comm.reshard", name, [v], attrs, user.layer)
        t = infer_types(op, [types[v]])
        ops.append(op.with_types(t, [want]))
        types[name], place[name] = t[0], want
        cache[(v, want)] = name
        return name
