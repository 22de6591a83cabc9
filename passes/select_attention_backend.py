"""select-attention-backend: the kernel each attention / indexer op runs, per phase and device.

Assumes: MLA form chosen. Guarantees: `attn.*` and `idx.topk` ops carry `backend`: on cuda,
`triton_sparse_mla_decode` (absorbed), `triton_sparse_prefill` (MHA), `triton_indexer_topk`;
on cpu, `torch`.

Example (GLM-5.3, tp1, decode):

    %L0.topk = idx.topk(%L0.iq_h, %L0.iw, %L0.icache, %positions) {head_dim=128, heads=32, k=2048, ...} : ...
    %L0.attn = attn.mla_absorbed(%L0.q_nope, %L0.q_pe_a, %L0.kv, %L0.topk, %positions) {dn=192, ...} : ...
 -> %L0.topk = idx.topk(%L0.iq_h, ...) {backend=triton_indexer_topk, head_dim=128, ...} : ...
    %L0.attn = attn.mla_absorbed(%L0.q_nope, ...) {backend=triton_sparse_mla_decode, dn=192, ...} : ...

Example (tiny, tp1, decode, device=cpu):

    %L0.attn = attn.mla_absorbed(%L0.q_nope, %L0.q_pe, %L0.kv, %L0.topk) {dn=16, ...} : ...
 -> %L0.attn = attn.mla_absorbed(%L0.q_nope, %L0.q_pe, %L0.kv, %L0.topk) {backend=torch, dn=16, ...} : ...
"""
from __future__ import annotations

from glmc.ir import Graph, Op

from .base import Pass, PassContext
from .rewrite import Rewrite, apply_patterns

CUDA_BACKENDS = {"attn.mla_absorbed": "triton_sparse_mla_decode",
                 "attn.mla_mha": "triton_sparse_prefill",
                 "idx.topk": "triton_indexer_topk"}


def _pick(device: str):
    def rule(op: Op, graph: Graph):
        # op -> op {backend=...} for the ops that have more than one implementation
        if op.kind not in CUDA_BACKENDS or op.attr("backend"):
            return None
        backend = CUDA_BACKENDS[op.kind] if device == "cuda" else "torch"
        return Rewrite([op.with_attrs(backend=backend)])
    return rule


class SelectAttentionBackend(Pass):
    name = "select-attention-backend"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        return apply_patterns(graph, [("backend", _pick(ctx.options.device))],
                              device=ctx.options.device)
