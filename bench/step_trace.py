"""Where one decode step's time goes: every kernel of the captured graph, attributed to its op.

    python -m bench.step_trace --out-dir $OUT --commit <sha> [--kv fp8|bf16] [--batches 1,32,128]
    python -m bench.step_trace --out-dir $OUT --parallel tp8ep8 --batches 1,16   # one rank, alone

The GLM-5.3-width slice of bench/decode_bench.py (2 layers, random weights, context --ctx), FP8 weights
and KV by default (`--kv bf16`: bf16 weights and KV). Per batch:
- the graph: torch.profiler over `--replays` replays of the captured decode graph; per replay its span
  (first kernel start to last kernel end), the sum of its kernels' device time, and the idle time
  between kernels (gaps);
- the ops: each op of one decode body run alone under the profiler gives its kernels' names; their
  sequence is the graph's (same ops, same order), so every graph kernel gets its op: per op, its
  kernels' device time inside the graph and the gaps in front of them;
- the host step: `runner.forward` (host vectors, copy in, replay) + reading one logit, wall time.
`--parallel` (not tp1): rank 0 of that mesh on this GPU (`LoneComm`, the peers' tokens from
mtp_gpu_check.peer_tokens, as its `--parts rank`): the decode body's calls are recorded once, and the
graph traced is theirs without the collectives (a lone rank has no peers to wait for; mtp_gpu_check
adds the calibrated collectives), so it shows the rank's own kernels and the gaps between them.
Writes step_trace_<kv>[_<parallel>]_<date>.json and prints the per-op table. Measures; changes nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench import common


def launch_model(prof):
    """The device kernels (and memsets/copies) a profile recorded, by start; not range annotations."""
    import torch
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and e.device_time > 0 and not e.name.startswith("op::")), key=lambda e: e.time_range.start)


def decode_calls(runner, batch) -> list:
    """[(op, args, step, implementation)] of one decode body, recorded as it runs once."""
    vectors = runner.host_vectors(batch, batch.batch_size).to(runner.r2t.device)
    return common.op_calls(runner, lambda: runner.run_tokens("decode", vectors))


def op_kernels(calls) -> list:
    """[(op label, kernel name)] of recorded calls, in launch order: each call runs alone under the
    profiler (its kernels counted)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    out = []
    for op, args, rt, fn in calls:
        fn(op, args, rt)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(op, args, rt)
            torch.cuda.synchronize()
        out += [(f"{op.kind} {op.results[0]}", k.name) for k in launch_model(prof)]
    return out


def graph_trace(graph, replays: int) -> list:
    """Per replay: [(kernel name, start us, duration us)]."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    ks = launch_model(prof)
    per = len(ks) // replays
    if not per or len(ks) % replays:
        raise RuntimeError(f"{len(ks)} kernels over {replays} replays")
    return [[(k.name, k.time_range.start, k.device_time) for k in ks[r * per:(r + 1) * per]] for r in range(replays)]


def op_labels(ops: list, names: list) -> tuple[list, int]:
    """Each graph kernel's op: the ops' kernel names (in launch order) matched against the graph's
    by the longest common subsequence of names (difflib), so that a kernel an op launches only when
    run alone (e.g. a quantisation the step shared with an earlier op) or one the graph has beside
    the ops (the step's own) leaves the rest aligned. -> (labels, graph kernels matched to an op);
    unmatched graph kernels are "(step)"."""
    import difflib
    want = [k for _, k in ops]
    labels = ["(step)"] * len(names)
    matched = 0
    for a, b, size in difflib.SequenceMatcher(None, want, names, autojunk=False).get_matching_blocks():
        for j in range(size):
            labels[b + j] = ops[a + j][0]
        matched += size
    return labels, matched


def summarise(ops: list, reps: list) -> dict:
    """Median over replays of each kernel's duration and the gap before it; grouped by op
    (`op_labels`; the kernels no op claims: the step's own)."""
    n = len(reps[0])
    names = [k[0] for k in reps[0]]
    dur = [statistics.median(r[i][2] for r in reps) for i in range(n)]
    gap = [0.0] + [statistics.median(r[i][1] - (r[i - 1][1] + r[i - 1][2]) for r in reps) for i in range(1, n)]
    span = statistics.median(r[-1][1] + r[-1][2] - r[0][1] for r in reps)
    labels, matched = op_labels(ops, names)
    rows, by_op = [], {}
    for i in range(n):
        rows.append({"i": i, "op": labels[i], "kernel": names[i][:90], "us": round(dur[i], 2), "gap_us": round(gap[i], 2)})
        o = by_op.setdefault(labels[i], {"op": labels[i], "kernels": 0, "us": 0.0, "gap_us": 0.0})
        o["kernels"] += 1
        o["us"] += dur[i]
        o["gap_us"] += gap[i]
    return {"span_us": round(span, 1), "busy_us": round(sum(dur), 1), "gap_us": round(sum(gap), 1),
            "kernels": n, "aligned": matched == len(ops), "matched": matched, "op_kernels": len(ops),
            "ops": [dict(o, us=round(o["us"], 1), gap_us=round(o["gap_us"], 1)) for o in by_op.values()],
            "trace": rows}


def host_step_ms(runner, batch, reps: int = 50) -> float:
    runner.forward("decode", batch)["logits"][0, 0].item()
    t = time.perf_counter()
    for _ in range(reps):
        runner.forward("decode", batch)["logits"][0, 0].item()
    return (time.perf_counter() - t) / reps * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--kv", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128])
    ap.add_argument("--prefill-tokens", type=int, default=None,
                    help="tokens per prefill forward (default: 8192 for a lone rank, 16384 for the whole step)")
    ap.add_argument("--parallel", default="tp1", help="not tp1: rank 0 of this mesh alone (LoneComm), collectives left out")
    args = ap.parse_args()
    import torch
    fp8 = args.kv == "fp8"
    lone = args.parallel != "tp1"
    info = {"device": torch.cuda.get_device_name(), "commit": args.commit, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "torch": torch.__version__, "ctx": args.ctx, "kv": args.kv, "weights": args.kv, "parallel": args.parallel,
            "rank": "rank 0 alone (LoneComm), collectives left out of the graph" if lone else "the whole step"}
    model = common.slice_model("cuda", torch.bfloat16, seed=0)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.zero_()
    weights, stacks = common.glmc_weights(model)
    B_max, ctx = max(args.batches), args.ctx
    # a lone rank cannot run an all-to-all: the MoE's gather form (as mtp_gpu_check's rank part)
    plan = common.glmc_plan(model, B_max, "bfloat16", fp8=fp8, kv_dtype=args.kv, parallel=args.parallel,
                        **({"moe_a2a": False} if lone else {}))
    comm = None
    if lone:
        from glmc.runtime.worker.comm import LoneComm
        comm = LoneComm(plan.mesh, rank=0)
    runner = common.gpu_runner(plan, weights, "cuda", B_max, ctx + 64, stacks=stacks, comm=comm)
    del model
    table = common.req_table(B_max, (ctx + 64) // 64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, plan.config.vocab_size, (ctx,), generator=g).tolist() for _ in range(B_max)]
    # a lone rank prefills 8192 tokens a forward by default, as mtp_gpu_check's rank part
    per_forward = args.prefill_tokens or (8192 if lone else 16384)
    common.prefill(runner, prompts, table, group=max(1, per_forward // ctx))
    if not lone:
        runner.capture(args.batches)
    res = {}
    for B in args.batches:
        nxt = torch.randint(0, plan.config.vocab_size, (B,), generator=g).tolist()
        batch = common.decode_batch([p + [t] for p, t in zip(prompts[:B], nxt)], table)
        if lone:
            from bench.mtp_gpu_check import COMM_KINDS, peer_tokens
            comm.peer = peer_tokens(B * plan.mesh["attn_dp"], plan.config.n_routed_experts)
            calls = [c for c in decode_calls(runner, batch) if not c[0].kind.startswith(COMM_KINDS)]
            comm.peer = None
            graph, _ = common.capture_graph(lambda: [fn(op, args, rt) for op, args, rt, fn in calls])
        else:
            runner.forward("decode", batch)
            calls, graph = decode_calls(runner, batch), runner.captured[B].graph
        r = summarise(op_kernels(calls), graph_trace(graph, args.replays))
        r["replay_ms"] = common.bench_ms(graph.replay, graph=False)
        r["host_step_ms"] = None if lone else host_step_ms(runner, batch)
        res[B] = r
        host = "" if lone else f", host step {r['host_step_ms']:.3f} ms"
        print(f"\nB={B}: replay {r['replay_ms']:.3f} ms{host}, traced span "
              f"{r['span_us']:.1f} us = busy {r['busy_us']:.1f} + gaps {r['gap_us']:.1f} over {r['kernels']} kernels"
              f" ({r['matched']} of the ops' {r['op_kernels']} kernels found in the graph)")
        for o in r["ops"]:
            print(f"  {o['op'][:56]:56s} {o['kernels']:3d} k {o['us']:8.1f} us  gaps {o['gap_us']:6.1f}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"_{args.parallel}" if lone else ""
    (out / f"step_trace_{args.kv}{tag}_{time.strftime('%Y-%m-%d')}.json").write_text(
        json.dumps({"info": info, "batches": res}, indent=1))


if __name__ == "__main__":
    main()
