"""Collective ops (`comm.*`), the placeholder `comm.reshard`, and fused ops (`fused.*`).

`size` is the number of ranks in the collective's group; `dim` the tensor dim it gathers or
scatters (always the token dim 0 here). A reshard's `kind` is one of all_reduce, all_gather,
reduce_scatter, shard (a free local slice of a replicated tensor).
"""
from __future__ import annotations

from .ops import register
from .types import Dim, TensorType


def _scaled(t: TensorType, dim: int, factor: int, gather: bool) -> TensorType:
    d = t.shape[dim]
    return t.with_dim(dim, d * factor if gather else d / factor)


RESHARD_KINDS = {"all_reduce": None, "all_gather": True, "reduce_scatter": False, "shard": False}


def reshard_type(t: TensorType, kind: str, size: int, dim: int = 0) -> TensorType:
    gather = RESHARD_KINDS[kind]
    return t if gather is None else _scaled(t, dim, size, gather)


@register("comm.reshard", 1, attrs=("kind", "group", "size", "src", "dst"))
def _reshard(op, ins):
    """Placement change src -> dst over `group`, lowered by insert-collectives."""
    return [reshard_type(ins[0], op.attr("kind"), int(op.attr("size")), int(op.attr("dim", 0)))]


for _k in ("all_reduce", "all_gather", "reduce_scatter"):
    def _coll(op, ins, _k=_k):
        return [reshard_type(ins[0], _k, int(op.attr("size")), int(op.attr("dim", 0)))]
    _coll.__doc__ = f"{_k.replace('_', '-')} over `group` ({{size}} ranks)."
    register(f"comm.{_k}", 1, attrs=("group", "size"))(_coll)


@register("tensor.shard", 1, attrs=("group", "size"))
def _shard(op, ins):
    """This rank's slice of a replicated tensor (no communication)."""
    return [reshard_type(ins[0], "shard", int(op.attr("size")), int(op.attr("dim", 0)))]


@register("fused.add_rms", None, results=2, attrs=("eps",))
def _add_rms(op, ins):
    """(rms_norm(s), s), s = a + residual: residual add fused with RMSNorm. Three operands (a, b,
    residual): s = (a + b) + residual, a + b rounded to the dtype first as the add it replaces
    (an MoE layer's shared + routed experts)."""
    if len(ins) not in (2, 3):
        raise ValueError(f"takes 2 or 3 operands (a, [b,] residual), got {len(ins)}")
    if any(t != ins[0] for t in ins[1:]):
        raise ValueError(f"operand types differ: {', '.join(map(str, ins))}")
    return [ins[0], ins[0]]


@register("fused.allreduce_add_rms", 2, results=2, attrs=("eps", "group", "size"))
def _ar_add_rms(op, ins):
    """(rms_norm(all_reduce(a) + b), all_reduce(a) + b) in one kernel: the deferred reduction."""
    return [ins[1], ins[1]]


@register("fused.reduce_scatter_add_rms", 2, results=2, attrs=("eps", "group", "size"))
def _rs_add_rms(op, ins):
    """(rms_norm(reduce_scatter(a) + b), reduce_scatter(a) + b)."""
    want = reshard_type(ins[0], "reduce_scatter", int(op.attr("size")))
    if want != ins[1]:
        raise ValueError(f"reduce-scatter of {ins[0]} gives {want}, residual is {ins[1]}")
    return [ins[1], ins[1]]


@register("fused.qkv_a_norm_rope_write", 2, results=2, attrs=("q_lora", "kv_lora", "rope_dim"))
def _qkv_fused(op, ins):
    """A-proj output -> (rms_norm(q_c), KV cache with rms_norm(c_kv) | rope(k_pe) written)."""
    a = ins[0]
    q = int(op.attr("q_lora"))
    kv_width = int(op.attr("kv_lora")) + int(op.attr("rope_dim"))
    return [a.with_dim(-1, Dim.of(q)), TensorType((Dim.of("S"), Dim.of(kv_width)), op.attr("dtype"))]


@register("fused.qkv_a_norm_rope_write_index", 2, results=3,
          attrs=("q_lora", "kv_lora", "rope_dim", "index_dim"))
def _qkv_fused_index(op, ins):
    """As fused.qkv_a_norm_rope_write, plus indexer k: LayerNorm + RoPE + index-cache write."""
    q_c, kv = _qkv_fused(op, ins)
    icache = TensorType((Dim.of("S"), Dim.of(int(op.attr("index_dim")))), op.attr("index_dtype"))
    return [q_c, kv, icache]
