"""Launch the one-shot peer-memory collective (`p2p_allreduce.py.j2`) over a channel's buffers.

A channel (`runtime/worker/peer_memory.PeerChannel`) is one rank's end of a set of equal buffers,
one per rank of a group, each mapped into every rank (CUDA P2P through torch's symmetric memory on
GPUs; shared memory between processes on the CPU, where the interpreter runs the same kernel):
`bufs` / `flags` are int64 tensors of the group's buffer and flag-array addresses in rank order,
`epochs` this rank's per-program epoch counters, `cap` the programs (output rows) a call may use,
`row_bytes` the bytes a row may hold. Layout of a buffer, in elements of the partials' dtype:
[2 slots][cap programs][rows per program][row_bytes / element]: program p's region is its own,
whatever the call's width, so calls of different sizes never share a region under different epochs.
Flags: [cap programs][world sources][2 parities] int64 (the parity slots: the all-to-all's).
"""
from __future__ import annotations

import torch
from glmc.codegen.triton_contexts import P2pAllReduceCtx
from glmc.codegen.triton_render import JIT, KernelLibrary


def fits(channel, rows_out: int, hidden: int, dtype: torch.dtype) -> bool:
    """Whether a call of `rows_out` output rows of `hidden` elements fits `channel`."""
    return 0 < rows_out <= channel.cap and hidden * dtype.itemsize <= channel.row_bytes


def _launch(ctx: P2pAllReduceCtx, lib: KernelLibrary, x: torch.Tensor, channel, programs: int, *tail) -> None:
    """One launch of `programs` programs over `channel` (its layout: one row per program, or world
    rows for a scatter channel); `tail`: the template's arguments after the buffer strides."""
    row_stride = channel.row_bytes // x.element_size()
    prog_stride = (channel.world if channel.scatter else 1) * row_stride
    lib(ctx)[(programs,)](x, x.stride(0), channel.bufs, channel.flags, channel.epochs, channel.rank, programs,
                          channel.cap * prog_stride, prog_stride, row_stride, *tail, num_warps=ctx.num_warps)


def p2p_allreduce(x: torch.Tensor, channel, residual=None, weight=None, eps=None, scatter: bool = False,
                  lib: KernelLibrary = JIT):
    """Sum of `x` [T, H] over the channel's group, in rank order (the same bits on every rank);
    `scatter`: this rank's T / world rows of it (rank-major slices, as NCCL's reduce-scatter).
    With `residual` and `weight`: (rms_norm(sum + residual) * weight, sum + residual), as
    torch_ref.add_rms_norm of the reduced sum. Every rank of the group must make the same calls."""
    n = channel.world
    x = x.contiguous()
    T, H = x.shape
    rows = T // n if scatter else T
    if scatter and rows * n != T:
        raise ValueError(f"p2p reduce-scatter: {T} rows do not split over {n} ranks")
    if channel.scatter != scatter or not fits(channel, rows, H, x.dtype):
        raise ValueError(f"p2p collective of {rows} rows x {H} {x.dtype} exceeds its channel "
                         f"({channel.cap} rows of {channel.row_bytes} bytes, scatter layout {channel.scatter})")
    out = torch.empty(rows, H, dtype=x.dtype, device=x.device)
    ctx = P2pAllReduceCtx.make(n, H, eps, residual is not None, scatter, False)
    if residual is None:
        _launch(ctx, lib, x, channel, rows, out, out.stride(0))
        return out
    res = residual.contiguous()
    new_res = torch.empty(rows, H, dtype=torch.result_type(x, res), device=x.device)
    _launch(ctx, lib, x, channel, rows, res, res.stride(0), new_res, new_res.stride(0), weight, out, out.stride(0))
    return out, new_res


def p2p_all_gather(x: torch.Tensor, channel, lib: KernelLibrary = JIT) -> torch.Tensor:
    """[world x T, W]: every rank's `x` [T, W] in rank order (dim 0), over a channel of one row per
    program. Every rank of the group must make the same calls."""
    n = channel.world
    x = x.contiguous()
    T, W = x.shape
    if channel.scatter or not fits(channel, T, W, x.dtype):
        raise ValueError(f"p2p all-gather of {T} rows x {W} {x.dtype} exceeds its channel "
                         f"({channel.cap} rows of {channel.row_bytes} bytes, scatter layout {channel.scatter})")
    out = torch.empty(n * T, W, dtype=x.dtype, device=x.device)
    _launch(P2pAllReduceCtx.make(n, W, None, False, False, True), lib, x, channel, T, out, out.stride(0))
    return out


def p2p_all_to_all(x: torch.Tensor, valid: torch.Tensor, channel, lib: KernelLibrary = JIT):
    """x [world x C, W] in world equal chunks, chunk q to rank q, of which only the rows with
    valid [world x C] != 0 travel (the routed ones); -> (out [world x C, W], recv_valid [world x C]
    int32): chunk q of out is what rank q sent here (as dist.all_to_all_single) where recv_valid is 1,
    unspecified elsewhere. Over a reduce-scatter-layout channel that only these calls use (their flags
    carry the valid bits). Every rank of the group must make the same calls."""
    n = channel.world
    x = x.contiguous()
    T, W = x.shape
    C = T // n
    if C * n != T or not channel.scatter or not fits(channel, C, W, x.dtype) or valid.numel() != T:
        raise ValueError(f"p2p all-to-all of {T} rows x {W} {x.dtype} ({valid.numel()} valid flags) over {n} "
                         f"ranks does not fit its channel ({channel.cap} chunk rows of {channel.row_bytes} "
                         f"bytes, scatter layout {channel.scatter})")
    out = torch.empty_like(x)
    recv = torch.empty(T, dtype=torch.int32, device=x.device)
    _launch(P2pAllReduceCtx.make(n, W, None, False, True, False, True), lib, x, channel, C, out, out.stride(0),
            valid.to(torch.int32).contiguous(), recv)
    return out, recv
