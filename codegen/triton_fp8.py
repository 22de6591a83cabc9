"""Triton FP8 kernels: per-token-group activation quantisation and the block-scaled w8a8 GEMM.

`fp8_linear(x, wq, ws)` = `fp8_block_gemm(*quantize_tokens(x), wq, ws)` has `fp8_ref`'s contract
(DeepSeek-V3 / GLM-5 checkpoints: weights float8_e4m3fn [N, K] with a fp32 scale per 128 x 128 block;
activations quantised per token per 128 columns) and runs as

1. `fp8_quant_tokens.py.j2`: up to 8 (row, 128-column group)s per program: s = max|x| / 448, q = e4m3(x / s),
   rounded to nearest even in exact fp32 steps (bit-exact with `fp8_ref.quantize_token_groups`);
2. `fp8_block_gemm.py.j2`: one output tile per program; per 128-wide K block, one FP8 tensor-core dot
   (exact products; runs of `FP8_DOT_PROMOTE` summed in the tensor core, fp32 beyond), scaled by the
   token's and the weight block's scales, accumulated in fp32.
   Split-K where the output tiles are too few to fill the GPU (decode: M = 1..128 rows): each program
   sums a range of K blocks into an fp32 partial, and
3. `fp8_split_reduce.py.j2` adds the partials in split order (deterministic: no atomics).

Tiles come from a row class (up to 16 rows / more: one kernel each, `Fp8BlockGemmCtx.variants`, so the
plan holds every kernel serving can launch); the split count is a run-time argument chosen per launch
from M, N, K and the SM count (`default_config`, whose thresholds bench/fp8_gemm_sweep.py measures).
The CUDA target runs them for every weight an FP8 plan stores FP8 (`codegen/weight_formats.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from glmc.codegen.triton_render import FP8_DOT_PROMOTE, JIT, fp8_promote, KernelLibrary, sm_count, next_pow2
from glmc.target import FP8_BLOCK, FP8_TILE_CLASSES, even_splits, fp8_row_class, fp8_split_count

# ----------------------------------------------------------------------------- defaults (set from the sweep)
# Row classes, split rule and their measurements: glmc/target.py (FP8_TILE_CLASSES, fp8_split_count).
GROUP_M = 8                # tile rows that walk the weight columns together (L2 reuse at prefill)


def default_config(num_rows: int, n: int, k: int, num_sms: int) -> dict:
    """The launch `fp8_block_gemm` makes when not told: the row class's tiles, and K split so that the
    programs (tiles x splits) reach the class's waves of `num_sms` (`fp8_split_count`).
    -> dict(block_m, block_n, num_warps, num_stages, splits). A pure function of its arguments."""
    block_m, block_n, num_warps, num_stages = class_tiles(num_rows)
    return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                splits=fp8_split_count(num_rows, n, k, block_m, block_n, num_sms))


def class_tiles(num_rows: int) -> tuple:
    """(block_m, block_n, num_warps, num_stages) of the row class `num_rows` falls in."""
    return fp8_row_class(num_rows)[1]


def class_rows() -> list[int]:
    """The smallest row count of each row class (one launch of each reaches every tile class)."""
    return [1] + [c[0] + 1 for c in FP8_TILE_CLASSES[:-1]]


# ----------------------------------------------------------------------------- contexts
QUANT_GROUPS_PER_PROGRAM = 8   # quantisers: 128-column groups of one row per program (one 2 KB bf16 load)


def _row_groups(width: int, group: int = FP8_BLOCK) -> tuple[int, int]:
    """A quantised row's groups and how many a program takes: (groups, groups_per_program)."""
    groups = -(-int(width) // group)
    return groups, min(QUANT_GROUPS_PER_PROGRAM, next_pow2(groups))


def group_grid(rows: int, groups: int, groups_per_program: int) -> tuple:
    """The grid of a quantiser taking `groups_per_program` of a row's `groups` per program."""
    return rows, -(-groups // groups_per_program)


@dataclass(frozen=True)
class Fp8QuantTokensCtx:
    """fp8_quant_tokens.py.j2: `groups_per_program` groups of one row per program over rows of `k`
    columns (one group per program was 16384 programs for [128, 16384]: 11.1 us on an H200)."""
    template: ClassVar[str] = "fp8_quant_tokens"
    k: int
    group: int
    groups: int
    groups_per_program: int
    num_warps: int

    @classmethod
    def make(cls, k, group=FP8_BLOCK):
        if group != next_pow2(group):
            raise ValueError(f"fp8_quant_tokens: the group must be a power of two, got {group}")
        return cls(int(k), int(group), *_row_groups(k, group), 4)

    def grid(self, rows: int) -> tuple:
        return group_grid(rows, self.groups, self.groups_per_program)


@dataclass(frozen=True)
class Fp8BlockGemmCtx:
    """fp8_block_gemm.py.j2: one [block_m, block_n] output tile x one K range per program; N, K fixed
    by the weight. `column_scales`: a tile wider than the 128-wide scale block loads a scale per
    column; `k_ragged`: K is not a multiple of 128 (masked K); `gapped`: the weight has zero-padding
    rows whose columns the store skips (`fp8_block_gemm`'s gap; the others keep contiguous stores);
    `promote`: K products per tensor-core sum (`FP8_DOT_PROMOTE`)."""
    template: ClassVar[str] = "fp8_block_gemm"
    n: int
    k: int
    k_blocks: int
    block_m: int
    block_n: int
    n_tiles: int
    group_m: int
    num_warps: int
    num_stages: int
    column_scales: bool
    k_ragged: bool
    gapped: bool = False
    promote: int = FP8_DOT_PROMOTE

    @classmethod
    def make(cls, n, k, num_rows, block_m=None, block_n=None, num_warps=None, num_stages=None, gapped=False,
             promote=FP8_DOT_PROMOTE):
        """The row class's tiles (`default_config`), each one overridable."""
        default_m, default_n, default_warps, default_stages = class_tiles(num_rows)
        block_m, block_n = block_m or default_m, block_n or default_n
        if block_m < 16 or block_n < 16 or block_m != next_pow2(block_m) or block_n != next_pow2(block_n):
            raise ValueError(f"fp8_block_gemm: tiles {block_m} x {block_n}: both must be powers of two >= 16 "
                             f"(block_n a divisor or multiple of {FP8_BLOCK})")
        n, k = int(n), int(k)
        return cls(n, k, -(-k // FP8_BLOCK), block_m, block_n, -(-n // block_n), GROUP_M,
                   num_warps or default_warps, num_stages or default_stages, block_n > FP8_BLOCK, k % FP8_BLOCK != 0,
                   bool(gapped), fp8_promote(promote))

    @classmethod
    def variants(cls, n, k, gapped=False) -> list:
        """Every kernel `fp8_block_gemm` launches by default for this weight: one per row class (the
        split count is a run-time argument) and the split reduction."""
        return [cls.make(n, k, rows, gapped=gapped) for rows in class_rows()] + [Fp8SplitReduceCtx.make(gapped=gapped)]


@dataclass(frozen=True)
class Fp8SplitReduceCtx:
    """fp8_split_reduce.py.j2: one (row, `block` columns) per program; one kernel for every shape.
    `swiglu` (a dense SwiGLU's gate/up GEMM, `fp8_swiglu_quant`): the gate and up partials' sums
    become silu(g) * u, rounded to `act_dtype` and quantised per 128 columns, `inter` wide."""
    template: ClassVar[str] = "fp8_split_reduce"
    block: int
    num_warps: int
    swiglu: bool = False
    inter: int = 0
    act_dtype: str = ""
    bf16: bool = False      # h rounded to bf16 on its bits (exact under the interpreter too)
    gapped: bool = False    # partials with zero-padding columns to skip (fp8_block_gemm's gap)
    groups: int = 0         # swiglu: 128-column groups of a row, `groups_per_program` per program
    groups_per_program: int = 0

    @classmethod
    def make(cls, swiglu_inter: int | None = None, act_dtype: torch.dtype = torch.bfloat16, gapped: bool = False):
        if swiglu_inter is None:
            return cls(512, 4, gapped=bool(gapped))
        groups, per_program = _row_groups(swiglu_inter)
        return cls(FP8_BLOCK, 4, True, int(swiglu_inter), _ACT[act_dtype], act_dtype == torch.bfloat16,
                   groups=groups, groups_per_program=per_program)


_ACT = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16"}


# ----------------------------------------------------------------------------- launches
def quantize_tokens(x, lib: KernelLibrary = JIT):
    """fp8_ref.quantize_token_groups on Triton: x [M, K] -> (xq float8_e4m3fn [M, K], s fp32 [M, K/128])."""
    m, k = x.shape
    ctx = Fp8QuantTokensCtx.make(k)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, ctx.groups, dtype=torch.float32, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if m:
        lib(ctx)[ctx.grid(m)](x, x.stride(0), q, q.stride(0), s, s.stride(0), num_warps=ctx.num_warps)
    return q, s


def fp8_block_gemm(xq, xs, wq, ws, out_dtype=torch.bfloat16, lib: KernelLibrary = JIT, out=None, gap=None,
                   **tiles):
    """fp8_ref.fp8_gemm on Triton: -> [M, N] in `out_dtype`, or written into `out` (an [M, N] view
    with unit column stride, e.g. some columns of a wider output). `gap` (at, width): weight rows
    [at, at + width) are zero padding (`glmc.target.fp8_group_gap`), left out of the [M, N - width]
    result. `tiles` (block_m, block_n, num_warps, num_stages, splits) override `default_config`'s.
    No host sync; CUDA-graph capturable (the split workspace is allocated here)."""
    m, k = xq.shape
    n = wq.shape[0]
    if wq.shape[1] != k or tuple(ws.shape) != (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)):
        raise ValueError(f"fp8_block_gemm: x {tuple(xq.shape)}, weight {tuple(wq.shape)} and its scales "
                         f"{tuple(ws.shape)} do not fit 128 x 128 blocks")
    gap_at, gap_w = gap or (n, 0)
    if not (0 <= gap_w and 0 <= gap_at and gap_at + gap_w <= n):
        raise ValueError(f"fp8_block_gemm: gap {gap} is not within the weight's {n} rows")
    splits = tiles.pop("splits", None)
    ctx = Fp8BlockGemmCtx.make(n, k, m, gapped=gap_w > 0, **tiles)
    if splits is None:
        splits = fp8_split_count(m, n, k, ctx.block_m, ctx.block_n, sm_count(xq.device))
    splits = even_splits(ctx.k_blocks, splits)
    width = n - gap_w
    y = torch.empty(m, width, dtype=out_dtype, device=xq.device) if out is None else out
    if tuple(y.shape) != (m, width) or (width > 1 and y.stride(1) != 1):
        raise ValueError(f"fp8_block_gemm: out {tuple(y.shape)} / {y.stride()} is not a [{m}, {width}] "
                         f"row-major view")
    if not m:
        return y
    # one split: the kernel stores y and never touches `part` (xs, an fp32 device tensor, stands in)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=xq.device) if splits > 1 else xs
    lib(ctx)[(-(-m // ctx.block_m) * ctx.n_tiles, splits)](
        xq, xq.stride(0), xs, xs.stride(0), wq, wq.stride(0), ws, ws.stride(0), y, y.stride(0), part, m,
        splits, -(-ctx.k_blocks // splits), gap_at, gap_w, num_warps=ctx.num_warps, num_stages=ctx.num_stages)
    if splits > 1:
        red = Fp8SplitReduceCtx.make(gapped=gap_w > 0)
        lib(red)[(m, -(-width // red.block))](part, y, y.stride(0), m, width, splits, gap_at, gap_w,
                                              num_warps=red.num_warps)
    return y


def _gemm_partials(xq, xs, wq, ws, lib: KernelLibrary, splits=None):
    """fp8_block_gemm's launch with its fp32 result left split: -> part fp32 [splits, M, N] (one
    split: the kernel's own store, in fp32)."""
    m, k = xq.shape
    n = wq.shape[0]
    ctx = Fp8BlockGemmCtx.make(n, k, m)
    splits = even_splits(ctx.k_blocks,
                         splits or fp8_split_count(m, n, k, ctx.block_m, ctx.block_n, sm_count(xq.device)))
    part = torch.empty(splits, m, n, dtype=torch.float32, device=xq.device)
    if m:
        lib(ctx)[(-(-m // ctx.block_m) * ctx.n_tiles, splits)](
            xq, xq.stride(0), xs, xs.stride(0), wq, wq.stride(0), ws, ws.stride(0), part[0], n, part, m,
            splits, -(-ctx.k_blocks // splits), n, 0, num_warps=ctx.num_warps, num_stages=ctx.num_stages)
    return part


def fp8_swiglu_quant(xq, xs, parts: list, act_dtype=torch.bfloat16, lib: KernelLibrary = JIT, splits=None):
    """A dense SwiGLU's first half on FP8 weights, ready for the down GEMM: h = silu(x W_gate^T) *
    (x W_up^T) rounded to `act_dtype`, quantised per token per 128 columns -> (hq float8_e4m3fn
    [M, I], hs fp32 [M, I/128]). `parts`: [(wq, ws[, gap])], the joined gate|up weight ([2I, K], or
    with a ragged I the gate padded to its 128-row block: gap (I, padding rows)) or gate and up
    apart; each GEMM leaves its fp32 split-K partials and one reduction launch sums them, applies
    SwiGLU and quantises (`Fp8SplitReduceCtx` swiglu)."""
    m = xq.shape[0]
    if len(parts) == 1:
        wq, ws, *gap = parts[0]
        part = _gemm_partials(xq, xs, wq, ws, lib, splits)
        inter, pad = gap[0] if gap and gap[0][1] else (part.shape[2] // 2, 0)
        g, u = part, part[:, :, inter + pad:]
    else:
        (gw, gs, *_), (uw, us, *_) = parts
        g, u = _gemm_partials(xq, xs, gw, gs, lib, splits), _gemm_partials(xq, xs, uw, us, lib, splits)
        inter = g.shape[2]
        if u.shape != g.shape:
            raise ValueError(f"fp8_swiglu_quant: gate partials {tuple(g.shape)} and up {tuple(u.shape)} differ")
    red = Fp8SplitReduceCtx.make(inter, act_dtype)
    hq = torch.empty(m, inter, dtype=torch.float8_e4m3fn, device=xq.device)
    hs = torch.empty(m, red.groups, dtype=torch.float32, device=xq.device)
    if m:
        lib(red)[group_grid(m, red.groups, red.groups_per_program)](
            g, u, g.stride(1), g.stride(0), hq, hq.stride(0), hs, hs.stride(0), m, g.shape[0], num_warps=red.num_warps)
    return hq, hs


def fp8_linear(x, wq, ws, out_dtype=None, lib: KernelLibrary = JIT, **tiles):
    """x @ W^T for a block-scaled FP8 weight: quantise x per token group, then the w8a8 GEMM."""
    xq, xs = quantize_tokens(x, lib)
    return fp8_block_gemm(xq, xs, wq, ws, out_dtype or x.dtype, lib, **tiles)
