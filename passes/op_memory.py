"""What each op of the CUDA target allocates, in the order its implementation allocates and frees.

One function per op kind replays `codegen/cuda_target.py` (and the launch wrappers it calls:
`triton_launch`, `triton_fp8`; the MoE ops are in `moe_memory.py`, the collectives in
`comm_memory.py`) as tensor allocations on a `step_arena.Arena`: every `torch.empty` / op output
that gets new storage is an `alloc`, every temporary that dies (a Python reference dropped) a
`free`, views allocate nothing. Results stay
allocated (the executor holds them). Runtime dtypes are the target's, not the IR's: activations in
the compute dtype (bf16, or fp32 for an fp32 checkpoint), the indexer's and the router's ids int64,
router logits and MoE partial sums fp32. Launch-time choices the target makes from the device
(flash-decoding splits from the SM count) come from `Target.num_sms`.

Not modelled (not tensors): cuBLAS and sort workspaces inside aten kernels, Triton's own scratch.
Kinds without a model (`MODELS`) are counted at their IR result bytes (`generic`): exact for
ops that allocate their result and nothing else; `step_memory` reports which kinds it guessed.
Tile tables and launch rules come from the one target description both sides read (`glmc.target`).
"""
from __future__ import annotations

from glmc.ir import Op

from glmc.target import (ARGMAX_SPLITS, FP8_BLOCK, FP8_KINDS, INDEXER_BLOCK_N, NORM_QUANT_ROWS, TOPK_CHUNK,
                         UNQUANTISED, fp8_gemm_rows, fp8_gemm_splits, gemv_takes, mla_num_splits, mla_tiles,
                         mla_v_parts, mla_wide, topk_segment)

from .step_arena import Step, Val, model


# ----------------------------------------------------------------------------- views and elementwise
@model("io.input")
def _input(op, args, s):
    return s.feeds[op.attr("name")]


@model("tensor.slice")
def _slice(op, args, s):
    x = args[0]
    whole = int(op.attr("dim")) == 0
    return Val(x.buf, x.elem, x.dense and whole)


@model("tensor.view")
def _view(op, args, s):
    x = args[0]
    return Val(x.buf, x.elem, True) if x.dense else s.arena.new(s.numel(op), x.elem)   # reshape copies


@model("tensor.select_last")
def _select_last(op, args, s):
    return s.arena.new(s.numel(op), args[0].elem)


@model("elt.add", "tensor.concat")
def _elementwise(op, args, s):
    return s.arena.new(s.numel(op), max(a.elem for a in args))


@model("embed.lookup")
def _embed(op, args, s):
    if int(op.attr("tp", 1)) == 1:
        return s.arena.new(s.numel(op), s.t.act)
    T, n = s.rows(op), s.numel(op)
    local = s.tmp(T, 8)                                       # ids - first row
    ge, lt = s.tmp(T, 1), s.tmp(T, 1)
    hit = s.tmp(T, 1)
    s.free(ge, lt)
    clamped = s.tmp(T, 8)
    rows = s.tmp(n, s.t.act)
    s.free(clamped)
    mask = s.tmp(T, s.t.act)
    out = s.arena.new(n, s.t.act)
    s.free(rows, mask, local, hit)
    return out


@model("rope.apply")
def _out_like(op, args, s):
    return s.arena.new(s.numel(op), args[0].elem)


def _norm_quantises(op, s: Step) -> None:
    """cuda_target._norm_quantises: a norm whose output an FP8 GEMM reads quantises it too (held
    with the value, `quantized`)."""
    value = op.results[0]
    for u in s.graph.users(value):
        names = u.attr("weight") if isinstance(u.attr("weight"), tuple) else (u.attr("weight"),)
        if u.operands[0] == value and u.kind in FP8_KINDS and (
                u.kind in ("mlp.swiglu", "moe.experts") or any(_is_fp8(u, n, s) for n in names)):
            if s.t.fp8_weights and s.rows(op) <= NORM_QUANT_ROWS:   # else the first FP8 consumer does
                quantized(s, value, s.rows(op), s.numel(op) // max(1, s.rows(op)))
            return


@model("norm.rms")
def _rms(op, args, s):
    out = s.arena.new(s.numel(op), args[0].elem)
    _norm_quantises(op, s)
    return out


@model("fused.add_rms")
def add_rms(op, args, s):
    """The add + RMS norm kernel (also after a collective that did not run one-shot: comm_memory):
    the residual and the normed rows in the input's dtype, the FP8 quantisation where it is read;
    a third operand (the folded add's) is read in place."""
    res = s.arena.new(s.numel(op, 1), max(a.elem for a in args))
    out = s.arena.new(s.numel(op), args[0].elem)
    _norm_quantises(op, s)
    return out, res


@model("fused.qkv_a_norm_rope_write", "fused.qkv_a_norm_rope_write_index")
def _qkv_write(op, args, s):
    c_q = s.arena.new(s.numel(op), args[0].elem)
    return (c_q, None, None) if op.kind.endswith("_index") else (c_q, None)


# ----------------------------------------------------------------------------- GEMMs
def _is_fp8(op: Op, name: str, s: Step) -> bool:
    return s.t.fp8_weights and op.kind in FP8_KINDS and not name.endswith(UNQUANTISED)


def _plain_runs(op: Op, s: Step, rows: list[int]) -> list[int]:
    """Rows of each run of consecutive plain (not FP8) weights among the op's row parts
    (`cuda_target.fp8_parts` concatenates such a run into one bf16 GEMM)."""
    names = op.attr("weight") if isinstance(op.attr("weight"), tuple) else (op.attr("weight"),)
    runs, last = [], True
    for name, r in zip(names, rows):
        if _is_fp8(op, name, s):
            last = True
        elif last:
            runs.append(r)
            last = False
        else:
            runs[-1] += r
    return runs


def _fp8_gemm_widths(op: Op, s: Step, rows: list[int]) -> list[int]:
    """Output rows of each FP8 GEMM `cuda_target.fp8_parts` makes of the op's row parts (runs of
    FP8 weights, joined by `fp8_row_groups`)."""
    names = op.attr("weight") if isinstance(op.attr("weight"), tuple) else (op.attr("weight"),)
    widths, run = [], []
    for name, r in [*zip(names, rows), (None, 0)]:
        if name is not None and _is_fp8(op, name, s):
            run.append(r)
            continue
        widths += [n for n, _ in fp8_gemm_rows(run)]
        run = []
    return widths


def quantize(s: Step, rows: int, cols: int) -> tuple[int, int]:
    """triton_fp8.quantize_tokens: e4m3 [rows, cols] + fp32 scales [rows, cols / 128]."""
    return s.tmp(rows * cols, 1), s.tmp(rows * -(-cols // FP8_BLOCK), 4)


def quantized(s: Step, value: str, rows: int, cols: int) -> None:
    """cuda_target.quantized: the value's quantisation, made by its first FP8 consumer and held
    with the value until it dies (`step_memory`)."""
    if value not in s.memo:
        s.memo[value] = quantize(s, rows, cols)


def parts_mm(s: Step, value: str, rows: int, cols: int, width: int, plain: list[int], fp8: list[int]) -> Val:
    """cuda_target._parts_mm: x (`value`) quantised once per step, one [rows, width] output, each
    plain run's bf16 GEMM (past the gemv kernel's rows through a temporary copied into its columns), each
    FP8 GEMM that splits K through fp32 partials [splits, rows, n] (`fp8_gemm_splits`)."""
    quantized(s, value, rows, cols)
    y = s.arena.new(rows * width, s.t.act)
    for r in plain:
        if not gemv_takes(rows, r):       # cuBLAS into a temporary (the gemv kernel writes the columns)
            s.free(s.tmp(rows * r, s.t.act))
    for n in fp8:
        splits = fp8_gemm_splits(rows, n, cols, s.t.num_sms)
        if splits > 1:
            s.free(s.tmp(splits * rows * n, 4))
    return y


def _row_parts(op: Op, s: Step) -> list[int]:
    """Output rows of each weight of a linear / A-projection, in the order of `weight`."""
    w = op.attr("weight")
    if not isinstance(w, tuple):
        return [s.numel(op) // max(1, s.rows(op))]
    cfg = s.cfg
    rows = {"q_a_proj.weight": cfg.q_lora_rank, "kv_a_proj_with_mqa.weight": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
            "indexer.wk.weight": cfg.index_head_dim, "indexer.weights_proj.weight": cfg.index_n_heads}
    return [next(v for k, v in rows.items() if n.endswith(k)) for n in w]


@model("linear", "mla.a_proj", "lm.head")
def _linear(op, args, s):
    names = op.attr("weight") if isinstance(op.attr("weight"), tuple) else (op.attr("weight"),)
    if not any(_is_fp8(op, n, s) for n in names):
        return mm(s, args[0], s.type_of(op.operands[0]).numel(s.env), s.numel(op))   # one cuBLAS GEMM
    rows = s.rows(op)
    parts = _row_parts(op, s)
    return parts_mm(s, op.operands[0], rows, int(op.attr("in_features")), s.numel(op) // max(1, rows),
                    _plain_runs(op, s, parts), _fp8_gemm_widths(op, s, parts))


@model("mlp.swiglu")
def _swiglu(op, args, s):
    """bf16: one gate|up GEMM, the silu_mul kernel, down. FP8 (triton_fp8.fp8_swiglu_quant): x quantised
    (once per step),
    each gate/up GEMM's fp32 partials [splits, T, n] (one split too), h quantised by their reduction,
    then the down GEMM."""
    T, hidden, inter = s.rows(op), int(op.attr("hidden")), int(op.attr("inter")) // int(op.attr("tp", 1))
    if s.t.fp8_weights:
        quantized(s, op.operands[0], T, hidden)
        parts = [s.tmp(fp8_gemm_splits(T, n, hidden, s.t.num_sms) * T * n, 4)
                 for n, _ in fp8_gemm_rows([inter, inter])]
        hq, hs = quantize(s, T, inter)
        s.free(*parts)
        out = s.arena.new(T * hidden, s.t.act)
        splits = fp8_gemm_splits(T, hidden, inter, s.t.num_sms)
        if splits > 1:
            s.free(s.tmp(splits * T * hidden, 4))
        s.free(hq, hs)
        return out
    gu = mm(s, args[0], T * hidden, T * 2 * inter)
    h = s.tmp(T * inter, s.t.act)                 # silu_mul
    s.free(gu.buf)
    out = s.arena.new(T * hidden, s.t.act)
    s.free(h)
    return out


def mm(s: Step, x: Val, x_numel: int, out_numel: int) -> Val:
    """cuda_target._mm: x cast to the weights' (compute) dtype when it differs, one cuBLAS GEMM."""
    cast = s.tmp(x_numel, s.t.act) if x.elem != s.t.act else None
    out = s.arena.new(out_numel, s.t.act)
    s.free(cast)
    return out


# ----------------------------------------------------------------------------- indexer and attention
@model("idx.topk")
def _topk(op, args, s):
    """The [T, width] fp32 score workspace (the head weights scaled in the kernel), the top-k
    select's buffers (a row wider than TOPK_CHUNK: radix histograms per segment); -> the int32 KV
    slots [T, k] the select writes instead of positions (cuda_target._topk's value)."""
    T, k = s.rows(op), int(op.attr("k"))
    width = -(-s.t.max_len // INDEXER_BLOCK_N) * INDEXER_BLOCK_N
    scores = s.tmp(T * width, 4)
    out = Val(s.arena.alloc(T * k * 4), 4, cols=k)
    if T and width > TOPK_CHUNK:
        n = -(-width // topk_segment(T, width))
        s.free(s.tmp(T * 4 * n * 256, 4), s.tmp(T * 8, 4), s.tmp(T * n, 4))   # hist, state, gt
    s.free(scores)
    return out


def mla_splits(T: int, H: int, R: int, topk: int | None, s: Step) -> int:
    """SparseMlaDecodeCtx.make's head block, output parts and warps for T tokens, then mla_num_splits
    at the target's SMs."""
    wide = mla_wide(T, H, s.t.kv_fp8)
    block_h, block_n, num_warps = mla_tiles(wide)
    v_parts = mla_v_parts(T, H, R, s.t.kv_fp8)
    num_keys = topk if topk is not None else s.t.max_len
    return mla_num_splits(T, H, block_h, num_keys, block_n, s.t.num_sms, v_parts, num_warps)


def topk_slots(s: Step, T: int, K: int) -> int:
    """triton_launch.topk_slots: masks, the clamped positions, the gathered int64 slots and the
    masked copy, -> int32 slots [T, K]."""
    ge, le = s.tmp(T * K, 1), s.tmp(T * K, 1)
    valid = s.tmp(T * K, 1)
    s.free(ge, le)
    clamped = s.tmp(T * K, 8)
    slots = s.tmp(T * K, 8)
    s.free(clamped)
    masked = s.tmp(T * K, 8)
    out = s.tmp(T * K, 4)
    s.free(valid, slots, masked)
    return out


@model("attn.mla_absorbed", "attn.sparse_mla", "attn.mla_mha")
def _attn(op, args, s):
    """q_lat = q_nope W_UK, split-K partials (fp32 [T, H, splits, R], none with one split, + log-sum-exp),
    out_lat, o = out_lat W_UV written as [T, H * dv] by the batched GEMM."""
    T, H = s.rows(op), s.type_of(op.operands[0]).shape[1].eval(s.env)    # this rank's heads
    R, dv = int(op.attr("kv_lora")), int(op.attr("dv"))
    K = None if len(args) < 4 or args[3] is None else args[3].cols or s.cfg.index_topk
    dn = s.type_of(op.operands[0]).shape[2].eval(s.env)
    cast = s.tmp(T * H * dn, s.t.act) if args[0].elem != s.t.act else None   # q_nope.to(W_UK's dtype)
    q_lat = s.tmp(T * H * R, s.t.act)
    s.free(cast)
    pe = s.tmp(s.type_of(op.operands[1]).numel(s.env), s.t.act) if args[1].elem != s.t.act else None
    S = mla_splits(T, H, R, K, s)
    o_part, lse = s.tmp(T * H * S * R, 4) if S > 1 else None, s.tmp(T * H * S, 4)   # one split: no partials
    out_lat = s.tmp(T * H * R, s.t.act)
    if T:
        slots = topk_slots(s, T, K) if K is not None and args[3].elem != 4 else None   # int32: slots already
        s.free(o_part, lse, slots)
    s.free(pe)
    out = s.arena.new(T * H * dv, s.t.act)
    s.free(q_lat, out_lat)
    return out


# ----------------------------------------------------------------------------- sampling
@model("sample.tokens")
def _sample(op, args, s):
    """triton_launch.sample_greedy: ids [B] int64, then the split argmax's partials (fp32 and int32
    [B, ARGMAX_SPLITS]) and done-counters (int32 [B])."""
    B = s.rows(op)
    out = s.arena.new(B, 8)
    s.free(s.tmp(B * ARGMAX_SPLITS, 4), s.tmp(B * ARGMAX_SPLITS, 4), s.tmp(B, 4))
    return out
