"""fuse-qkv-norm-rope: q/kv RMSNorm + k_pe RoPE + paged KV write (+ indexer K) in one op.

Assumes: the layer program's A-projection slices. Guarantees: per layer, the q_a / kv_a norms,
the k_pe RoPE and `mem.kv_write` become `fused.qkv_a_norm_rope_write(a, positions) -> (q_c, kv)`;
on full layers the indexer key LayerNorm + RoPE + `mem.index_k_write` join it
(`fused.qkv_a_norm_rope_write_index -> (q_c, kv, icache)`). Example (layer 1, shared):

    %L1.q_c = norm.rms(%L1.q_a) ...; %L1.c_kv = norm.rms(%L1.kv_a) ...
    %L1.k_pe = rope.apply(%L1.k_pe_a, %positions) ...; %L1.kv = mem.kv_write(%L1.c_kv, %L1.k_pe) ...
 -> %L1.q_c, %L1.kv = fused.qkv_a_norm_rope_write(%L1.a, %positions) {...} : [T, 2048] bf16, [S, 576] fp8
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
             "eps": q_norm.attr("eps"), "theta": rope.attr("theta"), "layer": op.attr("layer"),
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
