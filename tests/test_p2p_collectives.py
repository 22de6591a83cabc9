"""The one-shot peer-memory collectives (codegen/templates/p2p_allreduce.py.j2) across real processes.

Each rank is a gloo process; the group's buffers are shared-memory files mapped into every rank
(`runtime/worker/peer_memory.py`, the CPU mapping), and the Triton interpreter runs the kernel with
its flag protocol. Many calls in a row, with inputs that change every call and calls of changing
widths (the region of each program is its own; epochs advance in memory, as in CUDA-graph
replays): every result equals gloo's all-reduce (fp32 partials: exact for 2 ranks, the same sum in
rank order for 3), the fused residual add + RMSNorm equals torch_ref's on that sum, the all-gather
(fp32 rows on the all-reduce channel, int32 route ids on their own) and the equal-chunk all-to-all
(byte rows, as the MoE exchange sends; a random ~60% of the slots routed, the rest never sent: the
rows that arrived and which ones did) equal gloo's exactly, and every rank holds the same bits. A stale read (a peer's last epoch, or the other slot) fails the comparison.
"""
import os

import pytest
import torch
from glmc.runtime.worker.launch import spawn

H = 48
CALLS = 60
WIDTHS = (1, 4, 3, 6)           # rows per call, cycling: programs come and go between calls


def _inputs(call: int, rank: int, rows: int):
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(rows, H, generator=g) * (1 + call % 5)


def _rank(rank, world, out_dir):
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist
    from glmc.codegen import torch_ref as ref
    from glmc.codegen.triton_p2p import p2p_all_gather, p2p_all_to_all, p2p_allreduce
    from glmc.runtime.worker.peer_memory import PeerChannel
    torch.set_num_threads(1)
    ranks = list(range(world))
    cap, row_bytes = 24, H * 4
    ar = PeerChannel.open(None, ranks, rank, cap, row_bytes, False, torch.device("cpu"))
    rs = PeerChannel.open(None, ranks, rank, cap, row_bytes, True, torch.device("cpu"))
    ids = PeerChannel.open(None, ranks, rank, cap, 8 * 4, False, torch.device("cpu"))   # [rows, 8] int32
    a2a = PeerChannel.open(None, ranks, rank, cap, H + 8, True, torch.device("cpu"))    # byte rows, as the MoE's
    weight = torch.rand(H, generator=torch.Generator().manual_seed(7)) + 0.5
    bad = []
    outs = []
    for call in range(CALLS):
        rows = WIDTHS[call % len(WIDTHS)]
        x = _inputs(call, rank, rows * world)
        want = x.clone()
        dist.all_reduce(want)
        res = _inputs(call, 100, rows)                         # replicated, as the residual stream is
        got = p2p_allreduce(x, ar)
        if not torch.equal(got, want) if world == 2 else not torch.allclose(got, want, atol=1e-5):
            bad.append(("all_reduce", call, float((got - want).abs().max())))
        normed, new_res = p2p_allreduce(x[:rows], ar, res, weight, 1e-6)
        part = x[:rows].clone()
        dist.all_reduce(part)
        w_normed, w_res = ref.add_rms_norm(part, res, weight, 1e-6)
        if not (torch.allclose(normed, w_normed, atol=1e-5) and torch.allclose(new_res, w_res, atol=1e-5)):
            bad.append(("allreduce_add_rms", call, float((normed - w_normed).abs().max())))
        scat = p2p_allreduce(x, rs, scatter=True)
        if not torch.allclose(scat, want[rank * rows:(rank + 1) * rows], atol=1e-5):
            bad.append(("reduce_scatter", call, float((scat - want[rank * rows:(rank + 1) * rows]).abs().max())))
        gathered = p2p_all_gather(x[:rows], ar)                # the all-gather shares the all-reduce channel
        parts = [torch.empty_like(x[:rows]) for _ in range(world)]
        dist.all_gather(parts, x[:rows].contiguous())
        if not torch.equal(gathered, torch.cat(parts)):
            bad.append(("all_gather", call, 0.0))
        route = torch.randint(0, 256, (rows, 8), generator=torch.Generator().manual_seed(call * 7 + rank),
                              dtype=torch.int32)
        parts = [torch.empty_like(route) for _ in range(world)]
        dist.all_gather(parts, route)
        if not torch.equal(p2p_all_gather(route, ids), torch.cat(parts)):
            bad.append(("all_gather int32", call, 0.0))
        send = torch.randint(0, 256, (rows * world, H + 8), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(call * 11 + rank))
        valid = (torch.rand(rows * world, generator=torch.Generator().manual_seed(call * 13 + rank)) < 0.6)
        valid = valid.to(torch.int32)                          # the routed slots: only these travel
        want_x, want_v = torch.empty_like(send), torch.empty_like(valid)
        dist.all_to_all_single(want_x, send)
        dist.all_to_all_single(want_v, valid)
        got_x, got_v = p2p_all_to_all(send, valid, a2a)
        if not (torch.equal(got_v, want_v) and torch.equal(got_x[got_v == 1], want_x[want_v == 1])):
            bad.append(("all_to_all", call, 0.0))
        outs.append((got, normed, new_res, gathered))
    torch.save({"bad": bad, "outs": outs, "epochs": ar.epochs.tolist()}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.usefixtures("one_torch_thread")
def test_one_shot_collective_equals_gloo_call_after_call(tmp_path, world):
    spawn(_rank, world, str(tmp_path), backend="gloo")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r in range(world):
        assert not got[r]["bad"], (r, got[r]["bad"][:5])
    for a, b in zip(got[0]["outs"], got[1]["outs"]):      # the same bits on every rank
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # program p ran once per call at least p + 1 rows wide: the plain call (rows x world), the fused
    # one and the all-gather (rows each)
    widths = [WIDTHS[c % len(WIDTHS)] for c in range(CALLS)]
    want = [sum((p < w * world) + 2 * (p < w) for w in widths) for p in range(24)]
    assert got[0]["epochs"] == want


def test_a_call_wider_than_its_channel_is_refused():
    from glmc.codegen.triton_p2p import fits, p2p_allreduce
    from glmc.runtime.worker.peer_memory import PeerChannel
    one = torch.zeros(1, dtype=torch.int64)
    ch = PeerChannel(1, 0, 4, 64, False, one, one, torch.zeros(4, dtype=torch.int64))
    assert fits(ch, 4, 16, torch.float32) and not fits(ch, 5, 16, torch.float32)
    assert not fits(ch, 4, 17, torch.float32)
    with pytest.raises(ValueError, match="exceeds its channel"):
        p2p_allreduce(torch.zeros(5, 16), ch)
