"""lower-moe: choose how token-split MoE reaches its experts, by cost (or `--moe-a2a`).

Assumes: insert-collectives ran. Two lowerings of `moe.experts` on tokens split over ranks:
  gather: all-gather tokens (+ routing) -> local experts on all tokens -> reduce-scatter partials;
  a2a:    moe.dispatch each token to its experts' ranks -> local experts -> moe.combine.
The cost model compares bytes on the wire per rank plus a per-collective latency at the phase's
token count (`phase_tokens`) and records the decision in `meta.moe_lowering`; small decode
batches favour the gather (fewer, cheaper-to-start collectives), prefill chunks the all-to-all
(k/W of the bytes). a2a needs moe_tp == 1. The gather form (from insert-collectives) lowered to
the all-to-all (forced here; a decode batch of 32 would keep the gather):

Example (GLM-5.3, dp8ep8, decode, moe_a2a=true):

    %L3.hn.ag = comm.all_gather(%L3.hn) {group=[attn_dp], size=8} : [T*8, 6144] bf16 @ R  # L3
    %L3.route_w.ag = comm.all_gather(%L3.route_w) {group=[attn_dp], size=8} : ...
    %L3.route_ids.ag = comm.all_gather(%L3.route_ids) {group=[attn_dp], size=8} : ...
    %L3.routed = moe.experts(%L3.hn.ag, %L3.route_w.ag, %L3.route_ids.ag) {...} : ... @ {ep=P}  # L3
    %L3.routed.rs = comm.reduce_scatter(%L3.routed) {group=[world], size=8} : [T, 6144] bf16 @ ...
 -> %L3.routed.dx, %L3.routed.dw, %L3.routed.di = moe.dispatch(%L3.hn, %L3.route_w, %L3.route_ids) {...
    %L3.routed = moe.experts(%L3.routed.dx, %L3.routed.dw, %L3.routed.di) {...} : ... @ {ep=S(0)}  # L3
    %L3.routed.cb = moe.combine(%L3.routed, %L3.hn) {group=[ep], size=8, top_k=8} : ... @ {attn_dp=S(0)}

The gather form then routes on the gathered tokens where it can: when the router reads the very
tokens the experts gather and its weights and ids go nowhere else, moe.gate + moe.topk run again
on all_gather(x) and those two all-gathers go (`meta.moe_lowering.routing`: "recompute"), if the
router's FLOPs on the other ranks' rows (at ROUTER_TFLOPS) cost less than two collectives: the
per-token phases, not 8K-token prefill chunks (`moe_routing` forces either where the router can
move). Every rank then routes each token as tp1 does.

Example (GLM-5.3, tp8ep8, decode):

    %L3.router = moe.gate(%L3.hn) {...} : [T/8, 256] fp32 @ {attn_tp=S(0)}  # L3
    %L3.route_w.ag = comm.all_gather(%L3.route_w) {group=[attn_tp], size=8} : [T, 8] fp32 @ R  # L3
 -> %L3.hn.ag = comm.all_gather(%L3.hn) {group=[attn_tp], size=8} : [T, 6144] bf16 @ R  # L3
    %L3.router.all = moe.gate(%L3.hn.ag) {...} : [T, 256] fp32 @ R  # L3
    %L3.route_w.all, %L3.route_ids.all = moe.topk(%L3.router.all) {...} : [T, 8] fp32 @ R, [T, 8] i32 @ R
    %L3.routed = moe.experts(%L3.hn.ag, %L3.route_w.all, %L3.route_ids.all) {...} : [T, 6144] bf16 @ {ep=P}
"""
from __future__ import annotations

from glmc.ir import Graph, Op, Placement
from glmc.ir.ops import infer_types
from glmc.ir.types import DTYPE_BYTES

from .base import Pass, PassContext, PassError
from .rewrite import Rewrite, apply_patterns

# Assumed, not measured here: NCCL collective latency on one NVLink node, an all-to-all with
# per-token routing (DeepEP-style) costs more to start, and one direction of H200 NVLink.
LATENCY_US = {"collective": 5.0, "a2a": 15.0}
WIRE_GBPS = 450.0
# The fp32 router's rate on the rows it would recompute (three TF32 products per fp32 one: about a
# third of an H200's dense TF32), assumed.
ROUTER_TFLOPS = 150.0


def phase_tokens(ctx: PassContext) -> int:
    """Tokens per DP rank at which the phase is costed."""
    o, dp = ctx.options, ctx.parallel.attn_dp
    per_rank = max(1, o.decode_batch // dp)
    return {"prefill": o.chunked_prefill, "mtp_verify": per_rank * o.mtp_draft_tokens}.get(
        ctx.phase, per_rank)


def _match(op: Op, graph: Graph):
    """reduce_scatter(moe.experts(all_gather(x), all_gather(w), all_gather(ids)))"""
    if op.kind != "comm.reduce_scatter":
        return None
    ex = graph.producer(op.operands[0])
    if ex.kind != "moe.experts":
        return None
    gathers = [graph.producer(v) for v in ex.operands]
    if not all(g.kind == "comm.all_gather" for g in gathers):
        return None
    return ex, gathers


def _a2a(ctx: PassContext):
    size, disp_dtype = ctx.parallel.ep, _dispatch_dtype(ctx)

    def rule(op: Op, graph: Graph):
        m = _match(op, graph)
        if m is None:
            return None
        ex, gathers = m
        src = [g.operands[0] for g in gathers]
        base = ex.result
        attrs = {"top_k": ex.attr("top_k"), "group": ("ep",), "size": size}
        disp = Op.make("moe.dispatch", [f"{base}.dx", f"{base}.dw", f"{base}.di"], src,
                       {**attrs, "dtype": disp_dtype}, op.layer)
        routed = Placement.of({"ep": "S(0)"})
        disp = disp.with_types(infer_types(disp, [graph.type_of(v) for v in src]), [routed] * 3)
        out_dtype = {"out_dtype": ex.types[0].dtype} if disp_dtype != ex.types[0].dtype else {}
        experts = Op.make(ex.kind, ex.results, disp.results, {**dict(ex.attrs), **out_dtype}, ex.layer)
        experts = experts.with_types(infer_types(experts, list(disp.types)), [routed])
        comb = Op.make("moe.combine", f"{base}.cb", [base, src[0]], attrs, op.layer)
        comb = comb.with_types(infer_types(comb, [experts.types[0], graph.type_of(src[0])]),
                               op.placements)
        dead = {g.result for g in gathers} | {op.result, ex.result}
        return Rewrite([disp, experts, comb], dead=dead, rename={op.result: comb.result})
    return rule


def _routes(ex: Op, gathers: list[Op], graph: Graph):
    """(moe.gate, moe.topk) whose weights and ids the gather form all-gathers, when the router's
    input is the very tokens gathered for the experts and the gathers are its outputs' only users."""
    topk = graph.producer(gathers[1].operands[0])
    if topk.kind != "moe.topk" or graph.producer(gathers[2].operands[0]) is not topk:
        return None
    gate = graph.producer(topk.operands[0])
    if gate.kind != "moe.gate" or gate.operands[0] != gathers[0].operands[0]:
        return None
    if any(len(graph.users(v)) != 1 for v in (*topk.results, gate.result)):
        return None
    return gate, topk


def _route_gathered(op: Op, graph: Graph):
    """The gather form's routing recomputed on the gathered tokens: moe.gate + moe.topk on
    all_gather(x) (replicated, as the experts' input) instead of all-gathering their weights and
    ids; two collectives fewer per MoE layer, the router's rows times the group."""
    m = _match(op, graph)
    routes = m and _routes(*m, graph)
    if not routes:
        return None
    (ex, gathers), (gate, topk) = m, routes
    x, placement = gathers[0].result, gathers[0].placements[0]
    new_gate = Op.make("moe.gate", f"{gate.result}.all", [x], dict(gate.attrs), gate.layer)
    new_gate = new_gate.with_types(infer_types(new_gate, [graph.type_of(x)]), [placement])
    new_topk = Op.make("moe.topk", [f"{v}.all" for v in topk.results], new_gate.results, dict(topk.attrs), topk.layer)
    new_topk = new_topk.with_types(infer_types(new_topk, list(new_gate.types)), [placement] * 2)
    experts = Op.make(ex.kind, ex.results, [x, *new_topk.results], dict(ex.attrs), ex.layer)
    experts = experts.with_types(ex.types, ex.placements)
    dead = {gathers[1].result, gathers[2].result, *topk.results, gate.result, ex.result}
    return Rewrite([new_gate, new_topk, experts, op], dead=dead)


def _routing_us(ex: Op, gathers: list[Op], graph: Graph, env: dict) -> dict[str, float]:
    """The gather form's routing: all-gather the weights and ids ("gather": two collectives) or, where
    the router can move (`_routes`), recompute it on the other ranks' rows too ("recompute")."""
    w = int(gathers[1].attr("size"))
    out = {"gather": 2 * LATENCY_US["collective"] +
           sum(g.types[0].nbytes(env) for g in gathers[1:]) * (w - 1) / w / WIRE_GBPS / 1e3}
    routes = _routes(ex, gathers, graph)
    if routes:
        gate = routes[0]
        rows = graph.type_of(gate.operands[0]).shape[0].eval(env) * (w - 1)
        out["recompute"] = 2.0 * rows * int(gate.attr("hidden")) * int(gate.attr("experts")) / ROUTER_TFLOPS / 1e6
    return out


def _dispatch_dtype(ctx: PassContext) -> str:
    """DeepEP-style fp8 dispatch when the experts run in fp8; otherwise the activation dtype."""
    return "fp8" if ctx.spec.dtypes.weight == "fp8" else ctx.spec.dtypes.activation


def estimate_us(graph: Graph, ctx: PassContext, tokens: int) -> tuple[dict, dict] | None:
    """Cost of both lowerings for the first token-split MoE layer, at `tokens` per DP rank (the
    gather form with its cheaper routing), and of the gather form's routing (`_routing_us`)."""
    env = {"T": tokens, "B": tokens, "S": 1}
    for op in graph.ops:
        m = _match(op, graph)
        if m is None:
            continue
        ex, gathers = m
        w = int(op.attr("size"))
        frac = (w - 1) / w
        x_bytes = gathers[0].types[0].nbytes(env) + op.types[0].nbytes(env) * w
        routing = _routing_us(ex, gathers, graph, env)
        x = graph.type_of(gathers[0].operands[0])
        rows = x.shape[0].eval(env) * int(ex.attr("top_k"))
        h = x.shape[-1].eval(env)
        a2a_bytes = rows * (h * DTYPE_BYTES[_dispatch_dtype(ctx)] + 8) + rows * h * DTYPE_BYTES[x.dtype]
        return ({"gather": 2 * LATENCY_US["collective"] + x_bytes * frac / WIRE_GBPS / 1e3 + min(routing.values()),
                 "a2a": 2 * LATENCY_US["a2a"] + a2a_bytes * frac / WIRE_GBPS / 1e3}, routing)
    return None


class LowerMoE(Pass):
    name = "lower-moe"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        tokens = phase_tokens(ctx)
        est = estimate_us(graph, ctx, tokens)
        if est is None:
            return graph
        cost, routing = est
        forced = ctx.options.moe_a2a
        if forced and ctx.parallel.moe_tp > 1:
            raise PassError(f"lower-moe: --moe-a2a needs moe_tp 1, {ctx.parallel.name} has moe_tp "
                            f"{ctx.parallel.moe_tp} (world {ctx.parallel.world} / ep {ctx.parallel.ep})")
        can_a2a = ctx.parallel.moe_tp == 1
        choice = ("a2a" if forced else "gather") if forced is not None else \
            ("a2a" if can_a2a and cost["a2a"] < cost["gather"] else "gather")
        decision = {"choice": choice, "forced": forced is not None, "tokens_per_rank": tokens,
                    "est_us": {k: round(v, 2) for k, v in cost.items()}}
        if choice == "a2a":
            return apply_patterns(graph, [("moe-a2a", _a2a(ctx))], moe_lowering=decision)
        forced_routing = ctx.options.moe_routing
        if forced_routing not in (None, "gather", "recompute"):
            raise PassError(f"lower-moe: moe_routing {forced_routing!r}: gather or recompute")
        decision["routing"] = (forced_routing if forced_routing in routing else "gather") if forced_routing \
            else min(routing, key=routing.get)
        decision["routing_est_us"] = {k: round(v, 2) for k, v in routing.items()}
        if decision["routing"] == "gather":
            return graph.with_ops(graph.ops, moe_lowering=decision)
        return apply_patterns(graph, [("moe-route-gathered", _route_gathered)], moe_lowering=decision)
