"""Triton MoE experts: token permutation by expert, grouped SwiGLU GEMMs, weighted combine.

`moe_experts(x, ids, weights, w_gate, w_up, w_down, expert_offset=0)` has `torch_ref.moe_experts`'s
contract (y_t = sum over the chosen experts held here of w_te * swiglu_e(x_t); fp32 [T, H]) and runs as

1. `align_rows` (no host sync, so it can be captured in a CUDA graph): the T*k routed rows are sorted
   by expert and each expert's run is padded to a multiple of BLOCK_M, so one program block never
   mixes experts. The grid is the static upper bound cdiv(T*k, BM) + min(E, T*k) blocks; blocks past
   the real end carry expert -1 and exit at once. At decode sizes one `moe_align.py.j2` launch does
   it (~35 small torch kernels otherwise: tens of us at one token, against ~130 us of weight reads).
2. `moe_experts.py.j2` with down=False: gate and up GEMMs of a block share its activation tile,
   SiLU-and-mul is applied in registers, h is written once (in x's dtype, as HF rounds it).
3. the same template with down=True: h @ W_down^T, scaled by the routing weight, written per routed
   row; `moe_combine.py.j2` then sums each token's k slots (deterministic: no atomics).

Split K (`moe_launch`): at a few rows per expert (decode) the grid of 2 would leave SMs idle behind
long serial K loops, so a stage may split K into S runs, one per program along grid axis 2: the gate/up
stage then writes fp32 partial gate and up sums and `moe_swiglu_reduce.py.j2` adds them in split order
before SiLU-and-mul (SiLU is not linear: it must see the full sums); the down stage writes S partial y
that the combine sums with the k slots. Every sum has a fixed order and no atomics: the same bits on
every run. S is a kernel argument (not specialised), so one binary serves every S.

`moe_experts_fp8` is the same pipeline on block-FP8 expert stacks (`MoeExpertsFp8Ctx`).
Weights are [E, out, in] stacks (HF layout); gate and up may be views of HF's fused gate_up tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from glmc.codegen.triton_render import _DOT, FP8_DOT_PROMOTE, JIT, KernelLibrary, fp8_promote, next_pow2, sm_count
from glmc.target import (ALIGN_MAX_EXPERTS, ALIGN_ROWS, BLOCK_MS, MOE_SPLIT_BLOCK_M, MOE_SPLIT_DTYPES, block_m_for,
                         moe_block_n, moe_splits)

_ACT = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16"}


@dataclass(frozen=True)
class MoeExpertsCtx:
    """moe_experts.py.j2: one (row block, output tile[, K split]) per program; `down` picks the stage,
    `split` the split-K form (fp32 partials over a runtime number of K runs; see `moe_launch`)."""
    template: ClassVar[str] = "moe_experts"
    down: bool
    split: bool
    n_in: int
    n_out: int
    top_k: int
    block_m: int
    block_n: int
    block_k: int
    k_steps: int
    dot_dtype: str
    dot_precision: str
    num_warps: int
    num_stages: int

    @classmethod
    def make(cls, down, n_in, n_out, top_k, dtype, block_m, split=False, block_n=None, block_k=None, num_warps=None,
             num_stages=None):
        dot_dtype, precision = _DOT[dtype]
        block_n = block_n or moe_block_n(block_m, n_out)
        block_k = block_k or min(128 if block_m <= 16 else 64, max(16, next_pow2(n_in)))
        num_warps = num_warps or (4 if block_m * block_n <= 16 * 128 else 8)
        return cls(bool(down), bool(split), int(n_in), int(n_out), int(top_k), int(block_m), int(block_n),
                   int(block_k), -(-int(n_in) // int(block_k)), dot_dtype, precision, num_warps, num_stages or 4)

    @classmethod
    def variants(cls, hidden, inter, top_k, dtype) -> list:
        """Every context `moe_experts` makes without tile overrides: both stages at every row-block class
        (`BLOCK_MS`), their split-K forms at the decode class (`MOE_SPLIT_BLOCK_M`, the only one `moe_launch`
        splits) with the split gate/up stage's reduction where bf16 experts split (`MOE_SPLIT_DTYPES`), the
        one-program sort and the combine."""
        splits = "bf16" in MOE_SPLIT_DTYPES
        stages = [cls.make(down, *((inter, hidden) if down else (hidden, inter)), top_k, dtype, bm, split)
                  for bm in BLOCK_MS for split in ((False, True) if bm == MOE_SPLIT_BLOCK_M and splits else (False,))
                  for down in (False, True)]
        reduce = [MoeSwigluReduceCtx.make(inter, MOE_SPLIT_BLOCK_M, dtype, fp8=False)] if splits else []
        return stages + reduce + glue_variants(hidden, top_k)


@dataclass(frozen=True)
class MoeSwigluReduceCtx:
    """moe_swiglu_reduce.py.j2: h = silu(sum of gate partials) * (sum of up partials) after a split-K
    gate/up stage, splits summed in a fixed order; `fp8`: h then quantised per row per 128 columns for
    the FP8 down stage (block_n is then one 128-column group)."""
    template: ClassVar[str] = "moe_swiglu_reduce"
    inter: int
    block_m: int
    block_n: int
    fp8: bool
    act_dtype: str
    num_warps: int

    @classmethod
    def make(cls, inter, block_m, dtype, fp8):
        block_n = 128 if inter >= 128 else max(16, next_pow2(inter))
        return cls(int(inter), int(block_m), block_n, bool(fp8), _ACT[dtype], 4)


# moe_align's (up to this many routed rows, rows per program, warps), from bench/glue_micro.py on an H200
# (2026-12-03, top-8 of 256 experts): 16 rows per program at 4 warps, 6.1 / 5.9 / 7.6 / 7.8 us at 8 / 64 /
# 256 / 1024 rows (32 rows: 7.0 / 7.1 / 8.4 / 8.6; 2 or 8 warps slower), against the torch ops' 61.6 /
# 63.9 / 87.0 / 96.6. The one-program kernel before it (each row walked twice by one program) took 6.5 /
# 9.6 / 25.3 / 73.8 (2026-12-02). The classes differ in how many rows each program counts.
# The class up to ALIGN_ROWS (4096: a dp8ep8 rank's 32 requests gathered over 8 ranks, or 512 tokens of
# a prefill chunk, at top-8) is not measured yet: each program counts every row, as the others do.
ALIGN_TILES = ((64, 16, 4), (1024, 16, 4), (ALIGN_ROWS, 32, 8))


@dataclass(frozen=True)
class MoeAlignCtx:
    """moe_align.py.j2: `align_rows` in one launch of cdiv(rows, `rows`) programs over <= `experts_block`
    local experts and <= `all_rows` routed rows (row and expert counts and the row block, a multiple
    of `pad_chunk`, are kernel arguments: one binary for every step of the class and every block)."""
    template: ClassVar[str] = "moe_align"
    rows: int
    all_rows: int
    experts_block: int
    blocks_block: int
    fill: int
    pad_chunk: int
    num_warps: int

    @classmethod
    def make(cls, rows=None, num_warps=None, num_rows=1):
        """The row class of `num_rows` (ALIGN_TILES); `rows`, `num_warps` override its tile."""
        top, chunk, warps = next((t for t in ALIGN_TILES if num_rows <= t[0]), ALIGN_TILES[-1])
        if num_rows > top:
            raise ValueError(f"moe_align: {num_rows} routed rows is more than its largest class {top}")
        return cls(int(rows or chunk), next_pow2(top), ALIGN_MAX_EXPERTS, 128, 256, min(BLOCK_MS),
                   int(num_warps or warps))

    def grid(self, num_rows: int) -> tuple:
        return (max(1, -(-int(num_rows) // self.rows)),)


@dataclass(frozen=True)
class MoeCombineCtx:
    """moe_combine.py.j2: out[t] = the sum of y over the K splits and the token's local slots."""
    template: ClassVar[str] = "moe_combine"
    hidden: int
    top_k: int
    block: int
    num_warps: int

    @classmethod
    def make(cls, hidden, top_k):
        return cls(int(hidden), int(top_k), min(1024, next_pow2(hidden)), 4)


def glue_variants(hidden, top_k) -> list:
    """The sort and combine kernels around the expert stages, as `variants` lists them."""
    return ([MoeAlignCtx.make(num_rows=n) for n, _, _ in ALIGN_TILES]
            + [MoeCombineCtx.make(hidden, top_k)])


def num_blocks_bound(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound on padded blocks: every non-empty expert wastes < one block; at most min(E, rows) are non-empty."""
    return -(-num_rows // block_m) + min(num_experts, num_rows)


def _pad_args(pad, ids):
    """(loc, pad_slot, MASK_PAD) kernel arguments of `pad` = (loc [T] KV slots, the padding slot) or None
    (no token is padding: ids stands in for the pointer the kernel then never reads)."""
    return (pad[0], int(pad[1]), True) if pad is not None else (ids, -1, False)


def align_rows(ids, num_experts, block_m, expert_offset=0, lib: KernelLibrary | None = None, pad=None):
    """Sort routed rows by (local) expert, padding each expert's run to a multiple of block_m.

    ids [T, k] (global expert ids). Returns (sorted_rows [NB*BM] int32: flat row t*k+j or the sentinel
    T*k for padding; block_expert [NB] int32: local expert of each block, -1 past the end). Rows routed
    to experts outside [offset, offset+E) are dropped (another EP rank holds them). No host sync.
    With `lib`, up to ALIGN_ROWS rows over <= ALIGN_MAX_EXPERTS experts (decode sizes, small prefill
    chunks; any row block of BLOCK_MS) are sorted by one moe_align launch, which with `pad` =
    (loc [T], pad_slot) also drops the rows of padding
    tokens (loc[t] == pad_slot: a step's padding rows all route as one token, up to k experts no real
    token may need); otherwise (and without `lib`) by torch ops, which keep them (prefill sizes, where
    the combine zeroes their output). Besides that the result is the same.
    """
    n, nb = ids.numel(), num_blocks_bound(ids.numel(), num_experts, block_m)
    if lib is not None and n <= ALIGN_ROWS and num_experts <= ALIGN_MAX_EXPERTS and block_m in BLOCK_MS:
        sorted_rows = torch.empty(nb * block_m, dtype=torch.int32, device=ids.device)
        block_expert = torch.empty(nb, dtype=torch.int32, device=ids.device)
        ctx = MoeAlignCtx.make(num_rows=n)
        loc, pad_slot, mask = _pad_args(pad, ids)
        lib(ctx)[ctx.grid(n)](ids if ids.is_contiguous() else ids.contiguous(), sorted_rows, block_expert, n, nb,
                              num_experts, expert_offset, loc, pad_slot, ids.shape[1], block_m, mask,
                              num_warps=ctx.num_warps)
        return sorted_rows, block_expert
    dev = ids.device
    E = num_experts
    flat = ids.reshape(-1).long() - expert_offset
    e = torch.where((flat >= 0) & (flat < E), flat, E)              # non-local rows -> bucket E
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, e, torch.ones_like(e))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[E:].zero_()            # the non-local bucket gets no blocks (a kernel: no host copy in capture)
    order = torch.argsort(e, stable=True)
    e_sorted = e[order]
    starts = torch.cumsum(counts, 0) - counts
    ends_padded = torch.cumsum(padded, 0)
    dest = ends_padded[e_sorted] - padded[e_sorted] + torch.arange(n, device=dev) - starts[e_sorted]
    size = nb * block_m
    dest = torch.where(e_sorted < E, dest, size)                     # dropped rows land in a spare cell
    sorted_rows = torch.full((size + 1,), n, dtype=torch.int32, device=dev)
    sorted_rows.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(nb, device=dev) * block_m
    block_expert = torch.searchsorted(ends_padded, block_start, right=True)
    block_expert = torch.where(block_start < ends_padded[-1], block_expert, -1).to(torch.int32)
    return sorted_rows[:size], block_expert


# ----------------------------------------------------------------------------- launch choice
def moe_launch(rows: int, experts: int, hidden: int, inter: int, num_sms: int, fp8: bool = False,
               block_m: int | None = None) -> dict:
    """The default launch for `rows` routed rows over `experts` local experts, as `moe_experts`' tiles:
    {"block_m": BM, "gate_up": {"splits": S1}, "down": {"splits": S2}} (tile sizes: the contexts' `make`;
    the split counts: `glmc.target.moe_splits`, over the split form's tile, `moe_block_n`: the FP8
    gate/up stage's is narrower than its unsplit one-quantisation-group tile). Pure in its arguments."""
    bm = block_m or block_m_for(rows, experts)
    gate_up, down = moe_splits(rows, experts, hidden, inter, num_sms, fp8, bm)
    return {"block_m": bm, "gate_up": {"splits": gate_up}, "down": {"splits": down}}


def _stage_tiles(launch: dict, tiles: dict, stage: str) -> tuple[int, dict]:
    """(splits, `make` overrides) of one stage: the launch's splits under the caller's `tiles[stage]`."""
    over = {**launch[stage], **tiles.get(stage, {})}
    return int(over.pop("splits")), over


def _check_stacks(w_gate, w_up, w_down):
    if w_gate.stride() != w_up.stride() or w_gate.shape != w_up.shape:
        raise ValueError(f"moe_experts: gate {tuple(w_gate.shape)}/{w_gate.stride()} and up "
                         f"{tuple(w_up.shape)}/{w_up.stride()} stacks must share shape and strides")
    E, inter, hidden = w_gate.shape
    if tuple(w_down.shape) != (E, hidden, inter):
        raise ValueError(f"moe_experts: down stack {tuple(w_down.shape)} != {(E, hidden, inter)}")


def _combine(y, ids, expert_offset, num_experts, out, lib, pad=None):
    """out[t] = sum over splits s and slots j of y[s, t*k + j] for the locally held routes (the others
    were never written), 0 for padding tokens (`pad`, as `align_rows`): one moe_combine launch, a
    fixed order."""
    T, k = ids.shape
    ids = ids if ids.stride(-1) == 1 else ids.contiguous()
    ctx = MoeCombineCtx.make(out.shape[1], k)
    lib(ctx)[(T, -(-out.shape[1] // ctx.block))](y, y.stride(1), y.stride(0), ids, ids.stride(0), out, out.stride(0),
                                                y.shape[0], num_experts, expert_offset, *_pad_args(pad, ids),
                                                num_warps=ctx.num_warps)
    return out


def _partials(splits, rows, cols, device):
    """fp32 [splits, rows, cols] split-K partials; rows rounded up to 16 so the split stride stays a
    multiple of 16 (one specialisation class for every row count)."""
    return torch.empty(splits, -(-rows // 16) * 16, cols, dtype=torch.float32, device=device)


def moe_experts(x, ids, weights, w_gate, w_up, w_down, expert_offset=0, tiles=None, lib: KernelLibrary = JIT,
                pad=None, out_dtype=torch.float32):
    """torch_ref.moe_experts on Triton: -> [T, H] in `out_dtype` (the combine sums in fp32 and rounds
    once as it stores: what a cast of the fp32 sums gives, without its launch). `tiles` = {"gate_up":
    {...}, "down": {...}, "block_m": int} overrides `moe_launch`'s splits ("splits") and
    MoeExpertsCtx.make's tile choices (block_n, block_k, num_warps, num_stages) per stage
    (bench/moe_sweep.py sweeps them). `pad` = (loc [T] KV slots, the padding slot): padding tokens'
    rows run no expert (`align_rows`) and their output is 0."""
    _check_stacks(w_gate, w_up, w_down)
    T, k = ids.shape
    E, inter, hidden = w_gate.shape
    tiles = tiles or {}
    n = T * k
    out = torch.empty(T, hidden, dtype=out_dtype, device=x.device)
    if not T:
        return out
    launch = moe_launch(n, E, hidden, inter, sm_count(x.device), block_m=tiles.get("block_m"))
    bm = launch["block_m"]
    sorted_rows, block_expert = align_rows(ids, E, bm, expert_offset, lib, pad)
    nb = block_expert.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    h = torch.empty(nb * bm, inter, dtype=x.dtype, device=x.device)
    s1, over = _stage_tiles(launch, tiles, "gate_up")
    up = MoeExpertsCtx.make(False, hidden, inter, k, w_gate.dtype, bm, s1 > 1, **over)
    part = _partials(s1, nb * bm, 2 * inter, x.device) if s1 > 1 else h
    lib(up)[(nb, -(-inter // up.block_n), s1)](
        x, x.stride(0), w_gate, *w_gate.stride(), w_up, part, part.stride(-2), part.stride(0), sorted_rows,
        block_expert, n, s1, num_warps=up.num_warps, num_stages=up.num_stages)
    if s1 > 1:
        red = MoeSwigluReduceCtx.make(inter, bm, x.dtype, fp8=False)
        lib(red)[(nb, -(-inter // red.block_n))](part, part.stride(1), part.stride(0), h, h.stride(0), sorted_rows,
                                                 block_expert, n, s1, num_warps=red.num_warps)
    s2, over = _stage_tiles(launch, tiles, "down")
    dn = MoeExpertsCtx.make(True, inter, hidden, k, w_down.dtype, bm, s2 > 1, **over)
    y = _partials(s2, n, hidden, x.device)
    lib(dn)[(nb, -(-hidden // dn.block_n), s2)](
        h, h.stride(0), w_down, *w_down.stride(), weights.reshape(-1).float().contiguous(), y, y.stride(1),
        y.stride(0), sorted_rows, block_expert, n, s2, num_warps=dn.num_warps, num_stages=dn.num_stages)
    return _combine(y, ids, expert_offset, E, out, lib, pad)


# ----------------------------------------------------------------------------- FP8 experts
@dataclass(frozen=True)
class MoeExpertsFp8Ctx:
    """moe_experts_fp8.py.j2: one (row block, output tile[, K split]) per program over block-FP8 expert
    stacks. K runs in 128-wide blocks (one weight scale per block); an output tile lies inside one
    128-row scale block (block_n divides 128). The unsplit gate/up stage's tile is one whole 128-column
    group of h (its quantisation for the down stage is fused there); split, that moves to the reduction
    and the tile may be narrower."""
    template: ClassVar[str] = "moe_experts_fp8"
    down: bool
    split: bool
    n_in: int
    n_out: int
    top_k: int
    block_m: int
    block_n: int
    k_blocks: int
    act_dtype: str
    num_warps: int
    num_stages: int
    promote: int = FP8_DOT_PROMOTE   # K products per tensor-core sum (triton_render.FP8_DOT_PROMOTE)

    @classmethod
    def make(cls, down, n_in, n_out, top_k, dtype, block_m, split=False, block_n=None, num_warps=None,
             num_stages=None, promote=FP8_DOT_PROMOTE):
        if not down and not split:   # one quantisation group of h per tile
            fixed = 128 if n_out >= 128 else max(16, next_pow2(n_out))
            if block_n not in (None, fixed):
                raise ValueError(f"MoeExpertsFp8Ctx: the unsplit gate/up stage's block_n is one 128-column "
                                 f"group of h ({fixed}), not {block_n}")
            block_n = fixed
        block_n = block_n or moe_block_n(block_m, n_out)
        if 128 % block_n:
            raise ValueError(f"MoeExpertsFp8Ctx: block_n {block_n} must divide the 128-row scale block")
        num_warps = num_warps or (4 if block_m * block_n <= 16 * 128 else 8)
        return cls(bool(down), bool(split), int(n_in), int(n_out), int(top_k), int(block_m), int(block_n),
                   -(-int(n_in) // 128), _ACT[dtype], num_warps, num_stages or 3, fp8_promote(promote))

    @classmethod
    def variants(cls, hidden, inter, top_k, dtype) -> list:
        """Every context `moe_experts_fp8` makes without tile overrides (as `MoeExpertsCtx.variants`)."""
        stages = [cls.make(down, *((inter, hidden) if down else (hidden, inter)), top_k, dtype, bm, split)
                  for bm in BLOCK_MS for split in ((False, True) if bm == MOE_SPLIT_BLOCK_M else (False,))
                  for down in (False, True)]
        reduce = MoeSwigluReduceCtx.make(inter, MOE_SPLIT_BLOCK_M, dtype, fp8=True)
        return stages + [reduce] + glue_variants(hidden, top_k)


def moe_experts_fp8(x, ids, weights, w_gate, w_up, w_down, expert_offset=0, tiles=None,
                    lib: KernelLibrary = JIT, x_scales=None, act_dtype=None, pad=None, out_dtype=torch.float32):
    """`moe_experts` on block-FP8 expert stacks (`fp8_ref.Fp8Weight` [E, out, in]): x quantised per
    token per 128 columns, h quantised in the gate/up kernel (or, split K, in the reduction), fp32
    accumulation; -> [T, H] in `out_dtype` (reference: `fp8_ref.moe_experts_fp8`, fp32). `tiles` as
    `moe_experts`' (per stage: splits, block_n, num_warps, num_stages; K steps are the 128-wide
    scale blocks). With `x_scales`, x is already e4m3 with those per-128 scales (rows an FP8
    dispatch delivered) and `act_dtype` the activations' dtype the kernels are specialised for.
    `pad` as `moe_experts`'."""
    from glmc.codegen.triton_fp8 import quantize_tokens
    if w_gate.shape != w_up.shape or tuple(w_down.shape) != (w_gate.shape[0], w_gate.shape[2], w_gate.shape[1]):
        raise ValueError(f"moe_experts_fp8: gate {tuple(w_gate.shape)}, up {tuple(w_up.shape)}, "
                         f"down {tuple(w_down.shape)} are not [E, I, H], [E, I, H], [E, H, I]")
    if w_gate.q.stride() != w_up.q.stride() or w_gate.q.stride(2) != 1 or w_down.q.stride(2) != 1:
        raise ValueError(f"moe_experts_fp8: gate/up stacks {w_gate.q.stride()} / {w_up.q.stride()} and down "
                         f"{w_down.q.stride()} must be row-major with equal gate/up strides")
    T, k = ids.shape
    E, inter, hidden = w_gate.shape
    act = act_dtype or x.dtype
    tiles = tiles or {}
    n = T * k
    out = torch.empty(T, hidden, dtype=out_dtype, device=x.device)
    if not T:
        return out
    launch = moe_launch(n, E, hidden, inter, sm_count(x.device), fp8=True, block_m=tiles.get("block_m"))
    bm = launch["block_m"]
    sorted_rows, block_expert = align_rows(ids, E, bm, expert_offset, lib, pad)
    nb = block_expert.shape[0]
    xq, xs = (x, x_scales) if x_scales is not None else quantize_tokens(x, lib)
    hq = torch.empty(nb * bm, inter, dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty(nb * bm, -(-inter // 128), dtype=torch.float32, device=x.device)
    gq, gs = w_gate.q, w_gate.scale_inv
    s1, over = _stage_tiles(launch, tiles, "gate_up")
    up = MoeExpertsFp8Ctx.make(False, hidden, inter, k, act, bm, s1 > 1, **over)
    part = _partials(s1, nb * bm, 2 * inter, x.device) if s1 > 1 else None
    outs = (part, part.stride(1), part.stride(0)) if s1 > 1 else (hq, hq.stride(0), hs, hs.stride(0))
    lib(up)[(nb, -(-inter // up.block_n), s1)](
        xq, xq.stride(0), xs, xs.stride(0), gq, gq.stride(0), gq.stride(1), gs, gs.stride(0), gs.stride(1),
        w_up.q, w_up.scale_inv, *outs, sorted_rows, block_expert, n, s1,
        num_warps=up.num_warps, num_stages=up.num_stages)
    if s1 > 1:
        red = MoeSwigluReduceCtx.make(inter, bm, act, fp8=True)
        lib(red)[(nb, -(-inter // red.block_n))](part, part.stride(1), part.stride(0), hq, hq.stride(0), hs,
                                                 hs.stride(0), sorted_rows, block_expert, n, s1,
                                                 num_warps=red.num_warps)
    s2, over = _stage_tiles(launch, tiles, "down")
    dn = MoeExpertsFp8Ctx.make(True, inter, hidden, k, act, bm, s2 > 1, **over)
    y = _partials(s2, n, hidden, x.device)
    dq, ds = w_down.q, w_down.scale_inv
    lib(dn)[(nb, -(-hidden // dn.block_n), s2)](
        hq, hq.stride(0), hs, hs.stride(0), dq, dq.stride(0), dq.stride(1), ds, ds.stride(0), ds.stride(1),
        weights.reshape(-1).float().contiguous(), y, y.stride(1), y.stride(0), sorted_rows, block_expert, n, s2,
        num_warps=dn.num_warps, num_stages=dn.num_stages)
    return _combine(y, ids, expert_offset, E, out, lib, pad)
