"""Collectives of a plan over torch.distributed (gloo on CPU, NCCL on GPU), counted as they run.

On NCCL every collective is capture-safe (fixed sizes from shapes, no host sync): the CUDA target
replays them inside decode CUDA graphs, and `add(counts)` credits a replayed step with the counts
its capture recorded. gloo lacks reduce_scatter and single-tensor all-gather: those are composed.

Ranks are laid out as rank = attn_dp_rank * attn_tp + attn_tp_rank (attention) and
rank = ep_rank * moe_tp + moe_tp_rank (MoE), so token shards over (attn_dp, attn_tp) concatenate
in rank order. Every call adds to `counts[kind] = {count, message_bytes}` with the cost model's
conventions (`glmc.passes.costs`), so a step's counts can be compared with `glmc explain`.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import sys

import torch
import torch.distributed as dist
from glmc.runtime.worker.peer_memory import PeerChannel, PeerMemoryUnavailable

ATTN, MOE = ("attn_dp", "attn_tp"), ("ep", "moe_tp")


@dataclass(frozen=True)
class Coords:
    rank: int
    mesh: dict

    def of(self, axis: str) -> int:
        m = self.mesh
        return {"attn_dp": self.rank // m["attn_tp"], "attn_tp": self.rank % m["attn_tp"],
                "ep": self.rank // m["moe_tp"], "moe_tp": self.rank % m["moe_tp"]}[axis]


def group_ranks(axes, mesh: dict, world: int) -> list[list[int]]:
    """The partition of ranks into groups over `axes` (a tuple of axis names; `("world",)`: all ranks)."""
    if axes == ("world",):
        return [list(range(world))]
    axes = tuple(a for a in axes if mesh[a] > 1)
    family = ATTN if set(axes) <= set(ATTN) else MOE if set(axes) <= set(MOE) else None
    if family is None:
        raise ValueError(f"group over {axes} mixes attention and MoE axes")
    other = [a for a in family if a not in axes]
    key = lambda r: tuple(Coords(r, mesh).of(a) for a in other)  # noqa: E731
    groups: dict = defaultdict(list)
    for r in range(world):
        groups[key(r)].append(r)
    return list(groups.values())


class Comm:
    """Process groups for every group a plan uses, and counted collectives over them."""

    def __init__(self, mesh: dict, groups_used: set):
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.mesh, self.coords = mesh, Coords(self.rank, mesh)
        self.nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        self.counts: dict = defaultdict(lambda: {"count": 0, "message_bytes": 0})
        self._groups: dict = {}
        self._channels: dict = {}     # (axes, mode, row bytes) -> PeerChannel | None
        for axes in sorted(groups_used, key=repr):       # same order on every rank
            for ranks in group_ranks(axes, mesh, self.world):
                g = dist.new_group(ranks) if self.world > 1 else None
                if self.rank in ranks:
                    self._groups[axes] = (g, ranks)

    def _g(self, axes):
        return self._groups[axes]

    def count(self, kind: str, nbytes: int, p2p: bool = False) -> None:
        self.counts[kind]["count"] += 1
        self.counts[kind]["message_bytes"] += int(nbytes)
        if p2p:      # run by the one-shot peer-memory kernel, not NCCL / gloo
            self.counts[kind]["p2p"] = self.counts[kind].get("p2p", 0) + 1

    def peer_channel(self, axes, mode: str, row_bytes: int, cap: int, device):
        """This rank's `PeerChannel` over the group of `axes` for one-shot collectives of one `mode`
        ("reduce": all-reduces, "scatter": reduce-scatters, "gather": all-gathers, "exchange": equal-chunk
        all-to-alls) of up to `cap` programs' rows of `row_bytes`; opened on first use, which every rank of the group reaches at
        the same op (opening is collective). None where peer memory cannot be mapped (logged once;
        the caller keeps NCCL / gloo)."""
        row_bytes = -(-row_bytes // 16) * 16
        key = (axes, mode, row_bytes)
        if key not in self._channels:
            g, ranks = self._g(axes)
            try:
                self._channels[key] = PeerChannel.open(g, ranks, self.rank, cap, row_bytes,
                                                       mode in ("scatter", "exchange"),
                                                       torch.device(device))
            except PeerMemoryUnavailable as e:
                print(f"glmc: rank {self.rank}: no peer memory over {list(axes)} ({e}); NCCL/gloo instead",
                      file=sys.stderr, flush=True)
                self._channels[key] = None
        return self._channels[key]

    def reset(self) -> dict:
        out = {k: dict(v) for k, v in self.counts.items()}
        self.counts.clear()
        return out

    def add(self, counts: dict) -> None:
        """Credit collectives that ran without Python (a replayed CUDA graph's, as captured)."""
        for kind, c in counts.items():
            self.counts[kind]["count"] += c["count"]
            self.counts[kind]["message_bytes"] += c["message_bytes"]
            if c.get("p2p"):
                self.counts[kind]["p2p"] = self.counts[kind].get("p2p", 0) + c["p2p"]

    def all_reduce(self, x, axes, nbytes=None):
        g, _ = self._g(axes)
        x = x.contiguous().clone()
        dist.all_reduce(x, group=g)
        self.count("all_reduce", x.numel() * x.element_size() if nbytes is None else nbytes)
        return x

    def all_gather(self, x, axes, dim=0, nbytes=None):
        g, ranks = self._g(axes)
        if self.nccl:
            out = x.new_empty((len(ranks) * x.shape[0],) + tuple(x.shape[1:]))
            dist.all_gather_into_tensor(out, x.contiguous(), group=g)
            out = torch.cat(out.chunk(len(ranks)), dim=dim) if dim else out
        else:
            parts = [torch.empty_like(x) for _ in ranks]
            dist.all_gather(parts, x.contiguous(), group=g)
            out = torch.cat(parts, dim=dim)
        self.count("all_gather", out.numel() * out.element_size() if nbytes is None else nbytes)
        return out

    def reduce_scatter(self, x, axes, dim=0, nbytes=None):
        """Sum over the group, keep this rank's 1/n slice of dim (all-reduce + slice: gloo has no
        reduce_scatter; the traffic counted is the collective's, not the implementation's)."""
        g, ranks = self._g(axes)
        self.count("reduce_scatter", x.numel() * x.element_size() if nbytes is None else nbytes)
        if self.nccl:
            parts = x.chunk(len(ranks), dim=dim)
            out = x.new_empty(parts[0].shape)
            dist.reduce_scatter_tensor(out, torch.cat(parts) if dim else x.contiguous(), group=g)
            return out
        total = x.contiguous().clone()
        dist.all_reduce(total, group=g)
        return total.chunk(len(ranks), dim=dim)[ranks.index(self.rank)].contiguous()

    def broadcast(self, x, axes, nbytes=None):
        g, ranks = self._g(axes)
        x = x.contiguous().clone()
        dist.broadcast(x, src=ranks[0], group=g)
        self.count("broadcast", x.numel() * x.element_size() if nbytes is None else nbytes)
        return x

    def all_to_all_equal(self, x: torch.Tensor, axes, kind: str, nbytes: int) -> torch.Tensor:
        """x's dim 0 in equal parts, part i to the i-th rank of the group; what each sent here, in
        the same layout (capture-safe: the sizes are x's shape)."""
        g, _ = self._g(axes)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=g)
        self.count(kind, nbytes)
        return out

    def all_to_all(self, chunks: list[torch.Tensor], axes, kind: str, nbytes: int):
        """Send chunks[i] to the i-th rank of the group; returns what each rank sent here."""
        g, ranks = self._g(axes)
        sizes = torch.tensor([c.shape[0] for c in chunks], dtype=torch.int64)
        recv_sizes = torch.empty_like(sizes)
        dist.all_to_all_single(recv_sizes, sizes, group=g)
        rest = chunks[0].shape[1:]
        out = torch.empty((int(recv_sizes.sum()),) + tuple(rest), dtype=chunks[0].dtype)
        dist.all_to_all_single(out, torch.cat(chunks).contiguous(), recv_sizes.tolist(),
                               sizes.tolist(), group=g)
        self.count(kind, nbytes)
        return list(out.split(recv_sizes.tolist()))


class LoneComm(Comm):
    """Rank `rank` of `mesh` run by itself, in one process with no peers: one rank's share of a
    multi-GPU plan, its weights and its work, on one GPU (`python -m bench.mtp_gpu_check --parts rank`).

    Every collective returns the shape the real one returns and moves nothing: an all-reduce
    returns x (this rank's own contribution), a reduce-scatter this rank's slice of x, a broadcast
    x, an all-gather this rank's part in its place and `peer(part, x)` in every other part's
    (default x: a replicated value gathers to copies of itself; a caller that knows what the peers
    hold, e.g. their tokens' expert ids, says so). The values are therefore not the multi-rank
    run's; the shapes, the sizes and so the work of every other op are. Collectives are counted as
    `Comm` counts them (the cost model's message bytes). An all-to-all (MoE dispatch / combine)
    raises: what the peers send decides the work after it, and a lone rank cannot know it. No
    process group is needed and no peer memory is mapped (the one-shot kernels fall back here)."""

    def __init__(self, mesh: dict, rank: int = 0, peer=None):
        world = mesh["attn_dp"] * mesh["attn_tp"]
        if not 0 <= rank < world:
            raise ValueError(f"LoneComm: rank {rank} is not one of the mesh's {world} ranks ({mesh})")
        self.world, self.rank, self.mesh, self.coords = world, rank, mesh, Coords(rank, mesh)
        self.nccl = False
        self.peer = peer
        self.counts = defaultdict(lambda: {"count": 0, "message_bytes": 0})
        self._groups, self._channels = {}, {}

    def _g(self, axes):
        if axes not in self._groups:
            ranks = next(g for g in group_ranks(axes, self.mesh, self.world) if self.rank in g)
            self._groups[axes] = (None, ranks)
        return self._groups[axes]

    def peer_channel(self, axes, mode, row_bytes, cap, device):
        return None

    def all_reduce(self, x, axes, nbytes=None):
        self.count("all_reduce", x.numel() * x.element_size() if nbytes is None else nbytes)
        return x.contiguous().clone()

    def all_gather(self, x, axes, dim=0, nbytes=None):
        _, ranks = self._g(axes)
        own = ranks.index(self.rank)
        parts = [x if i == own or self.peer is None else self.peer(i, x) for i in range(len(ranks))]
        out = torch.cat(parts, dim=dim)
        self.count("all_gather", out.numel() * out.element_size() if nbytes is None else nbytes)
        return out

    def reduce_scatter(self, x, axes, dim=0, nbytes=None):
        _, ranks = self._g(axes)
        self.count("reduce_scatter", x.numel() * x.element_size() if nbytes is None else nbytes)
        return x.chunk(len(ranks), dim=dim)[ranks.index(self.rank)].contiguous()

    def broadcast(self, x, axes, nbytes=None):
        self.count("broadcast", x.numel() * x.element_size() if nbytes is None else nbytes)
        return x.contiguous().clone()

    def all_to_all_equal(self, x, axes, kind, nbytes):
        raise NotImplementedError(f"LoneComm: {kind} is an all-to-all; a rank alone cannot know what "
                                  "its peers send it (measure a plan without MoE dispatch / combine)")

    def all_to_all(self, chunks, axes, kind, nbytes):
        return self.all_to_all_equal(None, axes, kind, nbytes)
