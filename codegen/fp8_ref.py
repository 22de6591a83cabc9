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

from dataclasses import dataclass

import torch

from glmc.target import FP8_BLOCK

FP8_MAX = 448.0   # largest finite float8_e4m3fn


def fp8_block_dequant(w_fp8, scale_inv, block=FP8_BLOCK):
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


def quantize_weight_blocks(w, block=FP8_BLOCK):
    """(Wq float8_e4m3fn [N, K], S fp32 [ceil(N/block), ceil(K/block)]) per block x block: the
    checkpoint convention, for quantising a bf16 checkpoint on load."""
    return _quantize(w, block, block)


def quantize_token_groups(x, group=FP8_BLOCK):
    """(xq float8_e4m3fn [M, K], s fp32 [M, ceil(K/group)]): per row and group of `group` columns."""
    return _quantize(x, 1, group)


def fp8_gemm(xq, xs, wq, ws, block=FP8_BLOCK):
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


@dataclass(frozen=True, eq=False)   # tensors: identity, not element-wise equality
class Fp8Weight:
    """A block-scaled FP8 weight as the CUDA target holds it: `q` float8_e4m3fn [..., N, K] and
    `scale_inv` fp32 [..., ceil(N/128), ceil(K/128)] (W = q * scale_inv per 128 x 128 block; a
    leading dim stacks experts). Carried through the loader and the op table in place of a tensor."""
    q: torch.Tensor
    scale_inv: torch.Tensor

    def __post_init__(self):
        blocks = tuple(-(-d // FP8_BLOCK) for d in self.q.shape[-2:])
        if (self.q.dtype != torch.float8_e4m3fn or self.q.shape[:-2] != self.scale_inv.shape[:-2]
                or tuple(self.scale_inv.shape[-2:]) != blocks):
            raise ValueError(f"Fp8Weight: {self.q.dtype} {tuple(self.q.shape)} with scales "
                             f"{tuple(self.scale_inv.shape)}: want float8_e4m3fn and scales {blocks}")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale_inv.nbytes

    def to(self, device) -> "Fp8Weight":
        return Fp8Weight(self.q.to(device), self.scale_inv.to(device, torch.float32))

    def dequant(self, dtype=torch.float32) -> torch.Tensor:
        """W in `dtype` (fp32 math, then one rounding)."""
        if self.q.dim() == 2:
            return fp8_block_dequant(self.q, self.scale_inv).to(dtype)
        return torch.stack([Fp8Weight(q, s).dequant(dtype) for q, s in zip(self.q, self.scale_inv)])

    @classmethod
    def quantize(cls, w) -> "Fp8Weight":
        """`quantize_weight_blocks` per [N, K] matrix (one expert at a time for a stack)."""
        if w.dim() == 2:
            return cls(*quantize_weight_blocks(w))
        parts = [quantize_weight_blocks(m) for m in w]
        return cls(torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]))

    @classmethod
    def stack(cls, weights: list["Fp8Weight"]) -> "Fp8Weight":
        """[N, K] weights of one shape -> one [E, N, K] stack."""
        return cls(torch.stack([w.q for w in weights]), torch.stack([w.scale_inv for w in weights]))

    @classmethod
    def cat_rows(cls, weights: list["Fp8Weight"], pad: bool = False) -> "Fp8Weight":
        """Rows of several weights as one (the fused gate_up, the A-projection): every part but the
        last must end on a 128-row block boundary, or the scale rows would not line up; `pad`: such
        a part is padded with zero rows to its block instead (its scale row covers them; the GEMM
        skips their output columns, `fp8_group_gap`)."""
        bad = [tuple(w.shape) for w in weights[:-1] if w.shape[-2] % FP8_BLOCK]
        if bad and not pad:
            raise ValueError(f"Fp8Weight.cat_rows: parts {bad} do not end on a {FP8_BLOCK}-row block")
        qs = [w.q for w in weights]
        for i, w in enumerate(weights[:-1]):
            if w.shape[-2] % FP8_BLOCK:
                qs[i] = torch.cat([w.q, w.q.new_zeros(*w.q.shape[:-2], -w.shape[-2] % FP8_BLOCK, w.shape[-1])], -2)
        return cls(torch.cat(qs, -2), torch.cat([w.scale_inv for w in weights], -2))


def moe_experts_fp8(x, ids, weights, w_gate: Fp8Weight, w_up: Fp8Weight, w_down: Fp8Weight, expert_offset=0):
    """`torch_ref.moe_experts`'s contract on block-FP8 expert stacks, computed as the w8a8 kernels do:
    x quantised per token per 128 columns; per route g, u = fp8_gemm(x, gate/up); h = silu(g) * u
    rounded to x's dtype, then quantised per 128 columns; y = w * fp8_gemm(h, down), summed over the
    token's routes in slot order -> fp32 [T, H]. Routes to experts outside [offset, offset + E) add 0."""
    T, k = ids.shape
    E = w_gate.shape[0]
    xq, xs = quantize_token_groups(x)
    out = torch.zeros(T, w_down.shape[1], dtype=torch.float32, device=x.device)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j]) - expert_offset
            if not 0 <= e < E:
                continue
            g = fp8_gemm(xq[t:t + 1], xs[t:t + 1], w_gate.q[e], w_gate.scale_inv[e])
            u = fp8_gemm(xq[t:t + 1], xs[t:t + 1], w_up.q[e], w_up.scale_inv[e])
            h = (g / (1.0 + torch.exp(-g)) * u).to(x.dtype).float()
            y = fp8_gemm(*quantize_token_groups(h), w_down.q[e], w_down.scale_inv[e])
            out[t] += float(weights[t, j]) * y[0]
    return out


# ----------------------------------------------------------------------------- FP8 KV caches
# FlashMLA's sparse FP8 latent cache: one 656-byte row per token = the latent's kv_lora e4m3 values,
# then one fp32 scale per 128 of them, then the RoPE'd key in bf16. The indexer's key cache
# (DeepGEMM `fp8_paged_mqa_logits`, SGLang `nsa_indexer`): per page of PAGE tokens, all PAGE x dim
# e4m3 key bytes first, then the PAGE fp32 scales (132 bytes per token at dim 128). Both quantise
# with `quantize_token_groups` (s = amax / 448 per group of 128).
KV_PAGE = 64


def kv_fp8_row_bytes(kv_lora: int, rope_dim: int) -> int:
    """Bytes of one token's latent-cache row: 656 for GLM-5 / DeepSeek-V3.2 (512 + 4 x 4 + 64 x 2)."""
    return kv_lora + 4 * -(-kv_lora // FP8_BLOCK) + 2 * rope_dim


def index_fp8_row_bytes(dim: int) -> int:
    """Bytes per token of the FP8 indexer key cache: 132 at dim 128 (keys + one fp32 scale)."""
    return dim + 4


def kv_fp8_views(rows: torch.Tensor, kv_lora: int):
    """(latent e4m3 [n, kv_lora], scales fp32 [n, kv_lora/128], k_pe bf16 [n, rope]) views of uint8
    rows [n, 656] (contiguous rows: each view keeps the row's byte stride in its own element size)."""
    n, width = rows.shape
    groups = -(-kv_lora // FP8_BLOCK)
    pe0 = kv_lora + 4 * groups
    if width % 4 or pe0 % 4:
        raise ValueError(f"kv_fp8_views: a {width}-byte row with the scales at {kv_lora} cannot be viewed as fp32")
    return (rows.view(torch.float8_e4m3fn)[:, :kv_lora], rows.view(torch.float32)[:, kv_lora // 4:pe0 // 4],
            rows.view(torch.bfloat16)[:, pe0 // 2:])


def kv_fp8_pack(c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """uint8 rows [n, kv_fp8_row_bytes] holding quantised c_kv [n, kv_lora] and k_pe [n, rope] in bf16."""
    n, kv_lora = c_kv.shape
    rows = torch.empty(n, kv_fp8_row_bytes(kv_lora, k_pe.shape[1]), dtype=torch.uint8, device=c_kv.device)
    q, s, pe = kv_fp8_views(rows, kv_lora)
    q[:], s[:] = quantize_token_groups(c_kv)
    pe[:] = k_pe.to(torch.bfloat16)
    return rows


def kv_fp8_unpack(rows: torch.Tensor, kv_lora: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_kv fp32 [n, kv_lora], k_pe fp32 [n, rope]) of packed rows: q * s per group of 128."""
    q, s, pe = kv_fp8_views(rows, kv_lora)
    return q.float() * s.repeat_interleave(FP8_BLOCK, 1)[:, :kv_lora], pe.float()


def kv_fp8_round(c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The values an FP8 latent cache gives back for (c_kv, k_pe): the torch target's emulation."""
    return kv_fp8_unpack(kv_fp8_pack(c_kv, k_pe), c_kv.shape[1])


def index_fp8_round(k: torch.Tensor) -> torch.Tensor:
    """The values an FP8 indexer key cache gives back for keys k [n, dim] (fp32)."""
    q, s = quantize_token_groups(k, group=k.shape[1])
    return q.float() * s


def index_fp8_views(pages: torch.Tensor, dim: int):
    """(keys e4m3 [num_pages, KV_PAGE, dim], scales fp32 [num_pages, KV_PAGE]) views of the uint8 page
    tensor [num_pages, KV_PAGE * (dim + 4)] (a page's keys first, then its scales): slot s is
    [s // KV_PAGE, s % KV_PAGE]."""
    keys = pages[:, :KV_PAGE * dim].view(torch.float8_e4m3fn).unflatten(1, (KV_PAGE, dim))
    scales = pages.view(torch.float32)[:, KV_PAGE * dim // 4:]
    return keys, scales
