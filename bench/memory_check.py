"""What a rank's GPU runner allocates against what `glmc explain` says it will (issue 10, item 5).

    python bench/memory_check.py --out-dir $OUT      # the H200: GLM-5.3-width slice, FP8 weights + FP8 KV
    python bench/memory_check.py --cpu --out-dir /tmp  # CPU smoke: narrow widths, no graphs (TRITON_INTERPRET=1)

The slice is bench/gpu_plan_check.py's (2 layers at GLM-5.3 width: a dense layer, a 256-expert MoE layer,
both full DSA indexers), its bf16 random weights quantised to block FP8 on load, the KV and indexer caches
FP8 (656- and 132-byte rows). Fields, each measured and as explain (`glmc.explain.explain_plan`) has it:

- weights: the runner's weights and expert stacks (unique storages: each expert once, in its stack);
- weight_copies: re-laid-out weights the CUDA target keeps beside the originals (absorbed MLA's W_UK /
  W_UV^T, joined A-projection and gate_up rows), made by the first forward;
- kv, index: the KV pool's latent and indexer caches (explain's bytes per token x the pool's slots);
- tables: the runner's req_to_token copy and last-token vector (not in explain: (max_running + 1) x
  (max_context + 1) int64, from the runner's own sizes);
- on the GPU also: allocated_vs_held (torch.cuda.memory_allocated after load and the first steps
  against the sum above: a miss is memory held outside the census), prefill_workspace and
  decode_workspace (max_memory_allocated above the held bytes during a prefill of max_running prompts
  of ctx / 2 tokens and one eager decode of all of them, against the plan's indexer workspace and
  graph_bytes of the largest bucket), graphs (memory_allocated growth over capturing every decode
  bucket, one shared pool, against graph_bytes of the largest bucket).
Each compared field passes within 5%. The JSON (memory_check.json under --out-dir) has every number.
`runner_bytes` is also the held-bytes census tests/test_memory_accounting.py uses on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_plan_check as pc  # noqa: E402

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
    """{field: bytes} the runner `ex` (a PlanExecutor or GpuRunner) holds, each storage counted once,
    in field order (a copy that is a view of a weight counts as the weight)."""
    seen: set = set()
    experts = {k: v for k, v in ex._stacks.items() if not isinstance(k, tuple)}
    joined = {k: v for k, v in ex._stacks.items() if isinstance(k, tuple)}   # executor.weight's A-proj cat
    out = {"weights": unique_bytes([ex.weights, experts], seen),
           "weight_copies": unique_bytes([joined, getattr(ex, "_derived", {})], seen),
           "kv": unique_bytes(ex.pool.kv, seen), "index": unique_bytes(ex.pool.index_k, seen),
           "tables": unique_bytes([getattr(ex, "r2t", None), getattr(ex, "last_token", None)], seen)}
    return out


def explain_bytes(plan, ex) -> dict:
    """{field: bytes} explain's per-rank memory says for the runner's pool and tables."""
    from glmc.explain import explain_plan
    mem = explain_plan(plan, batch=1, context=1)["memory"]
    slots, rows = ex.pool.num_slots, getattr(ex, "pad_row", -1) + 1   # GpuRunner: max_running + a spare row
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
    model = pc.slice_model(dev, dtype, seed=0, narrow=cpu)
    plan = pc.glmc_plan(model, max_reqs, "float32" if cpu else "bfloat16", fp8=True, kv_dtype="fp8")
    weights, stacks = pc.glmc_weights(model)
    runner = pc.gpu_runner(plan, weights, dev, max_reqs, ctx, stacks=stacks)
    del model, weights, stacks          # what stays allocated now is the runner's alone
    gc.collect()
    if cpu:
        return plan, runner, None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return plan, runner, torch.cuda.memory_allocated() - before


def first_steps(runner, max_reqs: int, ctx: int, between=lambda phase: None):
    """Prefill max_reqs prompts of ctx // 2 tokens, then one eager decode step of all of them (the
    op table makes its re-laid-out copies on first use); `between(phase)` runs before each."""
    import torch
    c = runner.config
    table = pc.req_table(max_reqs, -(-ctx // 64))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, c.vocab_size, (ctx // 2,), generator=g).tolist() for _ in range(max_reqs)]
    between("prefill")
    pc.prefill(runner, prompts, table, group=max(1, 8192 // (ctx // 2)))
    between("decode")
    runner.forward("decode", pc.decode_batch([p + [1] for p in prompts], table))
    between("end")


def _field(measured, explained, note) -> dict:
    ratio = measured / explained if explained else None
    return {"measured": measured, "explain": explained, "ratio": ratio,
            "pass": ratio is not None and abs(ratio - 1) <= TOLERANCE, "note": note}


def gpu_phases() -> tuple[dict, callable]:
    """`first_steps` with the allocator read around each phase: -> (numbers, the `between` hook)."""
    import torch
    got, state = {}, {}

    def between(phase):
        torch.cuda.synchronize()
        now = torch.cuda.memory_allocated()
        if "phase" in state:   # the phase that just ended: its peak above what it started with
            got[f"{state['phase']}_peak_above_start"] = torch.cuda.max_memory_allocated() - state["start"]
        torch.cuda.reset_peak_memory_stats()
        state.update(phase=phase, start=now)
    return got, between


def run(cpu: bool, max_reqs: int, ctx: int) -> dict:
    import torch
    t0 = time.perf_counter()
    plan, runner, loaded = build(cpu, max_reqs, ctx)
    gpu, between = ({}, lambda phase: None) if cpu else gpu_phases()
    base = 0 if cpu else torch.cuda.memory_allocated()
    first_steps(runner, max_reqs, ctx, between)
    held = runner_bytes(runner)
    want = explain_bytes(plan, runner)
    res = {"fields": compare(held, want), "plan": {"weights": plan.weight_formats["linear_weights"],
                                                   "kv_cache": plan.dtypes.kv_cache, "buckets": runner.buckets}}
    if not cpu:
        gpu["after_load"] = loaded
        gpu["after_first_steps"] = torch.cuda.memory_allocated() - base + loaded
        pre = torch.cuda.memory_allocated()
        runner.capture()
        torch.cuda.synchronize()
        gpu["graphs"] = torch.cuda.memory_allocated() - pre
        gpu["max_allocated_during_capture"] = torch.cuda.max_memory_allocated()
        top = str(max(runner.buckets))
        prefill_ws = plan.graphs["prefill"].meta["memory"]["indexer_workspace_bytes"]
        f = res["fields"]
        f["allocated_vs_held"] = _field(gpu["after_first_steps"], sum(held.values()),
                                        "memory_allocated after load + first steps vs the runner's census "
                                        "(explain side: the census; a miss = something held outside it)")
        f["graphs"] = _field(gpu["graphs"], want["graphs"].get(top, 0),
                             f"the decode graphs' pool (all buckets share it) vs explain's graph_bytes[{top}]")
        f["decode_workspace"] = _field(gpu["decode_peak_above_start"],
                                       want["graphs"].get(top, 0) + want["indexer_workspace"],
                                       f"eager decode of {max_reqs}: peak above the held bytes vs explain's "
                                       f"graph_bytes[{top}] + indexer_workspace_bytes")
        f["prefill_workspace"] = _field(gpu["prefill_peak_above_start"], prefill_ws,
                                        "prefill peak above the held bytes vs the prefill plan's indexer "
                                        "workspace (explain has no prefill activation estimate)")
    res["gpu"], res["explain"], res["seconds"] = gpu, want, round(time.perf_counter() - t0, 1)
    return res


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
    pc.import_glmc()
    import torch
    res = {"device": "cpu-interpreter" if args.cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "max_running": args.max_running, "ctx": args.ctx,
           **run(args.cpu, args.max_running, args.ctx)}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_check.json").write_text(json.dumps(res, indent=1, default=str))
    for name, f in res["fields"].items():
        ratio = f"{f['ratio']:.3f}" if isinstance(f["ratio"], float) else "-"
        print(f"{name:18s} measured {f['measured'] / 2**20:10.2f} MiB  explain {f['explain'] / 2**20:10.2f} MiB"
              f"  ratio {ratio:>6}  {'PASS' if f['pass'] else 'FAIL'}")
    print("MEMORY CHECK:", " ".join(f"{n}={'PASS' if f['pass'] else 'FAIL'}" for n, f in res["fields"].items()))
    print(f"saved {out / 'memory_check.json'}")


if __name__ == "__main__":
    main()
