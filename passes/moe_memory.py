"""What the CUDA target's MoE ops allocate: the router, the row alignment, the experts' buffers,
the a2a lowering's dispatch and combine.

Replays `cuda_target._gate` / `_moe_topk` / `_experts` / `_dispatch` / `_combine` and
`triton_moe.align_rows`, `moe_experts[_fp8]` on a `step_arena.Arena` (see `op_memory.py` for the
conventions). The dispatch and combine follow the code (NCCL's all_to_all_single into an
`empty_like`, or the peer-memory exchange and its recv_valid), unmeasured: the CPU tests run one rank.
"""
from __future__ import annotations

from glmc.ir.types import fp8_row_bytes
from glmc.target import (ALIGN_MAX_EXPERTS, ALIGN_ROWS, FP8_BLOCK, block_m_for, gemv_takes,
                         moe_splits, narrow_splits)

from .comm_memory import p2p_runs
from .op_memory import quantize, quantized
from .step_arena import Step, Val, model


# ----------------------------------------------------------------------------- MoE
@model("moe.gate")
def _gate(op, args, s):
    """fp32 logits; past the gemv kernel's rows the narrow GEMM's fp32 partials when it splits K
    (both read x as it is)."""
    T, E = s.rows(op), int(op.attr("experts"))
    out = s.arena.new(s.numel(op), 4)
    if not gemv_takes(T, E):
        splits = narrow_splits(T, E, int(op.attr("hidden")), s.t.num_sms)
        if splits > 1:
            s.free(s.tmp(splits * T * E, 4))
    return out


@model("moe.topk")
def _moe_topk(op, args, s):
    n = s.numel(op)
    return s.arena.new(n, 4), s.arena.new(n, 8)


def align_rows(s: Step, n: int, E: int, bm: int) -> tuple[int, int, int]:
    """triton_moe.align_rows over n routed rows and E local experts, its temporaries in order;
    -> (sorted_rows, block_expert, blocks)."""
    flat = s.tmp(n, 8)
    ge, lt = s.tmp(n, 1), s.tmp(n, 1)
    local = s.tmp(n, 1)
    s.free(ge, lt)
    e = s.tmp(n, 8)
    s.free(local)
    counts, ones = s.tmp(E + 1, 8), s.tmp(n, 8)
    s.free(ones)
    p1 = s.tmp(E + 1, 8)
    p2 = s.tmp(E + 1, 8)
    s.free(p1)
    p3 = s.tmp(E + 1, 8)
    s.free(p2)
    padded = s.tmp(E + 1, 8)
    s.free(p3)
    values, order = s.tmp(n, 8), s.tmp(n, 8)                  # argsort = sort(stable): values dropped
    s.free(values)
    e_sorted = s.tmp(n, 8)
    cs = s.tmp(E + 1, 8)
    starts = s.tmp(E + 1, 8)
    s.free(cs)
    ends = s.tmp(E + 1, 8)
    a1, a2 = s.tmp(n, 8), s.tmp(n, 8)                         # ends[e] - padded[e] + arange - starts[e]
    a3 = s.tmp(n, 8)
    s.free(a1, a2)
    a4 = s.tmp(n, 8)
    a5 = s.tmp(n, 8)
    s.free(a3, a4)
    a6 = s.tmp(n, 8)
    dest = s.tmp(n, 8)
    s.free(a5, a6)
    nb = -(-n // bm) + min(E, n)
    lt_e = s.tmp(n, 1)
    dest2 = s.tmp(n, 8)
    s.free(lt_e, dest)
    sorted_rows = s.tmp(nb * bm + 1, 4)
    s.free(s.tmp(n, 4))                                       # order.to(int32), scattered
    ar = s.tmp(nb, 8)
    block_start = s.tmp(nb, 8)
    s.free(ar)
    found = s.tmp(nb, 8)
    lt_b = s.tmp(nb, 1)
    masked = s.tmp(nb, 8)
    s.free(lt_b)
    block_expert = s.tmp(nb, 4)
    s.free(masked, found)
    s.free(flat, e, counts, padded, order, e_sorted, starts, ends, dest2, block_start)
    return sorted_rows, block_expert, nb


def _partials(splits: int, rows: int, cols: int) -> int:
    """triton_moe._partials: fp32 [splits, rows rounded up to 16, cols] elements."""
    return splits * -(-rows // 16) * 16 * cols


@model("moe.experts")
def _experts(op, args, s):
    """out [T, H] in the activations' dtype; the row alignment (one moe_align launch's two outputs at
    decode sizes, else the torch ops'); (FP8: x quantised) h [blocks x BM, inter]; split K: fp32
    gate/up partials; fp32 per-routed-row outputs y [splits, T k, H], summed into out by moe_combine
    (which rounds as it stores: no cast)."""
    H = int(op.attr("hidden"))
    E = int(op.attr("experts")) // int(op.attr("ep", 1))
    inter = int(op.attr("inter")) // int(op.attr("moe_tp", 1))
    ids = s.type_of(op.operands[2]).shape                    # [tokens, k]; a2a: [received rows, 1]
    rows, k = ids[0].eval(s.env), ids[1].eval(s.env)
    n = rows * k
    src = s.graph.producer(op.operands[0])                  # e4m3 rows from an FP8 dispatch, scales with them
    pre = src.kind == "moe.dispatch" and src.attr("dtype") == "fp8"
    act = s.t.act if pre else args[0].elem
    out = s.tmp(rows * H, act)
    if not rows:
        return Val(out, act)
    bm = block_m_for(n, E)
    if n <= ALIGN_ROWS and E <= ALIGN_MAX_EXPERTS:
        nb = -(-n // bm) + min(E, n)
        sorted_rows, block_expert = s.tmp(nb * bm, 4), s.tmp(nb, 4)
    else:
        sorted_rows, block_expert, nb = align_rows(s, n, E, bm)
    s1, s2 = moe_splits(n, E, H, inter, s.t.num_sms, s.t.fp8_weights, bm)
    work = []
    if s.t.fp8_weights:
        if not pre:
            quantized(s, op.operands[0], rows, H)
        work += [s.tmp(nb * bm * inter, 1),
                 s.tmp(nb * bm * -(-inter // FP8_BLOCK), 4)]
    else:
        work.append(s.tmp(nb * bm * inter, args[0].elem))
    if s1 > 1:
        work.append(s.tmp(_partials(s1, nb * bm, 2 * inter), 4))
    y = s.tmp(_partials(s2, n, H), 4)
    s.free(sorted_rows, block_expert, y, *work)
    return Val(out, act)


# ----------------------------------------------------------------------------- a2a lowering
@model("moe.dispatch")
def _dispatch(op, args, s):
    """cuda_target._dispatch: each (token, expert) row's slot per peer (one-hot cumsum), the payload
    packed as bytes (x rows, fp32 weight, int32 id), the [n T k] send buffer and what came back,
    unpacked; the rows' buffer positions stay (ctx.routes, read by the combine) to the step's end."""
    x, (T, H) = args[0], (d.eval(s.env) for d in s.type_of(op.operands[0]).shape)
    k, n = int(op.attr("top_k")), int(op.attr("size"))
    cap = T * k
    fp8 = op.attr("dtype") == "fp8"                           # x quantised: e4m3 + fp32 per 128 columns
    groups = -(-H // FP8_BLOCK)
    row = fp8_row_bytes(H) if fp8 else H * x.elem
    width = row + 8
    dest = s.tmp(cap, 8)
    hot = s.tmp(cap * n, 8)
    cum = s.tmp(cap * n, 8)
    s.free(hot)
    less = s.tmp(cap * n, 8)
    s.free(cum)
    slot = s.tmp(cap, 8)
    s.free(less)
    scaled = s.tmp(cap, 8)
    s.tmp(cap, 8)                                             # pos: kept in ctx.routes
    s.free(scaled)
    quant = [*quantize(s, T, H), s.tmp(T * row, 1)] if fp8 else []   # + their bytes side by side
    ar = s.tmp(T, 8)
    index = s.tmp(cap, 8)
    x_bits = s.tmp(cap * row, 1)                              # repeat_interleave: index_select of an index
    s.free(ar, index, *quant)
    id32 = s.tmp(cap, 4)
    bits = s.tmp(cap * width, 1)
    send = s.tmp(n * cap * width, 1)
    valid = s.tmp(n * cap, 4)
    got = s.tmp(n * cap * width, 1)
    recv = s.tmp(n * cap, 4) if p2p_runs(op, s) else None    # the kernel's recv_valid
    di32 = s.tmp(n * cap, 4)
    if recv is not None:                                      # torch.where(recv != 0, ids, -1)
        ne = s.tmp(n * cap, 1)
        masked = s.tmp(n * cap, 4)
        s.free(ne, di32)
        di32 = masked
    ge = s.tmp(n * cap, 1)
    s.tmp(n * cap, 4)                                         # the used slots: kept in ctx.routes
    s.free(ge)
    if fp8:
        s.tmp(n * cap * groups, 4)                            # the rows' scales: kept (ctx.routes) for the experts
    dx = s.arena.new(n * cap * H, 1 if fp8 else x.elem)
    dw = s.arena.new(n * cap, 4)
    di = s.arena.new(n * cap, 8)
    s.free(di32, dest, slot, x_bits, id32, bits, send, valid, got, recv)
    return dx, dw, di


@model("moe.combine")
def _combine(op, args, s):
    """cuda_target._combine: the experts' rows back (the same fixed buffers), each token's k rows
    gathered, summed in fp32, cast back."""
    y, T = args[0], s.rows(op)
    k, H = int(op.attr("top_k")), s.type_of(op.operands[0]).shape[1].eval(s.env)
    back = s.tmp(s.type_of(op.operands[0]).numel(s.env), y.elem)
    recv = s.tmp(s.type_of(op.operands[0]).shape[0].eval(s.env), 4) if p2p_runs(op, s) else None
    rows = s.tmp(T * k * H, y.elem)
    f32 = s.tmp(T * k * H, 4)
    s.free(rows)
    summed = s.tmp(T * H, 4)
    s.free(f32)
    out = s.arena.new(T * H, y.elem)
    s.free(summed, back, recv)
    return out
