"""fuse-qkv-norm-rope: q/kv RMSNorm + k_pe RoPE + paged KV write (+ indexer K) in one op.

Assumes: the layer program's A-projection slices. Guarantees: per layer, the q_a / kv_a norms,
the k_pe RoPE and `mem.kv_write` become `fused.qkv_a_norm_rope_write(a, positions) -> (q_c, kv)`;
on full layers the indexer key LayerNorm + RoPE + `mem.index_k_write` join it
(`fused.qkv_a_norm_rope_write_index -> (q_c, kv, icache)`) when both RoPEs turn by the same angles
(theta, dims, scaling); the fused op keeps each RoPE's pairing (`interleaved`, `index_interleaved`)
and the yarn `scaling`, if any. GLM-5.3 layer 2 (full) and layer 3 (shared):

Example (GLM-5.3, tp1, decode):

    %L2.ik = rope.apply(%L2.ik_n, %positions) {dims=64, interleaved=true, theta=8000000.0} : ...
    %L2.icache = mem.index_k_write(%L2.ik) {dtype=fp8} : [S, 128] fp8 @ R  # L2
    %L3.q_c = norm.rms(%L3.q_a) {eps=1e-06, ...} : [T, 2048] bf16 @ R  # L3
    %L3.c_kv = norm.rms(%L3.kv_a) {eps=1e-06, ...} : [T, 512] bf16 @ R  # L3
    %L3.k_pe = rope.apply(%L3.k_pe_a, %positions) {dims=64, interleaved=true, theta=8000000.0} : ...
    %L3.kv = mem.kv_write(%L3.c_kv, %L3.k_pe) {dtype=fp8} : [S, 576] fp8 @ R  # L3
 -> %L2.q_c, %L2.kv, %L2.icache = fused.qkv_a_norm_rope_write_index(%L2.a, %positions) {...
    %L3.q_c, %L3.kv = fused.qkv_a_norm_rope_write(%L3.a, %positions) {... interleaved=true, ...} : ...
"""
from __future__ import annotations

from glmc.ir import Graph, Op

from .base import Pass, PassContext
from .rewrite import Rewrite, apply_patterns


def _through(graph: Graph, value: str, *kinds: str) -> list[Op] | None:
    """The chain of producers of `value` with the given kinds (outermost first), or None."""
    chain = []
    for kind in kinds:
        op = graph.producer(value)
        if op.kind != kind:
            return None
        chain.append(op)
        value = op.operands[0]
    return chain


def _index_chain(graph: Graph, a: str):
    for user in graph.users(a):
        if user.kind == "tensor.slice":
            for u in graph.users(user.result):
                if u.kind == "norm.layer":
                    rope = graph.users(u.result)[0]
                    write = graph.users(rope.result)[0]
                    return [write, rope, u, user]
    return None


def _same_angles(a: Op, b: Op) -> bool:
    """Two rope ops rotate by the same angles (theta, rotated dims, scaling); pairing may differ."""
    return all(a.attr(k) == b.attr(k) for k in ("theta", "dims", "scaling"))


def fuse_qkv(op: Op, graph: Graph):
    # kv_write(rms(slice(a)), rope(slice(a))) + rms(slice(a)) for q -> one fused op
    if op.kind != "mem.kv_write":
        return None
    ckv = _through(graph, op.operands[0], "norm.rms", "tensor.slice")
    kpe = _through(graph, op.operands[1], "rope.apply", "tensor.slice")
    if ckv is None or kpe is None:
        return None
    a = ckv[1].operands[0]
    qs = [u for s in graph.users(a) if s.kind == "tensor.slice" and s.attr("start") == 0
          for u in graph.users(s.result) if u.kind == "norm.rms"]
    if not qs:
        return None
    q_norm = qs[0]
    rope = kpe[0]
    attrs = {"q_lora": q_norm.types[0].shape[-1].coeff.numerator,
             "kv_lora": ckv[0].types[0].shape[-1].coeff.numerator,
             "rope_dim": rope.types[0].shape[-1].coeff.numerator, "dtype": op.attr("dtype"),
             "eps": q_norm.attr("eps"), "theta": rope.attr("theta"),
             "interleaved": rope.attr("interleaved", True),
             "weight": (q_norm.attr("weight"), ckv[0].attr("weight"))}
    if rope.attr("scaling") is not None:
        attrs["scaling"] = rope.attr("scaling")
    chain = [q_norm, graph.producer(q_norm.operands[0]), *ckv, *kpe, op]
    results, types, places = [q_norm.result, op.result], [q_norm.types[0], op.types[0]], \
        [q_norm.placements[0], op.placements[0]]
    kind = "fused.qkv_a_norm_rope_write"
    idx = _index_chain(graph, a)
    if idx is not None and _same_angles(idx[1], rope):  # one cos/sin table serves both keys
        write, index_rope, ln, _ = idx
        kind += "_index"
        attrs.update(index_dim=ln.types[0].shape[-1].coeff.numerator, index_dtype=write.attr("dtype"),
                     index_weight=(ln.attr("weight"), ln.attr("bias")), index_eps=ln.attr("eps"),
                     index_interleaved=index_rope.attr("interleaved", True))
        chain += idx
        results.append(write.result)
        types.append(write.types[0])
        places.append(write.placements[0])
    fused = Op.make(kind, results, [a, kpe[0].operands[1]], attrs, op.layer, types, places)
    return Rewrite([fused], dead={o.result for o in chain})


class FuseQKVNormRope(Pass):
    name = "fuse-qkv-norm-rope"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        return apply_patterns(graph, [("q/kv norm+rope+kv write", fuse_qkv)])
