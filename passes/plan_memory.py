"""plan-memory: what one rank holds — weights, KV + indexer cache per token, workspaces, graphs.

Assumes: a lowered, sharded graph with buckets. Guarantees: `meta.memory` with
`weights_bytes` (this phase's graph, one rank), `kv_bytes_per_token` (c_kv | k_pe per layer, all
layers; an fp8 row is FlashMLA's: e4m3 latent + a fp32 scale per 128 + bf16 k_pe, `costs.kv_row_bytes`),
`index_bytes_per_token` (indexer keys + fp8 scale, full layers only), the layer counts,
`indexer_workspace_bytes` (fp32 score tiles + running top-k for the largest step) and
`graph_bytes` per bucket (the largest per-layer activation set at that batch, plus logits).
GLM-5.3: 656 bytes of fp8 KV per token on each of 78 layers (512 + 4 x 4 + 64 x 2), 128 + 4 on each
of 21 indexer layers:

Example (GLM-5.3, tp1, decode):

 -> #! memory = {
    #!   index_bytes_per_token: 2772,
    #!   index_layers: 21,
    #!   kv_bytes_per_token: 51168,
    #!   kv_layers: 78,
"""
from __future__ import annotations

from glmc.ir import Graph

from .base import Pass, PassContext
from .costs import cache_row_bytes, params_of, weight_bytes_for

TILE_KEYS = 4096


def _rows(graph: Graph, ctx: PassContext) -> int:
    buckets = graph.meta.get("cuda_graph_buckets") or [ctx.options.chunked_prefill]
    return max(buckets)


def _layer_activation_bytes(graph: Graph, env: dict) -> int:
    per_layer: dict = {}
    for op in graph.ops:
        for t in op.types:
            if t is not None and t.shape and t.shape[0].sym in ("T", "B"):
                per_layer[op.layer] = per_layer.get(op.layer, 0) + t.nbytes(env)
    return max(per_layer.values(), default=0)


class PlanMemory(Pass):
    name = "plan-memory"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        wb = weight_bytes_for(ctx.spec.dtypes)
        weights = 0
        for op in graph.ops:
            _, local, _, cls = params_of(op)
            weights += local * wb[cls]
        rows = [row for op in graph.ops for row in cache_row_bytes(op, graph)]
        kv = [b for index, b in rows if not index]
        idx = [b for index, b in rows if index]
        kv_tok, idx_tok = sum(kv), sum(idx)
        cfg = ctx.spec.config
        memory = {
            "weights_bytes": weights,
            "kv_bytes_per_token": kv_tok, "kv_layers": len(kv),
            "index_bytes_per_token": idx_tok, "index_layers": len(idx),
            # scores are produced in tiles of TILE_KEYS keys and merged into a running top-k
            "indexer_workspace_bytes": _rows(graph, ctx) * (TILE_KEYS + 2 * cfg.index_topk) * 4
            if idx else 0,
            "graph_bytes": {str(b): _layer_activation_bytes(graph, {"T": b, "B": b, "S": 1})
                            + b * cfg.vocab_size * 4
                            for b in graph.meta.get("cuda_graph_buckets", [])},
        }
        return graph.with_ops(graph.ops, memory=memory)
