"""GLM-5.3 at full size on the GPUs of one host: decode TPOT per concurrency, MTP off and on.

    python -m bench.full_model --out-dir $OUT                   # every visible GPU (full size: 8 H200s)
    python -m bench.full_model --layers 8 --out-dir $OUT        # fewer layers (default on < 8 GPUs: what fits)
    python -m bench.full_model --cpu                            # gloo dry run: the tiny config, 2 ranks
    python -m bench.full_model --specs dp-a2a,tp --mtp 0        # some specs; MTP off only

Each spec (dp{n}ep{n} with the gather and with the all-to-all MoE lowering, tp{n}ep{n}; n = the GPUs)
runs as n processes, one per GPU. Every rank makes its shard of `glm-5.3-random` (GLM-5.3's card with
random block-FP8 weights, `runtime/worker/random_weights`: no checkpoint) through the one loader,
captures the decode graphs (with --mtp also verify and draft) up to the largest per-rank batch, fills
its KV pool and indexer cache with random rows (long_context_bench's fill: no 8K-token prefills) and
gives each request --context cached tokens. Per concurrency c over the whole machine (c / dp requests
per DP rank; all c on every rank of a TP group):
- TPOT without MTP: the whole decode step (inputs in, graph replay, logits read), wall time over
  back-to-back steps after a barrier, the slowest rank's;
- TPOT with MTP (N drafts, acceptance length pinned at --accept, the value glmc-small measured on the
  H200 on 2026-12-01, stated as such): the cycle verify(b(N+1)) + draft-extend(b(N+1)) + (N-1)
  draft(b), each a whole step, divided by the acceptance (mtp_gpu_check's formula);
- output tok/s per GPU (c / TPOT / n), memory per GPU (allocated, reserved, in use; the largest rank's)
  and device time in collectives per step (rank 0, torch.profiler: NCCL and peer-memory kernels);
- next to `glmc explain`'s calibrated prediction of the same plan, batch and context (--calibration).
It also prints the prediction for the whole GLM-5.3 on 8 GPUs at every concurrency (the table to
compare with SGLang's recipe, docs/performance.md), whatever ran. Concurrencies that do not fit are
reported with the bytes they need.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench import long_context_bench as lc

GIB = 2**30
HEADROOM = 12 * GIB      # activations, graph pools, NCCL and allocator slack beside weights and KV
CALIBRATION = Path(__file__).resolve().parent / "results" / "calibration_nvidia-h200-x2_2026-11-30_derived.json"
ACCEPT_NOTE = "pinned: glmc-small's acceptance length on the H200 (bench/mtp_gpu_check.py, 2026-12-01)"


KINDS = {"dp-gather": ("dp{n}ep{n}", False), "dp-a2a": ("dp{n}ep{n}", True), "tp": ("tp{n}ep{n}", None)}
MOE = {False: "gather", True: "a2a", None: "-"}


def specs_for(n: int, kinds: str) -> list[tuple[str, bool | None]]:
    """(parallel, moe_a2a) on n GPUs of each of `kinds` (comma list of KINDS' names)."""
    bad = [k for k in kinds.split(",") if k not in KINDS]
    if bad:
        raise SystemExit(f"--specs: {bad[0]!r} is not one of {', '.join(KINDS)}")
    return [(KINDS[k][0].format(n=n), KINDS[k][1]) for k in kinds.split(",")]


def compile_for(ckpt, parallel, a2a, max_batch, mtp):
    from glmc.compiler import compile_plan
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.spec import load_spec
    spec = load_spec(ckpt)
    opts = Options(device="cuda", max_batch=max_batch, moe_a2a=bool(a2a), **({"mtp_draft_tokens": mtp + 1} if mtp else {}))
    return compile_plan(spec, parse_parallel(parallel, spec.config), opts)


def per_rank_batch(plan, c: int) -> int:
    return -(-c // plan.mesh["attn_dp"])


def rank_bytes(plan, b: int, context: int, mtp: int) -> dict:
    """What one rank holds at per-rank batch b: weights (explain's), the KV pool of b requests of
    context + mtp tokens (long_context_bench.pool_bytes), headroom."""
    mem = plan.graphs["decode"].meta["memory"]
    return {"weights": mem["weights_bytes"] + mem.get("weight_copies_bytes", 0),
            "kv": lc.pool_bytes(plan, b, context + mtp)[0], "headroom": HEADROOM}


def fitting_layers(n: int, context: int, c_max: int, device_bytes: int, mtp: int) -> int:
    """The most decoder layers (<= 78) whose dp{n}ep{n} rank fits device_bytes at c_max (linear in
    the layer count past the dense ones: explain's weights and KV at 6 and 12 layers)."""
    from glmc.tiny import make_random_glm
    need = {}
    for layers in (6, 12):
        d = make_random_glm(tempfile.mkdtemp(prefix="glmc_layers_"), layers=layers)
        plan = compile_for(d, f"dp{n}ep{n}", False, -(-c_max // n), mtp)
        need[layers] = sum(rank_bytes(plan, per_rank_batch(plan, c_max), context, mtp).values())
    slope = (need[12] - need[6]) / 6
    return max(4, min(78, int(6 + (device_bytes - need[6]) // slope)))


# ----------------------------------------------------------------------------- one rank
def run_rank(rank: int, world: int, job: dict, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from glmc.runtime.worker.comm import Comm
    from glmc.runtime.worker.forward_batch import ForwardBatch
    from glmc.runtime.worker.loader import load_runner

    plan, ctx, mtp, cuda = job["plan"], job["context"], job["mtp"], job["device"] == "cuda"
    comm = Comm(plan.mesh, plan.groups)
    dp = plan.mesh["attn_dp"]
    b_max = max(job["batches"].values())
    t0 = time.perf_counter()
    runner = load_runner(plan, job["ckpt"], device=job["device"], comm=comm, num_pages=job["num_pages"],
                         max_context=ctx + mtp + 64, max_running=b_max, capture=cuda,
                         speculative_num_steps=mtp, prefill_graphs=False).executor
    out = {"rank": rank, "load_and_capture_s": time.perf_counter() - t0, "points": {}}
    lc.fill_pool_(runner.pool)
    table = common.req_table(b_max, -(-(ctx + mtp + 64) // 64))
    lc.load_table_(runner, table, b_max)   # random values, but each position its own slot
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator().manual_seed(rank)
    vocab, hidden = plan.config.vocab_size, plan.config.hidden_size

    def whole(phase, per, b, at, **kw):
        ids = [torch.randint(0, vocab, (per,), generator=g).tolist() for _ in range(b)]
        batch = ForwardBatch.build("extend" if per > 1 else "decode", ids, list(range(b)), [at] * b, table)
        tokens = [b * per] * dp if dp > 1 else None
        return lambda: runner.forward(phase, batch, dp_tokens=tokens, **kw)["logits"][:1].float().sum().item()

    def ms(fn, reps):
        fn()
        sync()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - t) / reps * 1e3

    for c, b in job["batches"].items():
        point = {"batch_per_rank": b}
        step = whole("decode", 1, b, ctx)
        point["decode_ms"] = ms(step, job["reps"])
        if cuda and rank == 0:
            point["collectives_ms"] = collective_ms(step, job["reps"])
        if mtp:
            hid = lambda T: torch.randn(T, hidden, device=runner.r2t.device, dtype=runner.dtype)  # noqa: E731
            verify = whole("mtp_verify", mtp + 1, b, ctx)
            extend = whole("mtp_draft", mtp + 1, b, ctx, hidden=hid(b * (mtp + 1)))
            draft = whole("mtp_draft", 1, b, ctx + mtp + 1, hidden=hid(b))
            point["verify_ms"], point["draft_extend_ms"], point["draft_ms"] = (
                ms(f, job["reps"]) for f in (verify, extend, draft))
        if cuda:
            point["memory"] = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                               "in_use": (lambda f, t: t - f)(*torch.cuda.mem_get_info())}
        out["points"][c] = point
    torch.save(out, f"{out_dir}/rank{rank}.pt")


def collective_ms(step, reps: int) -> float:
    """Device ms per step of NCCL and peer-memory (p2p_*) kernels, under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    us = sum(e.self_device_time_total for e in prof.key_averages()
             if "nccl" in e.key.lower() or "p2p" in e.key.lower())
    return us / reps / 1e3


# ----------------------------------------------------------------------------- the run
def predicted_ms(plan, phase: str, tokens: int, context: int, cal, launches) -> float | None:
    """explain's calibrated step time of `phase` at `tokens` per rank (the plan's own dtypes);
    `launches`: the plan's `glmc.launches.LaunchCounts`, made once per plan (it traces each point once)."""
    from glmc.predict import predict_step
    if cal is None or phase not in plan.graphs:
        return None
    env = {"T": tokens, "B": tokens, "S": context, "K": plan.config.index_topk}
    return predict_step(plan.graphs[phase], env, plan.dtypes, cal, plan.world,
                        launches(phase, tokens, context))["step_s"] * 1e3


def summarise(plan, ranks: list[dict], c: int, n: int, args, cal, launches) -> dict:
    pts = [r["points"][c] for r in ranks]
    b = pts[0]["batch_per_rank"]
    row = {"concurrency": c, "batch_per_rank": b, "tpot_ms": max(p["decode_ms"] for p in pts)}
    row["tok_s_per_gpu"] = c / row["tpot_ms"] * 1e3 / n
    row["collectives_ms"] = pts[0].get("collectives_ms")
    row["predicted_ms"] = predicted_ms(plan, "decode", b, args.context, cal, launches)
    if "memory" in pts[0]:
        row["memory_gib"] = {k: max(p["memory"][k] for p in pts) / GIB for k in pts[0]["memory"]}
    if args.mtp:
        cycle = max(p["verify_ms"] + p["draft_extend_ms"] + (args.mtp - 1) * p["draft_ms"] for p in pts)
        row["mtp"] = {"steps": args.mtp, "accept_length": args.accept, "accept_note": ACCEPT_NOTE,
                      "cycle_ms": cycle, "tpot_ms": cycle / args.accept,
                      "tok_s_per_gpu": c / (cycle / args.accept) * 1e3 / n}
    return row


def run_spec(parallel, a2a, ckpt, n, args, device_bytes, cal, backend) -> dict:
    import torch
    from glmc.runtime.worker.launch import spawn
    moe = MOE[a2a]
    res = {"parallel": parallel, "moe": moe, "skipped": {}, "rows": []}
    probe = compile_for(ckpt, parallel, a2a, 1, args.mtp)
    batches = {}
    for c in args.concurrency:
        b = per_rank_batch(probe, c)
        need = rank_bytes(probe, b, args.context, args.mtp)
        if device_bytes is not None and sum(need.values()) > device_bytes:
            res["skipped"][c] = {"needs_gib": {k: v / GIB for k, v in need.items()}, "device_gib": device_bytes / GIB}
        else:
            batches[c] = b
    if not batches:
        return res
    plan = compile_for(ckpt, parallel, a2a, max(batches.values()), args.mtp)
    pages = max(batches.values()) * -(-(args.context + args.mtp + 64) // 64) + 1
    job = {"plan": plan, "ckpt": str(ckpt), "context": args.context, "mtp": args.mtp, "batches": batches,
           "num_pages": pages, "reps": args.reps, "device": "cpu" if args.cpu else "cuda"}
    out = tempfile.mkdtemp(prefix=f"glmc_full_{parallel}_")
    t0 = time.perf_counter()
    spawn(run_rank, n, job, out, backend=backend, timeout_s=1800)
    ranks = [torch.load(f"{out}/rank{r}.pt") for r in range(n)]
    res["seconds"] = time.perf_counter() - t0
    res["load_and_capture_s"] = max(r["load_and_capture_s"] for r in ranks)
    from glmc.launches import LaunchCounts
    launches = LaunchCounts(plan)
    res["rows"] = [summarise(plan, ranks, c, n, args, cal, launches) for c in batches]
    return res


def full_prediction(args, cal) -> list[dict]:
    """explain's calibrated TPOT of the whole GLM-5.3 on 8 GPUs at every concurrency."""
    from glmc.launches import LaunchCounts
    from glmc.tiny import make_random_glm
    if cal is None:
        return []
    ckpt = make_random_glm(tempfile.mkdtemp(prefix="glmc_full_"))
    rows = []
    for parallel, a2a in specs_for(8, args.specs):
        plan = compile_for(ckpt, parallel, a2a, 1, 0)
        launches = LaunchCounts(plan)
        for c in args.concurrency:
            b = per_rank_batch(plan, c)
            tpot = predicted_ms(plan, "decode", b, args.context, cal, launches)
            rows.append({"parallel": parallel, "moe": MOE[a2a],
                         "concurrency": c, "batch_per_rank": b, "predicted_tpot_ms": tpot,
                         "predicted_tok_s_per_gpu": c / tpot * 1e3 / 8})
    return rows


def table(results: dict) -> str:
    lines = ["spec              c  b/rank  TPOT ms  tok/s/GPU  MTP TPOT  coll ms  mem GiB  pred ms"]
    for spec in results["specs"]:
        for r in spec["rows"]:
            mtp = r.get("mtp", {}).get("tpot_ms")
            f = lambda v, w=8, p=2: "-".rjust(w) if v is None else f"{v:{w}.{p}f}"  # noqa: E731
            mem = r.get("memory_gib", {}).get("in_use")
            lines.append(f"{spec['parallel'] + '/' + spec['moe']:16} {r['concurrency']:5} {r['batch_per_rank']:6} "
                         f"{f(r['tpot_ms'])} {f(r['tok_s_per_gpu'], 10, 1)} {f(mtp, 9)} {f(r['collectives_ms'])} "
                         f"{f(mem, 8, 1)} {f(r['predicted_ms'])}")
        for c, why in spec["skipped"].items():
            lines.append(f"{spec['parallel'] + '/' + spec['moe']:16} {c:5}  does not fit: needs "
                         f"{sum(why['needs_gib'].values()):.1f} GiB of {why['device_gib']:.1f}")
    if results["predicted_8gpu"]:
        lines.append("predicted, whole GLM-5.3 on 8 GPUs (explain, calibrated): spec c TPOT ms tok/s/GPU")
        for r in results["predicted_8gpu"]:
            lines.append(f"  {r['parallel'] + '/' + r['moe']:16} {r['concurrency']:5} {r['predicted_tpot_ms']:8.2f} "
                         f"{r['predicted_tok_s_per_gpu']:10.1f}")
    return "\n".join(lines)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run: the tiny config over gloo, Triton interpreted")
    ap.add_argument("--gpus", type=int, help="ranks (default: every visible GPU; --cpu: 2)")
    ap.add_argument("--specs", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)} "
                    "(dp{n}ep{n} with either MoE lowering, tp{n}ep{n}; default: all)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: 78 on >= 8 GPUs, else what fits)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--concurrency", type=ints, default=[1, 16, 64, 256, 1024], help="over the whole machine")
    ap.add_argument("--mtp", type=int, default=3, help="MTP draft tokens N (0: MTP off only)")
    ap.add_argument("--accept", type=float, default=2.94, help="pinned acceptance length at --mtp")
    ap.add_argument("--reps", type=int, default=20, help="steps per timing")
    ap.add_argument("--calibration", default=str(CALIBRATION) if CALIBRATION.exists() else None)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        if args.concurrency == ap.get_default("concurrency"):
            args.concurrency = [1, 4]
        if args.context == ap.get_default("context"):
            args.context = 80
        args.reps = min(args.reps, 2)
    import torch
    from glmc.calibration import load
    from glmc.runtime.worker.random_weights import make_random_checkpoint
    from glmc.tiny import TINY_DIR, make_random_glm, tiny_hf_config
    n = args.gpus or (2 if args.cpu else torch.cuda.device_count())
    cal = load(args.calibration) if args.calibration else None
    root = Path(tempfile.mkdtemp(prefix="glmc_full_model_"))
    if args.cpu:
        ckpt, device_bytes, backend = make_random_checkpoint(root, tiny_hf_config(), TINY_DIR), None, "gloo"
    else:
        device_bytes, backend = torch.cuda.mem_get_info()[1], "nccl"
        layers = args.layers or (78 if n >= 8 else fitting_layers(n, args.context, max(args.concurrency),
                                                                   device_bytes, args.mtp))
        ckpt = make_random_glm(root, layers=layers)
    cfg = json.loads((ckpt / "config.json").read_text())
    info = {"device": "cpu-interpreter" if args.cpu else torch.cuda.get_device_name(), "gpus": n,
            "commit": args.commit, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "layers": cfg["num_hidden_layers"], "args": vars(args)}
    results = {"info": info, "specs": [], "predicted_8gpu": []}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"full_model_{n}gpu_{time.strftime('%Y-%m-%d_%H%M')}.json"
    for parallel, a2a in specs_for(n, args.specs):
        try:
            results["specs"].append(run_spec(parallel, a2a, ckpt, n, args, device_bytes, None if args.cpu else cal,
                                             backend))
        except Exception as e:   # reported; the next spec still runs
            results["specs"].append({"parallel": parallel, "moe": MOE[a2a], "rows": [], "skipped": {},
                                     "failed": f"{type(e).__name__}: {e}"[-2000:]})
        path.write_text(json.dumps(results, indent=1, default=str))
    results["predicted_8gpu"] = full_prediction(args, cal)
    path.write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    for s in results["specs"]:
        if "failed" in s:
            print(f"FAILED {s['parallel']}/{s['moe']}: {s['failed']}")
    print(f"saved {path}")
    sys.exit(1 if any("failed" in s for s in results["specs"]) else 0)


if __name__ == "__main__":
    main()
