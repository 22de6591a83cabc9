"""The glmc op set. Each infer function states the op's contract in its docstring.

Shapes are per-rank ("local"): weight-sharded sizes divide by the `tp` attribute the sharding pass
sets; the token dim (dim 0) is polymorphic and follows the first operand.
"""
from __future__ import annotations

from .ops import Op, dims, register
from .types import Dim, TensorType

T = TensorType


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _last(t: TensorType) -> Dim:
    return t.shape[-1]


def _tp(op: Op) -> int:
    return int(op.attr("tp", 1))


@register("io.input", 0, attrs=("name", "shape", "dtype"))
def _input(op, ins):
    """Graph input `name` of the given shape and dtype."""
    return [TensorType.of(op.attr("shape"), op.attr("dtype"))]


@register("embed.lookup", 1, attrs=("vocab", "hidden", "dtype"))
def _embed(op, ins):
    """ids [T] -> rows of the (vocab-parallel when tp>1: partial sum) table [T, hidden]."""
    return [T((ins[0].shape[0], Dim.of(op.attr("hidden"))), op.attr("dtype"))]


@register("norm.rms", 1, attrs=("eps",))
def _rms(op, ins):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim."""
    return [ins[0]]


@register("norm.layer", 1, attrs=("eps",))
def _ln(op, ins):
    """LayerNorm over the last dim, with weight and bias."""
    return [ins[0]]


@register("rope.apply", 2, attrs=("theta", "dims"))
def _rope(op, ins):
    """Rotate the first `dims` of the last dim by position (interleaved pairs)."""
    _check(ins[1].shape[0] == ins[0].shape[0], f"positions {ins[1]} do not match tokens {ins[0]}")
    return [ins[0]]


@register("elt.add", 2)
def _add(op, ins):
    """a + b, same type."""
    _check(ins[0] == ins[1], f"operand types differ: {ins[0]} vs {ins[1]}")
    return [ins[0]]


def _linear_out(op, x: TensorType, out_features: int) -> TensorType:
    par = op.attr("parallel", "replicated")
    in_f = int(op.attr("in_features"))
    in_local = in_f // _tp(op) if par == "row" else in_f
    _check(_last(x) == Dim.of(in_local), f"input last dim {_last(x)} != in_features {in_local}")
    out_local = out_features // _tp(op) if par in ("column", "vocab") else out_features
    return T(x.shape[:-1] + (Dim.of(out_local),), op.attr("out_dtype", x.dtype))


@register("linear", 1, attrs=("in_features", "out_features"))
def _linear(op, ins):
    """x @ W^T; parallel=column shards out, row shards in (partial out), replicated neither."""
    return [_linear_out(op, ins[0], int(op.attr("out_features")))]


@register("mla.a_proj", 1, attrs=("in_features", "out_features"))
def _a_proj(op, ins):
    """Fused A-projection [q_a | kv_a_with_mqa (| indexer wk | weights_proj)], replicated."""
    return [_linear_out(op, ins[0], int(op.attr("out_features")))]


@register("tensor.slice", 1, attrs=("dim", "start", "stop"))
def _slice(op, ins):
    """x[..., start:stop, ...] on `dim` (local indices)."""
    d, a, b = int(op.attr("dim")), int(op.attr("start")), int(op.attr("stop"))
    _check(0 <= a < b, f"bad slice {a}:{b}")
    _check(ins[0].shape[d].sym is not None or b <= int(ins[0].shape[d].coeff),
           f"slice {a}:{b} out of range for dim {d} of {ins[0]}")
    return [ins[0].with_dim(d, Dim.of(b - a))]


@register("tensor.view", 1, attrs=("shape",))
def _view(op, ins):
    """Reshape keeping dim 0 (tokens); `tp` divides dim `tp_dim` of the given shape."""
    shape = list(dims(*op.attr("shape")))
    shape[0] = ins[0].shape[0]
    if _tp(op) > 1:
        k = int(op.attr("tp_dim"))
        shape[k] = shape[k] / _tp(op)
    out = T(tuple(shape), ins[0].dtype)
    n_in = [d for d in ins[0].shape[1:]]
    _check(_prod(n_in) == _prod(shape[1:]), f"view {ins[0]} -> {out} changes the element count")
    return [out]


def _prod(ds) -> int:
    p = 1
    for d in ds:
        _check(d.sym is None, f"non-token dim {d} must be static")
        p *= int(d.coeff)
    return p


@register("tensor.concat", 2, attrs=("dim",))
def _concat(op, ins):
    """cat([a, b], dim) (last dim only)."""
    a, b = ins
    _check(a.shape[:-1] == b.shape[:-1], f"concat of {a} and {b}")
    return [a.with_dim(-1, Dim.of(int(_last(a).coeff + _last(b).coeff)))]


@register("tensor.select_last", 1)
def _select_last(op, ins):
    """The last token of each request: [T, ...] -> [B, ...]."""
    return [T((Dim.of("B"),) + ins[0].shape[1:], ins[0].dtype)]


@register("mem.kv_write", 2, attrs=("dtype",))
def _kv_write(op, ins):
    """Write c_kv | k_pe of the new tokens into the paged KV pool of the op's layer; result is its cache."""
    width = int(_last(ins[0]).coeff + _last(ins[1]).coeff)
    return [T(dims("S", width), op.attr("dtype"))]


@register("mem.index_k_write", 1, attrs=("dtype",))
def _index_write(op, ins):
    """Write indexer keys into the op's layer's paged indexer cache (full layers only)."""
    return [T(dims("S", _last(ins[0])), op.attr("dtype"))]


# Readers that turn their query by RoPE as they load it (fuse-query-rope): kind -> (the query's
# operand, operands without the positions). With one more operand, the positions, the op first does
# what rope.apply(query, positions) {dims, interleaved, theta, scaling} would, its attributes
# named rope_dims, rope_interleaved, rope_theta, rope_scaling on the reader.
ROPE_READERS = {"idx.topk": (0, 3), "attn.sparse_mla": (1, 4), "attn.mla_mha": (1, 4), "attn.mla_absorbed": (1, 4)}


def _query_rope(op, ins) -> None:
    """Checks a ROPE_READERS op's operands: its own, or those and the positions with rope_* attributes."""
    q, n = ROPE_READERS[op.kind]
    _check(len(ins) in (n, n + 1), f"takes {n} operands, or {n + 1} with the positions its query turns by")
    if len(ins) > n:
        _check(op.attr("rope_dims") is not None and op.attr("rope_theta") is not None,
               "positions operand without rope_dims and rope_theta")
        _check(ins[n].shape[0] == ins[q].shape[0], f"positions {ins[n]} do not match query {ins[q]}")


@register("idx.topk", None, attrs=("k",))
def _topk(op, ins):
    """I(t,s)=sum_h w_h relu(q_h.k_s / sqrt(D)), causal, top-k key indices per query; (q, w, cache
    [, positions]): with positions, q turned first (ROPE_READERS)."""
    _query_rope(op, ins)
    return [T((ins[0].shape[0], Dim.of(op.attr("k"))), "i32")]


@register("idx.reuse", 1)
def _reuse(op, ins):
    """Shared layer: the top-k of the previous full layer (the operand)."""
    return [ins[0]]


@register("comm.broadcast", 1, attrs=("group", "size"))
def _bcast(op, ins):
    """Broadcast from rank 0 of the group (same type)."""
    return [ins[0]]


def _attn(op, ins):
    """MLA over the latent cache: (q_nope, q_pe, kv, top-k [, positions]); with positions, q_pe
    turned first (ROPE_READERS)."""
    _query_rope(op, ins)
    q_nope, q_pe = ins[:2]
    heads = int(op.attr("heads")) // _tp(op)
    _check(q_nope.shape[1:] == dims(heads, op.attr("dn")), f"q_nope {q_nope} != [T, {heads}, dn]")
    _check(q_pe.shape[1:] == dims(heads, op.attr("dr")), f"q_pe {q_pe} != [T, {heads}, dr]")
    return [T((q_nope.shape[0], Dim.of(heads * int(op.attr("dv")))), q_nope.dtype)]


for _kind in ("attn.sparse_mla", "attn.mla_mha", "attn.mla_absorbed"):
    register(_kind, None, attrs=("heads", "dn", "dr", "dv"))(_attn)


@register("moe.gate", 1, attrs=("experts",))
def _gate(op, ins):
    """Router logits x @ Wg^T in fp32."""
    return [T((ins[0].shape[0], Dim.of(op.attr("experts"))), "fp32")]


@register("moe.topk", 1, results=2, attrs=("top_k",))
def _moe_topk(op, ins):
    """sigmoid + bias selection, group-limited; -> (weights fp32, expert ids i32)."""
    k = Dim.of(op.attr("top_k"))
    return [T((ins[0].shape[0], k), "fp32"), T((ins[0].shape[0], k), "i32")]


@register("moe.experts", 3, attrs=("experts", "inter"))
def _experts(op, ins):
    """sum_i w_i * SwiGLU_e_i(x) over this rank's experts (and intermediate shard)."""
    x, w, ids = ins
    _check(w.shape[0] == x.shape[0] and ids.shape == w.shape, f"routing {w}/{ids} vs tokens {x}")
    return [T(x.shape, op.attr("out_dtype", x.dtype))]


@register("moe.dispatch", 3, results=3, attrs=("top_k", "group", "size"))
def _dispatch(op, ins):
    """All-to-all: send each token to the ranks of its experts -> (x, weights, ids) received."""
    x, w, ids = ins
    n = x.shape[0] * int(op.attr("top_k"))
    return [T((n,) + x.shape[1:], op.attr("dtype", x.dtype)), T((n, Dim.of(1)), "fp32"),
            T((n, Dim.of(1)), "i32")]


@register("moe.combine", 2, attrs=("top_k", "group", "size"))
def _combine(op, ins):
    """All-to-all back: weighted expert outputs summed per source token."""
    y, like = ins
    return [T(like.shape, like.dtype)]


@register("mlp.swiglu", 1, attrs=("inter",))
def _swiglu(op, ins):
    """down(silu(gate x) * up x); tp shards the intermediate dim (partial out)."""
    return [ins[0]]


@register("lm.head", 1, attrs=("vocab",))
def _lm_head(op, ins):
    """Logits x @ W^T in fp32; vocab-parallel when tp>1."""
    v = int(op.attr("vocab")) // _tp(op)
    return [T((ins[0].shape[0], Dim.of(v)), "fp32")]


@register("sample.tokens", 1)
def _sample(op, ins):
    """Token ids from logits: the sampler of runtime/engine/sampling.py at its defaults (greedy,
    temperature 0); the engine samples the plan's logits with each request's parameters."""
    return [T((ins[0].shape[0],), "i64")]
