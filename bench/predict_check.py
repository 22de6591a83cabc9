"""Predicted next to measured for every row of the 2-GPU benchmark files, on the CPU; and the /2
calibration fields that today's per-kernel profiles give.

    python -m bench.predict_check                       # the table: calibration as /1 (before) and as it is
    python -m bench.predict_check --derive-into FILE    # write the derived /2 fields into FILE (a /1 file)

The plans are rebuilt without a GPU by the benchmarks' own builders (`spec_bench.py`: common.GLM53 +
common.SLICE + its LAYERS, max_batch 2 x the largest batch; `multi_gpu_check.py`: `compile_for` over its
tiny checkpoint and width slice) and predicted at each row's bucket and context with
`bench/predicted.py`, as the benchmarks do, with the launches of the code those runs measured
(`MEASURED_LAUNCHES`, `measured_program`: the CUDA target has changed since; today's plans launch
what their launch programs say). "before" reads the calibration as its /1 fields only (the
predictor's /1 fallback is the model before the /2 terms).

Derived fields (`derive`), from `spec_bench`'s `profile_rank0` (per kernel of one replay:
launches, device microseconds; torch.profiler over 5 replays of the captured decode graph):
- gap: replay time (CUDA events, unprofiled) minus the kernels' device time, per launch, on tp1
  (one GPU: no NCCL wait in the profile); added to every device time below, so each figure is a
  replay figure like the calibration's launch overheads;
- topk_select: `topk_select_kernel` per launch on tp1 at 1, 32 and 128 rows of 4097 scores;
- torch_op_s: the device time of every kernel that is neither a cuBLAS GEMM, a glmc Triton kernel
  nor NCCL, over the aten ops the measured code launched (`MEASURED_LAUNCHES`), at B=1 (mean of the
  specs);
- gemm_launch_s: cuBLAS kernels (nvjet, split-K reduce, gemv) at B=1, less the bytes of the plan's
  GEMM calls at the measured copy bandwidth, per GEMM call the plan makes (mean of the specs).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path

from bench import common

RESULTS = common.ROOT / "bench" / "results"
SPEC_BENCH = RESULTS / "spec_bench_2026-11-30.json"
MULTI = RESULTS / "multi_gpu_check_2026-11-30_predicted.json"
CALIBRATION = RESULTS / "calibration_nvidia-h200-x2_2026-11-30.json"
TRITON_KERNELS = re.compile(r"^[a-z_]+_kernel$")      # glmc's templates: `<name>_kernel`


# ----------------------------------------------------------------------------- the measured code's launches
# What the CUDA target of the recorded runs (2026-11-30) launched per op in a decode step: (Triton
# kernels + cuBLAS GEMMs, of them GEMM calls, other torch kernels, collectives). Each attention op then
# gathered its top-k's KV slots in 7 torch ops and turned its query by a RoPE kernel of its own, the
# indexer's top-k likewise, the greedy sampler made its parameter tensors in 10 torch ops, the MoE
# experts sorted their rows (36 torch ops) and summed their slots in torch ops at any row count.
MEASURED_LAUNCHES = {
    "embed.lookup": (0, 0, 1, ()), "norm.rms": (1, 0, 0, ()), "fused.add_rms": (1, 0, 0, ()),
    "rope.apply": (1, 0, 0, ()), "norm.layer": (0, 0, 3, ()),
    "fused.qkv_a_norm_rope_write": (1, 0, 0, ()), "fused.qkv_a_norm_rope_write_index": (1, 0, 0, ()),
    "mem.kv_write": (0, 0, 3, ()), "mem.index_k_write": (0, 0, 2, ()),
    "linear": (1, 1, 0, ()), "mla.a_proj": (1, 1, 0, ()), "lm.head": (1, 1, 0, ()), "mlp.swiglu": (3, 2, 0, ()),
    "idx.topk": (3, 0, 2, ()), "attn.mla_absorbed": (5, 2, 8, ()), "attn.sparse_mla": (5, 2, 8, ()),
    "attn.mla_mha": (5, 2, 8, ()), "moe.gate": (2, 0, 0, ()), "moe.topk": (1, 0, 0, ()),
    "moe.experts": (2, 0, 43, ()), "elt.add": (0, 0, 1, ()), "tensor.concat": (0, 0, 1, ()),
    "tensor.select_last": (0, 0, 1, ()), "sample.tokens": (1, 0, 10, ()),
    "comm.all_reduce": (0, 0, 0, ("all_reduce",)), "comm.all_gather": (0, 0, 0, ("all_gather",)),
    "comm.reduce_scatter": (0, 0, 0, ("reduce_scatter",)), "comm.broadcast": (0, 0, 0, ("all_gather",)),
    "fused.allreduce_add_rms": (1, 0, 0, ("all_reduce",)),
    "fused.reduce_scatter_add_rms": (1, 0, 0, ("reduce_scatter",)),
    "moe.dispatch": (0, 0, 18, ("all_to_all",)), "moe.combine": (0, 0, 4, ("all_to_all",)),
}
MEASURED_STEP_TORCH_OPS = 1   # the step's write of each row's slot into the device table


def measured_counts(op, env: dict) -> tuple[int, int, int, tuple]:
    """MEASURED_LAUNCHES of `op` (no entry: no launch) with what depended on the op: a vocab-parallel
    embedding masked its rows (8 torch ops), a collective along a dim other than 0 concatenated its
    chunks, the router's GEMV ran as one kernel below the GEMV rows."""
    from glmc.target import gemv_takes
    k, g, t, c = MEASURED_LAUNCHES.get(op.kind, (0, 0, 0, ()))
    if op.kind == "moe.gate" and gemv_takes(op.types[0].shape[0].eval(env), int(op.attr("experts", 0))):
        return 1, 0, 0, ()
    if op.kind == "embed.lookup" and int(op.attr("tp", 1)) > 1:
        return 0, 0, 8, ()
    if op.kind in ("comm.all_gather", "comm.reduce_scatter") and int(op.attr("dim", 0)):
        return k, g, t + 1, c
    return k, g, t, c


def measured_program(graph, env: dict):
    """A launch program of `graph` at `env` with the measured code's launches (`measured_counts`),
    for `glmc.predict.predict_step`."""
    from glmc.codegen.launch_program import Launch, Program
    out = [Launch("torch", "step") for _ in range(MEASURED_STEP_TORCH_OPS)]
    for op in graph.ops:
        kernels, gemms, torch_ops, collectives = measured_counts(op, env)
        where = {"op": op.results[0], "op_kind": op.kind, "layer": op.layer}
        out += [Launch("gemm", "mm", **where) for _ in range(gemms)]
        out += [Launch("triton", "kernel", **where) for _ in range(kernels - gemms)]
        out += [Launch("torch", "op", **where) for _ in range(torch_ops)]
        out += [Launch("collective", c, **where) for c in collectives]
    return Program("decode", env["T"], out)


def measured_ms(plan, tokens: int, context: int, cal: dict) -> float:
    """`predicted.predict_ms` of a recorded run's plan with the launches of the code it measured."""
    from bench import predicted
    env = {"T": tokens, "B": tokens, "S": context, "K": plan.config.index_topk}
    return predicted.predict_ms(plan, tokens, context, cal, measured_program(plan.graphs["decode"], env))


def kernel_class(name: str) -> str:
    """'gemm' (cuBLAS), 'triton' (glmc's kernels), 'nccl' or 'torch' (aten, cub, copies) of a profiled kernel."""
    if name.startswith("nvjet") or any(s in name for s in ("splitKreduce", "gemv", "gemm", "cutlass")):
        return "gemm"
    if "nccl" in name.lower():
        return "nccl"
    return "triton" if TRITON_KERNELS.match(name) else "torch"


def _spec_args(name: str) -> tuple[str, bool | None]:
    parallel, _, moe = name.partition("/")
    return parallel, {"": None, "gather": False, "a2a": True}[moe]


def spec_plans(data: dict) -> dict:
    """spec_bench's plans by spec name, as its main() compiles them."""
    from types import SimpleNamespace

    from bench import spec_bench
    from transformers import GlmMoeDsaConfig
    cfg = SimpleNamespace(config=GlmMoeDsaConfig(**{**common.GLM53, **common.SLICE, **spec_bench.LAYERS}))
    rows = [r for r in data["rows"] if "error" not in r]
    max_batch = 2 * max(r["B_per_rank"] for r in rows)
    plans = {}
    for r in rows:
        if r["spec"] not in plans:
            parallel, a2a = _spec_args(r["spec"])
            # measured before glmc had peer-memory collectives (every reduction through NCCL) and
            # before the gather form recomputed its routing (moe_routing: the file's, else gather)
            plans[r["spec"]] = common.glmc_plan(cfg, max_batch, "bfloat16", parallel, moe_a2a=a2a,
                                            p2p_collectives=data.get("p2p_collectives", False),
                                            moe_routing=data.get("moe_routing", "gather"))
    return plans


def spec_rows(data: dict, cal: dict, plans: dict | None = None) -> list[dict]:
    """[{name, bucket, context, measured_ms, predicted_ms, ratio}] for every timed spec_bench row."""
    plans = plans or spec_plans(data)
    ctx = data["info"]["ctx"]
    return [_row(f"{r['spec']} B={r['B_per_rank']}", r["bucket"], ctx, r["replay_ms"],
                 measured_ms(plans[r["spec"]], r["bucket"], ctx, cal))
            for r in data["rows"] if "replay_ms" in r]


def _row(name, bucket, context, measured, pred) -> dict:
    return {"name": name, "bucket": bucket, "context": context, "measured_ms": measured, "predicted_ms": pred,
            "ratio": pred / measured}


MULTI_CHECKS = {   # multi_gpu_check.check(): prompt lengths, dtype; 4 prompts, STEPS decode steps
    "tiny": ((37, 21, 50, 9), "float32"), "width": ((2100, 300, 700, 64), "bfloat16")}


def multi_plans(root: Path) -> dict:
    """multi_gpu_check's plans by (check, parallel, moe), built by its compile_for."""
    from types import SimpleNamespace

    from bench import multi_gpu_check as mg
    from transformers import GlmMoeDsaConfig
    plans = {}
    for kind, (lengths, dtype) in MULTI_CHECKS.items():
        source = mg.tiny_ckpt(root) if kind == "tiny" else \
            SimpleNamespace(config=GlmMoeDsaConfig(**{**common.GLM53, **common.SLICE}))
        for parallel, a2a in [("tp1", None), *mg.SPECS]:
            moe = {None: "-", False: "gather", True: "a2a"}[a2a]
            # measured (2026-11-30) before peer-memory collectives (every collective through NCCL)
            # and with the gather form's routing all-gathered
            plans[kind, parallel, moe] = mg.compile_for(kind, source, parallel, a2a, len(lengths), dtype,
                                                        p2p=False, routing="gather")
    return plans


def multi_rows(data: dict, cal: dict, plans: dict) -> list[dict]:
    """The rows of a multi_gpu_check --calibration file, predicted again. tp1 replays all 4 requests
    (bucket 4); the file keeps the other specs' buckets."""
    from bench import multi_gpu_check as mg
    out = []
    for r in data["rows"]:
        if not (r.get("predicted") or {}).get("measured_ms"):
            continue
        lengths, _ = MULTI_CHECKS[r["check"]]
        context = round(sum(lengths) / len(lengths)) + mg.STEPS
        bucket = r.get("bucket") or len(lengths)
        plan = plans[r["check"], r["parallel"], r["moe"]]
        out.append(_row(f"{r['check']} {r['parallel']}/{r['moe']}", bucket, context, r["predicted"]["measured_ms"],
                        measured_ms(plan, bucket, context, cal)))
    return out


def as_v1(cal: dict) -> dict:
    """The calibration without its /2 fields: what the predictor made of it before them."""
    from glmc.calibration import NEW_IN_V2, SCHEMA_V1
    return {**{k: v for k, v in cal.items() if k not in NEW_IN_V2}, "schema": SCHEMA_V1}


# ----------------------------------------------------------------------------- derived fields
def _profile(row: dict) -> dict:
    """{class: [launches, device us]} of one row's profile."""
    out: dict = {}
    for name, (n, us) in row["profile_rank0"].items():
        c = out.setdefault(kernel_class(name), [0.0, 0.0])
        c[0], c[1] = c[0] + n, c[1] + us
    return out


def _gemm_calls(plan) -> tuple[int, float]:
    """(cuBLAS GEMM calls, their bytes) of the plan's decode step at one token (runner dtypes)."""
    from bench import predicted

    from glmc.passes.costs import op_cost, params_of, weight_bytes_for
    graph, wb = plan.graphs["decode"], weight_bytes_for(predicted.runner_dtypes(plan))
    env = {"T": 1, "B": 1, "S": 1, "K": plan.config.index_topk}
    calls, nbytes = 0, 0.0
    for op in graph.ops:
        n = measured_counts(op, env)[1]
        if n:
            calls += n
            _, local, _, cls = params_of(op)      # attention: only its W_UK / W_UV are GEMM operands
            nbytes += local * wb[cls] if op.kind.startswith("attn.") else op_cost(op, graph, env, wb).hbm_bytes
    return calls, nbytes


def derive(data: dict, plans: dict, cal: dict) -> tuple[dict, dict]:
    """(the /2 fields, a note per field with its numbers) from spec_bench's profiles (module docstring)."""
    from glmc.codegen.launch_model import TOPK_CHUNK
    rows = [r for r in data["rows"] if "profile_rank0" in r]
    one_gpu = [r for r in rows if r["spec"] == "tp1"]
    gaps = [(r["replay_ms"] * 1e3 - sum(c[1] for c in _profile(r).values())) /
            sum(c[0] for c in _profile(r).values()) for r in one_gpu]
    gap = statistics.mean(gaps) * 1e-6
    ctx = data["info"]["ctx"]
    topk = []
    for r in one_gpu:
        n, us = r["profile_rank0"]["topk_select_kernel"]
        topk.append([r["bucket"], us / n * 1e-6 + gap])
    torch_ops, gemm = {}, {}
    for r in (r for r in rows if r["B_per_rank"] == 1):
        prof, plan = _profile(r), plans[r["spec"]]
        one = {"T": 1, "B": 1, "S": 1, "K": plan.config.index_topk}
        counted = sum(measured_counts(op, one)[2] for op in plan.graphs["decode"].ops) + MEASURED_STEP_TORCH_OPS
        n, us = prof["torch"]
        torch_ops[r["spec"]] = (us * 1e-6 + gap * n) / counted
        calls, nbytes = _gemm_calls(plan)
        n, us = prof["gemm"]
        gemm[r["spec"]] = (us * 1e-6 + gap * n - nbytes / cal["hbm_bytes_per_s"]) / calls
    plan = next(iter(plans.values()))
    fields = {"torch_op_s": statistics.mean(torch_ops.values()), "gemm_launch_s": statistics.mean(gemm.values()),
              "topk_select": {"k": plan.config.index_topk, "chunk": TOPK_CHUNK, "row_len": ctx + 1,
                              "seconds": sorted(topk)}}

    def us(per_spec: dict) -> str:
        return ", ".join(f"{k} {v * 1e6:.2f}" for k, v in per_spec.items())
    src = f"bench/results/{Path(data.get('path', SPEC_BENCH)).name} profile_rank0"
    notes = {
        "gap_s": (f"{gap * 1e6:.3f} us per launch: tp1 replay (CUDA events) minus its kernels' device time, per "
                  f"launch, at B={', '.join(str(r['B_per_rank']) for r in one_gpu)}: "
                  f"{', '.join(f'{g:.3f}' for g in gaps)} us ({src}); added to every device time below"),
        "topk_select": (f"topk_select_kernel device time per launch on tp1 + gap ({src}); row_len = context "
                        f"{ctx} + 1 (lens = pos + 1), chunk = TOPK_CHUNK"),
        "torch_op_s": (f"device time of the non-GEMM, non-Triton, non-NCCL kernels + gap per launch, over the aten "
                       f"ops the measured code launched (MEASURED_LAUNCHES), at B=1, us per op: {us(torch_ops)}; mean ({src}). "
                       "Cross-check: decode_bench_2026-11-30 replays one moe.experts op alone at T=1 in 228.3 us; "
                       "its two Triton kernels take 143.6 us per layer in this tp1 B=1 profile: (228.3 - 143.6) / "
                       "43 aten ops = 1.97 us"),
        "gemm_launch_s": (f"cuBLAS kernels' device time (nvjet, split-K reduce, gemv) + gap per launch, less the "
                          f"plan's GEMM bytes / hbm_bytes_per_s, per GEMM call, at B=1, us per call: {us(gemm)}; "
                          f"mean ({src}). Per weight on tp1 at B=1 (device us): W_UK 12.6 MB 5.7, Q 67 MB 18.5, "
                          "O 201 MB 51.7 + 1.8 split-K reduce, dense gate|up 302 MB 72.9, lm_head 1.9 GB 456.6"),
    }
    return fields, notes


def derive_into(path: Path, spec_bench: Path = SPEC_BENCH) -> dict:
    """Add the derived /2 fields to the calibration file at `path` (bumping it to /2); returns it."""
    from glmc.calibration import SCHEMA, validate
    raw = json.loads(path.read_text())
    data = {**json.loads(spec_bench.read_text()), "path": str(spec_bench)}
    fields, notes = derive(data, spec_plans(data), raw)
    raw.update({"schema": SCHEMA, **fields})
    raw["derived"] = {"fields": sorted(fields), "from": f"bench/results/{spec_bench.name}",
                      "by": "python -m bench.predict_check --derive-into", "notes": notes,
                      "remeasure": ("bench/calibrate.py measures these directly (torch sequences, a GEMM "
                                    "sweep, the top-k select kernel); re-run it on the device")}
    validate(raw, str(path))
    path.write_text(json.dumps(raw, indent=1) + "\n")
    return raw


def table(rows_before: list[dict], rows_after: list[dict]) -> str:
    lines = [f"{'row':28} {'bucket':>6} {'ctx':>5} {'measured':>9} {'before':>8} {'ratio':>6} {'after':>8} "
             f"{'ratio':>6}"]
    for b, a in zip(rows_before, rows_after):
        lines.append(f"{a['name']:28} {a['bucket']:6d} {a['context']:5d} {a['measured_ms']:9.3f} "
                     f"{b['predicted_ms']:8.3f} {b['ratio']:6.2f} {a['predicted_ms']:8.3f} {a['ratio']:6.2f}"
                     + ("" if abs(a["ratio"] - 1) <= 0.2 else "  OUTSIDE 20%"))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default=str(CALIBRATION))
    ap.add_argument("--spec-bench", default=str(SPEC_BENCH))
    ap.add_argument("--multi", default=str(MULTI))
    ap.add_argument("--derive-into", help="write the derived /2 fields into this calibration file")
    args = ap.parse_args(argv)
    from glmc.calibration import load
    if args.derive_into:
        raw = derive_into(Path(args.derive_into), Path(args.spec_bench))
        print(json.dumps({k: raw[k] for k in raw["derived"]["fields"]}, indent=1))
        print(json.dumps(raw["derived"]["notes"], indent=1))
        return
    cal = load(args.calibration)
    before = as_v1(cal)
    data = json.loads(Path(args.spec_bench).read_text())
    plans = spec_plans(data)
    print(f"spec_bench ({args.spec_bench}; {data['info']['device']} x{data['info']['gpus']}, {data['info']['date']}), "
          f"calibration {args.calibration} ({cal['schema']}); ms per decode graph replay")
    print(table(spec_rows(data, before, plans), spec_rows(data, cal, plans)))
    multi = json.loads(Path(args.multi).read_text())
    mplans = multi_plans(Path(tempfile.mkdtemp(prefix="glmc_predict_check_")))
    print(f"\nmulti_gpu_check ({args.multi}; {multi['device']} x{multi['gpus']}, {multi['date']})")
    print(table(multi_rows(multi, before, mplans), multi_rows(multi, cal, mplans)))


if __name__ == "__main__":
    main()
