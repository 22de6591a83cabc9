"""`glmc explain`: parameters, memory, FLOPs and the communication bill of a plan directory.

JSON keys (stable): `model`, `parallel`, `params` {total, mtp, active_per_token, per_rank},
`memory` {weights_bytes_per_rank (each weight once, as the loader holds it: FP8 with its block
scales), weight_copies_bytes_per_rank (cuda target: re-laid-out weights kept beside the originals),
and what a step allocates above what the runner holds (cuda target, `workspace_memory`:
decode_workspace_bytes {bucket: bytes} (one eager decode step's peak; graph_bytes: the same, its
old name), graph_pool_bytes (what capturing every decode bucket keeps allocated) and graph_pool
{outputs, inputs, workspaces, pool_reserved}, prefill_workspace_bytes at prefill_point {tokens,
requests, max_len} (the plan's largest chunk at the context) with prefill_peak_op,
indexer_workspace_bytes (the indexer's scores and top-k buffers at that chunk), workspace_notes),
kv_bytes_per_token, kv_elements_per_token_per_layer, kv_dtype, index_dtype,
kv_bytes_per_token_per_layer, index_bytes_per_token_per_layer (what the runtime's pool allocates per
layer: 656 / 132 for fp8 caches), index_bytes_per_token, full_indexer_layers, shared_indexer_layers,
hbm_bytes, kv_tokens_per_rank, max_context_at_batch}, `flops_per_token` {decode, executed_decode},
`comm` {prefill, decode}: each {point, per_step {kind: {count, message_bytes, wire_bytes}}, per_layer
{layer: {kind: {count, message_bytes}}}}, `moe_lowering` {phase: decision}, `moe_alternatives` {gather, a2a: per_step},
`ep_dispatch_bytes_per_token` (payload, top_k x hidden in the dispatch dtype),
`fusions` {phase: {rule: count}}, `fused_ops` {phase: {fused op kind: [layer, ...]}} (-1:
outside the decoder layers), `kernels` {kernels/<name>.py: the context it was rendered from} (cuda
target; empty for cpu), `launches` (a plan directory with launch/<phase>.txt, `glmc compile --device
cuda`) {phase: {tokens: {step {kind: count}, layers {launches per layer: [layer, ...]}}}}. Byte
conventions are those of `glmc.passes.costs`.
With a calibration (`glmc.calibration`; a CUDA plan: its launch programs are priced), `predicted`
{calibration, point: `glmc.predict.predict_step` at the explain point, table: [{batch_per_rank, step_ms, tpot_ms, tokens_per_s, comm_ms, overhead_ms,
graph_bucket, kv_fits}], assumptions: [str], mtp (a plan with MTP phases: `glmc.predict.predict_mtp`)
{accept_lengths, accept_source, host_source, table: [{batch_per_rank, drafts, verify_ms,
draft_extend_ms, draft_ms, host_ms, cycle_ms, tpot_ms, speedup}]}}.
`quality` (`recorded_quality`; only for a plan of models/small's config, from a checkout's
bench/results/quality_*.json) {source, target, device, date, commit, settings, formats (this
plan's), rows: [{format, weights, kv_cache, perplexity, agreement}]}.
"""
from __future__ import annotations

import json
from pathlib import Path

from glmc.codegen.launch_program import counts, split
from glmc.compiler import compile_phase
from glmc.config import DTypes, Options
from glmc.ir.types import DTYPE_BYTES
from glmc.launches import LaunchCounts
from glmc.parallel import parse_parallel
from glmc.passes.costs import params_of
from glmc.passes.estimate_cost import bill
from glmc.passes.plan_memory import phase_workspaces, prefill_point
from glmc.passes.rewrite import FUSIONS
from glmc.plan import Plan
from glmc.predict import predict_plan
from glmc.spec import ModelSpec

H200_HBM_BYTES = 141 * 10**9
MEM_FRACTION = 0.9
REPO = Path(__file__).resolve().parents[1]   # a checkout: bench/results holds the recorded runs


def _env(phase: str, batch: int, context: int, dp: int, topk: int) -> dict:
    if phase == "prefill":
        return {"T": context, "B": 1, "S": context, "K": topk, "prefill": True}
    t = max(1, -(-batch // dp))
    return {"T": t, "B": t, "S": context, "K": topk}


def _params(graphs: dict) -> dict:
    main = [params_of(op) for op in graphs["decode"].ops]
    shared_names = ("model.embed_tokens.weight", "lm_head.weight")
    mtp = [params_of(op) for op in graphs.get("mtp_draft", graphs["decode"]).ops
           if "mtp_draft" in graphs and op.attr("weight") not in shared_names]
    return {"total": sum(p[0] for p in main), "mtp": sum(p[0] for p in mtp),
            "active_per_token": sum(p[2] for p in main), "per_rank": sum(p[1] for p in main)}


def explain(plan_dir: str, batch: int = 32, context: int = 4096,
            hbm_bytes: int = H200_HBM_BYTES, calibration: dict | None = None) -> dict:
    launches = {f"launch/{p.name}": p.read_text() for p in sorted(Path(plan_dir).glob("launch/*.txt"))}
    return explain_plan(Plan.load(plan_dir), batch, context, hbm_bytes, calibration, launches)


def explain_plan(plan: Plan, batch: int = 32, context: int = 4096,
                 hbm_bytes: int = H200_HBM_BYTES, calibration: dict | None = None,
                 launches: dict[str, str] | None = None) -> dict:
    """The numbers of `plan` at a decode batch (all DP ranks) and context length; with a
    calibration (`glmc.calibration.load`), also the predicted decode step; with the plan
    directory's launch programs (`launches`: launch/<phase>.txt -> text), their launches per step
    and per layer."""
    meta, graphs = plan.to_json(), plan.graphs
    spec = ModelSpec(**meta["spec"])
    cfg, dtypes = spec.config, DTypes(**meta["dtypes"])
    par = plan.mesh
    dec_meta = meta["phases"]["decode"]
    mem = dec_meta["memory"]
    out = {"model": meta["model"], "parallel": meta["parallel"], "params": _params(graphs)}
    weights, copies = mem["weights_bytes"], mem.get("weight_copies_bytes", 0)   # plans saved before: none
    kv_tok = mem["kv_bytes_per_token"] + mem["index_bytes_per_token"]
    free = max(0, int(hbm_bytes * MEM_FRACTION) - weights - copies)
    full = meta["phases"]["decode"]["indexer"]["full_layers"]
    out["memory"] = {
        "weights_bytes_per_rank": weights, "weight_copies_bytes_per_rank": copies,
        **workspace_memory(plan, context),
        "kv_bytes_per_token": mem["kv_bytes_per_token"],
        "kv_elements_per_token_per_layer": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        "kv_dtype": dtypes.kv_cache, "index_dtype": dtypes.index_cache,
        # what the runtime's pool allocates per layer (KVPool.bytes_per_token_per_layer): 656 / 132 in fp8
        "kv_bytes_per_token_per_layer": mem["kv_bytes_per_token"] // max(1, mem["kv_layers"]),
        "index_bytes_per_token_per_layer": mem["index_bytes_per_token"] // max(1, mem["index_layers"]),
        "index_bytes_per_token": mem["index_bytes_per_token"], "full_indexer_layers": len(full),
        "shared_indexer_layers": cfg.num_hidden_layers - len(full), "hbm_bytes": hbm_bytes,
        "kv_tokens_per_rank": free // kv_tok if kv_tok else 0,
        "max_context_at_batch": (free // kv_tok) * par.attn_dp // max(1, batch) if kv_tok else 0,
    }
    ref = compile_phase(spec, parse_parallel("tp1", cfg), "decode", Options(device="cpu"))
    one = bill(ref, _env("decode", 1, context, 1, cfg.index_topk), dtypes)
    dec = bill(graphs["decode"], _env("decode", batch, context, par.attn_dp, cfg.index_topk), dtypes)
    out["flops_per_token"] = {"decode": one["totals"]["flops"],
                              "executed_decode": dec["totals"]["flops"] * par.world / batch}
    out["comm"] = {}
    for phase in ("prefill", "decode"):
        env = _env(phase, batch, context, par.attn_dp, cfg.index_topk)
        b = bill(graphs[phase], env, dtypes)
        out["comm"][phase] = {"point": {k: v for k, v in env.items() if k != "prefill"},
                              "per_step": b["comm"], "per_layer": b["per_layer"]}
    out["moe_lowering"] = {ph: m.get("moe_lowering") for ph, m in meta["phases"].items()
                           if m.get("moe_lowering")}
    out["moe_alternatives"] = _alternatives(spec, par, meta, batch, context)
    disp = "fp8" if dtypes.weight == "fp8" else dtypes.activation
    out["ep_dispatch_bytes_per_token"] = cfg.num_experts_per_tok * cfg.hidden_size * \
        DTYPE_BYTES[disp]
    out["fusions"] = {ph: {k: v for k, v in m.get("rewrites", {}).items() if k in FUSIONS}
                      for ph, m in meta["phases"].items()}
    out["fused_ops"] = {ph: _fused_where(g) for ph, g in graphs.items()}
    out["weights"] = plan.weight_formats   # block-FP8 or not, per op kind (codegen.weight_formats)
    out["kernels"] = dict(sorted(plan.kernel_contexts.items()))   # cuda target: kernels/<name>.py -> context
    if launches:
        out["launches"] = launch_counts(launches)
    quality = recorded_quality(plan)
    if quality:
        out["quality"] = quality
    if calibration is not None:
        t = _env("decode", batch, context, par.attn_dp, cfg.index_topk)["T"]
        out["predicted"] = predict_plan(plan, calibration, context, t, LaunchCounts(plan),
                                        out["memory"]["kv_tokens_per_rank"])
    return out


def launch_counts(launches: dict[str, str]) -> dict:
    """{phase: {tokens: {"step": {kind: n}, "layers": {count: [layer, ...]}}}} of launch/<phase>.txt
    texts (`codegen.launch_program.counts`): each program's launches per step by kind, and its
    decoder layers grouped by how many launches they make."""
    out = {}
    for path, text in sorted(launches.items()):
        phase = Path(path).stem
        for tokens, part in split(text).items():
            c = counts(part)
            by_count: dict[int, list[int]] = {}
            for layer, kinds in c["layers"].items():
                by_count.setdefault(sum(kinds.values()), []).append(layer)
            out.setdefault(phase, {})[tokens] = {"step": c["step"], "layers": dict(sorted(by_count.items()))}
    return out


WORKSPACE_NOTES = [
    "CUDA target, one rank: every op's tensor allocations replayed in execution order "
    "(passes/step_memory.py), each value freed after its last use as the executor drops it (the step's outputs kept)",
    "each allocation rounded up to the CUDA caching allocator's 512-byte block; segments and splits not modelled",
    "flash-decoding splits for an H200 (132 SMs); decode indexer scores span the context (the runner's max_context)",
    "graph pool: each graph's outputs and static inputs, plus torch's 32 MiB cuBLAS workspace (sm90 default) "
    "per stream running a GEMM: the warm-up side stream (one for all buckets) and the shared capture stream",
    "not counted: workspaces inside aten kernels (sort, reductions), Triton scratch, NCCL buffers",
]


def workspace_memory(plan: Plan, context: int, num_sms: int | None = None) -> dict:
    """The CUDA target's step workspaces of `plan` at `context` (module docstring); {} for a cpu plan."""
    opts, dtypes, cfg = plan.options, plan.dtypes, plan.config
    if opts.device != "cuda":
        return {"indexer_workspace_bytes": 0, "graph_bytes": {}}
    sms = {"num_sms": num_sms} if num_sms else {}
    chunk = opts.chunked_prefill
    dec = phase_workspaces(plan.graphs["decode"], "decode", dtypes, cfg, chunk, context, **sms)
    pre = phase_workspaces(plan.graphs["prefill"], "prefill", dtypes, cfg, chunk, context, **sms)
    step = pre["steps"][chunk]
    top = max(step.regions, key=lambda r: r[2])[0]
    pool = dec.get("graph_pool", {"allocated": 0})
    return {"decode_workspace_bytes": dec["workspace_bytes"], "graph_bytes": dec["workspace_bytes"],
            "graph_pool_bytes": pool["allocated"], "graph_pool": {k: v for k, v in pool.items() if k != "allocated"},
            "prefill_workspace_bytes": step.peak, "prefill_point": prefill_point(chunk, context),
            "prefill_peak_op": f"{top.kind} %{top.results[0]}",
            "indexer_workspace_bytes": pre["indexer_workspace_bytes"],
            "workspace_notes": WORKSPACE_NOTES + [f"no model for {k} (its result bytes counted)"
                                                  for k in sorted(step.guessed | set().union(
                                                      *(m.guessed for m in dec["steps"].values())))]}


def _fused_where(graph) -> dict:
    """{fused op kind: layers it sits in} (layer -1: outside the decoder layers)."""
    where: dict = {}
    for op in graph.ops:
        if op.kind.startswith("fused."):
            where.setdefault(op.kind, []).append(-1 if op.layer is None else op.layer)
    return where


def _alternatives(spec, par, meta, batch, context) -> dict:
    """The decode bill under both MoE lowerings (where the plan had a choice)."""
    if not any(m.get("moe_lowering") for m in meta["phases"].values()) or par.moe_tp > 1:
        return {}
    opts = meta["options"]
    out = {}
    for name, forced in (("gather", False), ("a2a", True)):
        o = Options(**{**opts, "moe_a2a": forced})
        g = compile_phase(spec, par, "decode", o)
        env = _env("decode", batch, context, par.attn_dp, spec.config.index_topk)
        out[name] = bill(g, env, spec.dtypes)["comm"]
    return out


def recorded_quality(plan: Plan) -> dict | None:
    """`python -m bench.quality`'s recorded run for a plan of the model it measured (models/small:
    the same config, so the numbers are those of models/small's weights), on the plan's target if
    one was recorded there, else the latest on any; None for other models or without a checkout's
    bench/results. `formats` names the row of the plan's own weight and cache formats."""
    config = plan.config.model_dump(mode="json")
    runs = [(path, json.loads(path.read_text())) for path in sorted(REPO.glob("bench/results/quality_*.json"))]
    runs = [(path, run) for path, run in runs if run.get("config") == config]
    if not runs:
        return None
    path, run = next(((p, r) for p, r in reversed(runs) if r["target"] == plan.target), runs[-1])
    weights, kv = plan.dtypes.weight == "fp8", plan.dtypes.kv_cache == "fp8"
    formats = "fp8_both" if weights and kv else "fp8_weights" if weights else "fp8_kv" if kv else "bf16"
    rows = [{"format": name, "weights": r["weights"], "kv_cache": r["kv_cache"], "perplexity": r["perplexity"],
             "agreement": r["agreement"]} for name, r in run["results"].items()]
    return {"source": str(path.relative_to(REPO)), "formats": formats, "rows": rows,
            **{k: run[k] for k in ("target", "device", "date", "commit", "settings")}}
