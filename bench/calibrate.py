"""Measure the ceilings glmc's step-time predictor reads; write a calibration file.

    python -m bench.calibrate [--out-dir bench/results] [--commit SHA]   # every visible GPU, ~1-2 min on 2 H200s
    python -m bench.calibrate --smoke --out-dir /tmp                    # CPU + gloo, tiny sizes: the plumbing

Writes <out-dir>/calibration_<device>[-x<gpus>]_<date>.json (format and conventions:
glmc/calibration.py), then `glmc explain PLAN --calibration FILE` predicts decode steps from it. One
process per GPU over NCCL (the environment's NCCL settings as they are); rank 0 also measures the
one-GPU ceilings while the others wait:
- hbm_bytes_per_s: copies of a 1 GiB buffer, 2 x bytes / time (read + written);
- gemm_flops_per_s: 8192^3 bf16 and 4096^3 fp32 matmuls (torch's default: no TF32), 2 n^3 / time;
- attention_flops_per_s: glmc's sparse-MLA decode kernel (`triton_launch.sparse_mla_latent`), 128
  tokens x 64 heads x 2048 top-k slots of 4096-token contexts (kv_lora 512, rope 64, bf16), FLOPs
  over the walked slots; left out, with a note, if Triton or the kernel fails;
- kernel_overhead_s: per launch in a CUDA graph of 128 tiny cuBLAS GEMMs and 128 one-row
  `add_rms_norm` Triton kernels, each reading the last's output; torch_op_overhead_s: 256 `add_`
  (a one-element add: the floor);
- torch_op_s (schema /2): the CUDA target's own torch code at one token in a graph: the MoE row
  alignment (`triton_moe.align_rows`, top-8 of 256 experts) and the torch add + RMS norm ([1, 6144]
  bf16), replay time over their aten ops (`codegen/launch_model.py`'s ALIGN_ROWS_OPS + ADD_RMS_TORCH_OPS);
- gemm_launch_s (/2): the cuBLAS calls of one GLM-5.3 decode layer at one token row (A-projection,
  indexer Q, Q, W_UK / W_UV bmm, O, the fp32 router, shared and dense SwiGLU, lm_head), each weight
  its own tensor (2.8 GB: none stays in L2), in one graph: (replay - their bytes / hbm_bytes_per_s)
  per call;
- topk_select (/2): glmc's top-k select kernel (k 2048, TOPK_CHUNK) over 1, 32, 128, 256, 512 rows
  of 4097 scores (a context of 4096), seconds per launch in a graph;
- collectives: groups of the first n ranks, n = 2, 4, 8, ... and all GPUs; all_reduce,
  all_gather, reduce_scatter, all_to_all of bf16 messages from 4 KiB to 256 MiB (powers of two;
  message convention of glmc/calibration.py), `reps` calls captured in one CUDA graph, replayed.
- p2p collectives (the same groups): glmc's one-shot peer-memory kernels (`codegen/triton_p2p.py`
  over `PeerChannel`s) at GLM-5.3's row width (6144 bf16) from 1 row to the 4 MiB channel cap:
  p2p_all_reduce and p2p_reduce_scatter with the residual add + RMSNorm fused (as the plans call
  them), p2p_all_gather, p2p_all_to_all (every slot routed: the exchange's worst case), as
  [[message bytes, seconds], ...] tables `glmc.calibration.p2p_collective_seconds` reads. A group
  whose peers cannot be mapped gets no tables (and says why). --smoke: 64 fp32 columns, 1-2 rows.
Timing: CUDA events around back-to-back replays (eager calls for copies and GEMMs), the median of
three windows; a collective's time is the slowest rank's. --smoke times eager calls on the CPU.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import common

KIB, MIB = 2**10, 2**20
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
WINDOWS = 3


def message_sizes(lo: int = 4 * KIB, hi: int = 256 * MIB) -> list[int]:
    """Powers of two from lo to hi (message bytes)."""
    return [1 << e for e in range(lo.bit_length() - 1, hi.bit_length())]


def group_sizes(world: int) -> list[int]:
    """2, 4, 8, ... up to world, and world itself."""
    return sorted({1 << e for e in range(1, world.bit_length()) if 1 << e <= world} | ({world} - {1}))


def shapes(kind: str, nbytes: int, ranks: int, elem: int = 2) -> tuple[int, int, int]:
    """(input numel per rank, output numel per rank, message bytes) of `kind` for a message near
    `nbytes`: the element count is rounded down to split evenly (ranks^2 for all_to_all)."""
    unit = ranks * ranks if kind == "all_to_all" else ranks
    total = max(unit, nbytes // elem // unit * unit)
    ins, outs = {"all_reduce": (total, total), "all_gather": (total // ranks, total),
                 "reduce_scatter": (total, total // ranks), "all_to_all": (total // ranks, total // ranks)}[kind]
    return ins, outs, total * elem


def plan_calls(seconds_guess: float) -> tuple[int, int]:
    """(calls captured per graph, replays per timed window): ~10 ms per window, <= 20 calls a graph."""
    reps = max(1, min(20, int(2e-3 / seconds_guess)))
    return reps, max(2, min(50, int(10e-3 / (seconds_guess * reps))))


def guess_seconds(nbytes: int) -> float:
    return 15e-6 + nbytes / 150e9


def _windows(run, per_window: int, cuda: bool) -> float:
    """Median over WINDOWS of (time of `run()` x per_window) / per_window."""
    import torch
    out = []
    for _ in range(WINDOWS):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_window):
                run()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / per_window)
        else:
            t = time.perf_counter()
            for _ in range(per_window):
                run()
            out.append((time.perf_counter() - t) / per_window)
    return statistics.median(out)


def seconds_per_call(fn, reps: int, replays: int, cuda: bool) -> float:
    """fn() timed: on CUDA `reps` calls captured in one graph, replayed; on the CPU eager calls."""
    import torch
    fn()
    if not cuda:
        return _windows(fn, reps * replays, False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    per_replay = _windows(graph.replay, replays, True)
    del graph
    return per_replay / reps


def eager_seconds(fn, calls: int, cuda: bool) -> float:
    import torch
    fn()
    if cuda:
        torch.cuda.synchronize()
    return _windows(fn, calls, cuda)


# ----------------------------------------------------------------------------- one device
def device_ceilings(smoke: bool) -> dict:
    """hbm_bytes_per_s, gemm_flops_per_s, kernel/torch-op overheads, attention rate (rank 0)."""
    import torch
    cuda = not smoke
    dev = "cuda" if cuda else "cpu"
    n = 2**29 if cuda else 2**19
    src = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    out = {"hbm_bytes_per_s": 2 * src.nbytes / eager_seconds(lambda: dst.copy_(src), 10, cuda)}
    src = dst = None
    out["gemm_flops_per_s"] = {dtype: gemm_rate(dtype, size if cuda else 128, dev, cuda)
                               for dtype, size in (("bf16", 8192), ("fp32", 4096))}
    out.update(launch_overheads(dev, cuda))
    out["torch_op_s"], out["torch_op_detail"] = target_torch_ops(dev, cuda)
    out["gemm_launch_s"], out["gemm_launch_detail"] = gemm_launches(dev, cuda, out["hbm_bytes_per_s"])
    out["topk_select"] = topk_select_table(dev, cuda)
    try:
        out["attention_flops_per_s"] = attention_rate() if cuda else None
    except Exception as e:  # noqa: BLE001  (reported in the file; the prediction falls back to the GEMM rate)
        out["attention_flops_per_s"] = None
        out["notes"] = f"attention kernel not measured: {type(e).__name__}: {e}"[:300]
    if out["attention_flops_per_s"] is None:
        out.pop("attention_flops_per_s")
    return out


def gemm_rate(dtype: str, size: int, dev: str, cuda: bool) -> float:
    """FLOPs per second of a size^3 matmul in `dtype` (bf16 | fp32)."""
    import torch
    x = torch.randn(size, size, device=dev, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    return 2 * size**3 / eager_seconds(lambda: x @ x, 5, cuda)


def launch_overheads(dev: str, cuda: bool) -> dict:
    """Per launch inside a graph: tiny GEMMs (+ one-row Triton norms when Triton runs), tiny adds."""
    import torch
    a, b, w = torch.randn(16, 64, device=dev), torch.empty(16, 64, device=dev), torch.eye(64, device=dev)

    def two_gemms():
        torch.mm(a, w, out=b)
        torch.mm(b, w, out=a)
    gemm = seconds_per_call(two_gemms, 64, 5, cuda) / 2
    kernels, detail = gemm, {"gemm_s": gemm}
    if cuda:
        try:
            from glmc.codegen import triton_launch as tt
            x, r, g = (torch.randn(1, 6144, device=dev, dtype=torch.bfloat16) for _ in range(3))
            norm = seconds_per_call(lambda: tt.add_rms_norm(x, r, g, 1e-5), 128, 5, cuda)
            kernels, detail["triton_s"] = (gemm + norm) / 2, norm
        except Exception as e:  # noqa: BLE001  (recorded; the GEMM figure stands alone)
            detail["triton_error"] = f"{type(e).__name__}: {e}"[:200]
    one = torch.zeros(1, device=dev)
    torch_op = seconds_per_call(lambda: one.add_(1), 256, 5, cuda)
    return {"kernel_overhead_s": kernels, "torch_op_overhead_s": torch_op, "kernel_overhead_detail": detail}


def target_torch_ops(dev: str, cuda: bool) -> tuple[float, dict]:
    """Seconds per aten op of the CUDA target's torch sequences at one token, replayed in a graph."""
    import torch
    from glmc.codegen import launch_model, torch_ref, triton_moe
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, 256, (1, 8), device=dev, generator=g)
    x, r = (torch.randn(1, 6144, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    w = torch.ones(6144, device=dev, dtype=torch.bfloat16)

    def sequences():
        triton_moe.align_rows(ids, 256, 16, 0)
        torch_ref.add_rms_norm(x, r, w, 1e-5)
    ops = launch_model.ALIGN_ROWS_OPS + launch_model.ADD_RMS_TORCH_OPS
    sec = seconds_per_call(sequences, 8, 5, cuda)
    return sec / ops, {"sequences_s": sec, "aten_ops": ops}


GEMMS = [(2784, 6144), (4096, 2048), (16384, 2048), (6144, 16384), (4096, 6144), (6144, 2048), (24576, 6144),
         (6144, 12288), (154880, 6144)]      # one GLM-5.3 decode layer's cuBLAS weights [N, K] (+ bmm, router)
BMMS = [(64, 192, 512), (64, 512, 256)]      # W_UK, W_UV: [heads, K, N]
ROUTER = (256, 6144)                        # fp32


def gemm_launches(dev: str, cuda: bool, hbm_bytes_per_s: float) -> tuple[float, dict]:
    """Seconds per cuBLAS call beyond its bytes at copy bandwidth: the calls of GEMMS, BMMS and
    ROUTER at one token row, each weight its own tensor, in one graph (on the CPU: 1/64 scale)."""
    import torch
    div = 1 if cuda else 64

    def small(n):
        return max(16, n // div)
    bf = dict(device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(small(n), small(k), **bf) for n, k in GEMMS]
    xs = [torch.randn(1, small(k), **bf) for _, k in GEMMS]
    bs = [torch.randn(h, small(k), small(n), **bf) for h, k, n in BMMS]
    qs = [torch.randn(h, 1, small(k), **bf) for h, k, _ in BMMS]
    wr = torch.randn(small(ROUTER[0]), small(ROUTER[1]), device=dev)
    xr = torch.randn(1, small(ROUTER[1]), device=dev)

    def calls():
        for x, w in zip(xs, ws):
            x @ w.T
        for q, b in zip(qs, bs):
            torch.bmm(q, b)
        xr @ wr.T
    nbytes = sum(t.nbytes for t in ws + xs + bs + qs + [wr, xr]) + \
        sum(w.shape[0] * 2 for w in ws) + sum(b.shape[0] * b.shape[2] * 2 for b in bs) + wr.shape[0] * 4
    n = len(ws) + len(bs) + 1
    sec = seconds_per_call(calls, 4 if cuda else 1, 5, cuda)    # 4 passes a graph: its launch amortised
    return max(1e-9, (sec - nbytes / hbm_bytes_per_s) / n), {"pass_s": sec, "calls": n, "bytes": nbytes}


def topk_select_table(dev: str, cuda: bool) -> dict:
    """The top-k select kernel's seconds per launch in a graph by rows (on the CPU: a torch sort
    stand-in at 40 scores, k 16: the plumbing only)."""
    import torch
    from glmc.codegen.launch_model import TOPK_CHUNK
    k, row_len, rows = (2048, 4097, (1, 32, 128, 256, 512)) if cuda else (16, 40, (1, 2))
    points = []
    for n in rows:
        scores = torch.randn(n, row_len, device=dev)
        lens = torch.full((n,), row_len, device=dev)
        if cuda:
            from glmc.codegen import triton_launch as tt
            fn = functools.partial(tt.topk_select, scores, lens, k, TOPK_CHUNK)
        else:
            from glmc.codegen import torch_ref
            fn = functools.partial(torch_ref.topk_lowest_first, scores, k)
        points.append([n, seconds_per_call(fn, 4, 5, cuda)])
    return {"k": k, "chunk": TOPK_CHUNK, "row_len": row_len, "seconds": points}


def attention_rate(tokens: int = 128, heads: int = 64, slots: int = 2048, context: int = 4096) -> float:
    """FLOPs per second of the sparse-MLA decode kernel over the top-k slots it walks."""
    import torch
    from glmc.codegen import triton_launch as tt
    dev, R, dr = "cuda", 512, 64
    kv = torch.randn(tokens * context, R + dr, device=dev, dtype=torch.bfloat16)
    r2t = torch.randperm(tokens * context, device=dev).view(tokens, context)
    rows = torch.arange(tokens, device=dev)
    pos = torch.full((tokens,), context - 1, device=dev, dtype=torch.int64)
    topk = torch.rand(tokens, context, device=dev).argsort(dim=1)[:, :slots]
    q_lat = torch.randn(tokens, heads, R, device=dev, dtype=torch.bfloat16)
    q_pe = torch.randn(tokens, heads, dr, device=dev, dtype=torch.bfloat16)
    ids = tt.topk_slots(topk, r2t, rows, pos)
    sec = seconds_per_call(lambda: tt.sparse_mla_latent(q_lat, q_pe, kv, r2t, rows, pos, topk, 0.0625, slots=ids),
                           4, 10, True)
    return 2.0 * tokens * heads * slots * (2 * R + dr) / sec


# ----------------------------------------------------------------------------- collectives
def collective_fn(kind: str, x, out, group, nccl: bool):
    """One call of `kind` from x into out over `group` (gloo lacks the *_tensor forms: emulated)."""
    import torch.distributed as dist
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_to_all":
        return lambda: dist.all_to_all_single(out, x, group=group)
    if kind == "all_gather":
        if nccl:
            return lambda: dist.all_gather_into_tensor(out, x, group=group)
        parts = list(out.chunk(dist.get_world_size(group)))
        return lambda: dist.all_gather(parts, x, group=group)
    if nccl:
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    mine = dist.get_rank(group)
    return lambda: (dist.all_reduce(x, group=group), out.copy_(x.chunk(dist.get_world_size(group))[mine]))


def slowest(seconds: float, dev, group=None) -> float:
    """The largest of every rank's `seconds` (over `group`; ranks outside a group pass 0)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([seconds], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def measure_collectives(rank: int, world: int, sizes: list[int], cuda: bool) -> dict:
    """{group size: {kind: [[message bytes, seconds], ...]}}; every rank walks the same sequence."""
    import torch
    import torch.distributed as dist
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tables: dict = {}
    for n in group_sizes(world):
        group = None if n == world else dist.new_group(list(range(n)))   # every rank makes every group
        for kind in KINDS:
            rows = []
            for nbytes in sizes:
                ins, outs, msg = shapes(kind, nbytes, n)
                sec = 0.0
                if rank < n:
                    x = torch.zeros(ins, dtype=torch.bfloat16, device=dev)
                    out = torch.empty(outs, dtype=torch.bfloat16, device=dev)
                    reps, replays = plan_calls(guess_seconds(msg)) if cuda else (1, 2)
                    sec = seconds_per_call(collective_fn(kind, x, out, group, cuda), reps, replays, cuda)
                    del x, out
                rows.append([msg, slowest(sec, dev)])
            tables.setdefault(str(n), {})[kind] = rows
    return tables


P2P_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 341)     # x 6144 bf16: 12 KiB .. 4 MiB (the channel cap)


def measure_p2p(rank: int, world: int, cuda: bool) -> tuple[dict, dict]:
    """({group size: {p2p_<kind>: [[message bytes, seconds], ...]}}, {group size: why not}): the
    one-shot kernels per group size, message convention of glmc/calibration.py (all-reduce and
    reduce-scatter: the input; all-gather: the output; all-to-all: the whole buffer)."""
    import torch
    import torch.distributed as dist
    from glmc.codegen.triton_p2p import p2p_all_gather, p2p_all_to_all, p2p_allreduce
    from glmc.runtime.worker.peer_memory import PeerChannel, PeerMemoryUnavailable
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype, H = (torch.bfloat16, 6144) if cuda else (torch.float32, 64)
    rows_list = P2P_ROWS if cuda else (1, 2)
    row = H * dtype.itemsize
    tables, skipped = {}, {}
    for n in group_sizes(world):
        group = None if n == world else dist.new_group(list(range(n)))   # every rank makes every group
        if rank >= n:
            continue
        cap = max(rows_list) * n
        try:
            ar = PeerChannel.open(group, list(range(n)), rank, cap, row, False, dev)
            rs = PeerChannel.open(group, list(range(n)), rank, cap, row, True, dev)
            a2a = PeerChannel.open(group, list(range(n)), rank, cap, row, True, dev)
        except PeerMemoryUnavailable as e:
            skipped[str(n)] = str(e)[:300]
            continue
        w = torch.ones(H, dtype=dtype, device=dev)
        out = {f"p2p_{k}": [] for k in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")}
        for r in rows_list:
            x = torch.randn(n * r, H, device=dev).to(dtype)
            res = torch.randn(n * r, H, device=dev).to(dtype)
            valid = torch.ones(n * r, dtype=torch.int32, device=dev)
            calls = {"p2p_all_reduce": (r * row, lambda: p2p_allreduce(x[:r], ar, res[:r], w, 1e-5)),
                     "p2p_reduce_scatter": (n * r * row, lambda: p2p_allreduce(x, rs, res[:r], w, 1e-5, True)),
                     "p2p_all_gather": (n * r * row, lambda: p2p_all_gather(x[:r], ar)),
                     "p2p_all_to_all": (n * r * row, lambda: p2p_all_to_all(x, valid, a2a))}
            for kind, (msg, fn) in calls.items():
                reps, replays = plan_calls(guess_seconds(msg)) if cuda else (1, 2)
                out[kind].append([msg, slowest(seconds_per_call(fn, reps, replays, cuda), dev, group)])
        tables[str(n)] = out
    return tables, skipped


def run_rank(rank: int, world: int, job: dict, out_dir: str) -> None:
    """One rank: the device ceilings (rank 0), then every collective; rank 0 writes rank0.json."""
    import torch.distributed as dist
    result = device_ceilings(job["smoke"]) if rank == 0 else {}
    dist.barrier()
    result["collectives"] = measure_collectives(rank, world, job["sizes"], not job["smoke"])
    p2p, skipped = measure_p2p(rank, world, not job["smoke"])
    for n, t in p2p.items():
        result["collectives"].setdefault(n, {}).update(t)
    if skipped:
        result["p2p_unavailable"] = skipped
    if rank == 0:
        Path(out_dir, "rank0.json").write_text(json.dumps(result))


# ----------------------------------------------------------------------------- the file
def slug(device: str, gpus: int) -> str:
    """'NVIDIA H200', 2 -> 'nvidia-h200-x2' (a file-name part)."""
    name = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return name + (f"-x{gpus}" if gpus > 1 else "")


def assemble(measured: dict, device: str, gpus: int, commit: str, smoke: bool, extra: dict) -> dict:
    """The calibration file's dict (glmc/calibration.py) from rank 0's measurements."""
    from glmc.calibration import SCHEMA
    cal = {"schema": SCHEMA, "device": device, "gpus": gpus, "date": time.strftime("%Y-%m-%d"),
           "commit": commit, "measured": not smoke, **measured, **extra}
    if smoke:
        cal["notes"] = "smoke run: CPU + gloo at tiny sizes; checks the plumbing, not a machine's ceilings"
    return cal


def summary(cal: dict) -> str:
    """The numbers, and per group size each collective's microseconds by message size."""
    lines = [(f"{cal['device']} x{cal['gpus']}: copy {cal['hbm_bytes_per_s'] / 1e9:.0f} GB/s, GEMM bf16 "
              f"{cal['gemm_flops_per_s']['bf16'] / 1e12:.1f} / fp32 {cal['gemm_flops_per_s']['fp32'] / 1e12:.1f} "
              f"TFLOP/s, attention kernel {cal.get('attention_flops_per_s', 0) / 1e12:.1f} TFLOP/s, "
              f"{cal['kernel_overhead_s'] * 1e6:.2f} us per kernel, {cal['torch_op_overhead_s'] * 1e6:.2f} us per "
              f"torch add, {cal['torch_op_s'] * 1e6:.2f} us per target torch op, {cal['gemm_launch_s'] * 1e6:.2f} us "
              "per GEMM call beyond its bytes (in a graph); top-k select at "
              + ", ".join(f"{r} rows {s * 1e6:.1f} us" for r, s in cal["topk_select"]["seconds"]))]
    for n, all_tables in cal["collectives"].items():
        tables = {k: t for k, t in all_tables.items() if not k.startswith("p2p_")}
        lines.append(f"-- {n} GPUs, NCCL: us per call (message bytes) --")
        lines.append(f"{'bytes':>10} " + " ".join(f"{k:>14}" for k in tables))
        for i, (nbytes, _) in enumerate(next(iter(tables.values()))):
            lines.append(f"{nbytes:>10} " + " ".join(f"{t[i][1] * 1e6:14.1f}" for t in tables.values()))
        for k, t in all_tables.items():
            if k.startswith("p2p_"):
                lines.append(f"-- {n} GPUs, {k} (one-shot kernel): " + ", ".join(f"{b} B {s * 1e6:.1f} us" for b, s in t))
    for n, why in cal.get("p2p_unavailable", {}).items():
        lines.append(f"-- {n} GPUs: no peer-memory tables: {why}")
    return "\n".join(lines)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT, capture_output=True,
                              text=True, timeout=10, check=False).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(common.ROOT / "bench" / "results"))
    ap.add_argument("--commit", help="recorded in the file (default: git rev-parse --short HEAD)")
    ap.add_argument("--gpus", type=int, help="GPUs to use (default: every visible one)")
    ap.add_argument("--max-mib", type=int, default=256, help="largest collective message, MiB")
    ap.add_argument("--smoke", action="store_true", help="CPU + gloo, 2 processes, tiny sizes")
    args = ap.parse_args(argv)
    import torch
    from glmc.runtime.worker.launch import spawn

    from glmc.calibration import validate
    t0 = time.perf_counter()
    world = 2 if args.smoke else (args.gpus or torch.cuda.device_count())
    if world < 1:
        raise SystemExit("calibrate: no GPU visible (use --smoke for a CPU dry run)")
    sizes = message_sizes(4 * KIB, 16 * KIB) if args.smoke else message_sizes(4 * KIB, args.max_mib * MIB)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")    # the peer-memory kernels, interpreted
    tmp = tempfile.mkdtemp(prefix="glmc_calibrate_")
    spawn(run_rank, world, {"smoke": args.smoke, "sizes": sizes}, tmp,
          backend="gloo" if args.smoke else "nccl", timeout_s=600)
    measured = json.loads(Path(tmp, "rank0.json").read_text())
    device = "cpu-smoke" if args.smoke else torch.cuda.get_device_name(0)
    nccl = None if args.smoke else torch.cuda.nccl.version()
    extra = {"torch": torch.__version__, "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
             "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
             "seconds": round(time.perf_counter() - t0, 1)}
    cal = assemble(measured, device, world, args.commit or git_commit(), args.smoke, extra)
    path = Path(args.out_dir) / f"calibration_{slug(device, world)}_{cal['date']}.json"
    validate(cal, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cal, indent=1) + "\n")
    print(summary(cal))
    print(f"wrote {path} ({cal['seconds']:.0f} s)")
    return path


if __name__ == "__main__":
    main()
