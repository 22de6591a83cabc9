"""What the CUDA target's kernels cost beyond their launches, for `glmc/predict.py` (the launches
themselves are the plan's launch program: `glmc.launches.LaunchCounts`); pure data, no torch.

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
counts (`collective_bytes`).
"""
from __future__ import annotations

from glmc.target import TOPK_CHUNK

TOPK_SPLIT_STAGES = 5          # launches of a wide workspace: 4 histogram rounds, compaction (+ short rows)
TOPK_SPLIT_STAGE_PASSES = 3    # register passes one of those launches costs (estimate; module docstring)


def topk_select_passes(row_len: int, k: int, chunk: int = TOPK_CHUNK) -> int:
    """The top-k select's latency over a row of `row_len` scores, in register counting passes."""
    if row_len > chunk:
        return TOPK_SPLIT_STAGES * TOPK_SPLIT_STAGE_PASSES
    return 34 if row_len > k else 2


ADD_RMS_TORCH_OPS = 8    # torch_ref.add_rms_norm: add, cast, pow, mean, add, rsqrt, mul, mul
ALIGN_ROWS_OPS = 36       # triton_moe.align_rows' torch form (aten ops, scalar wrappers excluded)


def collective_bytes(kind: str, message_bytes: float, size: int) -> float:
    """The message a collective of the plan actually moves, in the calibration's convention:
    the bill's `message_bytes`, times the group size for the fixed-capacity dispatch/combine."""
    return message_bytes * size if kind in ("moe.dispatch", "moe.combine") else message_bytes


def moe_workspace_bytes(pairs: float, hidden: int, inter: int, act_bytes: int) -> float:
    """HBM traffic of `moe.experts`' own buffers: the hidden h (written by the gate/up kernel, read
    by the down kernel) and the fp32 per-pair outputs (written, then summed over the k slots)."""
    return pairs * (2 * inter * act_bytes + 2 * hidden * 4)
