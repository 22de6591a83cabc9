"""Per-op sharding rules: (op, operand placements) -> (wanted operand placements, result
placements, attribute updates). `None` as a wanted placement means "as it is".

Weights follow the SGLang layout the article describes: A-projection, indexer and router
replicated; q_b_proj column-parallel over attn_tp; o_proj row-parallel; embedding and lm_head
vocab-parallel over attn_tp; experts split over ep (and their intermediate dim over moe_tp); the
dense MLP and shared expert TP-split only under pure TP, replicated on local tokens otherwise.
"""
from __future__ import annotations

from glmc.ir import Op, Placement

from .layouts import Layouts

Rule = tuple[list, list, dict]


def _tp(n: int) -> dict:
    return {"tp": n} if n > 1 else {}


def default_rule(op: Op, ins: list[Placement], lay: Layouts, ctx) -> Rule:
    """Element-wise / shape ops: reduce partial inputs first; others follow the first operand."""
    want = [lay.unpartial(ins[0])] * len(ins)
    return want, [want[0]] * len(op.results), {}


def _input(op, ins, lay, ctx):
    return [], [lay.ATT], {}


def _embed(op, ins, lay, ctx):
    tp = lay.par.attn_tp
    return [lay.TOK], [lay.P_ATT], _tp(tp)


def _rope(op, ins, lay, ctx):
    p = lay.unpartial(ins[0])
    return [p, lay.ATT], [p], {}


def _add(op, ins, lay, ctx):
    """Residual adds (`residual=true`, residual second) reduce the update into the residual's
    layout; other adds of equal partial sums stay partial (one reduction for shared + routed)."""
    a, b = ins
    if op.attr("residual"):
        res = lay.unpartial(b)
        return [res, res], [res], {}
    if a == b:
        return [None, None], [a], {}
    if a.axes_with("P") and not b.axes_with("P"):
        return [b, None], [b], {}
    target = lay.unpartial(a)
    return [target, target], [target], {}


def _slice(op, ins, lay, ctx):
    dim = op.attr("dim")
    if ins[0].items and any(p == f"S({dim})" for _, p in ins[0].items):
        raise ValueError(f"slice on dim {dim}, which is sharded {ins[0]}")
    return [None], [ins[0]], {}


def _view(op, ins, lay, ctx):
    sharded = [p for a, p in ins[0].items if a == "attn_tp" and p.startswith("S")]
    if not sharded:
        return [None], [ins[0]], {}
    return [None], [ins[0]], {"tp": lay.par.attn_tp, "tp_dim": int(sharded[0][2])}


def _attn_side(op, ins, lay, ctx):
    """KV writes, indexer, A-projection, last-token select: all tokens of the DP rank."""
    return [lay.ATT] * len(ins), [lay.ATT] * len(op.results), {}


def _linear(op, ins, lay, ctx):
    par, tp = op.attr("parallel", "replicated"), lay.par.attn_tp
    if par == "column":
        return [lay.ATT], [lay.heads(1)], _tp(tp)
    if par == "row":
        return [lay.heads(1)], [lay.P_ATT], _tp(tp)
    p = lay.unpartial(ins[0])
    return [p], [p], {}


def _attention(op, ins, lay, ctx):
    h = lay.heads(1)
    return [h, h, lay.ATT, lay.ATT], [h], _tp(lay.par.attn_tp)


def _swiglu(op, ins, lay, ctx):
    if op.attr("parallel") == "dense" and lay.pure_tp:
        return [lay.ATT], [lay.P_ATT], _tp(lay.par.attn_tp)
    if op.attr("parallel") == "shared" and lay.par.ep == 1:
        p = lay.unpartial(ins[0])
        return [p], [p.set("moe_tp", "P") if lay.par.moe_tp > 1 else p], _tp(lay.par.moe_tp)
    p = lay.unpartial(ins[0])
    return [p], [p], {}


def _experts(op, ins, lay, ctx):
    par = lay.par
    attrs = {k: v for k, v in (("ep", par.ep), ("moe_tp", par.moe_tp)) if v > 1}
    if par.ep == 1:
        p = lay.unpartial(ins[0])
        out = p.set("moe_tp", "P") if par.moe_tp > 1 else p
        return [p, p, p], [out], attrs
    return [lay.GLOBAL] * 3, [lay.P_MOE], attrs


def _lm_head(op, ins, lay, ctx):
    if lay.par.attn_tp > 1:
        return [lay.ATT], [lay.heads(1)], _tp(lay.par.attn_tp)
    return [lay.ATT], [lay.ATT], {}


def _sample(op, ins, lay, ctx):
    return [lay.ATT], [lay.ATT], {}


RULES = {
    "io.input": _input,
    "embed.lookup": _embed,
    "rope.apply": _rope,
    "elt.add": _add,
    "tensor.slice": _slice,
    "tensor.view": _view,
    "mla.a_proj": _attn_side,
    "mem.kv_write": _attn_side,
    "mem.index_k_write": _attn_side,
    "idx.topk": _attn_side,
    "tensor.select_last": _attn_side,
    "linear": _linear,
    "attn.sparse_mla": _attention,
    "mlp.swiglu": _swiglu,
    "moe.experts": _experts,
    "lm.head": _lm_head,
    "sample.tokens": _sample,
}

# Ops that exist when propagate-sharding runs and take `default_rule` (element-wise / per-token:
# partial inputs reduced first, placement of the first operand).
DEFAULT_RULE_KINDS = frozenset({"norm.rms", "norm.layer", "moe.gate", "moe.topk", "tensor.concat",
                                "idx.reuse"})
# Ops made after propagate-sharding, by the pass named here, which sets their placements.
PLACED_BY_PASS = {
    "comm.reshard": "propagate-sharding", "comm.all_reduce": "insert-collectives",
    "comm.all_gather": "insert-collectives", "comm.reduce_scatter": "insert-collectives",
    "comm.broadcast": "insert-collectives", "tensor.shard": "insert-collectives",
    "moe.dispatch": "lower-moe", "moe.combine": "lower-moe", "fused.add_rms": "fuse-add-norm",
    "fused.allreduce_add_rms": "fuse-add-norm", "fused.reduce_scatter_add_rms": "fuse-add-norm",
    "fused.qkv_a_norm_rope_write": "fuse-qkv-norm-rope",
    "fused.qkv_a_norm_rope_write_index": "fuse-qkv-norm-rope",
    "attn.mla_absorbed": "select-mla-form", "attn.mla_mha": "select-mla-form",
}
