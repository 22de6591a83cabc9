"""Triton MoE experts: token permutation by expert, grouped SwiGLU GEMMs, weighted combine.

`moe_experts(x, ids, weights, w_gate, w_up, w_down, expert_offset=0)` has `torch_ref.moe_experts`'s
contract (y_t = sum over the chosen experts held here of w_te * swiglu_e(x_t); fp32 [T, H]) and runs as

1. `align_rows` (torch ops, no host sync, so it can be captured in a CUDA graph): the T*k routed rows
   are sorted by expert and each expert's run is padded to a multiple of BLOCK_M, so one program
   block never mixes experts. The grid is the static upper bound cdiv(T*k, BM) + min(E, T*k) blocks;
   blocks past the real end carry expert -1 and exit at once.
2. `moe_experts.py.j2` with down=False: gate and up GEMMs of a block share its activation tile,
   SiLU-and-mul is applied in registers, h is written once (in x's dtype, as HF rounds it).
3. the same template with down=True: h @ W_down^T, scaled by the routing weight, written per routed
   row; the combine is then a sum over the k slots (deterministic: no atomics).

Weights are [E, out, in] stacks (HF layout); gate and up may be views of HF's fused gate_up tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from glmc.codegen.triton_render import _DOT, JIT, KernelLibrary, next_pow2


@dataclass(frozen=True)
class MoeExpertsCtx:
    """moe_experts.py.j2: one (row block, output tile) per program; `down` picks the stage."""
    template: ClassVar[str] = "moe_experts"
    down: bool
    n_in: int
    n_out: int
    top_k: int
    block_m: int
    block_n: int
    block_k: int
    dot_dtype: str
    dot_precision: str
    num_warps: int
    num_stages: int

    @classmethod
    def make(cls, down, n_in, n_out, top_k, dtype, block_m, block_n=None, block_k=None, num_warps=None,
             num_stages=None):
        dot_dtype, precision = _DOT[dtype]
        block_n = block_n or min(64 if block_m <= 16 else 128, max(16, next_pow2(n_out)))
        block_k = block_k or min(128 if block_m <= 16 else 64, max(16, next_pow2(n_in)))
        num_warps = num_warps or (4 if block_m * block_n <= 16 * 128 else 8)
        return cls(bool(down), int(n_in), int(n_out), int(top_k), int(block_m), int(block_n), int(block_k),
                   dot_dtype, precision, num_warps, num_stages or 4)

    @classmethod
    def variants(cls, hidden, inter, top_k, dtype) -> list["MoeExpertsCtx"]:
        """Both stages at every row-block class (`BLOCK_MS`): every context `moe_experts` makes
        without tile overrides."""
        return [cls.make(down, *((inter, hidden) if down else (hidden, inter)), top_k, dtype, bm)
                for bm in BLOCK_MS for down in (False, True)]


BLOCK_MS = (16, 32, 64)  # the row-block classes `block_m_for` picks from


def block_m_for(num_rows: int, num_experts: int) -> int:
    """Rows per block: 16 (the smallest MMA tile) while experts see a few rows each (decode), larger
    when the average expert gets a full tile (prefill)."""
    avg = num_rows / max(1, num_experts)
    return 16 if avg < 32 else 32 if avg < 64 else 64


def num_blocks_bound(num_rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound on padded blocks: every non-empty expert wastes < one block; at most min(E, rows) are non-empty."""
    return -(-num_rows // block_m) + min(num_experts, num_rows)


def align_rows(ids, num_experts, block_m, expert_offset=0):
    """Sort routed rows by (local) expert, padding each expert's run to a multiple of block_m.

    ids [T, k] (global expert ids). Returns (sorted_rows [NB*BM] int32: flat row t*k+j or the sentinel
    T*k for padding; block_expert [NB] int32: local expert of each block, -1 past the end). Rows routed
    to experts outside [offset, offset+E) are dropped (another EP rank holds them). No host sync.
    """
    dev, n = ids.device, ids.numel()
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
    nb = num_blocks_bound(n, E, block_m)
    size = nb * block_m
    dest = torch.where(e_sorted < E, dest, size)                     # dropped rows land in a spare cell
    sorted_rows = torch.full((size + 1,), n, dtype=torch.int32, device=dev)
    sorted_rows.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(nb, device=dev) * block_m
    block_expert = torch.searchsorted(ends_padded, block_start, right=True)
    block_expert = torch.where(block_start < ends_padded[-1], block_expert, -1).to(torch.int32)
    return sorted_rows[:size], block_expert


def _check_stacks(w_gate, w_up, w_down):
    if w_gate.stride() != w_up.stride() or w_gate.shape != w_up.shape:
        raise ValueError(f"moe_experts: gate {tuple(w_gate.shape)}/{w_gate.stride()} and up "
                         f"{tuple(w_up.shape)}/{w_up.stride()} stacks must share shape and strides")
    E, inter, hidden = w_gate.shape
    if tuple(w_down.shape) != (E, hidden, inter):
        raise ValueError(f"moe_experts: down stack {tuple(w_down.shape)} != {(E, hidden, inter)}")


def moe_experts(x, ids, weights, w_gate, w_up, w_down, expert_offset=0, tiles=None, lib: KernelLibrary = JIT):
    """torch_ref.moe_experts on Triton: -> fp32 [T, H]. `tiles` = {"gate_up": {...}, "down": {...},
    "block_m": int} overrides MoeExpertsCtx.make's tile choices (the benchmark sweeps them)."""
    _check_stacks(w_gate, w_up, w_down)
    T, k = ids.shape
    E, inter, hidden = w_gate.shape
    tiles = tiles or {}
    n = T * k
    out = torch.empty(T, hidden, dtype=torch.float32, device=x.device)
    if not T:
        return out
    bm = tiles.get("block_m") or block_m_for(n, E)
    sorted_rows, block_expert = align_rows(ids, E, bm, expert_offset)
    nb = block_expert.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    h = torch.empty(nb * bm, inter, dtype=x.dtype, device=x.device)
    up = MoeExpertsCtx.make(False, hidden, inter, k, w_gate.dtype, bm, **tiles.get("gate_up", {}))
    lib(up)[(nb, -(-inter // up.block_n))](
        x, x.stride(0), w_gate, *w_gate.stride(), w_up, h, h.stride(0), sorted_rows, block_expert, n,
        num_warps=up.num_warps, num_stages=up.num_stages)
    y = torch.empty(n, hidden, dtype=torch.float32, device=x.device)
    dn = MoeExpertsCtx.make(True, inter, hidden, k, w_down.dtype, bm, **tiles.get("down", {}))
    lib(dn)[(nb, -(-hidden // dn.block_n))](
        h, h.stride(0), w_down, *w_down.stride(), weights.reshape(-1).float().contiguous(), y, y.stride(0),
        sorted_rows, block_expert, n, num_warps=dn.num_warps, num_stages=dn.num_stages)
    local = ((ids >= expert_offset) & (ids < expert_offset + E)).view(T, k, 1)
    torch.sum(torch.where(local, y.view(T, k, hidden), 0.0), dim=1, out=out)
    return out


# ----------------------------------------------------------------------------- FP8 experts
_ACT = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16"}


@dataclass(frozen=True)
class MoeExpertsFp8Ctx:
    """moe_experts_fp8.py.j2: one (row block, output tile) per program over block-FP8 expert stacks.
    K runs in 128-wide blocks (one weight scale per block); an output tile lies inside one 128-row
    scale block (block_n divides 128), and the gate/up stage's tile is one whole 128-column group
    of h (its quantisation for the down stage is fused there)."""
    template: ClassVar[str] = "moe_experts_fp8"
    down: bool
    n_in: int
    n_out: int
    top_k: int
    block_m: int
    block_n: int
    k_blocks: int
    act_dtype: str
    num_warps: int
    num_stages: int

    @classmethod
    def make(cls, down, n_in, n_out, top_k, dtype, block_m):
        if down:
            block_n = min(64 if block_m <= 16 else 128, max(16, next_pow2(n_out)))
        else:                   # one quantisation group of h per tile
            block_n = 128 if n_out >= 128 else max(16, next_pow2(n_out))
        num_warps = 4 if block_m * block_n <= 16 * 128 else 8
        return cls(bool(down), int(n_in), int(n_out), int(top_k), int(block_m), block_n, -(-int(n_in) // 128),
                   _ACT[dtype], num_warps, 3)

    @classmethod
    def variants(cls, hidden, inter, top_k, dtype) -> list["MoeExpertsFp8Ctx"]:
        """Both stages at every row-block class: every context `moe_experts_fp8` makes."""
        return [cls.make(down, *((inter, hidden) if down else (hidden, inter)), top_k, dtype, bm)
                for bm in BLOCK_MS for down in (False, True)]


def moe_experts_fp8(x, ids, weights, w_gate, w_up, w_down, expert_offset=0, lib: KernelLibrary = JIT):
    """`moe_experts` on block-FP8 expert stacks (`fp8_ref.Fp8Weight` [E, out, in]): x quantised per
    token per 128 columns, h quantised in the gate/up kernel, fp32 accumulation; -> fp32 [T, H]
    (reference: `fp8_ref.moe_experts_fp8`)."""
    from glmc.codegen.triton_fp8 import quantize_tokens
    if w_gate.shape != w_up.shape or tuple(w_down.shape) != (w_gate.shape[0], w_gate.shape[2], w_gate.shape[1]):
        raise ValueError(f"moe_experts_fp8: gate {tuple(w_gate.shape)}, up {tuple(w_up.shape)}, "
                         f"down {tuple(w_down.shape)} are not [E, I, H], [E, I, H], [E, H, I]")
    if w_gate.q.stride() != w_up.q.stride() or w_gate.q.stride(2) != 1 or w_down.q.stride(2) != 1:
        raise ValueError(f"moe_experts_fp8: gate/up stacks {w_gate.q.stride()} / {w_up.q.stride()} and down "
                         f"{w_down.q.stride()} must be row-major with equal gate/up strides")
    T, k = ids.shape
    E, inter, hidden = w_gate.shape
    n = T * k
    out = torch.empty(T, hidden, dtype=torch.float32, device=x.device)
    if not T:
        return out
    bm = block_m_for(n, E)
    sorted_rows, block_expert = align_rows(ids, E, bm, expert_offset)
    nb = block_expert.shape[0]
    xq, xs = quantize_tokens(x, lib)
    up = MoeExpertsFp8Ctx.make(False, hidden, inter, k, x.dtype, bm)
    hq = torch.empty(nb * bm, inter, dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty(nb * bm, -(-inter // 128), dtype=torch.float32, device=x.device)
    gq, gs = w_gate.q, w_gate.scale_inv
    lib(up)[(nb, -(-inter // up.block_n))](
        xq, xq.stride(0), xs, xs.stride(0), gq, gq.stride(0), gq.stride(1), gs, gs.stride(0), gs.stride(1),
        w_up.q, w_up.scale_inv, hq, hq.stride(0), hs, hs.stride(0), sorted_rows, block_expert, n,
        num_warps=up.num_warps, num_stages=up.num_stages)
    y = torch.empty(n, hidden, dtype=torch.float32, device=x.device)
    dn = MoeExpertsFp8Ctx.make(True, inter, hidden, k, x.dtype, bm)
    dq, ds = w_down.q, w_down.scale_inv
    lib(dn)[(nb, -(-hidden // dn.block_n))](
        hq, hq.stride(0), hs, hs.stride(0), dq, dq.stride(0), dq.stride(1), ds, ds.stride(0), ds.stride(1),
        weights.reshape(-1).float().contiguous(), y, y.stride(0), sorted_rows, block_expert, n,
        num_warps=dn.num_warps, num_stages=dn.num_stages)
    local = ((ids >= expert_offset) & (ids < expert_offset + E)).view(T, k, 1)
    torch.sum(torch.where(local, y.view(T, k, hidden), 0.0), dim=1, out=out)
    return out
