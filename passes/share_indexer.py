"""share-indexer: shared layers use the previous full layer's top-k directly.

Assumes: `idx.reuse` marks shared layers (expand-layers). Guarantees: no `idx.reuse` remains; the
attention of a shared layer reads the full layer's top-k value; only full layers own indexer
weights, an indexer cache or an indexer workspace (checked); `meta.indexer` lists full layers and
the full layer each shared layer reads. GLM-5.3, layer 3:

Example (GLM-5.3, tp1, decode):

    %L3.topk = idx.reuse(%L2.topk) : [T, 2048] i32 @ R  # L3
    %L3.attn = attn.sparse_mla(%L3.q_nope, %L3.q_pe_a, %L3.kv, %L3.topk, %positions) {...} : ...
 -> #!   full_layers: [0..2, 6..74 step 4],
    #!     3..5: 2,
    %L3.attn = attn.sparse_mla(%L3.q_nope, %L3.q_pe_a, %L3.kv, %L2.topk, %positions) {...} : ...
"""
from __future__ import annotations

from glmc.ir import Graph, Op

from .base import Pass, PassContext, PassError
from .rewrite import Rewrite, apply_patterns

_INDEXER_KINDS = ("idx.topk", "mem.index_k_write", "fused.qkv_a_norm_rope_write_index")


def fold_reuse(op: Op, graph: Graph):
    # reuse(t) -> t
    if op.kind != "idx.reuse":
        return None
    return Rewrite([], dead={op.result}, rename={op.result: op.operands[0]})


class ShareIndexer(Pass):
    name = "share-indexer"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        shared = {op.layer: graph.producer(op.operands[0]).layer for op in graph.ops if op.kind == "idx.reuse"}
        for op in graph.ops:
            if op.layer in shared and op.kind in _INDEXER_KINDS:
                raise PassError(f"share-indexer: {op.where()}: shared layer {op.layer} owns "
                                f"indexer state")
        full = sorted({op.layer for op in graph.ops if op.kind == "idx.topk"})
        return apply_patterns(graph, [("reuse top-k", fold_reuse)],
                              indexer={"full_layers": full,
                                       "shared_from": {str(k): v for k, v in sorted(shared.items())}})
