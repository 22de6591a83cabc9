"""Decode step per parallel spec: tp1 on one GPU; tp2, tp2ep2, dp2ep2 (gather and a2a) on two.

    python -m bench.spec_bench --out-dir bench/results [--calibration FILE] [--batches 1,32,128]
    python -m bench.spec_bench --cpu --batches 1,2      # dry run: gloo, Triton interpreted, narrow dims

Model: a GLM-5.3-width slice, 1 dense + 3 MoE layers (256 experts split over the EP ranks), full
indexers on layers 0 and 2 (1 and 3 share their top-k), random bf16 weights from one seed (the same
on every rank), router correction bias zero (HF's init: routing spreads as the cost model assumes).
DSA is active: every request sits at position `--ctx` (4096 > index_topk 2048).
The KV and indexer caches are synthetic (random rows; no prefill). For each spec and per-rank batch
B (each attention-DP rank runs B requests; TP ranks share theirs):
- replay: the decode CUDA graph, CUDA events over back-to-back replays (slowest rank);
- step: `forward()` from host ids to device logits, host time included (slowest rank);
- tokens/s over all GPUs: B x attn_dp / step;
- collectives: NCCL kernel time inside profiled replays (torch.profiler), per kind (slowest rank);
- roofline: max over ranks of (HBM bytes the rank must move at B: `passes/costs.py`'s hbm_bytes with
  the routed experts one eager step really touched) / measured copy bandwidth, plus the
  collectives' measured in-graph time;
- predicted (with --calibration): `glmc/predict.py`'s step for the bucket replayed.
Targets: replay within 1.3x of the roofline at B = 32 and 128; dp2ep2 at 128 per rank
>= 1.7x tp1's tokens/s at 128.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench import common
from bench.common import ceilings  # copy bandwidth, measured as the decode bench does

LAYERS = dict(num_hidden_layers=4, first_k_dense_replace=1, indexer_types=["full", "shared", "full", "shared"])
TWO_GPU = [("tp2", None), ("tp2ep2", False), ("dp2ep2", False), ("dp2ep2", True)]
NCCL_KINDS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
              "SendRecv": "all_to_all", "AllToAll": "all_to_all"}


def nccl_ms(graph, replays):
    """(NCCL kernel ms per replay by kind, all kernels' ms per replay) from a profiled run of replays."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    by_kind, total, kernels = {}, 0.0, {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        us = e.device_time if hasattr(e, "device_time") else e.cuda_time
        total += us
        row = kernels.setdefault(e.name[:120], [0, 0.0])
        row[0], row[1] = row[0] + 1, row[1] + us
        if "nccl" in e.name.lower():
            kind = next((v for k, v in NCCL_KINDS.items() if k in e.name), "other")
            by_kind[kind] = by_kind.get(kind, 0.0) + us
    per_replay = {name: [n / replays, us / replays] for name, (n, us) in
                  sorted(kernels.items(), key=lambda kv: -kv[1][1])}   # kernel -> [launches, us] per replay
    return {k: v / replays / 1e3 for k, v in by_kind.items()}, total / replays / 1e3, per_replay


def must_bytes(plan, tokens, ctx, touched):
    """HBM bytes this rank must move in one decode step of `tokens` requests (runner dtypes: bf16):
    the cost model's, with its expected routed-expert reads replaced by the experts the step's
    routing really touched on this rank (`touched`: per MoE layer)."""
    from bench import predicted
    from glmc.passes.costs import op_cost, touched_experts, weight_bytes_for
    env = {"T": tokens, "B": tokens, "S": ctx, "K": plan.config.index_topk}
    graph, wb = plan.graphs["decode"], weight_bytes_for(predicted.runner_dtypes(plan))
    total = 0
    for op in graph.ops:
        total += op_cost(op, graph, env, wb).hbm_bytes
        if op.kind == "moe.experts":
            hidden, inter = int(op.attr("hidden")), int(op.attr("inter")) // int(op.attr("moe_tp", 1))
            local = int(op.attr("experts")) // int(op.attr("ep", 1))
            expected = touched_experts(local, int(op.attr("top_k")), int(op.attr("experts")), tokens)
            total += (touched.get(op.layer, expected) - expected) * 3 * hidden * inter * 2
    return total


def batch_of(plan, B, ctx, table):
    import torch
    from glmc.runtime.worker.forward_batch import ForwardBatch
    ids = torch.randint(0, plan.config.vocab_size, (B,), generator=torch.Generator().manual_seed(B)).tolist()
    return ForwardBatch.build("decode", [[t] for t in ids], list(range(B)), [ctx] * B, table)


def routed_experts(gpu, plan, batch, dp_tokens):
    """{MoE layer: this rank's experts some token of one eager decode step routes to}."""
    seen, orig = {}, gpu.impls["moe.experts"]

    def record(op, args, ctx):
        ids, first = args[2], ctx.expert_offset(op)
        local = int(op.attr("experts")) // int(op.attr("ep", 1))
        mine = ids[(ids >= first) & (ids < first + local)]
        seen[op.layer] = int(mine.unique().numel())
        return orig(op, args, ctx)
    gpu.impls = {**gpu.impls, "moe.experts": record}
    try:
        gpu.forward("decode", batch, dp_tokens=dp_tokens)   # nothing captured yet: runs eagerly
    finally:
        gpu.impls = {**gpu.impls, "moe.experts": orig}
    return seen


def one_spec(plan, weights, stacks, job, comm):
    """Every per-rank batch of one plan on this rank: -> list of measurements."""
    import torch
    from glmc.runtime.worker.loader import load_runner
    dev, batches, ctx, cuda = job["device"], job["batches"], job["ctx"], job["device"] == "cuda"
    max_b, max_ctx = max(batches), ctx + 64
    gpu = load_runner(plan, weights, device=dev, comm=comm, num_pages=max_b * max_ctx // 64 + 1,
                      max_context=max_ctx, max_running=max_b, capture=False, stacks=stacks).executor
    g = torch.Generator(device=dev).manual_seed(comm.rank)
    gpu.pool.randomize_(g)
    dp = plan.mesh["attn_dp"]
    need = {B: gpu.padded_tokens(B, [B] * dp if dp > 1 else None) for B in batches}
    buckets = sorted({next(b for b in gpu.buckets if b >= n) for n in need.values()})
    table = common.req_table(max_b, max_ctx // 64)
    touched = {B: routed_experts(gpu, plan, batch_of(plan, B, ctx, table), [B] * dp if dp > 1 else None)
               for B in batches}   # one eager step per batch: the experts its routing really picks
    if cuda:
        gpu.capture(buckets)
    out = []
    for B in batches:
        batch = batch_of(plan, B, ctx, table)
        dp_tokens = [B] * dp if dp > 1 else None
        row = {"B": B, "bucket": None, "touched_experts": touched[B],
               "must_bytes": must_bytes(plan, B, ctx, touched[B])}
        for _ in range(3):
            gpu.forward("decode", batch, dp_tokens=dp_tokens)
        reps = job["reps"]
        t0 = time.perf_counter()
        for _ in range(reps):
            logits = gpu.forward("decode", batch, dp_tokens=dp_tokens)["logits"]
            float(logits[0, 0])                 # the host waits for the step's logits
        row["step_ms"] = (time.perf_counter() - t0) / reps * 1e3
        row["bucket"] = gpu.last_bucket
        cap = gpu.captured.get(gpu.last_bucket) if cuda else None
        if cap is not None:
            row["replay_ms"] = common.replay_ms(cap.graph, reps)
            row["nccl_ms"], row["kernels_ms"], row["profile"] = nccl_ms(cap.graph, 5)
            row["counts"] = cap.counts
        out.append(row)
    gpu.release()
    del gpu
    if cuda:
        torch.cuda.empty_cache()
    return out


def run_rank(rank, world, job, out_dir):
    import torch
    from glmc.runtime.worker.comm import Comm
    dev = job["device"]
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // (2 * world)))   # ranks share the host's cores
    model = common.slice_model(dev, torch.bfloat16, seed=0, narrow=job["narrow"], **LAYERS)
    with torch.no_grad():   # HF's init value: routing spreads over experts (a random bias herds tokens onto a few)
        for n, t in list(model.named_parameters()) + list(model.named_buffers()):
            if n.endswith("e_score_correction_bias"):
                t.zero_()
    weights, stacks = common.glmc_weights(model)
    del model
    res = {}
    for name, plan in job["plans"].items():
        try:
            res[name] = one_spec(plan, weights, stacks, job, Comm(plan.mesh, plan.groups))
        except Exception as e:  # reported; the next spec still runs (every rank fails alike)
            import traceback
            res[name] = {"error": f"{type(e).__name__}: {e}"[-800:], "trace": traceback.format_exc()[-1500:]}
    torch.save(res, f"{out_dir}/rank{rank}.pt")


def summarise(name, plan, ranks, gbps, cal, ctx) -> list[dict]:
    """Slowest rank per batch; roofline, tokens/s, predicted."""
    from bench import predicted
    rows = []
    for i, first in enumerate(ranks[0]):
        per = [r[i] for r in ranks]
        row = {"spec": name, "B_per_rank": first["B"], "bucket": first["bucket"],
               "step_ms": max(r["step_ms"] for r in per)}
        row["tokens_per_s"] = first["B"] * plan.mesh["attn_dp"] / row["step_ms"] * 1e3
        row["touched_experts"] = [r["touched_experts"] for r in per]
        if "replay_ms" in first:
            row["replay_ms"] = max(r["replay_ms"] for r in per)
            row["tokens_per_s_replay"] = first["B"] * plan.mesh["attn_dp"] / row["replay_ms"] * 1e3
            kinds = {k for r in per for k in r["nccl_ms"]}
            row["nccl_ms"] = {k: max(r["nccl_ms"].get(k, 0.0) for r in per) for k in sorted(kinds)}
            row["kernels_ms"] = max(r["kernels_ms"] for r in per)
            row["profile_rank0"] = first["profile"]     # per replay: kernel -> [launches, device us]
            row["counts"] = first["counts"]
            comm = sum(row["nccl_ms"].values())
            row["roofline_ms"] = max(r["must_bytes"] for r in per) / gbps / 1e6 + comm
            row["replay_over_roofline"] = row["replay_ms"] / row["roofline_ms"]
            if cal:
                row["predicted"] = predicted.compare(f"{name} B={first['B']}",
                                                     predicted.predict_ms(plan, first["bucket"], ctx, cal),
                                                     row["replay_ms"])
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--calibration")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--commit", default=os.environ.get("GLMC_COMMIT", "unknown"))
    args = ap.parse_args()
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        args.ctx, args.reps = min(args.ctx, 40), 1
    import torch
    from glmc.calibration import load
    from glmc.runtime.worker.launch import spawn
    cuda = not args.cpu
    dev, backend = ("cuda", "nccl") if cuda else ("cpu", "gloo")
    cal = load(args.calibration) if args.calibration else None
    from types import SimpleNamespace

    from transformers import GlmMoeDsaConfig
    model_cfg = SimpleNamespace(config=GlmMoeDsaConfig(**{**common.GLM53, **common.SLICE, **(common.NARROW if args.cpu else {}),
                                                          **LAYERS}))
    plans = {"tp1": common.glmc_plan(model_cfg, max(args.batches) * 2, "bfloat16", "tp1")}
    for parallel, a2a in TWO_GPU:
        name = parallel + {None: "", False: "/gather", True: "/a2a"}[a2a]
        plans[name] = common.glmc_plan(model_cfg, max(args.batches) * 2, "bfloat16", parallel, moe_a2a=a2a)
    job = dict(device=dev, narrow=args.cpu, batches=args.batches, ctx=args.ctx, reps=args.reps)
    gbps, t0, rows = ceilings(args.cpu)[0], time.perf_counter(), []
    for world, names in ((1, ["tp1"]), (2, [n for n in plans if n != "tp1"])):
        out = tempfile.mkdtemp(prefix="glmc_spec_")
        spawn(run_rank, world, {**job, "plans": {n: plans[n] for n in names}}, out, backend=backend, timeout_s=900)
        ranks = [torch.load(f"{out}/rank{r}.pt") for r in range(world)]
        for n in names:
            if "error" in ranks[0][n]:
                rows.append({"spec": n, "error": ranks[0][n]["error"], "trace": ranks[0][n]["trace"]})
                print(json.dumps(rows[-1])[:1500], flush=True)
                continue
            rows += summarise(n, plans[n], [r[n] for r in ranks], gbps, cal, args.ctx)
    info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "gpus": torch.cuda.device_count() if cuda
            else 0, "date": time.strftime("%Y-%m-%d"), "commit": args.commit, "copy_gbps": gbps, "ctx": args.ctx,
            "model": "GLM-5.3 width, 1 dense + 3 MoE layers (256 experts), full indexers on 0 and 2, bf16",
            "calibration": args.calibration, "seconds": time.perf_counter() - t0}
    report(rows, info)
    path = Path(args.out_dir) / f"spec_bench_{info['date']}{'_cpu' if args.cpu else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"info": info, "rows": rows, "p2p_collectives": True,
                                "moe_routing": None}, indent=1))
    print(f"saved {path}")


def report(rows, info):
    print(f"device {info['device']}  copy {info['copy_gbps']:.0f} GB/s  ctx {info['ctx']}  {info['seconds']:.0f} s")
    print(f"{'spec':14} {'B/rank':>6} {'bucket':>6} {'replay':>8} {'step':>8} {'tok/s':>9} {'nccl':>7} "
          f"{'roofline':>8} {'x roof':>6} {'pred':>7}")
    tp1 = {r["B_per_rank"]: r["tokens_per_s"] for r in rows if r.get("spec") == "tp1"}
    for r in rows:
        if "error" in r:
            print(f"{r['spec']:14} ERROR {r['error'][:200]}")
            continue
        pred = r.get("predicted", {}).get("predicted_ms")
        print(f"{r['spec']:14} {r['B_per_rank']:6d} {r['bucket'] or 0:6d} {r.get('replay_ms', 0):8.3f} "
              f"{r['step_ms']:8.3f} {r['tokens_per_s']:9.0f} {sum(r.get('nccl_ms', {}).values()):7.3f} "
              f"{r.get('roofline_ms', 0):8.3f} {r.get('replay_over_roofline', 0):6.2f} "
              f"{pred if pred is not None else float('nan'):7.3f}  "
              f"x tp1 tok/s {r['tokens_per_s'] / tp1.get(r['B_per_rank'], float('nan')):.2f}")


if __name__ == "__main__":
    main()
