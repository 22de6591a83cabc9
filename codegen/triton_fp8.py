"""Triton FP8 kernels: per-token-group activation quantisation and the block-scaled w8a8 GEMM.

`fp8_linear(x, wq, ws)` = `fp8_block_gemm(*quantize_tokens(x), wq, ws)` has `fp8_ref`'s contract
(DeepSeek-V3 / GLM-5 checkpoints: weights float8_e4m3fn [N, K] with a fp32 scale per 128 x 128 block;
activations quantised per token per 128 columns) and runs as

1. `fp8_quant_tokens.py.j2`: one (row, 128-column group) per program: s = max|x| / 448, q = e4m3(x / s),
   rounded to nearest even in exact fp32 steps (bit-exact with `fp8_ref.quantize_token_groups`);
2. `fp8_block_gemm.py.j2`: one output tile per program; per 128-wide K block, one FP8 tensor-core dot
   (exact products, fp32 sums), scaled by the token's and the weight block's scales, accumulated in fp32.

The CUDA target runs them for every weight an FP8 plan stores FP8 (`codegen/weight_formats.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from glmc.codegen.fp8_ref import BLOCK
from glmc.codegen.triton_render import JIT, KernelLibrary, next_pow2


@dataclass(frozen=True)
class Fp8QuantTokensCtx:
    """fp8_quant_tokens.py.j2: one (row, group) per program over rows of `k` columns."""
    template: ClassVar[str] = "fp8_quant_tokens"
    k: int
    group: int
    num_warps: int

    @classmethod
    def make(cls, k, group=BLOCK):
        if group != next_pow2(group):
            raise ValueError(f"fp8_quant_tokens: the group must be a power of two, got {group}")
        return cls(int(k), int(group), 4)


@dataclass(frozen=True)
class Fp8BlockGemmCtx:
    """fp8_block_gemm.py.j2: one [block_m, block_n] output tile per program; N, K fixed by the weight."""
    template: ClassVar[str] = "fp8_block_gemm"
    n: int
    k: int
    k_blocks: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @classmethod
    def make(cls, n, k, num_rows, block_m=None, block_n=None, num_warps=None, num_stages=None):
        """Decode-sized rows (<= 16) take 16-row tiles (the smallest MMA M), larger ones 64; 64 output
        columns per tile (a divisor of the 128-wide scale block)."""
        block_m = block_m or (16 if num_rows <= 16 else 64)
        block_n = block_n or 64
        if BLOCK % block_n or block_n < 16 or block_m < 16:
            raise ValueError(f"fp8_block_gemm: tiles {block_m} x {block_n}: block_n must divide {BLOCK}, both >= 16")
        return cls(int(n), int(k), -(-int(k) // BLOCK), block_m, block_n, num_warps or 4, num_stages or 3)

    @classmethod
    def variants(cls, n, k) -> list["Fp8BlockGemmCtx"]:
        """Both row classes (decode, prefill)."""
        return [cls.make(n, k, rows) for rows in (1, 17)]


def quantize_tokens(x, lib: KernelLibrary = JIT):
    """fp8_ref.quantize_token_groups on Triton: x [M, K] -> (xq float8_e4m3fn [M, K], s fp32 [M, K/128])."""
    m, k = x.shape
    ctx = Fp8QuantTokensCtx.make(k)
    groups = -(-k // ctx.group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if m:
        lib(ctx)[(m, groups)](x, x.stride(0), q, q.stride(0), s, s.stride(0), num_warps=ctx.num_warps)
    return q, s


def fp8_block_gemm(xq, xs, wq, ws, out_dtype=torch.bfloat16, lib: KernelLibrary = JIT, out=None, **tiles):
    """fp8_ref.fp8_gemm on Triton: -> [M, N] in `out_dtype`, or written into `out` (an [M, N] view
    with unit column stride, e.g. some columns of a wider output). `tiles` override
    Fp8BlockGemmCtx.make's."""
    m, k = xq.shape
    n = wq.shape[0]
    if wq.shape[1] != k or tuple(ws.shape) != (-(-n // BLOCK), -(-k // BLOCK)):
        raise ValueError(f"fp8_block_gemm: x {tuple(xq.shape)}, weight {tuple(wq.shape)} and its scales "
                         f"{tuple(ws.shape)} do not fit 128 x 128 blocks")
    ctx = Fp8BlockGemmCtx.make(n, k, m, **tiles)
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device) if out is None else out
    if tuple(y.shape) != (m, n) or (n > 1 and y.stride(1) != 1):
        raise ValueError(f"fp8_block_gemm: out {tuple(y.shape)} / {y.stride()} is not a [{m}, {n}] row-major view")
    if m:
        lib(ctx)[(-(-m // ctx.block_m), -(-n // ctx.block_n))](
            xq, xq.stride(0), xs, xs.stride(0), wq, wq.stride(0), ws, ws.stride(0), y, y.stride(0), m,
            num_warps=ctx.num_warps, num_stages=ctx.num_stages)
    return y


def fp8_linear(x, wq, ws, out_dtype=None, lib: KernelLibrary = JIT, **tiles):
    """x @ W^T for a block-scaled FP8 weight: quantise x per token group, then the w8a8 GEMM."""
    xq, xs = quantize_tokens(x, lib)
    return fp8_block_gemm(xq, xs, wq, ws, out_dtype or x.dtype, lib, **tiles)
