"""select-mla-form: MHA form for prefill, absorbed (MQA-like) form for decode and MTP.

Assumes: `attn.sparse_mla` ops. Guarantees: prefill uses `attn.mla_mha` (kv_b_proj expands the
selected latents into per-head K/V; compute-dense); decode, mtp_draft and mtp_verify use
`attn.mla_absorbed` (q_nope @ W_UK, attention over the 576-wide latent cache, @ W_UV), which
never expands the cache. Same function, other cost.

Example (GLM-5.3, tp1, decode):

    %L0.attn = attn.sparse_mla(%L0.q_nope, %L0.q_pe_a, %L0.kv, %L0.topk, %positions) {...} : [T, 16384] bf16 @ R  # L0
 -> %L0.attn = attn.mla_absorbed(%L0.q_nope, %L0.q_pe_a, %L0.kv, %L0.topk, %positions) {...} : [T, 16384] bf16 @ R  # L0

Example (GLM-5.3, tp1, prefill):

    %L0.attn = attn.sparse_mla(%L0.q_nope, %L0.q_pe_a, %L0.kv, %L0.topk, %positions) {...} : [T, 16384] bf16 @ R  # L0
 -> %L0.attn = attn.mla_mha(%L0.q_nope, %L0.q_pe_a, %L0.kv, %L0.topk, %positions) {...} : [T, 16384] bf16 @ R  # L0
"""
from __future__ import annotations

from dataclasses import replace

from glmc.ir import Graph, Op

from .base import Pass, PassContext
from .rewrite import Rewrite, apply_patterns


def _form(kind: str):
    def rule(op: Op, graph: Graph):
        # sparse_mla -> the phase's form (same operands, attributes, types)
        return Rewrite([replace(op, kind=kind)]) if op.kind == "attn.sparse_mla" else None
    return rule


class SelectMLAForm(Pass):
    name = "select-mla-form"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        kind = "attn.mla_mha" if ctx.phase == "prefill" else "attn.mla_absorbed"
        return apply_patterns(graph, [(kind, _form(kind))])
