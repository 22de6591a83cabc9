"""What the collectives allocate on the CUDA target (NCCL path of `runtime/worker/comm.Comm`, or
the one-shot peer-memory kernel where the plan allows it: `p2p_runs`).

Replays `Comm.all_reduce` / `broadcast` (a contiguous clone reduced in place), `all_gather` /
`reduce_scatter` (a new output; along a dim > 0 a concatenation) and, for the fused forms, the
collective then the CUDA target's add + RMS norm (`op_memory.add_rms`) on a `step_arena.Arena`.
The a2a MoE dispatch and combine are in `moe_memory.py`.
"""
from __future__ import annotations

from .costs import comm_of, runs_p2p
from .op_memory import add_rms
from .step_arena import Step, Val, model


def p2p_runs(op, s: Step) -> bool:
    """Whether the CUDA target runs `op` with the one-shot peer-memory kernel at this step
    (`costs.runs_p2p` of its billed message)."""
    return runs_p2p(op, comm_of(op, s.graph, s.env)[1])


def _p2p(op, args, s) -> Val | tuple[Val, Val]:
    """codegen/triton_p2p.p2p_allreduce: a contiguous copy of a strided input, the output rows
    (and the new residual for the fused forms), all in the input's dtype."""
    x = args[0]
    copy = None if x.dense else s.tmp(s.type_of(op.operands[0]).numel(s.env), x.elem)
    out = s.arena.new(s.numel(op), x.elem)
    res = s.arena.new(s.numel(op, 1), x.elem) if op.kind.startswith("fused.") else None
    s.free(copy)
    return out if res is None else (out, res)


@model("comm.all_reduce", "comm.broadcast")
def _clone_collective(op, args, s):
    """Comm.all_reduce / broadcast: a contiguous clone, reduced in place (or the p2p kernel's output)."""
    if p2p_runs(op, s):
        return _p2p(op, args, s)
    x = args[0]
    copy = None if x.dense else s.tmp(s.numel(op), x.elem)
    out = s.arena.new(s.numel(op), x.elem)
    s.free(copy)
    return out


@model("comm.all_gather")
def _all_gather(op, args, s):
    """Comm.all_gather: the gathered [n T, ...] tensor; along a dim > 0 its chunks concatenated."""
    if p2p_runs(op, s):
        return _p2p(op, args, s)
    x = args[0]
    if not int(op.attr("dim", 0)):
        return s.arena.new(s.numel(op), x.elem)
    gathered = s.tmp(s.numel(op), x.elem)
    out = s.arena.new(s.numel(op), x.elem)
    s.free(gathered)
    return out


def _reduce_scatter(op, args, s, numel: int) -> Val:
    """Comm.reduce_scatter: this rank's slice; along a dim > 0 the input's chunks concatenated first."""
    x = args[0]
    out = s.arena.new(numel, x.elem)
    if int(op.attr("dim", 0)):
        s.free(s.tmp(numel * int(op.attr("size")), x.elem))
    return out


@model("comm.reduce_scatter")
def _reduce_scatter_op(op, args, s):
    return _p2p(op, args, s) if p2p_runs(op, s) else _reduce_scatter(op, args, s, s.numel(op))


@model("fused.allreduce_add_rms")
def _fused_allreduce(op, args, s):
    if p2p_runs(op, s):
        return _p2p(op, args, s)
    reduced = _clone_collective(op, args, s)
    out = add_rms(op, [reduced, args[1]], s)
    s.free(reduced.buf)
    return out


@model("fused.reduce_scatter_add_rms")
def _fused_reduce_scatter(op, args, s):
    if p2p_runs(op, s):
        return _p2p(op, args, s)
    reduced = _reduce_scatter(op, args, s, s.numel(op, 1))
    out = add_rms(op, [reduced, args[1]], s)
    s.free(reduced.buf)
    return out
