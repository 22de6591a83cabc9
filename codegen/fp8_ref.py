"""FP8 numerics, reference side (fp32 torch): the block-scaled convention of DeepSeek-V3 / GLM-5
checkpoints and the per-token-group activation quantisation of the w8a8 GEMM.

- Weights: Wq float8_e4m3fn [N, K] and `weight_scale_inv` S [ceil(N/128), ceil(K/128)] fp32,
  W = Wq * S per 128 x 128 block (`fp8_block_dequant`, `quantize_weight_blocks`).
- Activations: per token, per group of 128 columns, s = max|x| / 448 (1 for an all-zero group),
  xq = e4m3(x / s) rounded to nearest even, x ~ xq * s (`quantize_token_groups`).
- The w8a8 GEMM (`fp8_gemm`): y[m, n] = sum over K blocks kb of (xq[m, kb] . Wq[n, kb]) *
  s[m, kb] * S[n // 128, kb]: each block's fp8 dot product is exact in fp32, then scaled, in the
  order the kernel accumulates.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0   # largest finite float8_e4m3fn
BLOCK = 128


def fp8_block_dequant(w_fp8, scale_inv, block=BLOCK):
    """W[i, j] = Wq[i, j] * S[i // block, j // block] in fp32 (DeepSeek/GLM block-scaled FP8)."""
    rows, cols = w_fp8.shape
    s = scale_inv.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return w_fp8.float() * s


def _quantize(x, rows: int, cols: int):
    """(xq float8_e4m3fn, scales fp32 [ceil(M/rows), ceil(K/cols)]) per [rows, cols] block of x [M, K]:
    s = max|block| / 448 (1 for an all-zero block), xq = e4m3(x / s) (round to nearest even)."""
    m, k = x.shape
    pad = torch.zeros(-(-m // rows) * rows, -(-k // cols) * cols, dtype=torch.float32, device=x.device)
    pad[:m, :k] = x.float()
    blocks = pad.view(pad.shape[0] // rows, rows, pad.shape[1] // cols, cols)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(pad)[:m, :k]
    return q.to(torch.float8_e4m3fn), scale


def quantize_weight_blocks(w, block=BLOCK):
    """(Wq float8_e4m3fn [N, K], S fp32 [ceil(N/block), ceil(K/block)]) per block x block: the
    checkpoint convention, for quantising a bf16 checkpoint on load."""
    return _quantize(w, block, block)


def quantize_token_groups(x, group=BLOCK):
    """(xq float8_e4m3fn [M, K], s fp32 [M, ceil(K/group)]): per row and group of `group` columns."""
    return _quantize(x, 1, group)


def fp8_gemm(xq, xs, wq, ws, block=BLOCK):
    """y = x W^T in fp32 from per-token-group FP8 activations and block-scaled FP8 weights (module
    docstring): [M, N]."""
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.zeros(m, n, dtype=torch.float32, device=xq.device)
    for kb in range(-(-k // block)):
        cols = slice(kb * block, min(k, (kb + 1) * block))
        part = xq[:, cols].float() @ wq[:, cols].float().T
        y += part * xs[:, kb, None] * ws[torch.arange(n, device=wq.device) // block, kb][None, :]
    return y
