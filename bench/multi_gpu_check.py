"""Plans over several GPUs (NCCL) against tp1 on one: greedy tokens, logits and the collective bill.

    python -m bench.multi_gpu_check --out results.json          # N GPUs (default: all visible)
    python -m bench.multi_gpu_check --cpu                       # gloo dry run, Triton interpreted

For each spec (tp2, tp2ep2, dp2ep2 with the gather and the all-to-all MoE lowering; N for 2 GPUs),
one process per GPU loads the CUDA-target plan through the one loader (`runtime/worker/loader.py`),
captures the decode graphs, prefills its attention-DP share of the prompts and decodes greedily:
1. tiny: a tiny checkpoint with every dim >= 16 (Triton's dot minimum): tokens == tp1's (`--fp8`: its
   linear weights block-FP8 at FP8_ALIGNED's widths, the plans FP8: weights kept FP8 on every rank);
2. width: a GLM-5.3-width slice (random bf16 weights made from one seed on every rank, 1 dense +
   1 MoE layer, 256 experts split over the ranks): prefill and decode logits vs tp1's (bf16 tol);
3. the collectives each rank ran per replayed decode step == `glmc explain`'s bill at the bucket.
With --calibration FILE (bench/calibrate.py's), each spec's decode graph replay is also timed (the
slowest rank's, CUDA events over back-to-back replays) and printed next to the step glmc/predict.py
predicts for that plan and bucket (bench/predicted.py).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench import common

SPECS = [("tp2", None), ("tp2ep2", False), ("dp2ep2", False), ("dp2ep2", True)]
STEPS = 6


# --fp8: widths whose tensor-parallel K slices are whole 128-column groups (o_proj's 4 x 64 and the
# MLPs' 256 over 2 ranks), so a rank quantises its activations in the groups tp1 does and the specs
# agree to fp32 summation order; with narrower slices each rank quantises its part with its own
# scale, noise of the size FP8 activations make anyway (on the tiny random model tp2 vs tp1 prefill
# logits 6.8% apart, tp1 w8a8 vs dequantised weights 34%, CPU 2026-12-04)
FP8_ALIGNED = dict(v_head_dim=64, intermediate_size=256, moe_intermediate_size=256)


def tiny_ckpt(root: Path, fp8: bool = False) -> Path:
    """The tiny checkpoint (every dim >= 16); `fp8`: its linear weights block-FP8 as GLM-5 ships them,
    at FP8_ALIGNED's widths."""
    tiny_hf = common.tests_module("tiny_hf")
    path = root / ("tiny16_fp8" if fp8 else "tiny16")
    if not (path / "config.json").exists():
        (tiny_hf.save_tiny_fp8 if fp8 else tiny_hf.save_tiny)(path, "wide", seed=5, index_n_heads=16, qk_rope_head_dim=16,
                                              index_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                                              **(FP8_ALIGNED if fp8 else {}))
    return path


def prompts_for(vocab: int, lengths) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_rank(rank: int, world: int, job: dict, out_dir: str) -> None:
    """One rank: its share of the prompts through prefill + greedy decode; results to out_dir."""
    import torch
    from glmc.runtime.worker.comm import Comm
    from glmc.runtime.worker.forward_batch import ForwardBatch
    from glmc.runtime.worker.loader import load_runner

    plan, dev = job["plan"], job["device"]
    comm = Comm(plan.mesh, plan.groups)
    if job["kind"] == "width":
        model = common.slice_model(dev, torch.bfloat16, seed=0, narrow=job["narrow"])
        weights, stacks = common.glmc_weights(model)
        del model
    else:
        weights, stacks = job["ckpt"], None
    B, max_ctx = len(job["prompts"]), job["max_ctx"]
    gpu = load_runner(plan, weights, device=dev, comm=comm, num_pages=B * max_ctx // 64 + 1,
                      max_context=max_ctx, max_running=B, capture=job["capture"], prefill_graphs=False,
                      stacks=stacks).executor
    dp, dp_rank = plan.mesh["attn_dp"], comm.coords.of("attn_dp")
    share = [list(range(r, B, dp)) for r in range(dp)]
    mine = share[dp_rank]
    table = common.req_table(B, max_ctx // 64)
    seqs = [list(job["prompts"][i]) for i in mine]
    dp_prefill = [sum(len(job["prompts"][i]) for i in s) for s in share] if dp > 1 else None
    dp_decode = [len(s) for s in share] if dp > 1 else None
    batch = ForwardBatch.build("extend", seqs, mine, [0] * len(mine), table) if mine else \
        ForwardBatch.idle(table)
    logits = [gpu.forward("prefill", batch, dp_tokens=dp_prefill)["logits"].float().cpu()]
    comm.reset()
    tokens, counts = [], []
    for _ in range(STEPS):
        nxt = logits[-1].argmax(-1).tolist()
        tokens.append(nxt)
        for s, t in zip(seqs, nxt):
            s.append(t)
        batch = ForwardBatch.build("decode", [[s[-1]] for s in seqs], mine,
                                   [len(s) - 1 for s in seqs], table) if mine else ForwardBatch.idle(table)
        logits.append(gpu.forward("decode", batch, dp_tokens=dp_decode)["logits"].float().cpu())
        counts.append(comm.reset())
    cap = gpu.captured.get(gpu.last_bucket) if gpu.last_bucket and job["time_replay"] else None
    torch.save({"index": mine, "tokens": tokens, "logits": logits, "counts": counts,
                "bucket": gpu.last_bucket, "replay_ms": common.replay_ms(cap.graph) if cap else None},
               f"{out_dir}/rank{rank}.pt")


def run_spec(kind, parallel, a2a, world, job, backend) -> list[dict]:
    import torch
    from glmc.runtime.worker.launch import spawn
    out = tempfile.mkdtemp(prefix=f"glmc_{parallel}_")
    spawn(run_rank, world, job, out, backend=backend, timeout_s=600)
    return [torch.load(f"{out}/rank{r}.pt") for r in range(world)]


def compile_for(kind, source, parallel, a2a, max_running, dtype_name, p2p=True, routing=None):
    """The CUDA-target plan a check runs (`p2p`: small collectives over peer memory, the default;
    `routing`: Options.moe_routing)."""
    from glmc.compiler import compile_plan
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.spec import load_spec
    if kind == "width":
        return common.glmc_plan(source, max_running, dtype_name, parallel, moe_a2a=a2a, p2p_collectives=p2p,
                            moe_routing=routing)
    spec = load_spec(source)
    return compile_plan(spec, parse_parallel(parallel, spec.config),
                        Options(device="cuda", max_batch=max_running, moe_a2a=a2a, p2p_collectives=p2p,
                                moe_routing=routing))


def bill_at(plan, t, context):
    from glmc.passes.estimate_cost import bill
    got = bill(plan.graphs["decode"], {"T": t, "B": t, "S": context, "K": plan.config.index_topk},
               plan.dtypes)["comm"]
    return {k: {kk: v[kk] for kk in ("count", "message_bytes", "p2p") if kk in v} for k, v in got.items()}


def check(kind, args, root, backend, dev) -> list[dict]:
    narrow = args.cpu
    if kind == "tiny":
        source = tiny_ckpt(root, args.fp8)
        vocab = json.loads((source / "config.json").read_text())["vocab_size"]
        lengths, tol, dtype_name = (37, 21, 50, 9), 1e-4, "float32"
    else:
        from types import SimpleNamespace

        from transformers import GlmMoeDsaConfig
        source = SimpleNamespace(config=GlmMoeDsaConfig(**{**common.GLM53, **common.SLICE,
                                                          **(common.NARROW if narrow else {})}))
        vocab = source.config.vocab_size
        lengths, tol, dtype_name = ((40, 21, 33, 9) if narrow else (2100, 300, 700, 64)), 2e-2, "bfloat16"
    prompts = prompts_for(vocab, lengths)
    max_ctx = -(-(max(lengths) + STEPS + 1) // 64) * 64
    base = dict(kind=kind, ckpt=str(source) if kind == "tiny" else None, prompts=prompts,
                max_ctx=max_ctx, device=dev, capture=not args.cpu, narrow=narrow,
                time_replay=bool(args.calibration) and not args.cpu)
    ref_plan = compile_for(kind, source, "tp1", None, len(prompts), dtype_name)
    ref = run_spec(kind, "tp1", None, 1, {**base, "plan": ref_plan}, backend)[0]
    context = round(sum(lengths) / len(lengths)) + STEPS   # the predictor's one context: the mean
    rows = [predicted_row(kind, ref_plan, [ref], context, args)] if args.calibration else []
    for parallel, a2a in SPECS:
        moe = {None: "-", False: "gather", True: "a2a"}[a2a]
        if args.only and f"{parallel}/{moe}" not in args.only.split(","):
            continue
        t0 = time.perf_counter()
        row = {"check": kind, "parallel": parallel, "moe": moe}
        try:
            plan = compile_for(kind, source, parallel, a2a, len(prompts), dtype_name)
            res = run_spec(kind, parallel, a2a, plan.world, {**base, "plan": plan}, backend)
            row.update(compare(ref, res, plan, tol, max_ctx))
            if args.calibration:
                row["predicted"] = predicted_row(kind, plan, res, context, args)["predicted"]
        except Exception as e:  # reported; the next spec still runs
            row.update({"pass": False, "error": f"{type(e).__name__}: {e}"[-1500:]})
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def predicted_row(kind, plan, res, context, args) -> dict:
    """The predicted replay of `plan` at the bucket its ranks replayed, next to the slowest rank's."""
    from bench import predicted

    from glmc.calibration import load
    bucket, times = res[0]["bucket"], [r["replay_ms"] for r in res]
    measured = max(times) if bucket and None not in times else None
    moe = {None: "-", False: "gather", True: "a2a"}[plan.options.moe_a2a]
    name = f"{kind}/{plan.parallel}/{moe} bucket {bucket} context {context}"
    return {"check": kind, "parallel": plan.parallel, "moe": moe, "pass": True, "predicted": predicted.compare(
        name, predicted.predict_ms(plan, bucket or 1, context, load(args.calibration)), measured)}


def compare(ref, res, plan, tol, context) -> dict:
    """Tokens and logits of each request vs tp1's; counts per decode step vs the bill."""
    errs, same = [], True
    for r in res:
        for j, i in enumerate(r["index"]):
            same &= all(step[j] == ref["tokens"][k][i] for k, step in enumerate(r["tokens"]))
            for got, want in zip(r["logits"], ref["logits"]):
                g, w = got[j].double(), want[i].double()
                errs.append(float((g - w).norm() / w.norm()))
    bucket = res[0]["bucket"]          # every rank replays the same bucket (or none: eager)
    want = bill_at(plan, bucket, context) if bucket else None
    counts_ok = want is not None and all(step == want for r in res for step in r["counts"])
    return {"tokens_equal": bool(same), "max_rel_err": max(errs) if errs else None,
            "logits_ok": bool(errs) and max(errs) < tol, "bucket": bucket,
            "counts_equal_bill": counts_ok, "counts_rank0": res[0]["counts"][-1], "bill": want,
            "pass": bool(same) and bool(errs) and max(errs) < tol and (counts_ok or want is None)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--skip-width", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="the tiny check on a block-FP8 checkpoint (FP8 weights "
                    "kept FP8 on every rank; the width slice stays bf16)")
    ap.add_argument("--only", default="", help="comma list of specs to run, e.g. tp2ep2/gather,dp2ep2/a2a "
                    "(tp1 always runs: the reference)")
    ap.add_argument("--calibration", help="bench/calibrate.py's file: time each spec's decode replay and "
                    "print it next to the predicted step")
    args = ap.parse_args()
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    backend, dev = ("gloo", "cpu") if args.cpu else ("nccl", "cuda")
    results = {"device": "cpu-interpreter" if args.cpu else torch.cuda.get_device_name(),
               "gpus": 0 if args.cpu else torch.cuda.device_count(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "rows": []}
    root = Path(tempfile.mkdtemp(prefix="glmc_mgpu_"))
    for kind in ["tiny"] + ([] if args.skip_width else ["width"]):
        try:
            results["rows"] += check(kind, args, root, backend, dev)
        except Exception as e:  # reported; the next check still runs
            import traceback
            traceback.print_exc()
            results["rows"].append({"check": kind, "pass": False, "error": f"{type(e).__name__}: {e}"[:3000]})
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print("MULTI-GPU CHECK:", " ".join(f"{r['check']}/{r.get('parallel', '?')}/{r.get('moe', '?')}="
                                       f"{'PASS' if r['pass'] else 'FAIL'}" for r in results["rows"]))


if __name__ == "__main__":
    main()
