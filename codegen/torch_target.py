"""The torch target: one implementation per IR op kind, built on `torch_ref`.

`IMPLS[kind](op, args, ctx) -> tensor | tuple` where `args` are the operand values and `ctx` the
step's `codegen.context.StepContext` (weights, KV pool, batch, comm, rank coordinates).
Values are fp32 tensors on CPU; a KV-write result is its layer number (the cache itself lives in
the pool). Collectives count their traffic with the cost model's sizes (see runtime/worker/comm.py).
"""
from __future__ import annotations

import torch
from glmc.codegen import torch_ref as ref
from glmc.codegen.context import StepContext
from glmc.ir.dialect import ROPE_READERS
from glmc.ir.types import DTYPE_BYTES

IMPLS: dict = {}
# Kinds no final plan contains, so no target implements them: the pass named replaces them.
NOT_EXECUTED = {"comm.reshard": "insert-collectives", "idx.reuse": "share-indexer"}


def registry(table: dict):
    """`@impl(*kinds)` for an op table: registers the decorated function as every kind's
    implementation in `table` (each target's IMPLS starts as a copy of this one's)."""
    def impl(*kinds):
        def deco(fn):
            for k in kinds:
                table[k] = fn
            return fn
        return deco
    return impl


impl = registry(IMPLS)


@impl("io.input")
def _input(op, args, ctx: StepContext):
    return ctx.feeds[op.attr("name")]


@impl("embed.lookup")
def _embed(op, args, ctx: StepContext):
    w, ids = ctx.w(op.attr("weight")), args[0]
    if int(op.attr("tp", 1)) == 1:
        return w[ids].float()
    lo = ctx.tp_rank(op) * w.shape[0]
    local = ids - lo
    hit = (local >= 0) & (local < w.shape[0])
    return w[local.clamp(0, w.shape[0] - 1)].float() * hit[:, None]   # partial sum over ranks


@impl("norm.rms")
def _rms(op, args, ctx: StepContext):
    return ref.rms_norm(args[0], ctx.w(op.attr("weight")), op.attr("eps"))


@impl("norm.layer")
def _ln(op, args, ctx: StepContext):
    return ref.layer_norm(args[0], ctx.w(op.attr("weight")), ctx.w(op.attr("bias")), op.attr("eps"))


def turn(x, positions, op, prefix: str = ""):
    """x with its first `dims` turned as rope.apply turns them, by `op`'s attributes named `prefix` +
    dims, interleaved, theta, scaling (a rope's own, or a ROPE_READERS op's rope_*)."""
    d = int(op.attr(prefix + "dims"))
    roped = ref.rope(x[..., :d], positions, op.attr(prefix + "theta"), op.attr(prefix + "interleaved", True),
                     op.attr(prefix + "scaling"))
    return torch.cat([roped, x[..., d:]], dim=-1) if d < x.shape[-1] else roped


def unfused_args(op, args) -> list:
    """A ROPE_READERS op's operands as it reads them: with the positions (fuse-query-rope), its query
    turned by them and the positions dropped."""
    q, n = ROPE_READERS[op.kind]
    out = list(args[:n])
    if len(args) > n:
        out[q] = turn(out[q], args[n], op, "rope_")
    return out


@impl("rope.apply")
def _rope(op, args, ctx: StepContext):
    return turn(args[0], args[1], op)


@impl("linear", "mla.a_proj", "lm.head")
def _linear(op, args, ctx: StepContext):
    return args[0].float() @ ctx.w(op.attr("weight")).T


@impl("tensor.slice")
def _slice(op, args, ctx: StepContext):
    return args[0].narrow(int(op.attr("dim")), int(op.attr("start")),
                          int(op.attr("stop")) - int(op.attr("start")))


@impl("tensor.view")
def _view(op, args, ctx: StepContext):
    shape = list(op.types[0].shape)
    return args[0].reshape(args[0].shape[0], *[d.eval({}) for d in shape[1:]])


@impl("tensor.concat")
def _concat(op, args, ctx: StepContext):
    return torch.cat(args, dim=-1)


@impl("tensor.select_last")
def _select_last(op, args, ctx: StepContext):
    return args[0][torch.cumsum(ctx.batch.extend_lens, 0) - 1]


@impl("tensor.shard")
def _shard(op, args, ctx: StepContext):
    group = ctx.comm._g(_axes(op))[1]
    return args[0].chunk(len(group), dim=int(op.attr("dim", 0)))[group.index(ctx.comm.rank)]


@impl("elt.add")
def _add(op, args, ctx: StepContext):
    return args[0] + args[1]


@impl("mem.kv_write")
def _kv_write(op, args, ctx: StepContext):
    layer = op.layer
    ref.kv_write(ctx.pool, layer, ctx.loc, args[0], args[1])
    return layer


@impl("mem.index_k_write")
def _index_write(op, args, ctx: StepContext):
    layer = op.layer
    ref.index_k_write(ctx.pool, layer, ctx.loc, args[0])
    return layer


@impl("fused.qkv_a_norm_rope_write", "fused.qkv_a_norm_rope_write_index")
def _qkv_fused(op, args, ctx: StepContext):
    a, pos = args
    q, c, r = int(op.attr("q_lora")), int(op.attr("kv_lora")), int(op.attr("rope_dim"))
    wq, wkv = (ctx.w(n) for n in op.attr("weight"))
    q_c = ref.rms_norm(a[:, :q], wq, op.attr("eps"))
    c_kv = ref.rms_norm(a[:, q:q + c], wkv, op.attr("eps"))
    theta, scaling = op.attr("theta"), op.attr("scaling")
    k_pe = ref.rope(a[:, q + c:q + c + r], pos, theta, op.attr("interleaved", True), scaling)
    layer = op.layer
    ref.kv_write(ctx.pool, layer, ctx.loc, c_kv, k_pe)
    if not op.kind.endswith("_index"):
        return q_c, layer
    di = int(op.attr("index_dim"))
    w, b = (ctx.w(n) for n in op.attr("index_weight"))
    k = ref.layer_norm(a[:, q + c + r:q + c + r + di], w, b, op.attr("index_eps"))
    k = torch.cat([ref.rope(k[:, :r], pos, theta, op.attr("index_interleaved", True), scaling), k[:, r:]], dim=-1)
    ref.index_k_write(ctx.pool, layer, ctx.loc, k)
    return q_c, layer, layer


@impl("idx.topk")
def _topk(op, args, ctx: StepContext):
    q, w, layer = unfused_args(op, args)
    return ref.indexer_topk(q, w.float() * ref.index_head_scale(op), ctx.pool, layer, ctx.batch, int(op.attr("k")))


@impl("attn.mla_mha", "attn.mla_absorbed", "attn.sparse_mla")
def _attn(op, args, ctx: StepContext):
    q_nope, q_pe, layer, topk = unfused_args(op, args)
    fn = ref.mla_attention_mha if op.kind == "attn.mla_mha" else ref.mla_attention_absorbed
    return fn(q_nope, q_pe, ctx.pool, layer, ctx.w(op.attr("weight")), topk, ctx.batch,
              op.attr("scale"), int(op.attr("dn")), int(op.attr("dv")))


def _add_rms(op, a, b, ctx: StepContext):
    return ref.add_rms_norm(a, b, ctx.w(op.attr("weight")), op.attr("eps"))


@impl("fused.add_rms")
def _fused_add_rms(op, args, ctx: StepContext):
    x = args[0] if len(args) == 2 else args[0] + args[1]   # (a + b) in the dtype, as the folded elt.add
    return _add_rms(op, x, args[-1], ctx)


@impl("fused.allreduce_add_rms")
def _fused_ar(op, args, ctx: StepContext):
    reduced = ctx.comm.all_reduce(args[0], _axes(op), _plan_bytes(args[0], ctx, op.operands[0]))
    return _add_rms(op, reduced, args[1], ctx)


@impl("fused.reduce_scatter_add_rms")
def _fused_rs(op, args, ctx: StepContext):
    nbytes = _plan_bytes(args[0], ctx, op.operands[0])
    return _add_rms(op, ctx.comm.reduce_scatter(args[0], _axes(op), nbytes=nbytes), args[1], ctx)


@impl("moe.gate")
def _gate(op, args, ctx: StepContext):
    return args[0].float() @ ctx.w(op.attr("weight")).float().T


@impl("moe.topk")
def _moe_topk(op, args, ctx: StepContext):
    bias = ctx.w(ctx.gate_bias(op))
    return ref.moe_route_logits(args[0], bias, int(op.attr("top_k")), int(op.attr("n_group")),
                                int(op.attr("topk_group")), op.attr("norm_topk_prob"), op.attr("scale"))


@impl("moe.experts")
def _experts(op, args, ctx: StepContext):
    x, w, ids = args
    gate, up, down = ctx.experts(op)
    return ref.moe_experts(x, ids, w, gate, up, down, expert_offset=ctx.expert_offset(op))


@impl("mlp.swiglu")
def _swiglu(op, args, ctx: StepContext):
    p = op.attr("weight")
    return ref.swiglu(args[0], *(ctx.w(f"{p}.{n}_proj.weight") for n in ("gate", "up", "down")))


@impl("sample.tokens")
def _sample(op, args, ctx: StepContext):
    """The sampler at its defaults, greedy (runtime/engine/sampling.py); the engine samples the
    returned logits with each request's parameters."""
    return ref.sample_greedy(args[0])


def _axes(op) -> tuple[str, ...]:
    return tuple(op.attr("group"))


def _plan_bytes(x, ctx: StepContext, value: str, factor: float = 1.0) -> int:
    """Bytes of `x` in the plan's dtype for `value` (the CPU target computes in fp32 / int64)."""
    return int(x.numel() * factor) * DTYPE_BYTES[ctx.type_of(value).dtype]


@impl("comm.all_reduce")
def _ar(op, args, ctx: StepContext):
    return ctx.comm.all_reduce(args[0], _axes(op), _plan_bytes(args[0], ctx, op.operands[0]))


@impl("comm.all_gather")
def _ag(op, args, ctx: StepContext):
    nbytes = _plan_bytes(args[0], ctx, op.operands[0], int(op.attr("size")))
    return ctx.comm.all_gather(args[0], _axes(op), int(op.attr("dim", 0)), nbytes)


@impl("comm.reduce_scatter")
def _rs(op, args, ctx: StepContext):
    nbytes = _plan_bytes(args[0], ctx, op.operands[0])
    return ctx.comm.reduce_scatter(args[0], _axes(op), int(op.attr("dim", 0)), nbytes)


@impl("comm.broadcast")
def _bc(op, args, ctx: StepContext):
    return ctx.comm.broadcast(args[0], _axes(op), _plan_bytes(args[0], ctx, op.operands[0]))


@impl("moe.dispatch")
def _dispatch(op, args, ctx: StepContext):
    """Send each (token, expert) row to the rank holding the expert; remember the routing."""
    x, w, ids = args
    n, k, h = int(op.attr("size")), ids.shape[1], x.shape[1]
    dest = (ids // (ctx.num_experts // n)).reshape(-1)
    order = torch.argsort(dest, stable=True)
    rows = torch.cat([x.float().repeat_interleave(k, 0), w.reshape(-1, 1).float(),
                      ids.reshape(-1, 1).float()], dim=1)[order]
    send = torch.bincount(dest, minlength=n).tolist()
    nbytes = sum(t.payload_bytes({"T": x.shape[0]}) for t in op.types) * n
    got = ctx.comm.all_to_all(list(rows.split(send)), _axes(op), "dispatch", nbytes)
    ctx.routes[op.results[0]] = (order, send, [g.shape[0] for g in got])
    got = torch.cat(got)
    return got[:, :h], got[:, h:h + 1], got[:, h + 1:].long()


@impl("moe.combine")
def _combine(op, args, ctx: StepContext):
    """Send expert outputs back to their tokens' ranks and sum each token's k rows."""
    y, like = args
    order, send, recv = ctx.routes[op.operands[0] + ".dx"]
    n, k = int(op.attr("size")), int(op.attr("top_k"))
    nbytes = like.shape[0] * k * y.shape[1] * DTYPE_BYTES[ctx.type_of(op.operands[0]).dtype] * n
    back = torch.cat(ctx.comm.all_to_all(list(y.split(recv)), _axes(op), "combine", nbytes))
    rows = torch.zeros_like(back)
    rows[order] = back
    return rows.view(like.shape[0], k, -1).sum(1)
