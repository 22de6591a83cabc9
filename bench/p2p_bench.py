"""glmc's one-shot peer-memory reductions against NCCL and torch's one-shot all-reduce.

    python -m bench.p2p_bench --out p2p_bench.json              # every visible GPU, NCCL
    python -m bench.p2p_bench --cpu --world 2                   # gloo + /dev/shm, Triton interpreted
    python -m bench.p2p_bench --one-gpu 2 --out one_gpu.json    # one GPU: ranks as streams of one process

One process per GPU. At each message size (rows x 6144 bf16, 12 KiB to 6 MiB), inside CUDA graphs
(CALLS calls per graph, replayed; microseconds per call, the slowest rank's median):
- `nccl`: dist.all_reduce; `nccl_add_rms`: it + the CUDA target's NCCL-path add + RMSNorm (what
  fused.allreduce_add_rms ran before peer memory);
- `torch_one_shot`: torch.ops.symm_mem.one_shot_all_reduce over a symmetric buffer (the issue's
  anchor; multicast off);
- `glmc`, `glmc_add_rms`: codegen/triton_p2p.p2p_allreduce without / with the residual add + norm;
  `glmc_rs`: its reduce-scatter form.
Then stability: one graph of a fused call replayed REPLAYS times, a fresh input copied into its
static buffer before each replay; every result compared with NCCL's sum of the same inputs (new
residual bitwise for 2 ranks, where one rounding of a + b is NCCL's too; normed output within bf16
tolerance); a stale peer read shows as a mismatch. `--cpu` runs the stability part only, briefly.

`--one-gpu WORLDS` checks the kernels on a host with one GPU: each "rank" is a stream of
one process, its buffer plain device memory of the same GPU (the flag protocol, the sys-scope
atomics and the compiled kernel are the real ones; the peers' memory is local HBM, not NVLink).
Per world: every mode (all-reduce, + add + RMSNorm, reduce-scatter, + add + RMSNorm, all-gather,
equal-chunk all-to-all) at several widths (each width's calls one graph, replayed once) against torch (sums in rank order in fp32: the
same bits), then one CUDA graph holding every rank's calls of all modes, replayed REPLAYS times
with new inputs copied in before each replay, each replay's results compared on the device; then
us per call in graphs (CALLS calls per rank stream; all ranks' programs must be resident at once,
so widths stay at world x rows <= 1024 programs). Use 2 ranks: with 8 rank streams in one graph
the H200 hung (2026-12-01), as nothing makes a GPU run 8 spinning graph branches at once. First, world 1 over a one-rank NCCL group:
PeerChannel.open's torch-symmetric-memory mapping, the calls the runtime makes, on this torch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

H = 6144
ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512)        # x 6144 bf16: 12 KiB .. 6 MiB
CALLS = 20
REPLAYS = 3000


def _time_graph(fn, reps: int = 30) -> float:
    """Microseconds per call of `fn` (CALLS calls captured in one graph), median of reps replays."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    return _median_us_per_call(g, reps)


def _median_us_per_call(g, reps: int) -> float:
    """Microseconds per call of a graph of CALLS calls: the median of `reps` timed replays."""
    import torch
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def _rank(rank: int, world: int, args: dict, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from glmc.codegen import torch_ref as ref
    from glmc.codegen.triton_p2p import p2p_allreduce
    from glmc.runtime.worker.peer_memory import PeerChannel
    cpu = args["cpu"]
    dev = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if cpu else torch.bfloat16
    ranks, rows_max = list(range(world)), max(args["rows"])
    ar = PeerChannel.open(None, ranks, rank, rows_max, H * dtype.itemsize, False, dev)
    rs = PeerChannel.open(None, ranks, rank, rows_max // world, H * dtype.itemsize, True, dev)
    g = torch.Generator(device=dev).manual_seed(rank)
    weight = torch.rand(H, device=dev, dtype=dtype, generator=torch.Generator(device=dev).manual_seed(9)) + 0.5
    out = {"rank": rank, "rows": {}, "stability": {}}
    if not cpu:
        import torch.distributed._symmetric_memory as symm_mem
        name = dist.group.WORLD.group_name
        symm = symm_mem.empty(rows_max * H, dtype=dtype, device=dev)
        symm_mem.rendezvous(symm, name)
        for rows in args["rows"]:
            x = torch.randn(rows, H, device=dev, dtype=dtype, generator=g)
            res = torch.randn(rows, H, device=dev, dtype=dtype, generator=torch.Generator(device=dev).manual_seed(5))
            buf = symm[:rows * H].view(rows, H)
            buf.copy_(x)
            t = {"bytes": rows * H * dtype.itemsize}
            t["nccl"] = _time_graph(lambda: dist.all_reduce(x.clone()))
            t["nccl_add_rms"] = _time_graph(lambda: ref.add_rms_norm(_nccl(x), res, weight, 1e-5))
            try:
                t["torch_one_shot"] = _time_graph(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name))
            except Exception as e:  # reported, the rest still runs
                t["torch_one_shot_error"] = f"{type(e).__name__}: {e}"[:300]
            t["glmc"] = _time_graph(lambda: p2p_allreduce(x, ar))
            t["glmc_add_rms"] = _time_graph(lambda: p2p_allreduce(x, ar, res, weight, 1e-5))
            if rows % world == 0 and rows // world <= rs.cap:
                t["glmc_rs"] = _time_graph(lambda: p2p_allreduce(x, rs, scatter=True))
            out["rows"][rows] = t
    out["stability"] = _stability(ar, weight, dev, dtype, args["replays"], world, cpu)
    torch.save(out, f"{out_dir}/rank{rank}.pt")


def _nccl(x):
    import torch.distributed as dist
    y = x.clone()
    dist.all_reduce(y)
    return y


def _stability(ch, weight, dev, dtype, replays: int, world: int, cpu: bool) -> dict:
    """A fused call replayed `replays` times (eagerly on the CPU) with a new input each time,
    against NCCL's (gloo's) sum of the same input."""
    import torch
    from glmc.codegen import torch_ref as ref
    from glmc.codegen.triton_p2p import p2p_allreduce
    rows = 8
    x = torch.zeros(rows, H, device=dev, dtype=dtype)
    res = torch.zeros(rows, H, device=dev, dtype=dtype)
    step = (lambda: p2p_allreduce(x, ch, res, weight, 1e-5))
    if not cpu:
        from bench.common import capture_graph
        graph, outs = capture_graph(step)
        run = (lambda: (graph.replay(), outs)[1])
    else:
        run = step
    bad_res = bad_norm = 0
    worst = 0.0
    for i in range(replays):
        gen = torch.Generator(device=dev).manual_seed(1000 * i + ch.rank)
        x.copy_(torch.randn(rows, H, device=dev, dtype=dtype, generator=gen) * (1 + i % 7))
        res.copy_(torch.randn(rows, H, device=dev, dtype=dtype, generator=torch.Generator(device=dev).manual_seed(i)))
        normed, new_res = run()
        want_n, want_r = ref.add_rms_norm(_nccl(x), res, weight, 1e-5)
        same = torch.equal(new_res, want_r.to(dtype)) if world == 2 else \
            torch.allclose(new_res.float(), want_r.float(), rtol=1e-2, atol=1e-2)
        bad_res += not same
        err = float((normed.float() - want_n.float()).norm() / want_n.float().norm())
        worst = max(worst, err)
        bad_norm += err > (1e-5 if cpu else 1e-2)
    return {"replays": replays, "residual_mismatches": bad_res, "normed_over_tol": bad_norm, "worst_rel_err": worst}


def _one_gpu_channels(world: int, cap: int, row_bytes: int, scatter: bool):
    """One channel per emulated rank over buffers of the current GPU (PeerChannel's layout)."""
    import torch
    from glmc.runtime.worker.peer_memory import PeerChannel
    nbytes = PeerChannel.buffer_bytes(world, cap, row_bytes, scatter)
    bufs = [torch.zeros(nbytes, dtype=torch.uint8, device="cuda") for _ in range(world)]
    flags = [torch.zeros(PeerChannel.flag_bytes(world, cap) // 8, dtype=torch.int64, device="cuda")
             for _ in range(world)]
    b = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.int64, device="cuda")
    f = torch.tensor([t.data_ptr() for t in flags], dtype=torch.int64, device="cuda")
    return [PeerChannel(world, r, cap, row_bytes, scatter, b, f, torch.zeros(cap, dtype=torch.int64, device="cuda"),
                        [bufs, flags]) for r in range(world)]


def _one_gpu(world: int, replays: int) -> dict:
    """The --one-gpu check for one world size (see the module docstring)."""
    import torch
    from glmc.codegen import torch_ref as ref
    from glmc.codegen.triton_p2p import p2p_all_gather, p2p_all_to_all, p2p_allreduce
    dt, cap = torch.bfloat16, max(64, 16 * world)           # the widest call: 16 rows x world
    ar = _one_gpu_channels(world, cap, H * 2, False)
    rs = _one_gpu_channels(world, cap, H * 2, True)
    a2a = _one_gpu_channels(world, cap, H * 2, True)
    streams = [torch.cuda.Stream() for _ in range(world)]
    weight = torch.rand(H, device="cuda", generator=torch.Generator("cuda").manual_seed(9)).to(dt) + 0.5

    def calls(xs, res):
        """Every mode on every rank, each rank on its own stream; -> per rank a list of outputs
        (the all-to-all with every slot routed)."""
        ones = [torch.ones(x.shape[0], dtype=torch.int32, device="cuda") for x in xs]
        main, outs = torch.cuda.current_stream(), []
        for r in range(world):
            streams[r].wait_stream(main)
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                x, rows = xs[r], xs[r].shape[0] // world
                o = [p2p_allreduce(x, ar[r]), *p2p_allreduce(x[:rows], ar[r], res[:rows], weight, 1e-5),
                     p2p_allreduce(x, rs[r], scatter=True),
                     *p2p_allreduce(x, rs[r], res[:rows], weight, 1e-5, scatter=True),
                     p2p_all_gather(x[:rows], ar[r]), p2p_all_to_all(x, ones[r], a2a[r])[0]]
                outs.append(o)
        for r in range(world):
            main.wait_stream(streams[r])
        return outs

    def want(xs, res):
        rows = xs[0].shape[0] // world
        tot = xs[0].float()
        for x in xs[1:]:
            tot = tot + x.float()
        tot = tot.to(dt)
        head = xs[0][:rows].float()
        for x in xs[1:]:
            head = head + x[:rows].float()
        n_head, r_head = ref.add_rms_norm(head.to(dt), res[:rows], weight, 1e-5)
        gathered = torch.cat([x[:rows] for x in xs])
        per = []
        for r in range(world):
            sl = slice(r * rows, (r + 1) * rows)
            n_s, r_s = ref.add_rms_norm(tot[sl], res[:rows], weight, 1e-5)
            a2 = torch.cat([xs[q][sl] for q in range(world)])
            per.append([tot, n_head, r_head, tot[sl], n_s, r_s, gathered, a2])
        return per

    names = ["all_reduce", "ar_add_rms.normed", "ar_add_rms.residual", "reduce_scatter", "rs_add_rms.normed",
             "rs_add_rms.residual", "all_gather", "all_to_all"]
    exact = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "ar_add_rms.residual", "rs_add_rms.residual"}

    def compare(got, exp):
        """Per output name: max abs error (exact ones must be 0) over ranks; as device tensors."""
        errs = {}
        for r in range(world):
            for n, g, w in zip(names, got[r], exp[r]):
                e = (g.float() - w.float()).abs().max()
                errs[n] = torch.maximum(errs[n], e) if n in errs else e
        return errs

    def inputs(seed, rows):
        g = torch.Generator("cuda").manual_seed(seed)
        xs = [torch.randn(rows * world, H, device="cuda", generator=g).to(dt) * (1 + seed % 5) for _ in range(world)]
        return xs, torch.randn(rows, H, device="cuda", generator=g).to(dt)

    out = {"world": world, "eager": {}, "graph": {}, "us_per_call": {}}
    for i, rows in enumerate((1, 3, 8, 2, 16, 5)):               # programs come and go between calls
        xs, res = inputs(i, rows)
        g, got = _captured(lambda: calls(xs, res))
        g.replay()
        errs = compare(got, want(xs, res))
        out["eager"][f"call{i}_rows{rows}"] = {k: float(v) for k, v in errs.items()}
        print(f"world {world} width {rows}: {out['eager'][f'call{i}_rows{rows}']}", flush=True)
    rows = 4
    xs, res = inputs(100, rows)
    g, got = _captured(lambda: calls(xs, res))
    pool = [inputs(200 + k, rows) for k in range(7)]
    exps = [want(*p) for p in pool]
    worst = None
    for i in range(replays):
        src_x, src_r = pool[i % 7]
        for r in range(world):
            xs[r].copy_(src_x[r])
        res.copy_(src_r)
        g.replay()
        errs = compare(got, exps[i % 7])
        worst = errs if worst is None else {k: torch.maximum(worst[k], v) for k, v in errs.items()}
    out["graph"] = {"replays": replays, "rows": rows, "max_abs_err": {k: float(v) for k, v in worst.items()}}
    print(f"world {world} graph: {out['graph']}", flush=True)
    for rows in (1, 8, 32, 128):
        if rows * world > 1024 or rows > cap:
            continue
        xs, res = inputs(300 + rows, rows)
        x1 = [x[:rows] for x in xs]
        t = {"bytes": rows * H * 2}
        for name, fn in (("glmc", lambda r: p2p_allreduce(x1[r], ar[r])),
                         ("glmc_add_rms", lambda r: p2p_allreduce(x1[r], ar[r], res, weight, 1e-5))):
            t[name] = _time_streams(fn, streams)
        out["us_per_call"][rows] = t
    ok = all(v == 0 for c in out["eager"].values() for k, v in c.items() if k in exact) and \
        all(v < 0.1 for c in out["eager"].values() for v in c.values()) and \
        all(v == 0 if k in exact else v < 0.1 for k, v in out["graph"]["max_abs_err"].items())
    out["ok"] = ok
    return out


def _symm_world1() -> dict:
    """PeerChannel.open's CUDA mapping (torch symmetric memory) over a one-rank NCCL group: the API
    calls the runtime makes, on this torch, and each collective through it (world 1: a copy)."""
    import torch
    import torch.distributed as dist
    from glmc.codegen.triton_p2p import p2p_all_gather, p2p_all_to_all, p2p_allreduce
    from glmc.runtime.worker.peer_memory import PeerChannel
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        dev = torch.device("cuda", 0)
        ar = PeerChannel.open(None, [0], 0, 16, H * 2, False, dev)
        rs = PeerChannel.open(None, [0], 0, 16, H * 2, True, dev)
        a2a = PeerChannel.open(None, [0], 0, 16, H * 2, True, dev)
        x = torch.randn(8, H, device=dev).to(torch.bfloat16)
        res = torch.randn(8, H, device=dev).to(torch.bfloat16)
        w = torch.ones(H, device=dev, dtype=torch.bfloat16)
        got = {"all_reduce": p2p_allreduce(x, ar), "add_rms.residual": p2p_allreduce(x, ar, res, w, 1e-5)[1],
               "reduce_scatter": p2p_allreduce(x, rs, scatter=True), "all_gather": p2p_all_gather(x, ar),
               "all_to_all": p2p_all_to_all(x, torch.ones(8, dtype=torch.int32, device=dev), a2a)[0]}
        want = {"all_reduce": x, "add_rms.residual": x + res, "reduce_scatter": x, "all_gather": x, "all_to_all": x}
        return {"ok": all(torch.equal(got[k], want[k]) for k in got), "bufs": int(ar.bufs.numel()),
                "equal": {k: bool(torch.equal(got[k], want[k])) for k in got}}
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
    finally:
        dist.destroy_process_group()


def _captured(fn):
    """(graph, fn's result): fn captured, never run eagerly. With every rank a stream of one process,
    an eager call can deadlock: rank 0's kernel spins for rank 1's while the host, before launching
    rank 1's, loads a module or grows the allocator (calls that wait for the device). A capture runs
    nothing, and a replay launches every rank's kernels at once. Relaxed: Triton may compile inside."""
    import torch
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="relaxed"):
        out = fn()
    return g, out


def _time_streams(fn, streams, reps: int = 20) -> float:
    """Microseconds per call of fn(rank) on every rank's stream (CALLS calls each, one graph)."""
    import torch

    def body():
        main = torch.cuda.current_stream()          # the capture stream: the rank streams fork from it
        for s in streams:
            s.wait_stream(main)
        for r, s in enumerate(streams):
            with torch.cuda.stream(s):
                for _ in range(CALLS):
                    fn(r)
        for s in streams:
            main.wait_stream(s)
    g, _ = _captured(body)
    return _median_us_per_call(g, reps)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--world", type=int)
    ap.add_argument("--out")
    ap.add_argument("--replays", type=int)
    ap.add_argument("--one-gpu", help="comma-separated world sizes emulated on one GPU")
    a = ap.parse_args()
    import torch
    if a.one_gpu:
        t0 = time.perf_counter()
        runs = [{"world": 1, "symmetric_memory": _symm_world1()}]
        runs[0]["ok"] = runs[0]["symmetric_memory"]["ok"]
        print(f"P2P ONE-GPU world 1 over torch symmetric memory: {runs[0]['symmetric_memory']}", flush=True)
        for w in a.one_gpu.split(","):
            runs.append(_one_gpu(int(w), a.replays or REPLAYS))
            if a.out:                                        # a later world may hang: keep this one
                Path(a.out).write_text(json.dumps(runs, indent=1))
        result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "mode": "one-gpu",
                  "runs": runs, "seconds": round(time.perf_counter() - t0, 1)}
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1))
        for r in runs[1:]:
            print(f"P2P ONE-GPU world {r['world']}: {'PASS' if r['ok'] else 'FAIL'} graph {r['graph']}")
            print(f"  eager {r['eager']}")
            print(f"  us per call (all ranks on one GPU) {r['us_per_call']}")
        return 0 if all(r["ok"] for r in runs) else 1
    from glmc.runtime.worker.launch import spawn
    world = a.world or (2 if a.cpu else torch.cuda.device_count())
    if a.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    args = {"cpu": a.cpu, "rows": [8] if a.cpu else list(ROWS), "replays": a.replays or (20 if a.cpu else REPLAYS)}
    out_dir = tempfile.mkdtemp(prefix="glmc_p2p_")
    t0 = time.perf_counter()
    spawn(_rank, world, args, out_dir, backend="gloo" if a.cpu else "nccl", timeout_s=300)
    ranks = [torch.load(f"{out_dir}/rank{r}.pt") for r in range(world)]
    table = []
    for rows in args["rows"] if not a.cpu else []:
        cols = {k: max(r["rows"][rows][k] for r in ranks) for k, v in ranks[0]["rows"][rows].items()
                if isinstance(v, float)}
        table.append({"rows": rows, "kib": ranks[0]["rows"][rows]["bytes"] / 1024, **cols})
    stab = [r["stability"] for r in ranks]
    result = {"device": "cpu" if a.cpu else torch.cuda.get_device_name(), "world": world,
              "date": time.strftime("%Y-%m-%d"), "calls_per_graph": CALLS, "table_us": table, "stability": stab,
              "seconds": round(time.perf_counter() - t0, 1),
              "errors": {rows: r["rows"][rows].get("torch_one_shot_error") for r in ranks[:1]
                         for rows in r["rows"] if r["rows"][rows].get("torch_one_shot_error")}}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    keys = ("nccl", "torch_one_shot", "glmc", "nccl_add_rms", "glmc_add_rms", "glmc_rs")
    print(f"P2P BENCH {result['device']} x{world} ({result['date']}): us per call in CUDA graphs, slowest rank")
    print(f"{'KiB':>8} " + " ".join(f"{k:>15}" for k in keys))
    for row in table:
        print(f"{row['kib']:8.0f} " + " ".join(f"{row.get(k, float('nan')):15.1f}" for k in keys))
    ok = all(s["residual_mismatches"] == 0 and s["normed_over_tol"] == 0 for s in stab)
    print(f"STABILITY {'PASS' if ok else 'FAIL'}: {stab}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
