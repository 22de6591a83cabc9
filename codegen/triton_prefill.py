"""Sparse prefill attention on Triton: MLA in MHA form over each query's top-k (or causal) keys.

`mla_attention_mha(q_nope, q_pe, kv_cache, w_kv_b, topk, reqs, req_to_token, scale, dn, dv)` has
`torch_ref.mla_attention_mha`'s contract: o_h(t) = softmax_s(scale (q_nope_h.k_nope_h(s) + q_pe_h.k_pe(s)))
v_h(s) over the keys s of t's request that are causal (s <= pos(t)) and, when `topk` [T, K] is given,
among t's top-k POSITIONS (-1 padded; duplicates and future positions are tolerated and dropped);
[k_nope | v]_h = kv_b(c_kv). -> [T, H*dv] in q_nope's dtype. A query with no allowed key gets 0
(the reference gives NaN). It runs in three steps:

1. `prefill_keys` (torch ops on the device, host syncs: prefill only, not graph-capturable): each
   request's compact key list, i.e. the positions some query of it may attend to (top-k: the union of
   its rows; dense: every position), their KV slots, query blocks of `block_m` tokens that never span
   two requests and, for top-k, a per-token bitmask over the compact keys plus each block's list of
   key tiles holding an allowed key (tiles no query of the block wants are never read). It depends only
   on (batch, topk, tiles), so shared indexer layers may reuse a full layer's.
2. `expand_keys`: only the compact keys go through kv_b, one GEMM (cuBLAS) in the weight's dtype.
3. `sparse_mla_prefill.py.j2`: flash attention, one program per (query block, head): Q [block_m, dn+dr]
   times key tiles [block_n, dn+dr] is a real GEMM (queries of a block share the key tile), masked
   by the bitmask (top-k) or causality (dense). Work per block ~ its key tiles x block_m, so a block
   whose queries pick scattered keys still computes whole tiles (see `prefill_keys`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from glmc.codegen import fp8_ref
from glmc.codegen.triton_render import _DOT, JIT, next_pow2

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class SparseMlaPrefillCtx:
    """sparse_mla_prefill.py.j2: one (query block, head) per program; top-k or dense causal keys."""
    template: ClassVar[str] = "sparse_mla_prefill"
    num_heads: int
    qk_nope: int
    rope_dim: int
    v_dim: int
    kv_head: int        # dn + dv: one head's [k_nope | v] columns in an expanded key row
    nope_lo: int        # dn = nope_lo (largest power of two <= dn) + nope_hi: GLM 192 = 128 + 64
    nope_hi: int
    has_nope_hi: bool
    nope_hi_block: int
    rope_block: int
    v_block: int
    has_topk: bool
    block_m: int
    block_n: int
    word_bits: int  # allowed-key bits per int32 mask word (min(32, block_n): a tile spans whole words)
    qk_scale_log2: float
    dot_dtype: str
    dot_precision: str
    num_warps: int
    num_stages: int

    @classmethod
    def make(cls, num_heads, dn, dr, dv, has_topk, scale, dtype, block_m=None, block_n=None, num_warps=None,
             num_stages=None, interpret=None):
        """Defaults are FA2's for head dim 256 on sm_90: 64 x 64 tiles, 8 warps, 2 stages (Q + 2 x (K, V)
        bf16 tiles = 160 KB of shared memory, acc 64 fp32 registers per thread). Under the interpreter
        (default: $TRITON_INTERPRET) dots take fp32 operands: Triton 3.9's interpreter multiplies 16-bit
        floats' raw bits (its create_dot converts only fp8)."""
        block_m, block_n = block_m or 64, block_n or 64
        if block_m != next_pow2(block_m) or block_n != next_pow2(block_n):
            raise ValueError(f"sparse_mla_prefill: tiles must be powers of two, got {block_m} x {block_n}")
        if interpret is None:
            interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        dot_dtype, precision = _DOT[torch.float32 if interpret else dtype]
        lo = next_pow2(dn + 1) // 2
        hi = dn - lo
        if not interpret and min(block_m, block_n, lo, next_pow2(dr), hi or 16) < 16:
            raise ValueError(f"sparse_mla_prefill: tl.dot needs sizes >= 16, got tiles {block_m} x {block_n},"
                             f" nope {lo} + {hi}, rope {dr}")
        return cls(int(num_heads), int(dn), int(dr), int(dv), int(dn) + int(dv), lo, hi, hi > 0,
                   next_pow2(max(hi, 1)), next_pow2(dr), next_pow2(dv), bool(has_topk), block_m, block_n,
                   min(32, block_n), float(scale) * LOG2E, dot_dtype, precision, num_warps or 8, num_stages or 2)


@dataclass(frozen=True)
class Requests:
    """The prefill step's requests as host tensors [B]: req_to_token row, new tokens, total tokens;
    and each new token's position [T]. (`Requests(b.req_pool_indices, b.extend_lens, b.seq_lens,
    b.positions)` of a runtime ForwardBatch `b`.)"""
    rows: torch.Tensor
    extend_lens: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.rows.numel()


@dataclass(frozen=True)
class PrefillKeys:
    """Which key rows each query block reads (see module docstring, step 1). U = compact keys, NQB =
    query blocks, W = mask words per token, NT = key tiles per request (max)."""
    slots: torch.Tensor          # [U] int64 KV slot of each compact key, request by request
    blocks: torch.Tensor         # [NQB, 4] int32 (first token, end token, first key row, keys in request)
    bits: torch.Tensor | None    # [T, W] int32: bit c of token t = compact key c of its request allowed
    tiles: torch.Tensor | None   # [NQB, NT] int32 key tiles holding an allowed key, first num_tiles valid
    num_tiles: torch.Tensor | None  # [NQB] int32
    block_m: int
    block_n: int


def _query_blocks(extend_lens, block_m):
    """[NQB, 2] (first token, end token) of block_m-token blocks that never span two requests, and each
    block's request index [NQB] (host tensors)."""
    ext = extend_lens.long()
    nblk = (ext + block_m - 1) // block_m
    req = torch.repeat_interleave(torch.arange(ext.numel()), nblk)
    tok_off = torch.cumsum(ext, 0) - ext
    start = tok_off[req] + (torch.arange(req.numel()) - (torch.cumsum(nblk, 0) - nblk)[req]) * block_m
    end = torch.minimum(start + block_m, (tok_off + ext)[req])
    return torch.stack([start, end], 1), req


def _dense_keys(reqs, rows, r2t, dev):
    """Every position of every request: (slots [U], first key row [B], keys [B])."""
    seq = reqs.seq_lens.to(dev)
    start = torch.cumsum(seq, 0) - seq
    key_req = torch.repeat_interleave(torch.arange(seq.numel(), device=dev), seq)
    key_pos = torch.arange(key_req.numel(), device=dev) - start[key_req]
    return r2t[rows[key_req], key_pos].long(), start, seq


def _sparse_keys(reqs, topk, rows, r2t, tok_req, wb, block_n):
    """Union of each request's allowed top-k positions, as compact keys; -> (slots, first key row [B],
    keys [B], words [T, W] int64 bitmask over each request's compact keys)."""
    dev, B = topk.device, reqs.batch_size
    qpos = reqs.positions.to(dev)
    pos = torch.where((topk >= 0) & (topk <= qpos[:, None]), topk, -1).sort(-1).values
    valid = pos >= 0
    valid[:, 1:] &= pos[:, 1:] != pos[:, :-1]  # a repeated position counts once
    width = int(reqs.seq_lens.max())
    code = tok_req[:, None] * width + pos.clamp(min=0)
    keys = torch.unique(code[valid])  # sorted: request-major, then position
    num_keys = torch.bincount(keys // width, minlength=B)
    start = torch.cumsum(num_keys, 0) - num_keys
    local = torch.searchsorted(keys, code) - start[tok_req][:, None]
    per_tile = block_n // wb
    words = -(-max(1, int(num_keys.max()) if B else 1) // block_n) * per_tile
    bit = torch.where(valid, torch.ones_like(local) << (local % wb), 0)
    mask = torch.zeros(topk.shape[0], words, dtype=torch.int64, device=dev)
    mask.scatter_add_(1, torch.where(valid, local // wb, 0), bit)  # distinct bits: sum == OR
    return r2t[rows[keys // width], keys % width].long(), start, num_keys, mask


def prefill_keys(reqs: Requests, req_to_token, topk, block_m, block_n, device) -> PrefillKeys:
    """Step 1 for a prefill step's `reqs` and top-k positions `topk` [T, K] (or None); slots come from
    `req_to_token` (moved to `device`)."""
    dev = torch.device(device)
    r2t = req_to_token.to(dev)
    rows = reqs.rows.to(dev)
    span, blk_req = _query_blocks(reqs.extend_lens, block_m)
    span, blk_req = span.to(dev), blk_req.to(dev)
    tok_req = torch.repeat_interleave(torch.arange(reqs.batch_size, device=dev), reqs.extend_lens.to(dev))
    if topk is None:
        slots, start, count = _dense_keys(reqs, rows, r2t, dev)
        bits = tiles = num_tiles = None
    else:
        wb = min(32, block_n)
        slots, start, count, words = _sparse_keys(reqs, topk.to(dev), rows, r2t, tok_req, wb, block_n)
        T, nt = words.shape[0], words.shape[1] * wb // block_n
        tok_blk = torch.repeat_interleave(torch.arange(span.shape[0], device=dev), span[:, 1] - span[:, 0])
        tile_any = (words.view(T, nt, block_n // wb) != 0).any(-1).int()
        occupied = torch.zeros(span.shape[0], nt, dtype=torch.int32, device=dev).index_add_(0, tok_blk, tile_any) > 0
        num_tiles = occupied.sum(-1).int()
        tiles = torch.sort((~occupied).int(), dim=-1, stable=True).indices.int()  # occupied first, ascending
        bits = torch.where(words >= 2 ** 31, words - 2 ** 32, words).int()  # bit 31 as int32's sign bit
    blocks = torch.cat([span, start[blk_req, None], count[blk_req, None]], 1).int().contiguous()
    return PrefillKeys(slots, blocks, bits, tiles, num_tiles, block_m, block_n)


def expand_keys(kv_cache, w_kv_b, slots, kv_lora):
    """Step 2: (kv [U, H*(dn+dv)] = c_kv(slots) @ w_kv_b.T in w_kv_b's dtype, k_pe [U, dr] same dtype).
    FP8 rows (uint8, `fp8_ref.kv_fp8_views`) are dequantised first."""
    rows = kv_cache[slots]
    if rows.dtype == torch.uint8:
        c_kv, k_pe = fp8_ref.kv_fp8_unpack(rows, kv_lora)
    else:
        c_kv, k_pe = rows[:, :kv_lora], rows[:, kv_lora:]
    kv = c_kv.to(w_kv_b.dtype) @ w_kv_b.T
    return kv, k_pe.to(kv.dtype).contiguous()


def sparse_mla_prefill(q_nope, q_pe, kv, k_pe, keys: PrefillKeys, positions, scale, dv, **tiles):
    """Step 3: o [T, H*dv] (q_nope's dtype) from queries [T, H, dn] / [T, H, dr] (unit inner stride), the
    expanded compact keys of `expand_keys` and `keys`; `positions` [T] on the device. `tiles`
    (num_warps, num_stages) override SparseMlaPrefillCtx.make's; block sizes come from `keys`."""
    T, H, dn = q_nope.shape
    ctx = SparseMlaPrefillCtx.make(H, dn, q_pe.shape[-1], dv, keys.bits is not None, scale, kv.dtype,
                                   keys.block_m, keys.block_n, **tiles)
    out = torch.empty(T, H, dv, dtype=q_nope.dtype, device=q_nope.device)
    nqb = keys.blocks.shape[0]
    if not T or not nqb:
        return out.view(T, H * dv)
    if kv.stride(-1) != 1 or q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("sparse_mla_prefill: q_nope, q_pe and kv need a unit inner stride")
    args = [q_nope, q_nope.stride(0), q_nope.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1), kv, kv.stride(0),
            k_pe, k_pe.stride(0), keys.blocks, positions]
    if ctx.has_topk:
        args += [keys.bits, keys.bits.stride(0), keys.tiles, keys.tiles.stride(0), keys.num_tiles]
    JIT(ctx)[(nqb, H)](*args, out, out.stride(0), out.stride(1), num_warps=ctx.num_warps,
                              num_stages=ctx.num_stages)
    return out.view(T, H * dv)


def mla_attention_mha(q_nope, q_pe, kv_cache, w_kv_b, topk, reqs: Requests, req_to_token, scale, dn, dv,
                      block_m=None, block_n=None, **tiles):
    """torch_ref.mla_attention_mha on Triton (module docstring): kv_cache [slots, kv_lora + dr] is one
    layer's latent cache, w_kv_b [H*(dn+dv), kv_lora]; tile overrides as SparseMlaPrefillCtx.make."""
    dev = q_nope.device
    block_m, block_n = block_m or 64, block_n or 64
    keys = prefill_keys(reqs, req_to_token, topk, block_m, block_n, dev)
    kv, k_pe = expand_keys(kv_cache, w_kv_b, keys.slots, w_kv_b.shape[1])
    if kv.shape[1] != q_nope.shape[1] * (dn + dv):
        raise ValueError(f"mla_attention_mha: kv_b gives {kv.shape[1]} columns, expected H {q_nope.shape[1]}"
                         f" x (dn {dn} + dv {dv})")
    return sparse_mla_prefill(q_nope, q_pe, kv, k_pe, keys, reqs.positions.to(dev), scale, dv, **tiles)
