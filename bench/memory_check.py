"""What a rank's GPU runner allocates against what `glmc explain` says it will.

    bash bench/with_wheels.sh python -m bench.memory_check --out-dir $OUT   # the H200: GLM-5.3-width slice
    python -m bench.memory_check --cpu --out-dir /tmp  # CPU smoke: narrow widths, no graphs (TRITON_INTERPRET=1)

The slice is bench/common.py's (2 layers at GLM-5.3 width: a dense layer, a 256-expert MoE layer,
both full DSA indexers), its bf16 random weights quantised to block FP8 on load, the KV and indexer caches
FP8 (656- and 132-byte rows). Fields, each measured and as explain (`glmc.explain.explain_plan`) has it:

- weights: the runner's weights and expert stacks (unique storages: each expert once, in its stack);
- weight_copies: re-laid-out weights the CUDA target keeps beside the originals (absorbed MLA's W_UK /
  W_UV^T, joined A-projection and gate_up rows), made by the first forward;
- kv, index: the KV pool's latent and indexer caches (explain's bytes per token x the pool's slots);
- tables: the runner's req_to_token copy and last-token vector (not in explain: (max_running + 1) x
  (max_context + 1) int64, from the runner's own sizes);
- on the GPU also: allocated_vs_held (torch.cuda.memory_allocated after load and the first steps
  against the sum above: a miss is memory held outside the census); the step workspaces against
  explain's model of them (`glmc.explain.workspace_memory`, passes/step_memory.py) at the steps run:
  prefill_workspace (max_memory_allocated above the call's start over the prefill forwards of
  max_running prompts of ctx / 2 tokens, 8192 tokens per forward: the plan's largest chunk; the
  first forward is left out, as it also makes the op table's weight copies) against
  prefill_workspace_bytes at that chunk, decode_workspace (one eager decode of all of them) against
  decode_workspace_bytes of the largest bucket, graphs (memory_allocated growth over capturing every
  decode bucket) against graph_pool_bytes; graph_pool_reserved (the private pool's segments after
  capture, from torch.cuda.memory_snapshot) against the model's lower bound is reported, not judged.
- attribution (GPU and --cpu): one prefill forward and one eager decode under
  `runtime/worker/live_bytes.LiveBytes` (tensor storages per op, as the model counts them), each op's
  peak against the model's: `ops_off` lists the ops that differ by more than 1%.
Each judged field passes within 5%. The JSON (memory_check.json under --out-dir) has every number.
`runner_bytes` is also the held-bytes census tests/test_memory_accounting.py uses on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

from bench import common

TOLERANCE = 0.05


def _tensors(obj):
    """Every tensor inside obj (tensors, Fp8Weight, tuples, lists, dicts' values)."""
    import torch
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
    elif hasattr(obj, "q") and hasattr(obj, "scale_inv"):   # Fp8Weight
        yield obj.q
        yield obj.scale_inv


def unique_bytes(obj, seen: set) -> int:
    """Bytes of the storages under obj not in `seen` (which then holds them): views count once."""
    total = 0
    for t in _tensors(obj):
        s = t.untyped_storage()
        key = (s.device.type, s.data_ptr())
        if key not in seen and s.nbytes():
            seen.add(key)
            total += s.nbytes()
    return total


def runner_bytes(ex) -> dict:
    """{field: bytes} the runner `ex` (a PlanExecutor or CudaExecutor) holds, each storage counted once,
    in field order (a copy that is a view of a weight counts as the weight)."""
    seen: set = set()
    experts = {k: v for k, v in ex.stacks.items() if not isinstance(k, tuple)}
    joined = {k: v for k, v in ex.stacks.items() if isinstance(k, tuple)}   # executor.weight's A-proj cat
    out = {"weights": unique_bytes([ex.weights, experts], seen),
           "weight_copies": unique_bytes([joined, getattr(ex, "_derived", {})], seen),
           "kv": unique_bytes(ex.pool.kv, seen), "index": unique_bytes(ex.pool.index_k, seen),
           "tables": unique_bytes([getattr(ex, "r2t", None), getattr(ex, "last_token", None)], seen)}
    return out


def explain_bytes(plan, ex) -> dict:
    """{field: bytes} explain's per-rank memory says for the runner's pool and tables."""
    from glmc.explain import explain_plan
    mem = explain_plan(plan, batch=1, context=1)["memory"]
    slots, rows = ex.pool.num_slots, getattr(ex, "pad_row", -1) + 1   # CudaExecutor: max_running + a spare row
    return {"weights": mem["weights_bytes_per_rank"], "weight_copies": mem["weight_copies_bytes_per_rank"],
            "kv": mem["kv_bytes_per_token"] * slots, "index": mem["index_bytes_per_token"] * slots,
            "tables": rows * (getattr(ex, "max_context", 0) + 1) * 8,   # int64 r2t + last_token (not in explain)
            "indexer_workspace": mem["indexer_workspace_bytes"], "graphs": mem["graph_bytes"]}


def compare(measured: dict, predicted: dict, fields=("weights", "weight_copies", "kv", "index", "tables")) -> dict:
    """{field: {measured, explain, ratio, pass}}: pass when within TOLERANCE (both zero passes)."""
    out = {}
    for f in fields:
        m, p = measured[f], predicted[f]
        ratio = m / p if p else (1.0 if not m else float("inf"))
        out[f] = {"measured": m, "explain": p, "ratio": ratio, "pass": abs(ratio - 1) <= TOLERANCE}
    return out


# ----------------------------------------------------------------------------- the run
def build(cpu: bool, max_reqs: int, ctx: int):
    """The FP8-weight, FP8-KV slice's plan and runner; -> (plan, runner, allocated-after-load or None)."""
    import gc

    import torch
    dev, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    before = None if cpu else torch.cuda.memory_allocated()
    model = common.slice_model(dev, dtype, seed=0, narrow=cpu)
    plan = common.glmc_plan(model, max_reqs, "float32" if cpu else "bfloat16", fp8=True, kv_dtype="fp8")
    weights, stacks = common.glmc_weights(model)
    runner = common.gpu_runner(plan, weights, dev, max_reqs, ctx, stacks=stacks)
    del model, weights, stacks          # what stays allocated now is the runner's alone
    gc.collect()
    if cpu:
        return plan, runner, None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return plan, runner, torch.cuda.memory_allocated() - before


def prompts_and_table(runner, max_reqs: int, ctx: int):
    """max_reqs random prompts of ctx // 2 tokens and their req_to_token table; the forward group
    (requests per prefill forward: 8192 tokens, the plan's largest chunk)."""
    import torch
    table = common.req_table(max_reqs, -(-ctx // 64))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, runner.config.vocab_size, (ctx // 2,), generator=g).tolist() for _ in range(max_reqs)]
    return prompts, table, max(1, 8192 // (ctx // 2))


def first_steps(runner, max_reqs: int, ctx: int):
    """Prefill max_reqs prompts of ctx // 2 tokens, then one eager decode step of all of them (the
    op table makes its re-laid-out copies on first use)."""
    prompts, table, group = prompts_and_table(runner, max_reqs, ctx)
    common.prefill(runner, prompts, table, group=group)
    runner.forward("decode", common.decode_batch([p + [1] for p in prompts], table))


def _field(measured, explained, note, judged=True) -> dict:
    ratio = measured / explained if explained else None
    ok = ratio is not None and abs(ratio - 1) <= TOLERANCE
    return {"measured": measured, "explain": explained, "ratio": ratio, "pass": ok if judged else None, "note": note}


@contextmanager
def call_peaks(runner, calls: list):
    """Each `runner.forward` inside the block appends {phase, tokens, requests, peak_above_start}
    (torch.cuda's max_memory_allocated above memory_allocated at the call's start) to `calls`."""
    import torch
    forward = runner.forward

    def measured(phase, batch, *args, **kwargs):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = forward(phase, batch, *args, **kwargs)
        torch.cuda.synchronize()
        calls.append({"phase": phase, "tokens": batch.num_tokens, "requests": batch.batch_size,
                      "peak_above_start": torch.cuda.max_memory_allocated() - start})
        return out
    runner.forward = measured
    try:
        yield calls
    finally:
        del runner.forward


def pool_segments() -> dict:
    """Bytes of the CUDA graph pools' segments (every pool but the default one) and of their live blocks."""
    import torch
    segs = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    return {"reserved": sum(s["total_size"] for s in segs), "allocated": sum(s["allocated_size"] for s in segs)}


def model_step(plan, phase: str, tokens: int, requests: int, max_len: int, mode: str, cpu: bool):
    """The plan-memory model's step (`passes/step_memory.py`) at a point; on the CPU unrounded, with
    the interpreter's stand-in SM count (triton_render.sm_count)."""
    from glmc.passes.plan_memory import BLOCK_BYTES, target_of
    from glmc.passes.step_memory import step_memory
    target = target_of(plan.dtypes, tokens, requests, max_len, **({"num_sms": 2} if cpu else {}))
    return step_memory(plan.graphs[phase], target, plan.config, mode, 1 if cpu else BLOCK_BYTES)


def attribute(plan, runner, max_reqs: int, ctx: int, cpu: bool) -> dict:
    """One prefill forward (one group) and one eager decode of max_reqs under LiveBytes, per op
    against the model: {phase: {measured, model, ops_off: [(op, measured peak, model peak)]}}."""
    from glmc.runtime.worker.live_bytes import measure
    from glmc.runtime.worker.forward_batch import ForwardBatch
    prompts, table, group = prompts_and_table(runner, max_reqs, ctx)
    batches = {"prefill": ForwardBatch.build("extend", prompts[:group], list(range(len(prompts[:group]))),
                                             [0] * len(prompts[:group]), table),
               "decode": common.decode_batch([p + [1] for p in prompts], table)}
    out = {}
    for phase, batch in batches.items():
        mem = measure(runner, lambda: runner.forward(phase, batch))
        max_len = int(batch.seq_lens.max()) if phase == "prefill" else runner.max_context
        m = model_step(plan, phase, batch.num_tokens, batch.batch_size, max_len,
                       "prefill" if phase == "prefill" else "eager", cpu)
        off = [(f"{r.op.kind} %{r.op.results[0]}", r.peak - r.start, p - s) for r, (_, s, p, _) in
               zip(mem.regions, m.regions) if abs((r.peak - r.start) - (p - s)) > 0.01 * max(1, p - s)]
        out[phase] = {"measured": mem.peak, "model": m.peak, "ops_off": off[:20]}
    return out


# ----------------------------------------------------------------------------- the run
def run(cpu: bool, max_reqs: int, ctx: int) -> dict:
    import torch
    t0 = time.perf_counter()
    plan, runner, loaded = build(cpu, max_reqs, ctx)
    calls: list = []
    if cpu:
        first_steps(runner, max_reqs, ctx)
    else:
        base = torch.cuda.memory_allocated()
        with call_peaks(runner, calls):
            first_steps(runner, max_reqs, ctx)
    held = runner_bytes(runner)
    want = explain_bytes(plan, runner)
    res = {"fields": compare(held, want), "plan": {"weights": plan.weight_formats["linear_weights"],
                                                   "kv_cache": plan.dtypes.kv_cache, "buckets": runner.buckets}}
    res["attribution"] = attribute(plan, runner, max_reqs, ctx, cpu)
    gpu = {}
    if not cpu:
        gpu["after_load"], gpu["calls"] = loaded, calls
        gpu["after_first_steps"] = torch.cuda.memory_allocated() - base + loaded
        pre, pre_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        runner.capture()
        torch.cuda.synchronize()
        gpu["graphs"] = torch.cuda.memory_allocated() - pre
        gpu["graphs_reserved"] = torch.cuda.memory_reserved() - pre_reserved
        gpu["graph_pool_segments"] = pool_segments()
        res["fields"].update(_gpu_fields(plan, gpu, held, want, max_reqs, ctx))
    res["gpu"], res["explain"], res["seconds"] = gpu, want, round(time.perf_counter() - t0, 1)
    return res


def _gpu_fields(plan, gpu: dict, held: dict, want: dict, max_reqs: int, ctx: int) -> dict:
    from glmc.explain import explain_plan
    mem = explain_plan(plan, batch=1, context=ctx)["memory"]
    top = str(max(int(b) for b in mem["decode_workspace_bytes"]))
    pre = [c for c in gpu["calls"] if c["phase"] == "prefill"]
    big = max(pre[1:] or pre, key=lambda c: c["peak_above_start"])
    dec = next(c for c in gpu["calls"] if c["phase"] == "decode")
    model_pre = model_step(plan, "prefill", big["tokens"], big["requests"], ctx // 2, "prefill", False).peak
    return {
        "allocated_vs_held": _field(gpu["after_first_steps"], sum(held.values()),
                                    "memory_allocated after load + first steps vs the runner's census "
                                    "(explain side: the census; a miss = something held outside it)"),
        "graphs": _field(gpu["graphs"], mem["graph_pool_bytes"],
                         "memory_allocated growth over capturing every decode bucket vs explain's graph_pool_bytes "
                         "(graphs' outputs + static inputs + a cuBLAS workspace per stream)"),
        "graph_pool_reserved": _field(gpu["graph_pool_segments"]["reserved"], mem["graph_pool"]["pool_reserved"],
                                      "the graph pool's segments vs the model's lower bound (not judged)", False),
        "decode_workspace": _field(dec["peak_above_start"], mem["decode_workspace_bytes"][top],
                                   f"eager decode of {dec['requests']}: peak above the call's start vs explain's "
                                   f"decode_workspace_bytes[{top}] (context {ctx})"),
        "prefill_workspace": _field(big["peak_above_start"], model_pre,
                                    f"prefill forward of {big['tokens']} tokens ({big['requests']} requests of "
                                    f"{ctx // 2}): peak above the call's start vs the model at that point "
                                    f"(explain's prefill_workspace_bytes at context {ctx // 2})"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="narrow widths, no graphs, Triton interpreted")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--max-running", type=int, default=128, help="requests (rows, the largest bucket)")
    ap.add_argument("--ctx", type=int, default=4096, help="max context per request")
    args = ap.parse_args()
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        args.max_running, args.ctx = 2, 64
    import torch
    res = {"device": "cpu-interpreter" if args.cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "max_running": args.max_running, "ctx": args.ctx,
           **run(args.cpu, args.max_running, args.ctx)}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_check.json").write_text(json.dumps(res, indent=1, default=str))
    for name, f in res["fields"].items():
        ratio = f"{f['ratio']:.3f}" if isinstance(f["ratio"], float) else "-"
        verdict = {True: "PASS", False: "FAIL", None: "INFO"}[f["pass"]]
        print(f"{name:20s} measured {f['measured'] / 2**20:10.2f} MiB  explain {f['explain'] / 2**20:10.2f} MiB"
              f"  ratio {ratio:>6}  {verdict}")
    for phase, a in res["attribution"].items():
        print(f"attribution {phase}: LiveBytes peak {a['measured'] / 2**20:.2f} MiB, model "
              f"{a['model'] / 2**20:.2f} MiB, ops off by > 1%: {a['ops_off'] or 'none'}")
    judged = {n: f for n, f in res["fields"].items() if f["pass"] is not None}
    print("MEMORY CHECK:", " ".join(f"{n}={'PASS' if f['pass'] else 'FAIL'}" for n, f in judged.items()))
    print(f"saved {out / 'memory_check.json'}")


if __name__ == "__main__":
    main()
