"""What the CUDA target launches per op in a decode step: the facts `glmc/predict.py` costs.

Counted from `codegen/cuda_target.py` (and the torch-target implementations it reuses) as it runs in
a captured decode graph; pure data, no torch, so the compiler side may read it.
- `kernels`: Triton kernels and cuBLAS GEMMs (each Triton kernel pays `kernel_overhead_s` of the
  calibration); `gemms`: how many of them are cuBLAS GEMM calls (each pays `gemm_launch_s`);
- `torch_ops`: the small torch kernels around them: indexing, element-wise, casts, sort, scan
  (each pays `torch_op_overhead_s`; one per aten op, as `tests/test_predict.py` counts them on CPU
  for the MoE row alignment and the top-k slot gather; a CUDA sort or scan may launch a few);
- `collectives`: the NCCL calls (calibration kinds), each timed from the calibration's table.

The indexer's top-k select (`topk_select.py.j2`) runs a row of n <= TOPK_CHUNK scores in one
program, held in registers: 33 counting passes and a compaction when n > k, else one count and the
compaction (`topk_select_passes`); latency-bound, so the predictor times it from the calibration's
measured launches, scaled by these passes. A workspace wider than TOPK_CHUNK splits its long rows
over programs of 1024-8192 scores (`glmc.target.topk_segment`) and selects them by bytes in five
launches (the last also runs the short rows): each costs about TOPK_SPLIT_STAGE_PASSES register
passes (an estimate until bench/long_context_bench.py's top-k table is folded into the calibration),
independent of n while the segments fit on the GPU. The select writes the KV slots of what it
selects (int32) instead of the positions, so the attention ops gather nothing.

Extra HBM traffic of the CUDA implementation beyond the IR's tensors (`moe_workspace_bytes`): the MoE
experts write and read their [pairs, inter] hidden and their fp32 [pairs, hidden] per-pair
outputs before the k-way sum. The a2a MoE lowering sends fixed-capacity buffers (T*top_k rows to
every peer, `cuda_target._dispatch`): its all-to-all moves group-size x the payload the bill
counts (`collective_bytes`). Broadcast is timed as an all-gather of the same bytes (NCCL runs both as
rings).
"""
from __future__ import annotations

from dataclasses import dataclass

from glmc.target import ALIGN_MAX_EXPERTS, ALIGN_ROWS, ALIGN_ROWS_PER_EXPERT, TOPK_CHUNK, gemv_takes


@dataclass(frozen=True)
class Launches:
    """Launches of one op: Triton/cuBLAS kernels (`gemms` of them cuBLAS GEMMs), small torch
    kernels, NCCL collectives."""
    kernels: int = 0
    torch_ops: int = 0
    collectives: tuple[str, ...] = ()
    gemms: int = 0


TOPK_SPLIT_STAGES = 5          # launches of a wide workspace: 4 histogram rounds, compaction (+ short rows)
TOPK_SPLIT_STAGE_PASSES = 3    # register passes one of those launches costs (estimate; module docstring)


def topk_select_passes(row_len: int, k: int, chunk: int = TOPK_CHUNK) -> int:
    """The top-k select's latency over a row of `row_len` scores, in register counting passes."""
    if row_len > chunk:
        return TOPK_SPLIT_STAGES * TOPK_SPLIT_STAGE_PASSES
    return 34 if row_len > k else 2


ADD_RMS_TORCH_OPS = 8    # torch_ref.add_rms_norm: add, cast, pow, mean, add, rsqrt, mul, mul
ALIGN_ROWS_OPS = 36       # triton_moe.align_rows (aten ops, scalar wrappers excluded)

LAUNCHES: dict[str, Launches] = {
    # no kernel: views, inputs, ops lowered away before codegen
    "io.input": Launches(), "tensor.view": Launches(), "tensor.slice": Launches(),
    "tensor.shard": Launches(), "idx.reuse": Launches(), "comm.reshard": Launches(),
    "embed.lookup": Launches(torch_ops=1),                          # row gather (tp > 1: `launches`)
    "norm.rms": Launches(1), "fused.add_rms": Launches(1), "rope.apply": Launches(1),
    "norm.layer": Launches(torch_ops=3),                            # cast, F.layer_norm, cast
    "fused.qkv_a_norm_rope_write": Launches(1), "fused.qkv_a_norm_rope_write_index": Launches(1),
    "mem.kv_write": Launches(torch_ops=3), "mem.index_k_write": Launches(torch_ops=2),
    "linear": Launches(1, gemms=1), "mla.a_proj": Launches(1, gemms=1), "lm.head": Launches(1, gemms=1),
    "mlp.swiglu": Launches(3, gemms=2),                             # gate|up GEMM, silu_mul kernel, down GEMM
    "idx.topk": Launches(2),                                        # scores; select
    # W_UK bmm, split-K latent kernel (over the select's slots), combine kernel, W_UV bmm (a step trace
    # of 2026-12-04, 32 tokens: these 4, no torch op)
    "attn.mla_absorbed": Launches(4, gemms=2),
    "attn.sparse_mla": Launches(4, gemms=2), "attn.mla_mha": Launches(4, gemms=2),
    "moe.gate": Launches(2),                                        # narrow GEMM, its split reduction (decode: `launches`)
    "moe.topk": Launches(1),                                        # the router kernel
    # align_rows' torch ops (decode sizes: the moe_align kernel, `launches`); gate/up, down and combine
    # kernels (the combine stores in the activations' dtype)
    "moe.experts": Launches(3, ALIGN_ROWS_OPS),
    "elt.add": Launches(torch_ops=1), "tensor.concat": Launches(torch_ops=1),
    "tensor.select_last": Launches(torch_ops=1),
    "sample.tokens": Launches(1, 1),                                # the done-counters memset, the split argmax
    "comm.all_reduce": Launches(collectives=("all_reduce",)),
    "comm.all_gather": Launches(collectives=("all_gather",)),
    "comm.reduce_scatter": Launches(collectives=("reduce_scatter",)),
    "comm.broadcast": Launches(collectives=("all_gather",)),
    # (NCCL, then the add + RMS norm kernel; `launches` swaps in the one-shot kernel where it runs)
    "fused.allreduce_add_rms": Launches(1, collectives=("all_reduce",)),
    "fused.reduce_scatter_add_rms": Launches(1, collectives=("reduce_scatter",)),
    # slot of each row per peer (one_hot, cumsum, gather, ...), packing, send buffer, unpacking
    "moe.dispatch": Launches(torch_ops=18, collectives=("all_to_all",)),
    "moe.combine": Launches(torch_ops=4, collectives=("all_to_all",)),   # gather back, k-way sum
}
STEP_TORCH_OPS = 1          # the decode body's own write of each row's slot into the device table


P2P_KINDS = frozenset({"comm.all_reduce", "comm.reduce_scatter", "comm.all_gather", "fused.allreduce_add_rms",
                       "fused.reduce_scatter_add_rms", "moe.dispatch", "moe.combine"})


def launches(kind: str, attrs: dict, p2p: bool = False, routed_rows: float | None = None,
             rows: float | None = None) -> Launches:
    """LAUNCHES[kind], with what depends on attributes: a vocab-parallel embedding masks its rows,
    a collective along a dim other than 0 concatenates its chunks; `p2p`: a collective run by the
    one-shot peer-memory kernel (one Triton launch, a fused add + RMSNorm in it; no NCCL call; its
    time, launch included, is the collective's: `glmc.calibration.p2p_collective_seconds`);
    `routed_rows`: the (token, slot) rows a `moe.experts` sorts (its ids' numel), whose count
    decides between the moe_align kernel and the torch ops; `rows`: the op's rows (the router's
    GEMV below GEMV_ROWS)."""
    base = LAUNCHES[kind]
    if kind == "moe.gate" and rows is not None and gemv_takes(rows, int(attrs.get("experts", 0))):
        return Launches(1)
    if kind == "moe.experts" and routed_rows is not None:
        experts = int(attrs.get("experts", 0)) // int(attrs.get("ep", 1))
        if routed_rows <= ALIGN_ROWS and experts <= ALIGN_MAX_EXPERTS \
                and routed_rows < ALIGN_ROWS_PER_EXPERT * max(1, experts):
            return Launches(base.kernels + 1, base.torch_ops - ALIGN_ROWS_OPS, base.collectives, base.gemms)
    if p2p and kind in ("moe.dispatch", "moe.combine"):    # its torch ops stay; the exchange is the kernel
        return Launches(base.kernels, base.torch_ops, (), base.gemms)
    if p2p and kind in P2P_KINDS:
        return Launches()
    if kind == "embed.lookup" and int(attrs.get("tp", 1)) > 1:
        return Launches(torch_ops=8)     # sub, ge, lt, and, clamp, gather, cast, mul
    if kind in ("comm.all_gather", "comm.reduce_scatter") and int(attrs.get("dim", 0)):
        return Launches(base.kernels, base.torch_ops + 1, base.collectives, base.gemms)
    return base


def collective_bytes(kind: str, message_bytes: float, size: int) -> float:
    """The message a collective of the plan actually moves, in the calibration's convention:
    the bill's `message_bytes`, times the group size for the fixed-capacity dispatch/combine."""
    return message_bytes * size if kind in ("moe.dispatch", "moe.combine") else message_bytes


def moe_workspace_bytes(pairs: float, hidden: int, inter: int, act_bytes: int) -> float:
    """HBM traffic of `moe.experts`' own buffers: the hidden h (written by the gate/up kernel, read
    by the down kernel) and the fp32 per-pair outputs (written, then summed over the k slots)."""
    return pairs * (2 * inter * act_bytes + 2 * hidden * 4)
