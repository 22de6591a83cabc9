"""Typed kernel contexts: every shape, tile size and flag of a Triton kernel, computed in Python.

Templates are dumb (STYLE rule 10): a frozen ``*Ctx`` dataclass carries what its template
substitutes (``{{ value }}``) or branches on (``{% if flag %}``); ``make`` derives it from shapes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from glmc.codegen.fp8_ref import KV_PAGE
from glmc.codegen.torch_ref import rope_attention_factor
from glmc.codegen.triton_render import _DOT, _warps, next_pow2
from glmc.target import (ARGMAX_SPLITS, FP8_BLOCK, GEMV_ROW_CLASSES, INDEXER_BLOCK_N, MLA_MAX_SPLITS, NARROW_BLOCK_K,
                         NARROW_BLOCK_M, TOPK_CHUNK, mla_tiles, mla_v_parts, mla_wide, narrow_block_n)


# ----------------------------------------------------------------------------- contexts


@dataclass(frozen=True)
class RmsNormCtx:
    """rms_norm.py.j2: one row per program; optional fused residual add; `quant`: the output also
    quantised per token per 128 columns for the FP8 GEMMs it feeds (fp8_quant_tokens' bits), one
    program per (row, group) so that one row fills more than one SM; each program reduces its whole
    row, so above NORM_QUANT_ROWS rows (H200, 2026-12-03: 16-22 us at 128 rows against 7.8 for the
    norm then the quantiser) the plain norm runs and the GEMM quantises."""
    template: ClassVar[str] = "rms_norm"
    hidden: int
    eps: float
    has_residual: bool
    block_d: int
    num_warps: int
    quant: bool = False
    has_addend: bool = False   # x + addend (rounded to x's dtype) in x's place: a folded elt.add

    @classmethod
    def make(cls, hidden: int, eps: float, has_residual: bool, quant: bool = False,
             has_addend: bool = False) -> "RmsNormCtx":
        """`quant`: a program per (row, 128-column group), each reducing the whole row as the
        one-program form does (its warps too: the same statistic to the bit)."""
        if has_addend and not has_residual:
            raise ValueError("rms_norm: an addend needs the residual form (fused.add_rms with 3 operands)")
        block = next_pow2(hidden)
        return cls(hidden, float(eps), bool(has_residual), block, _warps(block, 1024), bool(quant), bool(has_addend))


GEMV_PRODUCTS = 8192     # fp32 products a program holds per K step (block_m x block_n x block_k)


@dataclass(frozen=True)
class GemvCtx:
    """gemv.py.j2: y = x W^T for a decode step's few rows (<= block_m), the small GEMMs cuBLAS runs
    as two or three launches (the router's fp32 GEMV after a cast, the indexer's weights_proj into a
    column slice); one program per `block_n` output columns, K = `k` fixed by the weight."""
    template: ClassVar[str] = "gemv"
    k: int
    block_m: int
    block_n: int
    block_k: int
    num_warps: int

    @classmethod
    def make(cls, k: int, rows: int) -> "GemvCtx":
        """The row class of `rows` (<= GEMV_ROW_CLASSES[-1]); two output columns per program."""
        block_m = next((r for r in GEMV_ROW_CLASSES if rows <= r), None)
        if block_m is None:
            raise ValueError(f"gemv: {rows} rows is more than its largest row class {GEMV_ROW_CLASSES[-1]}")
        block_n = 2
        block_k = min(next_pow2(int(k)), GEMV_PRODUCTS // (block_m * block_n))
        return cls(int(k), block_m, block_n, block_k, 4)

    @classmethod
    def variants(cls, k: int) -> list:
        return [cls.make(k, r) for r in GEMV_ROW_CLASSES]


@dataclass(frozen=True)
class NarrowGemmCtx:
    """narrow_gemm.py.j2: y = x W^T for a weight of few output columns past the gemv kernel's rows:
    the router's fp32 logits, which cuBLAS ran as x.float(), an fp32 SIMT GEMM and its split-K
    reduction (bench/glue_micro.py on an H200, 2026-12-04, [256, 6144]: 32 rows 18.3 -> 12.0 us,
    128 rows 24.8 -> 15.9, 4096 rows 331 -> 245; weights_proj's bf16 [32, 6144] lost to cuBLAS and
    its copy, 9.3 vs 7.8 us at 32 rows, so it stays there). Tensor-core tiles on fp32 operands: TF32
    products for a 16-bit weight (exact: bf16 and fp16 values are TF32 values), three TF32 products
    for an fp32 weight (fp32's accuracy); the split count is a run-time argument (`narrow_splits`),
    the partials summed by fp8_split_reduce."""
    template: ClassVar[str] = "narrow_gemm"
    n: int
    k: int
    k_blocks: int
    block_m: int
    block_n: int
    block_k: int
    n_tiles: int
    dot_dtype: str
    precision: str
    num_warps: int
    num_stages: int

    @classmethod
    def make(cls, n: int, k: int, w_dtype: torch.dtype) -> "NarrowGemmCtx":
        n, k = int(n), int(k)
        if w_dtype not in _DOT:
            raise ValueError(f"narrow_gemm: weight dtype {w_dtype} is not one of {sorted(map(str, _DOT))}")
        block_n = narrow_block_n(n)
        # fp32 operands always (Triton 3.9's interpreter multiplies 16-bit dots wrongly): a 16-bit weight
        # and x in its dtype are exact in TF32, so one TF32 product is the 16-bit MMA's; fp32: three
        return cls(n, k, -(-k // NARROW_BLOCK_K), NARROW_BLOCK_M, block_n, NARROW_BLOCK_K, -(-n // block_n),
                   "tl.float32", "tf32x3" if w_dtype == torch.float32 else "tf32", 4, 3)


@dataclass(frozen=True)
class P2pAllReduceCtx:
    """p2p_allreduce.py.j2: a one-shot all-reduce (or reduce-scatter) over peer memory, one output
    row per program, optionally fused with the residual add and RMSNorm (fused.allreduce_add_rms);
    or (`gather`) a one-shot all-gather of rows, one input row per program; or (`exchange`, with the
    reduce-scatter's layout) an all-to-all of equal chunks, output rows by source rank."""
    template: ClassVar[str] = "p2p_allreduce"
    world: int
    hidden: int
    eps: float
    has_norm: bool
    scatter: bool
    gather: bool
    exchange: bool
    block_d: int
    num_warps: int

    @classmethod
    def make(cls, world: int, hidden: int, eps: float | None, has_norm: bool, scatter: bool,
             gather: bool = False, exchange: bool = False) -> "P2pAllReduceCtx":
        block = next_pow2(hidden)
        return cls(int(world), hidden, float(eps or 0.0), bool(has_norm), bool(scatter or exchange), bool(gather),
                   bool(exchange), block, _warps(block, 1024))


@dataclass(frozen=True)
class MoeRouterCtx:
    """moe_router.py.j2: experts as a [groups, experts per group] tile; top-k by repeated argmax."""
    template: ClassVar[str] = "moe_router"
    num_experts: int
    n_group: int
    group_size: int
    topk_group: int
    top_k: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    group_limited: bool
    masked_score: str  # what experts of dropped groups score: torch_ref uses -inf (SGLang); HF uses 0.0
    block_groups: int
    block_group_size: int
    block_k: int
    num_warps: int

    @classmethod
    def make(cls, num_experts, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor):
        if num_experts % n_group or not 1 <= topk_group <= n_group or top_k > num_experts:
            raise ValueError(f"moe_router: experts {num_experts}, n_group {n_group}, topk_group {topk_group},"
                             f" top_k {top_k} are inconsistent")
        gs = num_experts // n_group
        return cls(num_experts, n_group, gs, topk_group, top_k, bool(norm_topk_prob),
                   float(routed_scaling_factor), topk_group < n_group, 'float("-inf")',
                   next_pow2(n_group), next_pow2(gs), next_pow2(top_k), _warps(num_experts, 64, 4))


@dataclass(frozen=True)
class RopeCtx:
    """rope.py.j2: rotate the first rope_dim of head_dim dims of [T, heads, head_dim]."""
    template: ClassVar[str] = "rope"
    num_heads: int
    head_dim: int
    rope_dim: int
    half_rope: int
    interleaved: bool
    attention_factor: float  # yarn's factor on cos/sin
    scaled: bool             # attention_factor != 1
    has_pass: bool
    block_h: int
    block_half: int
    block_pass: int
    num_warps: int

    @classmethod
    def make(cls, num_heads, head_dim, rope_dim, interleaved, attention_factor=1.0):
        half, rest = rope_dim // 2, head_dim - rope_dim
        block_h = min(next_pow2(num_heads), 16)
        return cls(num_heads, head_dim, rope_dim, half, bool(interleaved), float(attention_factor),
                   attention_factor != 1.0, rest > 0, block_h, next_pow2(half), next_pow2(max(rest, 1)),
                   _warps(block_h * head_dim, 512, 4))


@dataclass(frozen=True)
class QkvNormRopeWriteCtx:
    """qkv_norm_rope_write.py.j2: q/kv latent RMSNorm, k_pe RoPE, KV (and indexer K) cache write."""
    template: ClassVar[str] = "qkv_norm_rope_write"
    q_lora: int
    kv_lora: int
    rope_dim: int
    half_rope: int
    kv_pe_hi: int  # kv_lora + half_rope: where the rotated second halves go in a cache row
    eps: float
    interleaved: bool
    has_index_k: bool
    index_dim: int
    index_eps: float
    index_interleaved: bool
    attention_factor: float  # yarn's factor on cos/sin (both RoPEs)
    scaled: bool             # attention_factor != 1
    block_q: int
    block_kv: int
    block_half: int
    block_index: int
    num_warps: int
    # FP8 caches (`codegen.fp8_ref`): the latent quantised per `group` values (`num_groups` scales),
    # the indexer keys per key, in pages of `page` slots
    kv_fp8: bool = False
    index_fp8: bool = False
    any_fp8: bool = False
    group: int = FP8_BLOCK
    num_groups: int = 0
    page: int = KV_PAGE

    @classmethod
    def make(cls, q_lora, kv_lora, rope_dim, eps, interleaved, index_dim=0, index_eps=1e-6,
             index_interleaved=True, attention_factor=1.0, kv_fp8=False, index_fp8=False):
        half = rope_dim // 2
        index_fp8 = bool(index_fp8 and index_dim > 0)
        return cls(q_lora, kv_lora, rope_dim, half, kv_lora + half, float(eps), bool(interleaved),
                   index_dim > 0, index_dim, float(index_eps), bool(index_interleaved), float(attention_factor),
                   attention_factor != 1.0, next_pow2(q_lora), next_pow2(kv_lora), next_pow2(half),
                   next_pow2(max(index_dim, 1)), _warps(q_lora, 512, 4), bool(kv_fp8), index_fp8,
                   bool(kv_fp8) or index_fp8, FP8_BLOCK, -(-kv_lora // FP8_BLOCK) if kv_fp8 else 0, KV_PAGE)


@dataclass(frozen=True)
class QueryRope:
    """RoPE that a kernel turns its query by as it loads it (a ROPE_READERS op's rope_* attributes,
    fuse-query-rope): rope.apply's `dims`, pairing, theta and yarn `scaling`. Its kernel fields
    (`fields`: the `q_rope_*` of a context, read by `_rope_query.j2`) hold what the source depends
    on; theta and the yarn frequencies reach the kernel as a launch argument (the inv_freq table)."""
    dims: int
    theta: float
    interleaved: bool = True
    scaling: tuple | None = None

    @classmethod
    def of(cls, op) -> "QueryRope | None":
        """The RoPE an op's kernel turns its query by, None where it reads the query as it is."""
        if op.attr("rope_dims") is None:
            return None
        return cls(int(op.attr("rope_dims")), float(op.attr("rope_theta")), bool(op.attr("rope_interleaved", True)),
                   op.attr("rope_scaling"))

    @staticmethod
    def fields(rope: "QueryRope | None") -> dict:
        """A context's q_rope_* fields: dims 0 (the query read as it is), or the turned dims, half of
        them, the pairing and yarn's factor on cos and sin."""
        if rope is None:
            return {}
        return dict(q_rope_dims=rope.dims, q_rope_half=rope.dims // 2, q_rope_interleaved=rope.interleaved,
                    q_rope_factor=rope_attention_factor(rope.scaling))


@dataclass(frozen=True)
class IndexerScoresCtx:
    """indexer_scores.py.j2: one (token, key block) per program, heads padded to a dot tile; or
    (`block_m` > 1, prefill) one (block of a request's tokens, key block) per program, a dot per head."""
    template: ClassVar[str] = "indexer_scores"
    num_heads: int
    index_dim: int
    scale: float
    block_h: int
    block_n: int
    dot_dtype: str
    dot_precision: str
    num_warps: int
    fp8: bool = False   # keys from the FP8 page layout, dequantised in registers
    page: int = KV_PAGE
    w_scale: float = 1.0   # multiplies the head weights as loaded (the plan's: num_heads ** -0.5)
    block_m: int = 1       # tokens per program: 1, or a prefill token block sharing its key tile
    num_stages: int = 2
    q_rope_dims: int = 0   # the query's first dims turned as loaded (`QueryRope`); 0: read as it is
    q_rope_half: int = 0
    q_rope_interleaved: bool = True
    q_rope_factor: float = 1.0

    @classmethod
    def make(cls, num_heads, index_dim, dtype, block_n=None, fp8=False, w_scale=1.0, rope=None):
        dot_dtype, precision = _DOT[dtype]
        block_n = block_n or INDEXER_BLOCK_N
        return cls(num_heads, index_dim, index_dim ** -0.5, max(16, next_pow2(num_heads)), block_n,
                   dot_dtype, precision, 4, bool(fp8), KV_PAGE, float(w_scale), **QueryRope.fields(rope))

    @classmethod
    def make_tiled(cls, num_heads, index_dim, dtype, fp8=False, w_scale=1.0, block_m=None, block_n=None,
                   num_warps=None, num_stages=None, rope=None):
        """The prefill kernel: block_m tokens x block_n keys per program. Defaults 64 x 256, 8 warps, 3
        stages: each key read once per 64 tokens, each head's q tile once per 256 keys. Measured on an
        H200 (8192 tokens over 32K FP8 keys, GLM-5.3's 32 x 128 indexer, 2026-12-04): 4.52 ms; 2 stages
        5.69, 64 x 128 8.63, 128 x 128 6.17, 128 x 256 6.50, 32 x 256 at 4 warps 7.95; the per-token
        kernel 16.6."""
        base = cls.make(num_heads, index_dim, dtype, fp8=fp8, w_scale=w_scale, rope=rope)
        return replace(base, block_m=block_m or 64, block_n=block_n or 256, num_warps=num_warps or 8,
                       num_stages=num_stages or 3)






@dataclass(frozen=True)
class TopkSelectCtx:
    """topk_select.py.j2: exact k-th-largest threshold by bitwise search, then ordered compaction."""
    template: ClassVar[str] = "topk_select"
    k: int
    chunk: int
    num_warps: int

    @classmethod
    def make(cls, k, row_len=None, chunk=None, num_warps=None):
        """`chunk` scores per pass: given (a plan's TOPK_CHUNK), else fitted to `row_len`."""
        chunk = chunk or min(TOPK_CHUNK, next_pow2(max(row_len, 16)))
        return cls(k, chunk, num_warps or _warps(chunk, 256, 8))


@dataclass(frozen=True)
class SparseMlaDecodeCtx:
    """sparse_mla_decode.py.j2: absorbed MLA split-K partials over top-k slots (or causal positions).
    The split count is a run-time argument (`mla_num_splits`), so one kernel serves every batch of
    its token class (`mla_wide`: 16-head or 64-head tiles; FP8 rows also by dot operand type), head-major;
    FP8 rows scaled per gathered tile. The key-major and per-group FP8 forms stay for
    `bench/mla_tiles_sweep.py`: the sweep that rejected them had 64 heads on the GPU, and a rank of
    a tensor-parallel plan holds 8 (tp8), where a head-major tile pads the MMA's 16 rows with heads
    it does not have and key-major puts keys there instead; they are still to be swept at 8 heads."""
    template: ClassVar[str] = "sparse_mla_decode"
    num_heads: int
    kv_lora: int
    rope_dim: int
    has_topk: bool
    topk: int
    block_h: int
    block_n: int
    key_major: bool  # [keys, heads] scores: lets the MMA's M be keys / latent dims instead of heads
    qk_scale_log2: float  # softmax scale * log2(e): the kernel works in exp2
    dot_dtype: str
    dot_precision: str
    num_warps: int
    num_stages: int
    kv_fp8: bool = False   # FlashMLA FP8 rows: c_kv e4m3 with one fp32 scale per `group` values
    group: int = FP8_BLOCK
    dequant: bool = False  # FP8 rows: scale each gathered tile once (one dot over kv_lora), not per group
    v_parts: int = 1       # programs per head block, each accumulating kv_lora / v_parts output columns
    q_rope_dims: int = 0   # q_pe turned as loaded (`QueryRope`); 0: read as it is
    q_rope_half: int = 0
    q_rope_interleaved: bool = True
    q_rope_factor: float = 1.0

    @classmethod
    def make(cls, num_heads, kv_lora, rope_dim, topk, scale, dtype, num_tokens, block_h=None, block_n=None,
             num_warps=None, num_stages=None, key_major=None, kv_fp8=False, dot16=None, dequant=None, v_parts=None,
             rope=None):
        if kv_lora != next_pow2(kv_lora) or rope_dim != next_pow2(rope_dim):
            raise ValueError(f"sparse_mla_decode needs power-of-two kv_lora/rope dims, got {kv_lora}/{rope_dim}")
        # Why these defaults: sweeps on an H200 (64 heads, k 2048, contexts 1K and 2K):
        # - 2026-12-02 (bench/results/mla_tiles_sweep_h200_2026-12-02_dequant.json): head-major everywhere;
        #   FP8 rows scaled once per gathered tile (dequant: 32 tokens 89.7 us at 2K against 163.8 for the
        #   per-group key-major kernel, 128 tokens 265.5 against 474.1).
        # - 2026-12-04 (bench/results/h200_2026-12-04/mla_tiles_sweep_*.json): from 32 tokens 64 x 64
        #   tiles at 8 warps, all 64 heads in one program (Hopper's wgmma, not mma.sync): bf16 rows at 32 /
        #   128 / 8192 tokens 60.4 / 194.0 / 11646 us against 69.5 / 209.5 / 12311 for 32 x 64 at 4 warps.
        #   Key-major 64 x 128 (its scores dot 64 keys per warp group, where head-major computes the
        #   [64 heads, keys] scores in both warp groups alike: Triton's layout for a chained dot) lost at
        #   every count (74.6 / 227.1 / 13181; FP8 rows 143.9 at 32 tokens), spilling more.
        # - 2026-12-04 (bench/results/h200_2026-12-04/mla_tiles_sweep_{small,wide_dot16}.json): the
        #   wide class from 4 (FP8 rows) or 8 (bf16) tokens (`mla_wide`), parts by `mla_v_parts`. Dot
        #   operands for FP8 rows: fp16 in the narrow class (1 / 2 tokens 14.4 / 17.1 us against 15.9 /
        #   23.4 in bf16: e4m3 -> fp16 is one conversion instruction), bf16 in the wide one (8 / 16 / 32 /
        #   128 tokens 26.0 / 40.8 / 71.3 / 225.7 against 34.5 / 54.8 / 94.8 / 304.0 in fp16, which spills
        #   114 registers at 32 tokens and up against 24).
        wide = mla_wide(num_tokens, num_heads, kv_fp8)
        dequant = kv_fp8 if dequant is None else dequant
        if kv_fp8 and dot16 is None:
            dot16 = not wide
        tile_h, tile_n, warps = mla_tiles(wide)
        block_h, block_n, num_warps = block_h or tile_h, block_n or tile_n, num_warps or warps
        num_stages = num_stages or (2 if wide or not kv_fp8 else 1)
        dot_dtype, precision = _DOT[torch.float16 if dot16 and kv_fp8 and dtype != torch.float32 else dtype]
        if v_parts is None:
            v_parts = mla_v_parts(num_tokens, num_heads, kv_lora, kv_fp8 and dequant and not key_major)
        v_parts = int(v_parts)
        if v_parts > 1 and (key_major or (kv_fp8 and not dequant) or v_parts != next_pow2(v_parts)
                            or kv_lora // v_parts < (FP8_BLOCK if kv_fp8 else 16)):
            raise ValueError(f"sparse_mla_decode: v_parts={v_parts} needs head-major tiles, FP8 rows scaled per "
                             f"tile, a power of two and parts of >= {FP8_BLOCK if kv_fp8 else 16} of kv_lora {kv_lora}")
        return cls(num_heads, kv_lora, rope_dim, topk is not None, topk or 0, block_h, block_n, bool(key_major),
                   float(scale) * 1.4426950408889634, dot_dtype, precision, num_warps, num_stages, bool(kv_fp8),
                   FP8_BLOCK, bool(dequant and kv_fp8), v_parts, **QueryRope.fields(rope))

    @classmethod
    def variants(cls, num_heads, kv_lora, rope_dim, topk, scale, dtype, kv_fp8=False,
                 rope=None) -> list["SparseMlaDecodeCtx"]:
        """Every context `make` gives for some token count (the token classes)."""
        out = [cls.make(num_heads, kv_lora, rope_dim, topk, scale, dtype, t, kv_fp8=kv_fp8, rope=rope)
               for t in (1, 4, 8, 32, 64)]
        return list(dict.fromkeys(out))


@dataclass(frozen=True)
class MlaCombineCtx:
    """mla_combine.py.j2: merge split-K partials by their log-sum-exp; the split count is a run-time
    argument up to `block_splits` (a power of two)."""
    template: ClassVar[str] = "mla_combine"
    num_heads: int
    kv_lora: int
    block_splits: int
    num_warps: int

    @classmethod
    def make(cls, num_heads, kv_lora, num_splits):
        block = next_pow2(num_splits)
        return cls(num_heads, kv_lora, block, _warps(kv_lora * block, 1024, 4))

    @classmethod
    def variants(cls, num_heads, kv_lora) -> list["MlaCombineCtx"]:
        """One per power-of-two split bound up to MLA_MAX_SPLITS."""
        return [cls.make(num_heads, kv_lora, 1 << i) for i in range(MLA_MAX_SPLITS.bit_length())]


@dataclass(frozen=True)
class SiluMulCtx:
    """silu_mul.py.j2: a bf16 (or fp32) SwiGLU's activation between its two cuBLAS GEMMs, one launch
    where torch ran silu and the product (two, and one more [T, inter] pass)."""
    template: ClassVar[str] = "silu_mul"
    inter: int
    block: int
    num_warps: int

    @classmethod
    def make(cls, inter: int) -> "SiluMulCtx":
        block = min(1024, next_pow2(int(inter)))
        return cls(int(inter), block, _warps(block, 256))


@dataclass(frozen=True)
class SampleCtx:
    """sample.py.j2: one vocab row per program in chunks; cuts found by bit search; race draw."""
    template: ClassVar[str] = "sample"
    vocab: int
    chunk: int
    search_chunk: int  # the cut searches judge 16 candidate keys per token: [search_chunk, 16] tiles
    write_kept: bool  # also write the kept mask [B, V] (tests, benchmarks)
    num_warps: int

    @classmethod
    def make(cls, vocab, write_kept=False, chunk=None):
        chunk = chunk or min(4096, next_pow2(vocab))
        return cls(vocab, chunk, min(chunk, 1024), bool(write_kept), _warps(chunk, 256, 8))


@dataclass(frozen=True)
class StepInputsCtx:
    """step_inputs.py.j2: the executor's step prologue (device-sampled ids, own KV slots), one kernel
    for every batch."""
    template: ClassVar[str] = "step_inputs"
    block: int
    num_warps: int

    @classmethod
    def make(cls):
        return cls(256, 4)


@dataclass(frozen=True)
class ArgmaxCtx:
    """argmax.py.j2: greedy sampling, each row split over programs; the last of a row's reduces."""
    template: ClassVar[str] = "argmax"
    vocab: int
    chunk: int
    splits_block: int
    num_warps: int

    @classmethod
    def make(cls, vocab, chunk=None):
        chunk = chunk or min(2048, next_pow2(vocab))
        return cls(int(vocab), chunk, ARGMAX_SPLITS, _warps(chunk, 256, 8))
