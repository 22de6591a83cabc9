"""Peer memory for one-shot collectives: buffers of every rank of a group, mapped into each rank.

`PeerChannel.open(group, ranks, rank, cap, row_bytes, scatter, device)` (collective over the
group: every rank calls it with the same arguments) allocates this rank's buffer and flag array and
maps the peers':
- CUDA: torch's symmetric memory (`torch.distributed._symmetric_memory`, CUDA P2P over NVLink; no
  multicast object is used), one allocation each for the buffer and the flags;
- CPU: one shared-memory file per rank under /dev/shm (a gloo group's processes on one host), so
  the Triton interpreter runs the same kernel and the same flag protocol across real processes.
What the kernel gets (`codegen/triton_p2p.py`): `bufs` / `flags` (int64 addresses of each rank's
buffer / flag array in this process, in group-rank order), `epochs` (this rank's per-program
counters, zero at the start), `cap` (programs, i.e. output rows, a call may use), `row_bytes`.
`PeerChannel.open` raises `PeerMemoryUnavailable` (with the reason) where the mapping cannot be made;
`Comm` then keeps NCCL / gloo for that group and logs one line.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class PeerMemoryUnavailable(RuntimeError):
    """The group's buffers cannot be mapped into each rank (the reason is the message)."""


@dataclass
class PeerChannel:
    world: int
    rank: int                   # this rank's index in the group
    cap: int
    row_bytes: int
    scatter: bool
    bufs: torch.Tensor          # [world] int64 addresses
    flags: torch.Tensor         # [world] int64 addresses
    epochs: torch.Tensor        # [cap] int64, this rank's
    keep: list = field(default_factory=list, repr=False)   # the mapped tensors and handles

    @staticmethod
    def buffer_bytes(world: int, cap: int, row_bytes: int, scatter: bool) -> int:
        """Bytes of one rank's buffer: 2 slots x cap programs x rows per program x row_bytes."""
        return 2 * cap * (world if scatter else 1) * row_bytes

    @staticmethod
    def flag_bytes(world: int, cap: int) -> int:
        """Bytes of one rank's flag array: int64 per (program, source rank, epoch parity)."""
        return cap * world * 2 * 8

    @classmethod
    def open(cls, group, ranks: list[int], rank: int, cap: int, row_bytes: int, scatter: bool,
             device: torch.device) -> "PeerChannel":
        world, me = len(ranks), ranks.index(rank)
        nbytes = cls.buffer_bytes(world, cap, row_bytes, scatter)
        mapper = _map_cuda if device.type == "cuda" else _map_shm
        bufs, flags, keep = mapper(group, ranks, me, nbytes, cls.flag_bytes(world, cap), device)
        return cls(world, me, cap, row_bytes, scatter, bufs, flags,
                   torch.zeros(cap, dtype=torch.int64, device=device), keep)


def _map_cuda(group, ranks, me, nbytes, flag_bytes, device):
    try:
        import torch.distributed._symmetric_memory as symm_mem
        name = group.group_name if group is not None else dist.group.WORLD.group_name
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        flags = symm_mem.empty(flag_bytes // 8, dtype=torch.int64, device=device)
        flags.zero_()
        handles = [symm_mem.rendezvous(buf, name), symm_mem.rendezvous(flags, name)]
    except Exception as e:     # no P2P between these GPUs, no symmetric-memory backend, ...
        raise PeerMemoryUnavailable(f"torch symmetric memory over ranks {ranks}: {e}") from e
    torch.cuda.synchronize(device)
    dist.barrier(group=group)              # every rank's flags are zero before anyone signals
    addrs = [torch.tensor(list(h.buffer_ptrs), dtype=torch.int64, device=device) for h in handles]
    return addrs[0], addrs[1], [buf, flags, *handles]


def _map_shm(group, ranks, me, nbytes, flag_bytes, device):
    if not os.path.isdir("/dev/shm"):
        raise PeerMemoryUnavailable("no /dev/shm for the CPU peer buffers")
    token = [uuid.uuid4().hex if me == 0 else None]
    dist.broadcast_object_list(token, src=ranks[0], group=group)
    paths = [f"/dev/shm/glmc-p2p-{token[0]}-{r}" for r in range(len(ranks))]
    with open(paths[me], "wb") as f:                # zeros: empty slots, flags at epoch 0
        f.truncate(nbytes + flag_bytes)
    dist.barrier(group=group)
    try:
        maps = [torch.from_file(p, shared=True, size=nbytes + flag_bytes, dtype=torch.uint8) for p in paths]
    finally:
        dist.barrier(group=group)                   # every rank mapped every file: unlink (maps stay)
        os.unlink(paths[me])
    bufs = torch.tensor([m.data_ptr() for m in maps], dtype=torch.int64)
    return bufs, bufs + nbytes, maps
