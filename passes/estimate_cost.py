"""estimate-cost: FLOPs, weight bytes and the communication bill, per op, per layer, per step.

Assumes: a fully lowered graph. Guarantees: `meta.cost` holds the bill at the options' decode
point (`T` = decode_batch / attn_dp per rank, S = 4096) for a quick look; `bill(graph, env, ...)`
evaluates any point (what `glmc explain --batch --context` prints). GLM-5.3 under tp8 decodes 32
tokens with 2 all-reduces per layer plus the embedding's, and gathers the vocab-parallel logits once:

Example (GLM-5.3, tp8, decode):

 -> #! cost = {
    #!   comm: {all_gather: {count: 1, ...}, all_reduce: {count: 157, ...}},
    #!   point: {B: 32, K: 2048, S: 4096, T: 32}
"""
from __future__ import annotations

from collections import defaultdict

from glmc.ir import Graph

from .base import Pass, PassContext
from .costs import op_cost, runs_p2p, weight_bytes_for


def bill(graph: Graph, env: dict, dtypes) -> dict:
    """Totals and per-layer/per-kind communication for one step at `env`; a kind's row counts
    under `p2p` the collectives that run the one-shot peer-memory kernel at this point (message
    within the op's `p2p_max_bytes`), the rest being NCCL's."""
    wb = weight_bytes_for(dtypes)
    total = defaultdict(float)
    comm = defaultdict(lambda: {"count": 0, "message_bytes": 0, "wire_bytes": 0.0})
    per_layer: dict = defaultdict(lambda: defaultdict(
        lambda: {"count": 0, "message_bytes": 0, "messages": []}))
    for op in graph.ops:
        c = op_cost(op, graph, env, wb)
        for key in ("params", "params_local", "active_params", "weight_bytes_local", "flops", "hbm_bytes"):
            total[key] += getattr(c, key)
        if c.comm:
            row = comm[c.comm]
            row["count"] += 1
            row["message_bytes"] += c.message_bytes
            row["wire_bytes"] += c.wire_bytes
            if runs_p2p(op, c.message_bytes):         # the one-shot kernel, not NCCL
                row["p2p"] = row.get("p2p", 0) + 1
            cell = per_layer["-" if op.layer is None else str(op.layer)][c.comm]
            cell["count"] += 1
            cell["message_bytes"] += c.message_bytes
            cell["messages"].append(c.message_bytes)
    return {"totals": dict(total), "comm": {k: dict(v) for k, v in sorted(comm.items())},
            "per_layer": {k: {kk: dict(vv) for kk, vv in v.items()} for k, v in per_layer.items()}}


class EstimateCost(Pass):
    name = "estimate-cost"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        t = max(1, ctx.options.decode_batch // ctx.parallel.attn_dp)
        env = {"T": t, "B": t, "S": 4096, "K": ctx.spec.config.index_topk}
        b = bill(graph, env, ctx.spec.dtypes)
        summary = {"point": env, "flops": b["totals"]["flops"],
                   "comm": {k: {"count": v["count"], "message_bytes": v["message_bytes"]}
                            for k, v in b["comm"].items()}}
        return graph.with_ops(graph.ops, cost=summary)
