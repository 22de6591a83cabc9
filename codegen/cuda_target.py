"""The CUDA target: `torch_target.IMPLS` with the hot ops replaced by Triton kernels and cuBLAS GEMMs.

`IMPLS[kind](op, args, ctx)` as in torch_target, but values stay in the plan's compute dtype (bf16
for real checkpoints, fp32 for fp32 ones) on the weights' device, and every op here is capture-safe:
no host sync (.item(), .tolist(), int(tensor)), no allocation-size that depends on data, no host
loop over requests. That lets `runtime/worker/cuda_executor.py` capture a decode step as one CUDA graph.
`ctx` is a `codegen.context.CudaStepContext`: the torch target's context plus device index tensors
(rows, positions, the device req_to_token table), a static workspace width and a cache of weights
re-laid out once.

Ops not listed here (views, slices, concat, elt.add, io.input, collectives) use torch_target's.
Dense GEMMs go to cuBLAS (torch.matmul) in the weights' dtype; the router GEMM stays fp32: at decode
sizes (`glmc.target.gemv_takes`) it and the unquantised part of an FP8 A-projection run the
`gemv` kernel (one launch, x read as it is); above them the router runs the `narrow_gemm` kernel
(K split over programs; cuBLAS took a cast, an fp32 SIMT GEMM and its split-K reduction) and
weights_proj cuBLAS (into a temporary copied into its columns: faster than narrow_gemm, 2026-12-04). Weights
an FP8 plan stores FP8 (`fp8_ref.Fp8Weight`, `codegen/weight_formats.py`) run the block-scaled w8a8
GEMM (`triton_fp8`): the activation quantised once per step per token per 128 columns (by the norm
that makes it where an FP8 GEMM reads a norm's output, else by the first FP8 consumer: `quantized`),
one FP8 GEMM per run of row parts (`glmc.target.fp8_row_groups`: a part ending off a 128-row scale block
padded with zero rows, whose columns the GEMM skips), each into its columns of one output; the
routed experts run `triton_moe.moe_experts_fp8`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from glmc.codegen import torch_ref as ref
from glmc.codegen import torch_target
from glmc.codegen import triton_fp8 as tf
from glmc.codegen import triton_moe as tm
from glmc.codegen import triton_p2p as tp2p
from glmc.codegen import triton_launch as tt
from glmc.codegen.context import CudaStepContext
from glmc.codegen.fp8_ref import Fp8Weight
from glmc.codegen.triton_contexts import QueryRope
from glmc.codegen.weight_formats import FP8_KINDS, op_weight_names
from glmc.ir.types import DTYPE_BYTES
from glmc.target import NORM_QUANT_ROWS, TOPK_CHUNK, fp8_group_gap, fp8_row_groups, gemv_takes

IMPLS: dict = dict(torch_target.IMPLS)
# The torch target's implementations this target runs as they are: capture-safe on the device
# (views, slices, element-wise, KV writes by index, collectives through `Comm`, whose NCCL path
# has fixed sizes). Every other kind is overridden below; none is CPU-only.
FROM_TORCH_TARGET = frozenset({"io.input", "elt.add", "tensor.slice", "tensor.view", "tensor.concat",
                               "tensor.shard", "mem.kv_write", "mem.index_k_write", "comm.broadcast"})
CPU_ONLY: frozenset = frozenset()


impl = torch_target.registry(IMPLS)


def _mm(x, w):
    """x @ w.T in w's dtype (cuBLAS)."""
    return x.to(w.dtype) @ w.T


@impl("embed.lookup")
def _embed(op, args, ctx: CudaStepContext):
    """Row lookup; vocab-parallel (tp > 1): this rank's rows, zeros elsewhere (a partial sum)."""
    w, ids = ctx.w(op.attr("weight")), args[0]
    if int(op.attr("tp", 1)) == 1:   # F.embedding: 1.7 us at one row in a graph, w[ids] 2.6 (H200, 2026-12-03)
        return F.embedding(ids, w)
    local = ids - ctx.tp_rank(op) * w.shape[0]
    hit = (local >= 0) & (local < w.shape[0])
    return w[local.clamp(0, w.shape[0] - 1)] * hit[:, None].to(w.dtype)


def _holds_fp8(op, ctx: CudaStepContext) -> bool:
    """Whether `op` runs an FP8 GEMM on its first operand on this rank (its weights are FP8)."""
    if op.kind == "moe.experts":
        return isinstance(ctx.experts(op)[0], Fp8Weight)
    if op.kind == "mlp.swiglu":
        return isinstance(ctx.w(f"{op.attr('weight')}.gate_proj.weight"), Fp8Weight)
    return op.kind in FP8_KINDS and any(isinstance(ctx.w(n), Fp8Weight) for n in op_weight_names(op))


def _norm_quantises(op, ctx: CudaStepContext) -> bool:
    """Whether a norm's output (results[0]) feeds an FP8 GEMM: then (up to NORM_QUANT_ROWS rows)
    the norm kernel quantises it too and its consumers find that in `quantized`
    (kernel_set._fp8_rms lists both forms)."""
    value = op.results[0]
    return ctx.derived(("norm_quantises", id(ctx.graph), value),
                       lambda: any(u.operands[0] == value and _holds_fp8(u, ctx) for u in ctx.graph.users(value)))


@impl("norm.rms")
def _rms(op, args, ctx: CudaStepContext):
    if args[0].shape[0] > NORM_QUANT_ROWS or not _norm_quantises(op, ctx):
        return tt.rms_norm(args[0], ctx.w(op.attr("weight")), op.attr("eps"), ctx.kernels)
    out, ctx.memo[(op.results[0], "fp8_tokens")] = tt.rms_norm(args[0], ctx.w(op.attr("weight")), op.attr("eps"),
                                                               ctx.kernels, quant=True)
    return out


@impl("norm.layer")
def _ln(op, args, ctx: CudaStepContext):
    x = args[0]
    return ref.layer_norm(x, ctx.w(op.attr("weight")).float(), ctx.w(op.attr("bias")).float(),
                          op.attr("eps")).to(x.dtype)


@impl("rope.apply")
def _rope(op, args, ctx: CudaStepContext):
    x, d = args[0], int(op.attr("dims"))
    return tt.rope(x, args[1], op.attr("theta"), op.attr("interleaved", True), rope_dim=d,
                   scaling=op.attr("scaling"), lib=ctx.kernels)


def fp8_parts(weights: list) -> tuple[list, int]:
    """Row parts of one output (FP8 weights and plain ones, in column order) -> ([(first column,
    weight, gap)], width): consecutive FP8 parts joined into one GEMM (`fp8_row_groups`; a part
    ending off a 128-row block padded, its padding columns the GEMM's `gap`), plain ones
    concatenated (gap None). The kernel set lists one FP8 GEMM per joined part (`kernel_set._fp8_gemms`)."""
    out, col, i = [], 0, 0
    while i < len(weights):
        j = i
        while j < len(weights) and isinstance(weights[j], Fp8Weight) == isinstance(weights[i], Fp8Weight):
            j += 1
        run = weights[i:j]
        if isinstance(run[0], Fp8Weight):
            joined = []
            for g in fp8_row_groups([w.shape[0] for w in run]):
                gap = fp8_group_gap([run[k].shape[0] for k in g])
                w = Fp8Weight.cat_rows([run[k] for k in g], pad=True) if len(g) > 1 else run[g[0]]
                joined.append((w, gap, w.shape[0] - gap[1]))
        else:
            joined = [(torch.cat(run) if len(run) > 1 else run[0], None, sum(w.shape[0] for w in run))]
        for w, gap, width in joined:
            out.append((col, w, gap))
            col += width
        i = j
    return out, col


def quantized(x, value: str, ctx: CudaStepContext):
    """x (the IR value `value`) quantised per token per 128 columns, once per step: the FP8
    consumers of one activation (the indexer's wq_b and q_b of c_q; the routed and shared experts
    of the MoE input) share one quantisation (`ctx.memo`)."""
    key = (value, "fp8_tokens")
    if key not in ctx.memo:
        ctx.memo[key] = tf.quantize_tokens(x, ctx.kernels)
    return ctx.memo[key]


def _parts_mm(x, xq, xs, parts, width, lib):
    """x @ W^T over `fp8_parts` (x quantised: xq, xs), each part into its columns, in x's dtype."""
    y = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
    for col, w, gap in parts:
        if isinstance(w, Fp8Weight):
            tf.fp8_block_gemm(xq, xs, w.q, w.scale_inv, lib=lib, out=y[:, col:col + w.shape[0] - gap[1]], gap=gap)
        elif gemv_takes(x.shape[0], w.shape[0]):      # decode: straight into its columns (cuBLAS: 3 launches)
            tt.gemv(x, w, out=y[:, col:col + w.shape[0]], lib=lib)
        else:
            y[:, col:col + w.shape[0]].copy_(_mm(x, w))
    return y


def _fp8_mm(x, value: str, names: tuple, ctx: CudaStepContext):
    """x (the IR value `value`) @ W^T for the rows of `names`, or None when none of them is FP8 (a
    bf16 plan)."""
    if not any(isinstance(ctx.w(n), Fp8Weight) for n in names):
        return None
    parts, width = ctx.derived(("fp8_parts", names), lambda: fp8_parts([ctx.w(n) for n in names]))
    return _parts_mm(x, *quantized(x, value, ctx), parts, width, ctx.kernels)


@impl("linear", "mla.a_proj", "lm.head")
def _linear(op, args, ctx: CudaStepContext):
    name = op.attr("weight")
    y = _fp8_mm(args[0], op.operands[0], name if isinstance(name, tuple) else (name,), ctx)
    return _mm(args[0], ctx.w(name)) if y is None else y


@impl("tensor.select_last")
def _select_last(op, args, ctx: CudaStepContext):
    return args[0][ctx.last_rows]


# ----------------------------------------------------------------------------- small collectives over peer memory
def _p2p_channel(op, x, ctx: CudaStepContext, mode: str):
    """The peer-memory channel `op` (mode "reduce", "scatter" or "gather") of `x` runs on, or None
    for NCCL: the plan gave it a threshold (select-collective-backend), the message (an all-gather's
    output, the others' input, in the plan's dtype) is within it and the group's peers mapped."""
    limit = op.attr("p2p_max_bytes")
    if limit is None or x.dim() != 2 or x.shape[0] == 0:
        return None
    n = int(op.attr("size"))
    plan_row = x.shape[1] * DTYPE_BYTES[ctx.type_of(op.operands[0]).dtype]
    if x.shape[0] * plan_row * (n if mode == "gather" else 1) > int(limit):
        return None
    scatter = mode == "scatter"
    cap = int(limit) // plan_row // (1 if mode == "reduce" else n)   # programs: output rows (gather: input)
    ch = ctx.comm.peer_channel(torch_target._axes(op), mode, x.shape[1] * x.element_size(), cap, x.device)
    rows = x.shape[0] // n if scatter else x.shape[0]
    return ch if ch is not None and tp2p.fits(ch, rows, x.shape[1], x.dtype) else None


def _reduce(op, args, ctx: CudaStepContext, scatter: bool, fused: bool):
    """comm.all_reduce / comm.reduce_scatter and their fused add + RMSNorm forms: the one-shot
    kernel where `_p2p_channel` allows, else NCCL (the torch target's collective) and, fused, this
    target's add + RMSNorm (activations keep their dtype; an FP8 GEMM's input is quantised there)."""
    x = args[0]
    ch = _p2p_channel(op, x, ctx, "scatter" if scatter else "reduce")
    if ch is None and not fused:
        return torch_target.IMPLS[op.kind](op, args, ctx)
    nbytes = torch_target._plan_bytes(x, ctx, op.operands[0])
    if ch is None:
        axes = torch_target._axes(op)
        reduced = ctx.comm.reduce_scatter(x, axes, nbytes=nbytes) if scatter else ctx.comm.all_reduce(x, axes, nbytes)
        return _fused_add_rms(op, [reduced, args[1]], ctx)
    ctx.comm.count("reduce_scatter" if scatter else "all_reduce", nbytes, p2p=True)
    if not fused:
        return tp2p.p2p_allreduce(x, ch, scatter=scatter, lib=ctx.kernels)
    return tp2p.p2p_allreduce(x, ch, args[1], ctx.w(op.attr("weight")), op.attr("eps"), scatter, ctx.kernels)


for _kind, _scatter, _fused in (("comm.all_reduce", False, False), ("comm.reduce_scatter", True, False),
                                ("fused.allreduce_add_rms", False, True),
                                ("fused.reduce_scatter_add_rms", True, True)):
    IMPLS[_kind] = (lambda s, f: lambda op, args, ctx: _reduce(op, args, ctx, s, f))(_scatter, _fused)


@impl("comm.all_gather")
def _all_gather(op, args, ctx: CudaStepContext):
    """The one-shot all-gather where `_p2p_channel` allows (dim 0 only), else the torch target's."""
    x = args[0]
    ch = _p2p_channel(op, x, ctx, "gather")
    if ch is None:
        return torch_target.IMPLS[op.kind](op, args, ctx)
    ctx.comm.count("all_gather", torch_target._plan_bytes(x, ctx, op.operands[0], int(op.attr("size"))), p2p=True)
    return tp2p.p2p_all_gather(x, ch, ctx.kernels)


@impl("fused.add_rms")
def _fused_add_rms(op, args, ctx: CudaStepContext):
    addend = args[1] if len(args) == 3 else None      # a folded plain add: (a + b) + residual
    w, eps = ctx.w(op.attr("weight")), op.attr("eps")
    if args[0].shape[0] > NORM_QUANT_ROWS or not _norm_quantises(op, ctx):
        return tt.add_rms_norm(args[0], args[-1], w, eps, ctx.kernels, addend=addend)
    out, res, qs = tt.add_rms_norm(args[0], args[-1], w, eps, ctx.kernels, quant=True, addend=addend)
    ctx.memo[(op.results[0], "fp8_tokens")] = qs
    return out, res


@impl("fused.qkv_a_norm_rope_write", "fused.qkv_a_norm_rope_write_index")
def _qkv_fused(op, args, ctx: CudaStepContext):
    """Slices of the A-projection -> one kernel: c_q out; KV (and indexer K) rows written at ctx.loc."""
    a, pos = args
    q, c, r = int(op.attr("q_lora")), int(op.attr("kv_lora")), int(op.attr("rope_dim"))
    wq, wkv = (ctx.w(n) for n in op.attr("weight"))
    layer = op.layer
    kw = {}
    if op.kind.endswith("_index"):
        di = int(op.attr("index_dim"))
        w, b = (ctx.w(n) for n in op.attr("index_weight"))
        kw = dict(index_k=a[:, q + c + r:q + c + r + di], index_cache=ctx.pool.index_k[layer], k_norm_w=w,
                  k_norm_b=b, index_eps=op.attr("index_eps"), index_interleaved=op.attr("index_interleaved", True))
    c_q = tt.qkv_norm_rope_write(a[:, :q], a[:, q:q + c + r], pos, ctx.loc, ctx.pool.kv[layer], wq, wkv,
                                 op.attr("eps"), op.attr("theta"), op.attr("interleaved", True),
                                 scaling=op.attr("scaling"), lib=ctx.kernels, **kw)
    return (c_q, layer, layer) if kw else (c_q, layer)


@impl("idx.topk")
def _topk(op, args, ctx: CudaStepContext):
    """Indexer scores over the paged K cache into a [T, max_len] workspace (an eager prefill of long
    runs of tokens per request: the token-block kernel), then exact top-k. The
    value is the selected keys' KV slots (int32 [T, k], -1 padded), which the select kernel writes
    instead of the positions: this target's only readers of a top-k are the attention ops, which
    read KV rows by slot (the torch target's value is the positions; the IR's type is the same).
    A positions operand (fuse-query-rope): the scores kernel turns q by them as it loads it (ctx.pos:
    the step's positions, which the pass requires of them)."""
    q, w, layer = args[:3]
    scores = tt.indexer_scores(q, w, ctx.pool.index_k[layer], ctx.r2t, ctx.rows, ctx.pos, ctx.max_len,
                               lib=ctx.kernels, w_scale=ref.index_head_scale(op), rope=QueryRope.of(op),
                               tiled=ctx.token_runs)   # long prefill runs: token blocks share keys
    return tt.topk_select(scores, ctx.lens, int(op.attr("k")), TOPK_CHUNK, ctx.kernels,
                          slots_of=(ctx.r2t, ctx.rows))


def _absorbed_weights(ctx: CudaStepContext, name, heads, dn, dv):
    """W_UK [H, dn, R] and W_UV^T [H, R, dv] of kv_b_proj, contiguous, made once per runner."""
    def make():
        w = ctx.w(name).view(heads, dn + dv, -1)
        return w[:, :dn].contiguous(), w[:, dn:].transpose(1, 2).contiguous()
    return ctx.derived(("absorbed", name), make)


@impl("attn.mla_absorbed", "attn.sparse_mla", "attn.mla_mha")
def _attn(op, args, ctx: CudaStepContext):
    """Absorbed MLA for every phase (`triton_launch.mla_absorbed`): q_lat = q_nope W_UK (batched GEMM),
    the sparse latent kernel over top-k (or causal) keys, o = out_lat W_UV; with a positions operand
    (fuse-query-rope) the latent kernel turns q_pe as `_topk` turns q. The MHA form of prefill is the
    same function."""
    q_nope, q_pe, layer, topk = args[:4]
    H, dn, dv = q_nope.shape[1], int(op.attr("dn")), int(op.attr("dv"))   # this rank's heads
    w_uk, w_uv = _absorbed_weights(ctx, op.attr("weight"), H, dn, dv)
    slots = topk if topk is not None and topk.dtype == torch.int32 else None   # `_topk`'s slots
    o = tt.mla_absorbed(q_nope, q_pe, w_uk, w_uv, ctx.pool.kv[layer], ctx.r2t, ctx.rows, ctx.pos, topk,
                        op.attr("scale"), num_keys=None if topk is not None else ctx.max_len, slots=slots,
                        lib=ctx.kernels, rope=QueryRope.of(op))
    return o.view(o.shape[0], H * dv)


@impl("moe.gate")
def _gate(op, args, ctx: CudaStepContext):
    """The fp32 router logits: at decode sizes one GEMV kernel, else the narrow GEMM (fp32 products as
    three TF32 ones, K split over programs); x read in its dtype either way."""
    name = op.attr("weight")
    w = ctx.derived(("fp32", name), lambda: ctx.w(name).float().contiguous())
    if gemv_takes(args[0].shape[0], w.shape[0]):
        return tt.gemv(args[0], w, out_dtype=torch.float32, lib=ctx.kernels)
    return tt.narrow_gemm(args[0], w, out_dtype=torch.float32, lib=ctx.kernels)


@impl("moe.topk")
def _moe_topk(op, args, ctx: CudaStepContext):
    name = ctx.gate_bias(op)
    bias = ctx.derived(("fp32", name), lambda: ctx.w(name).float().contiguous())
    return tt.moe_route_logits(args[0], bias, int(op.attr("top_k")), int(op.attr("n_group")),
                               int(op.attr("topk_group")), op.attr("norm_topk_prob"), op.attr("scale"), ctx.kernels)


@impl("moe.experts")
def _experts(op, args, ctx: CudaStepContext):
    x, w, ids = args
    gate, up, down = ctx.experts(op)
    xs, act = None, x.dtype
    if x.dtype == torch.float8_e4m3fn:     # rows an FP8 dispatch delivered, with their scales
        if not isinstance(gate, Fp8Weight):
            raise TypeError(f"{op.results[0]}: the plan dispatches FP8 rows (moe.dispatch dtype=fp8) but this "
                            f"rank's experts are {gate.dtype}, not block FP8: load FP8 weights or recompile")
        xs, act = ctx.routes[op.operands[0] + ".scales"]
    if isinstance(gate, Fp8Weight):
        if xs is None:     # the tokens' own rows (gather lowering): quantised once with the shared expert's
            x, xs = quantized(x, op.operands[0], ctx)
        return tm.moe_experts_fp8(x, ids, w, gate, up, down, expert_offset=ctx.expert_offset(op),
                                  lib=ctx.kernels, x_scales=xs, act_dtype=act, pad=padding_rows(op, ids, ctx),
                                  out_dtype=act)
    return tm.moe_experts(x, ids, w, gate, up, down, expert_offset=ctx.expert_offset(op),
                          tiles=ctx.moe_tiles, lib=ctx.kernels, pad=padding_rows(op, ids, ctx), out_dtype=x.dtype)


def padding_rows(op, ids, ctx: CudaStepContext):
    """(a loc of the experts' rows, the padding slot) where the rows are tokens in order: the step's
    own (one rank's, or all-gathered over attention TP: `loc`) or every DP rank's, all-gathered over
    attention DP (`dp_loc`); padding tokens then run no expert. None for a dispatch's rows."""
    if ctx.graph.producer(op.operands[2]).kind == "moe.dispatch":
        return None
    for loc in (ctx.loc, ctx.dp_loc):
        if loc is not None and ids.shape[0] == loc.shape[0]:
            return loc, ctx.pad_slot
    return None


@impl("mlp.swiglu")
def _swiglu(op, args, ctx: CudaStepContext):
    """down(silu(gate x) * up x) with gate and up as one GEMM over a fused [2I, H] weight (bf16: cuBLAS,
    the silu_mul kernel, cuBLAS)."""
    p = op.attr("weight")
    names = (f"{p}.gate_proj.weight", f"{p}.up_proj.weight")
    if isinstance(ctx.w(names[0]), Fp8Weight):   # FP8: gate/up, SwiGLU + quantise in its split reduction, down
        x = args[0]
        parts, _ = ctx.derived(("fp8_parts", names), lambda: fp8_parts([ctx.w(n) for n in names]))
        hq, hs = tf.fp8_swiglu_quant(*quantized(x, op.operands[0], ctx), [(w.q, w.scale_inv, gap) for _, w, gap in parts],
                                     x.dtype, ctx.kernels)
        down = ctx.w(f"{p}.down_proj.weight")
        return tf.fp8_block_gemm(hq, hs, down.q, down.scale_inv, x.dtype, ctx.kernels)
    gate_up = ctx.derived(("gate_up", p), lambda: torch.cat([ctx.w(f"{p}.gate_proj.weight"),
                                                            ctx.w(f"{p}.up_proj.weight")]))
    return _mm(tt.silu_mul(_mm(args[0], gate_up), ctx.kernels), ctx.w(f"{p}.down_proj.weight"))


def _exchange(op, buf, valid, ctx: CudaStepContext, kind: str, nbytes: int):
    """The fixed-capacity MoE exchange of `buf` [n x C, W] (chunk q to rank q) -> (what arrived,
    recv_valid or None). Where the plan's threshold allows (`nbytes`, the bill's message: the whole
    buffer in the plan's dtypes) and the group's peers mapped: the one-shot kernel, which moves only
    the rows with `valid` [n x C] set and says which arrived (recv_valid [n x C] int32); else NCCL's
    all_to_all_single of the whole buffer (recv_valid None: every row arrived)."""
    limit, n = op.attr("p2p_max_bytes"), int(op.attr("size"))
    C = buf.shape[0] // n
    if limit is not None and C and nbytes <= int(limit):
        cap = int(limit) // (nbytes // (n * C)) // n          # chunk rows the limit allows
        ch = ctx.comm.peer_channel(torch_target._axes(op), "exchange", buf.shape[1] * buf.element_size(), cap,
                                   buf.device)
        if ch is not None and tp2p.fits(ch, C, buf.shape[1], buf.dtype):
            ctx.comm.count(kind, nbytes, p2p=True)
            return tp2p.p2p_all_to_all(buf, valid, ch, ctx.kernels)
    return ctx.comm.all_to_all_equal(buf, torch_target._axes(op), kind, nbytes), None


@impl("moe.dispatch")
def _dispatch(op, args, ctx: CudaStepContext):
    """The a2a MoE lowering, capture-safe: every rank has a fixed buffer of T*k slots for each peer
    (no host sync); row (t, j) takes the next free slot of the buffer of the rank holding its
    expert, unused slots carry expert id -1 (the experts kernel drops them). The payload travels
    bit-exact in one byte message (NCCL has no int16): x, the fp32 weight, the int32 expert id.
    With the plan's dtype=fp8 (FP8 experts, DeepEP's FP8 dispatch) x travels quantised: e4m3 rows
    and their fp32 scale per 128 columns, exactly what the experts kernel would make of x itself;
    the rows come out e4m3 (the plan's type) and the experts take them with their scales.
    Over peer memory only the used slots travel (their valid bits ride on the kernel's flags), and
    the slots that did not arrive get id -1 here; NCCL moves the whole buffer.
    Counted with the plan's (payload) bytes, as the torch target counts."""
    x, w, ids = args
    n, k = int(op.attr("size")), ids.shape[1]
    cap = x.shape[0] * k
    dest = (ids // (ctx.num_experts // n)).reshape(-1)
    slot = (F.one_hot(dest, n).cumsum(0) - 1).gather(1, dest[:, None]).squeeze(1)
    pos = dest * cap + slot                                   # row of the [n * cap] send buffer
    fp8 = op.attr("dtype") == "fp8"
    if fp8:
        xq, xs = tf.quantize_tokens(x, ctx.kernels)
        x_bits = torch.cat([xq.view(torch.uint8), xs.view(torch.uint8)], 1).repeat_interleave(k, 0)
    else:
        x_bits = x.repeat_interleave(k, 0).view(torch.uint8)  # element bytes of x
    hx = x_bits.shape[1]
    bits = torch.cat([x_bits, w.reshape(-1, 1).float().view(torch.uint8),
                      ids.reshape(-1, 1).to(torch.int32).view(torch.uint8)], dim=1)
    send = torch.zeros(n * cap, bits.shape[1], dtype=torch.uint8, device=x.device)
    send[:, -4:] = 255                                         # expert id -1: an empty slot
    send[pos] = bits
    valid = torch.zeros(n * cap, dtype=torch.int32, device=x.device)
    valid[pos] = 1
    nbytes = sum(t.payload_bytes({"T": x.shape[0]}) for t in op.types) * n
    got, recv = _exchange(op, send, valid, ctx, "dispatch", nbytes)
    got_ids = got[:, hx + 4:].contiguous().view(torch.int32)
    if recv is not None:
        got_ids = torch.where(recv[:, None] != 0, got_ids, -1)
    ctx.routes[op.results[0]] = (pos, (got_ids[:, 0] >= 0).to(torch.int32))   # the combine sends those back
    if fp8:
        h = x.shape[1]
        dx = got[:, :h].contiguous().view(torch.float8_e4m3fn)
        ctx.routes[op.results[0] + ".scales"] = (got[:, h:hx].contiguous().view(torch.float32), x.dtype)
    else:
        dx = got[:, :hx].contiguous().view(x.dtype)
    return dx, got[:, hx:hx + 4].contiguous().view(torch.float32), got_ids.long()


@impl("moe.combine")
def _combine(op, args, ctx: CudaStepContext):
    """Expert outputs back to their tokens' ranks (the same fixed buffers; over peer memory only the
    slots that arrived in the dispatch), each token's k summed."""
    y, like = args
    pos, used = ctx.routes[op.operands[0] + ".dx"]
    n, k = int(op.attr("size")), int(op.attr("top_k"))
    nbytes = like.shape[0] * k * y.shape[1] * DTYPE_BYTES[ctx.type_of(op.operands[0]).dtype] * n
    back, _ = _exchange(op, y, used, ctx, "combine", nbytes)
    return back[pos].view(like.shape[0], k, -1).float().sum(1).to(y.dtype)


@impl("sample.tokens")
def _sample(op, args, ctx: CudaStepContext):
    """The sampler at its defaults, greedy (runtime/engine/sampling.py); the engine samples the
    returned logits with each request's parameters."""
    return tt.sample_greedy(args[0], ctx.kernels)
