"""The CUDA target's description: device constants, tile tables and launch rules, defined once.

The role TVM's `Target` plays: the facts about the GPU and the kernels' launch choices that both the
compiler (`passes/`: memory model, costs) and codegen (`codegen/`: contexts, launchers, launch model)
read. Pure data and small pure functions of shapes and the SM count: no torch, nothing of glmc but
the IR's types, so every stage may import it. A value measured on a device says where and when.
"""
from __future__ import annotations

from glmc.ir.types import FP8_SCALE_GROUP

# ----------------------------------------------------------------------------- device
H200_SMS = 132   # SMs of the GPU the compiler plans for (grids and split counts; a meta-device trace)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block shapes must be powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------- block FP8
FP8_BLOCK = FP8_SCALE_GROUP   # 128: values per fp32 scale (activation groups, weight blocks 128 x 128)
FP8_KINDS = ("linear", "mla.a_proj", "mlp.swiglu", "moe.experts")   # ops an FP8 plan stores FP8 weights of
UNQUANTISED = ("self_attn.indexer.weights_proj.weight",)   # bf16 inside an FP8 op (the A-projection)
NORM_QUANT_ROWS = 4   # up to this many rows a norm that feeds an FP8 GEMM quantises its output itself

# fp8_block_gemm's row classes: (largest row count of the class, its tiles (block_m, block_n, num_warps,
# num_stages), the waves of SMs its programs (tiles x K splits) should reach). Decode rows up to 16 take 16-row tiles (the
# smallest tensor-core M) split to ~3 waves; more rows take 64 x 128 tiles split only to fill one wave.
# Tiles 128 wide meet one weight scale block per K block (one scale load). The bound 16 and 17 = the
# second class's first row count: startup.warm_lengths launches 1, 17 and 2^n tokens, so every class
# is compiled before serving. From bench/fp8_gemm_sweep.py on the H200: 2026-12-01, decode 16 x 128
# (best single config at M = 1, 151 vs 160 us over the layer's GEMMs) split to ~3 waves (o_proj 29 vs
# 34 us), prefill 64 x 128, 4 warps, 4 stages (4519 vs 5009 us over the prefill shapes); 2026-12-04
# (`--grid`: every tile x split count at M = 32 / 64 / 128), 17-255 rows as prefill's tiles with one
# wave, was 64 x 64 at 3 stages with 3 waves: over the 2-layer slice's GEMMs 232.6 -> 226.3 /
# 252.5 -> 245.7 / 350.7 -> 301.3 us (o_proj at 128 rows 60.7 -> 47.1 us: 5 splits of 64 x 64 tiles
# wrote and re-read fp32 partials the 2 splits of 64 x 128 do not).
FP8_TILE_CLASSES = ((16, (16, 128, 4, 3), 3), (None, (64, 128, 4, 4), 1))
FP8_SPLIT_MIN_K_BLOCKS = 2   # K splits of at least this many 128-wide K blocks
FP8_MAX_SPLITS = 64          # a bound on the fp32 workspace and the reduction's reads


def fp8_row_class(num_rows: int) -> tuple:
    """The FP8_TILE_CLASSES entry `num_rows` falls in."""
    return next(c for c in FP8_TILE_CLASSES if c[0] is None or num_rows <= c[0])


def even_splits(k_blocks: int, splits: int) -> int:
    """`splits` (at least 1) made consistent with equal widths: ceil(k_blocks / width) splits of
    width = ceil(k_blocks / splits) blocks, so no split is empty (the last may be narrower)."""
    splits = max(1, min(int(splits), k_blocks))
    return -(-k_blocks // -(-k_blocks // splits))


def fp8_split_count(num_rows: int, n: int, k: int, block_m: int, block_n: int, num_sms: int) -> int:
    """K splits of an [num_rows, k] x [n, k]^T block-FP8 GEMM in [block_m, block_n] tiles: enough for
    the row class's waves of programs, within FP8_SPLIT_MIN_K_BLOCKS blocks a split and
    FP8_MAX_SPLITS; 1 when the tiles alone fill them."""
    tiles = -(-num_rows // block_m) * -(-n // block_n)
    k_blocks = -(-k // FP8_BLOCK)
    want = -(-fp8_row_class(num_rows)[2] * num_sms // tiles)
    return even_splits(k_blocks, min(want, k_blocks // FP8_SPLIT_MIN_K_BLOCKS, FP8_MAX_SPLITS))


def fp8_gemm_splits(num_rows: int, n: int, k: int, num_sms: int) -> int:
    """The K splits fp8_block_gemm launches with its row class's tiles."""
    block_m, block_n = fp8_row_class(num_rows)[1][:2]
    return fp8_split_count(num_rows, n, k, block_m, block_n, num_sms)


def fp8_row_groups(rows: list[int]) -> list[list[int]]:
    """Indices of row parts that share one FP8 GEMM (`Fp8Weight.cat_rows(pad=True)`): consecutive
    parts, where one part before the last of a group may end off a 128-row block (zero rows pad it
    to the block; its GEMM skips their columns: `fp8_group_gap`); a second such part starts a new
    group. GLM-5.3's full-layer A-projection q_a | kv_a (576 rows) | wk is one GEMM."""
    groups: list[list[int]] = []
    gapped = False
    for i, r in enumerate(rows):
        prev = rows[groups[-1][-1]] if groups else 0
        if groups and (prev % FP8_BLOCK == 0 or not gapped):
            gapped = gapped or prev % FP8_BLOCK != 0
            groups[-1].append(i)
        else:
            groups.append([i])
            gapped = False
    return groups


def fp8_group_gap(rows: list[int]) -> tuple[int, int]:
    """(first skipped column, skipped columns) of the GEMM of one `fp8_row_groups` group (its parts'
    rows): the zero rows padding its part that ends off a block; (sum(rows), 0) when none does. The
    joined weight has sum(rows) + skipped rows."""
    at = 0
    for r in rows[:-1]:
        at += r
        if r % FP8_BLOCK:
            return at, -r % FP8_BLOCK
    return sum(rows), 0


def fp8_gemm_rows(rows: list[int]) -> list[tuple[int, int]]:
    """(weight rows, zero padding rows among them) of each FP8 GEMM a run of FP8 row parts (their
    rows) is joined into (`fp8_row_groups`, `fp8_group_gap`)."""
    out = []
    for g in fp8_row_groups(rows):
        pad = fp8_group_gap([rows[i] for i in g])[1]
        out.append((sum(rows[i] for i in g) + pad, pad))
    return out


# ----------------------------------------------------------------------------- small GEMMs
GEMV_ROW_CLASSES = (1, 4, 16)   # GemvCtx's row classes
GEMV_ROWS = GEMV_ROW_CLASSES[-1]   # up to this many rows a decode GEMV is one gemv kernel ...
# ... and outputs narrower than GEMV_NARROW[0] columns only up to GEMV_NARROW[1] rows: a program per two
# columns leaves most SMs idle there (bench/glue_micro.py on an H200, 2026-12-03, K 6144: weights_proj's
# 32 outputs at 16 rows 37.8 us vs cuBLAS 8.2, at 4 rows 5.6 vs 7.0; the router's 256 at 16 rows 12.5
# vs 19.2, at 32 rows 23.5 vs 18.2, so no 32-row class either)
GEMV_NARROW = (64, 4)


def gemv_takes(rows: int, n: int) -> bool:
    """Whether an [rows, K] x [n, K]^T product runs the gemv kernel (else the router runs the narrow
    GEMM and weights_proj cuBLAS)."""
    return rows <= (GEMV_ROWS if n >= GEMV_NARROW[0] else GEMV_NARROW[1])


# narrow_gemm.py.j2 (the router past the gemv's rows): [64, <= 64] tiles over K blocks
# of 64, K split so that the programs fill one wave of SMs, >= 2 K blocks a split, at most 64 splits
NARROW_BLOCK_M, NARROW_BLOCK_N, NARROW_BLOCK_K, NARROW_MAX_SPLITS = 64, 64, 64, 64


def narrow_block_n(n: int) -> int:
    """narrow_gemm's tile width for n output columns: the next power of two, 16 .. NARROW_BLOCK_N."""
    return min(NARROW_BLOCK_N, max(16, next_pow2(n)))


def narrow_splits(rows: int, n: int, k: int, num_sms: int) -> int:
    """narrow_gemm's K splits for [rows, k] x [n, k]^T: enough programs for one wave of `num_sms`,
    each split >= 2 K blocks, at most NARROW_MAX_SPLITS, widths equal (ceil(blocks / width) splits)."""
    tiles = -(-rows // NARROW_BLOCK_M) * -(-n // narrow_block_n(n))
    blocks = -(-k // NARROW_BLOCK_K)
    splits = max(1, min(-(-num_sms // tiles), blocks // 2, NARROW_MAX_SPLITS, blocks))
    return -(-blocks // -(-blocks // splits))


# ----------------------------------------------------------------------------- indexer top-k
INDEXER_BLOCK_N = 64   # IndexerScoresCtx's key block at decode: the score workspace's width is its multiple
TOPK_CHUNK = 8192  # scores per top-k pass in a plan: a row up to this long is read once and held in registers
TOPK_SEGMENTS = (1024, 8192)   # scores per program of a long row's radix select: smallest, largest
TOPK_PROGRAMS = (32, 16, 256)  # programs of the split select in all: at least, per row, at most


def topk_segment(rows: int, width: int) -> int:
    """Scores per program of the split select: the batch over min(256, max(32, 16 x rows))
    programs, a power of two in TOPK_SEGMENTS at or below the row's share. Measured on an H200
    (bench/long_context_bench.py's top-k tables, us, 2026-12-04, rounds 1-3 by atomics): one row of
    32K / 64K / 128K is fastest at 1024 / 2048 / 4096 scores a program (20.0 / 24.9 / 30.1; 64
    programs: 21.6 / 28.9 / 31.2), 32 rows of 32K / 64K / 128K at 4096 / 8192 / 8192 (47.5 / 71.3 /
    104.2): more programs each re-read more of their row's histograms than they save, fewer leave
    the GPU idle."""
    lo, hi = TOPK_SEGMENTS
    least, per_row, most = TOPK_PROGRAMS
    segs = max(1, max(least, min(most, per_row * rows)) // max(rows, 1))
    share = -(-width // segs)
    return max(lo, min(hi, 1 << (share.bit_length() - 1)))


# ----------------------------------------------------------------------------- MLA decode
MLA_MAX_SPLITS = 64  # flash-decoding splits of one (token, head block) at most: the combine's widest tile
MLA_WARPS_PER_SM = 8  # the split programs' warps, all together, fill this many per SM (one wave)


def mla_wide(num_tokens: int, num_heads: int, kv_fp8: bool) -> bool:
    """SparseMlaDecodeCtx's wide class: 64 x 64 tiles at 8 warps, all 64 heads in one program (Hopper's
    wgmma, where 16-head tiles run mma.sync), from 4 tokens on FP8 rows and 8 on bf16 rows. Sweep of
    2026-12-04 on an H200 (bench/results/h200_2026-12-04/mla_tiles_sweep_small.json, 64 heads, k
    2048, 2K keys): FP8 rows at 4 / 8 / 16 tokens 21.2 / 26.0 / 40.8 us against 38.6 / 71.6 / 150.5 for
    the 16 x 32 tiles at 4 warps before; bf16 rows at 8 / 16 24.3 / 37.6 against 29.0 / 55.0, at 4
    tokens within 4% of 16 x 32 (kept there)."""
    return num_heads >= 64 and num_tokens >= (4 if kv_fp8 else 8)


def mla_tiles(wide: bool) -> tuple[int, int, int]:
    """SparseMlaDecodeCtx's default (block_h, block_n, num_warps) of its token class (`mla_wide`)."""
    return (64, 64, 8) if wide else (16, 32, 4)


def mla_v_parts(num_tokens: int, num_heads: int, kv_lora: int, fp8_tiles: bool) -> int:
    """SparseMlaDecodeCtx's default output parts, for FP8 rows scaled per tile (head-major) when each
    part keeps whole 128-value scale groups: at 64 heads 2 in the wide class below 8 tokens (4 tokens
    21.2 us against 23.0 in one part), else 1 (the narrow class: 1 token 14.4 both, 2 tokens 17.1
    against 20.2; the wide class from 8 tokens: every part recomputes the scores); below 64 heads
    (a tensor-parallel rank; not swept) 2. Else 1."""
    if not fp8_tiles or kv_lora < 2 * FP8_BLOCK:
        return 1
    if num_heads < 64:
        return 2
    return 2 if mla_wide(num_tokens, num_heads, True) and num_tokens < 8 else 1


def mla_num_splits(num_tokens: int, num_heads: int, block_h: int, num_keys: int, block_n: int,
                   num_sms: int, v_parts: int = 1, num_warps: int = 4) -> int:
    """Flash-decoding split count (a launch parameter, not part of a kernel's source): the largest
    power of two whose programs' warps fit MLA_WARPS_PER_SM per SM (one wave: 2 programs of 4 warps
    or 1 of 8 per SM), >= 2 key blocks per split, at most MLA_MAX_SPLITS. Powers of two cut a top-k of
    2048 (or a 1K context) into equal whole key blocks. Sweep of 2026-12-03 on an H200 (kernel +
    combine, 64 heads, `python -m bench.mla_tiles_sweep --splits`): this rule picks the fastest count at
    every point, 1-128 tokens x contexts 1K / 2K x FP8 / bf16 rows; the 2-wave rule before it (not a
    power of two) was up to 1.5x slower (FP8 rows, 1K: 8 tokens 52.5 vs 38.5 us, 32 tokens 75.1 vs
    55.8, 128 tokens 215.9 vs 173.5; bf16 128 tokens 135.7 vs 121.8): the split partials [T, H, S,
    512] fp32 are written and read back, and a second wave of programs waits for the first."""
    programs = num_tokens * -(-num_heads // block_h) * v_parts
    fit = max(1, MLA_WARPS_PER_SM * num_sms // (programs * num_warps))
    return max(1, min(1 << (fit.bit_length() - 1), num_keys // (2 * block_n), MLA_MAX_SPLITS))


# ----------------------------------------------------------------------------- sampling
ARGMAX_SPLITS = 64  # programs one row's argmax is split over at most (argmax.py.j2's partials per row)


def argmax_splits(rows: int, vocab: int, chunk: int, num_sms: int) -> int:
    """Programs per row: about two waves of the GPU over all rows, each at least one chunk of ids."""
    return max(1, min(ARGMAX_SPLITS, -(-2 * num_sms // max(1, rows)), -(-vocab // chunk)))


# ----------------------------------------------------------------------------- MoE experts
BLOCK_MS = (16, 32, 64)  # the row-block classes `block_m_for` picks from


def block_m_for(num_rows: int, num_experts: int) -> int:
    """Rows per block: 16 (the smallest MMA tile) while experts see a few rows each (decode), larger
    when the average expert gets a full tile (prefill)."""
    avg = num_rows / max(1, num_experts)
    return BLOCK_MS[0] if avg < 32 else BLOCK_MS[1] if avg < 64 else BLOCK_MS[2]


def moe_block_n(block_m: int, n_out: int) -> int:
    """The expert kernels' default output tile for n_out columns at row block block_m."""
    return min(64 if block_m <= 16 else 128, max(16, next_pow2(n_out)))


ALIGN_ROWS = 4096          # routed rows up to which one moe_align launch sorts them (T <= 512 at top-8)
ALIGN_MAX_EXPERTS = 256    # ... over at most this many local experts, at any row block; else torch ops

# Split-K thresholds: the lead sets them from bench/moe_sweep.py's table (T = 1 .. 128 on an H200).
MOE_SPLIT_BLOCK_M = 16           # only the decode row-block class splits (its split forms are in the variants)
# Measured on the H200 (bench/moe_sweep.py, 2026-12-01, GLM-5.3 experts at T = 1): bf16 ran best unsplit
# (155 us vs 178 with gate/up split 4 ways), FP8 with gate/up split 2 ways (100 us vs 104 at 4); so
# only FP8 stages split, and only below 2 programs per SM.
MOE_SPLIT_DTYPES = ("fp8",)
MOE_SPLIT_PROGRAMS_PER_SM = 2    # a stage splits K while its grid has fewer programs than this per SM ...
MOE_SPLIT_MIN_K = 512            # ... and every split keeps at least this many columns of K ...
MOE_SPLIT_MAX = 8                # ... up to this many splits (a power of two)


def moe_num_splits(programs: int, n_in: int, num_sms: int) -> int:
    """K splits for a stage whose unsplit grid has `programs` programs over K = n_in: the smallest power
    of two giving >= MOE_SPLIT_PROGRAMS_PER_SM programs per SM, at most MOE_SPLIT_MAX, each split >=
    MOE_SPLIT_MIN_K."""
    splits = 1
    while (splits < MOE_SPLIT_MAX and programs * splits < MOE_SPLIT_PROGRAMS_PER_SM * num_sms
           and n_in >= 2 * splits * MOE_SPLIT_MIN_K):
        splits *= 2
    return splits


def moe_splits(rows: int, experts: int, hidden: int, inter: int, num_sms: int, fp8: bool,
               block_m: int) -> tuple[int, int]:
    """The K splits (gate/up, down) of `rows` routed rows over `experts` local experts at row block
    `block_m`. Programs are counted over the row blocks that surely have work, max(cdiv(rows, BM),
    min(experts, rows)), times the stage's split-form output tiles. Only the decode class BM =
    MOE_SPLIT_BLOCK_M of a dtype in MOE_SPLIT_DTYPES splits. GLM-5.3 FP8 on 132 SMs: T = 1 (8 rows)
    splits gate/up 2 ways (8 x 32 tiles x 2 = 512 programs of 3072 K), down not (8 x 96 = 768); T >= 2
    and bf16 do not split."""
    if block_m != MOE_SPLIT_BLOCK_M or ("fp8" if fp8 else "bf16") not in MOE_SPLIT_DTYPES:
        return 1, 1
    busy = max(-(-rows // block_m), min(experts, rows))
    return (moe_num_splits(busy * -(-inter // moe_block_n(block_m, inter)), hidden, num_sms),
            moe_num_splits(busy * -(-hidden // moe_block_n(block_m, hidden)), inter, num_sms))
