"""The decode step time a plan should take on a calibrated machine (`glmc explain --calibration`).

Every op of the decode graph at a point (T tokens per DP rank, S context, K index_topk) costs

    t_op = gemms x gemm_launch_s + (kernels - gemms) x kernel_overhead_s + torch_ops x torch_op_s
           + max(hbm_bytes / hbm_bytes_per_s, compute_s)
           + latency_s (the indexer's top-k select)
           + each of its collectives, timed from the calibration's table for its group size

and a step is the sum (plus the step's own launches outside every op: its inputs into the device
table): the CUDA target replays one graph on one stream, so nothing overlaps. The launches are the
plan's launch program at the point (`glmc.launches.LaunchCounts`: what the CUDA target launches
for that graph, traced on the meta device): per op its Triton kernels, cuBLAS GEMM calls, other torch
kernels and collectives. A collective the one-shot peer-memory kernel runs (`runs_p2p`) is priced as
that kernel (`p2p_collective_seconds`, launch included), which in a fused reduction also does the add
+ RMS norm: such an op launches nothing else (a lone rank's program, traced without peers, shows the
NCCL call and the norm kernel there). Implementation workspaces are
`codegen/launch_model.py`'s; HBM bytes and FLOPs are `glmc.passes.costs`' (weights read, the
experts some token picks, KV and indexer rows read, activations). compute_s = FLOPs / the GEMM rate
of the weights' dtype (the router: fp32); attention splits into its W_UK/W_UV projections (GEMM
rate) and the latent part over every top-k slot its kernel walks (K, pads included) at
`attention_flops_per_s` (the GEMM rate when the calibration lacks it). Collective lookup and
group-size extrapolation: `glmc.calibration`.

Three terms carry what a launch floor plus bytes / bandwidth misses at small batch, each a
measured ceiling of the calibration (schema /2; a /1 file falls back as `glmc.calibration` says):
- `gemm_launch_s` per cuBLAS GEMM call (linear, lm_head, the SwiGLU's two GEMMs, attention's
  W_UK/W_UV bmm, the router's fp32 GEMM) in place of `kernel_overhead_s`: a one-row GEMM streams
  its weights at about copy bandwidth but pays a fixed pipeline fill + epilogue (+ split-K's reduce
  kernel) of a few microseconds;
- `torch_op_s` per aten op of the target's own torch code (index gathers, scans, a sort,
  scatters, small element-wise ops around the MoE, attention and the norms): what those ops cost in
  a replay, not a one-element add;
- latency_s: the top-k select runs one program per token row, walking the row of S + 1 scores
  (a decode token at position S scores every key up to itself) 34 times: its measured launch at
  T rows, scaled by `launch_model.topk_select_passes` to this row length, less the launch already
  counted in `kernel_overhead_s`. It does not shrink with the batch: ~60 us per full indexer layer
  at context 4096 on an H200 at any T up to the SM count.
"""
from __future__ import annotations

from collections import defaultdict

from glmc.calibration import (
    SCHEMA_V1,
    collective_seconds,
    p2p_collective_seconds,
    gemm_launch_seconds,
    measured_ranks,
    topk_select_seconds,
    torch_op_seconds,
)
from glmc.codegen.launch_model import TOPK_CHUNK, collective_bytes, moe_workspace_bytes, topk_select_passes
from glmc.ir.types import DTYPE_BYTES
from glmc.passes.costs import moe_pairs, op_cost, runs_p2p, weight_bytes_for

TABLE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_FIELDS = ("seconds", "memory_s", "compute_s", "data_s", "overhead_s", "latency_s", "comm_s", "hbm_bytes",
           "flops", "kernels", "torch_ops", "collectives")


# The engine's host time per speculative cycle that the device does not hide: a served cycle's wall
# time minus its graph replays (verify + draft-extend + N - 1 draft steps), glmc-small on one H100,
# greedy cycles whole on the device and chained, 48 tokens per request (`python -m bench.mtp_gpu_check
# --parts small`): ms by drafts, at concurrency 1 and 16. It is per request and cycle host work
# (scheduling, batch building, acceptance, streaming), so it carries over to a larger model served
# from one process.
SPEC_HOST_SOURCE = "bench/results/h100_2026-12-07/mtp_gpu_check_small.json"
SPEC_HOST_MS = {1: (0.087, 1.478), 2: (0.128, 2.042), 3: (0.088, 2.039)}


# bench/results/mtp_accept_2026-12-01_specsampling.json: glmc-small, standard speculative sampling
# at temperature 1.0, accept length (tokens per verify step) by drafts
SMALL_ACCEPT_LENGTH = {0: 1.0, 1: 1.718, 2: 2.054, 3: 2.274}
SMALL_ACCEPT_SOURCE = "bench/results/mtp_accept_2026-12-01_specsampling.json"


def spec_host_ms(drafts: int, concurrency: int) -> float:
    """`SPEC_HOST_MS` at `concurrency` requests: linear through the two measured points (past 16
    requests extrapolated); 0 without drafts (plain decoding overlaps its host work with the device)."""
    if not drafts:
        return 0.0
    one, sixteen = SPEC_HOST_MS[min(drafts, max(SPEC_HOST_MS))]
    return one + (sixteen - one) * (concurrency - 1) / 15


def _gemm_rate(cal: dict, dtype: str) -> float:
    rates = cal["gemm_flops_per_s"]
    return rates.get(dtype) or rates["bf16"]


def _compute_seconds(op, flops: float, env: dict, dtypes, cal: dict) -> float:
    """FLOPs over the rate of the unit that runs them (module docstring)."""
    if op.kind == "moe.gate":
        return flops / _gemm_rate(cal, "fp32")
    rate = _gemm_rate(cal, dtypes.weight if dtypes.weight in cal["gemm_flops_per_s"] else dtypes.activation)
    if not op.kind.startswith("attn."):
        return flops / rate
    a = op.attr
    rows = op.types[0].shape[0].eval(env)
    heads = int(a("heads")) // int(a("tp", 1))
    c, dn, dr, dv = int(a("kv_lora")), int(a("dn")), int(a("dr")), int(a("dv"))
    slots = env["K"] if len(op.operands) > 3 else env["S"]
    latent = 2.0 * rows * heads * slots * (2 * c + dr)
    projections = 2.0 * rows * heads * (dn * c + c * dv)
    return projections / rate + latent / cal.get("attention_flops_per_s", rate)


def _select_latency(op, env: dict, cal: dict) -> float:
    """The top-k select's time beyond its launch (module docstring); 0 for every other op."""
    if op.kind != "idx.topk" or "topk_select" not in cal:
        return 0.0
    t = cal["topk_select"]
    rows = op.types[0].shape[0].eval(env)
    ratio = topk_select_passes(env["S"] + 1, int(op.attr("k")), TOPK_CHUNK) / \
        topk_select_passes(t["row_len"], t["k"], t["chunk"])
    return max(0.0, topk_select_seconds(cal, rows, ratio) - cal["kernel_overhead_s"])


# the calibration's collective kinds of a program's collective launches (a broadcast is timed as an
# all-gather of the same bytes: NCCL runs both as rings; MoE dispatch and combine are all-to-alls)
COLLECTIVE_KINDS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
                    "broadcast": "all_gather", "dispatch": "all_to_all", "combine": "all_to_all",
                    "all_to_all": "all_to_all"}
P2P_FUSES = frozenset({"fused.allreduce_add_rms", "fused.reduce_scatter_add_rms"})


def launch_terms(launches, cal: dict) -> tuple[float, dict]:
    """(overhead seconds, {kernels, gemms, torch_ops}) of launches that are not collectives: each
    Triton kernel `kernel_overhead_s`, each cuBLAS GEMM call `gemm_launch_s`, each other torch
    kernel `torch_op_s`."""
    n = {"kernels": 0, "gemms": 0, "torch_ops": 0}
    for x in launches:
        if x.kind == "triton":
            n["kernels"] += 1
        elif x.kind == "gemm":
            n["kernels"] += 1
            n["gemms"] += 1
        elif x.kind == "torch":
            n["torch_ops"] += 1
    seconds = (n["gemms"] * gemm_launch_seconds(cal) + (n["kernels"] - n["gemms"]) * cal["kernel_overhead_s"]
               + n["torch_ops"] * torch_op_seconds(cal))
    return seconds, n


def op_seconds(op, graph, env: dict, dtypes, cal: dict, weight_bytes: dict, launches=()) -> dict:
    """The terms of t_op (module docstring) for one op making `launches` (its launches in the
    program: `Program.op_launches()`)."""
    cost = op_cost(op, graph, env, weight_bytes)
    hbm = cost.hbm_bytes
    if op.kind == "moe.experts":
        pairs, _ = moe_pairs(op, graph, env)
        inter = int(op.attr("inter")) // int(op.attr("moe_tp", 1))
        hbm += moe_workspace_bytes(pairs, int(op.attr("hidden")), inter, DTYPE_BYTES[dtypes.activation])
    p2p = runs_p2p(op, cost.message_bytes)          # the plan's one-shot kernel
    size = int(op.attr("size", 1))
    collectives = [COLLECTIVE_KINDS[x.name] for x in launches if x.kind == "collective"]
    if p2p:
        kind = "all_to_all" if cost.comm in ("dispatch", "combine") else cost.comm
        comm = p2p_collective_seconds(cal, kind, cost.message_bytes, size)
        launches = () if op.kind in P2P_FUSES else launches
        collectives = []
    else:
        comm = sum(collective_seconds(cal, k, collective_bytes(op.kind, cost.message_bytes, size), size)
                   for k in collectives)
    overhead, n = launch_terms(launches, cal)
    memory, compute = hbm / cal["hbm_bytes_per_s"], _compute_seconds(op, cost.flops, env, dtypes, cal)
    latency = _select_latency(op, env, cal)
    return {"seconds": overhead + max(memory, compute) + latency + comm, "memory_s": memory, "compute_s": compute,
            "data_s": max(memory, compute), "overhead_s": overhead, "latency_s": latency, "comm_s": comm,
            "hbm_bytes": hbm, "flops": cost.flops, "kernels": n["kernels"], "torch_ops": n["torch_ops"],
            "collectives": len(collectives)}


def predict_step(graph, env: dict, dtypes, calibration: dict, ranks: int, program) -> dict:
    """Predicted step of `graph` (one rank of a plan over `ranks` GPUs) at `env`, its launches
    those of `program` (the launch program of that graph at that point, `codegen.launch_program.Program`):
    {step_s, the summed terms of every op, by_kind {op kind: the same, plus count}}."""
    wb = weight_bytes_for(dtypes)
    per_op = program.op_launches()
    by_kind: dict = defaultdict(lambda: dict.fromkeys(("count",) + _FIELDS, 0))
    for op in graph.ops:
        if int(op.attr("size", 1)) > ranks:
            raise ValueError(f"{op.kind} {op.results[0]}: a group of {op.attr('size')} on {ranks} GPUs")
        row = by_kind[op.kind]
        row["count"] += 1
        for key, value in op_seconds(op, graph, env, dtypes, calibration, wb, per_op.get(op.results[0], ())).items():
            row[key] += value
    total = {key: sum(r[key] for r in by_kind.values()) for key in _FIELDS}
    step, n = launch_terms(program.step_launches(), calibration)
    total["seconds"] += step
    total["overhead_s"] += step
    total["torch_ops"] += n["torch_ops"]
    total["kernels"] += n["kernels"]
    return {"step_s": total.pop("seconds"), **total, "point": dict(env),
            "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]["seconds"]))}


def _bucket(buckets: list, batch: int):
    return next((b for b in sorted(buckets) if b >= batch), None)


def predict_plan(plan, calibration: dict, context: int, batch_per_rank: int, launches,
                 kv_tokens_per_rank: int | None = None, batches=TABLE_BATCHES) -> dict:
    """`glmc explain`'s `predicted` section: the step at the explain point, a table over batches per
    DP rank, and the assumptions behind both; `launches(phase, tokens, context)` -> the launch
    program the step runs (`glmc.launches.LaunchCounts` of the plan)."""
    graph, cfg, mesh = plan.graphs["decode"], plan.config, plan.mesh
    dp, world = mesh.get("attn_dp", 1), plan.world
    buckets = graph.meta.get("cuda_graph_buckets", [])

    def at(t):
        return predict_step(graph, {"T": t, "B": t, "S": context, "K": cfg.index_topk}, plan.dtypes,
                            calibration, world, launches("decode", t, context))
    rows = []
    for t in batches:
        p = at(t)
        rows.append({"batch_per_rank": t, "step_ms": p["step_s"] * 1e3, "tpot_ms": p["step_s"] * 1e3,
                     "tokens_per_s": t * dp / p["step_s"], "comm_ms": p["comm_s"] * 1e3,
                     "overhead_ms": p["overhead_s"] * 1e3, "graph_bucket": _bucket(buckets, t),
                     "kv_fits": None if kv_tokens_per_rank is None else t * context <= kv_tokens_per_rank})
    out = {"calibration": {k: calibration.get(k) for k in ("path", "device", "gpus", "date", "measured", "schema")},
           "point": at(batch_per_rank), "table": rows,
           "assumptions": assumptions(plan, calibration, context, buckets, launches("decode", 1, context))}
    mtp = predict_mtp(plan, calibration, context, {r["batch_per_rank"]: r["step_ms"] for r in rows}, launches)
    if mtp is not None:
        out["mtp"] = mtp
    return out


def predict_mtp(plan, calibration: dict, context: int, plain_ms: dict[int, float], launches,
                accept: dict[int, float] | None = None) -> dict | None:
    """Speculative decoding with N = 1..3 MTP drafts at each batch per DP rank t of `plain_ms`
    {t: plain step ms}; None for a plan without MTP phases. A cycle is the served one:

        cycle = verify(t (N + 1) tokens) + draft-extend (a draft step at t (N + 1), its upper bound)
                + (N - 1) draft steps at t + the host's work per cycle (`spec_host_ms` at t x DP requests)

    and TPOT = cycle / accept length (`accept`, default glmc-small's measured ones); `launches` as
    `predict_plan`'s.
    -> {accept_lengths, accept_source, host_source, table: [{batch_per_rank, drafts, verify_ms,
    draft_extend_ms, draft_ms, host_ms, cycle_ms, tpot_ms, speedup (plain step / TPOT)}]}."""
    graphs, cfg = plan.graphs, plan.config
    if "mtp_verify" not in graphs or "mtp_draft" not in graphs:
        return None
    dp, world = plan.mesh.get("attn_dp", 1), plan.world
    accept = accept or SMALL_ACCEPT_LENGTH
    most = min(3, plan.options.mtp_draft_tokens, max(accept))

    def ms(phase, t, b):
        return predict_step(graphs[phase], {"T": t, "B": b, "S": context, "K": cfg.index_topk}, plan.dtypes,
                            calibration, world, launches(phase, t, context))["step_s"] * 1e3
    rows = []
    for t, plain in plain_ms.items():
        draft = ms("mtp_draft", t, t)
        for n in range(1, most + 1):
            verify, extend = ms("mtp_verify", t * (n + 1), t), ms("mtp_draft", t * (n + 1), t)
            host = spec_host_ms(n, t * dp)
            cycle = verify + extend + (n - 1) * draft + host
            tpot = cycle / accept[n]
            rows.append({"batch_per_rank": t, "drafts": n, "verify_ms": verify, "draft_extend_ms": extend,
                         "draft_ms": draft, "host_ms": host, "cycle_ms": cycle, "tpot_ms": tpot,
                         "speedup": plain / tpot})
    return {"accept_lengths": {n: accept[n] for n in range(1, most + 1)},
            "accept_source": SMALL_ACCEPT_SOURCE if accept is SMALL_ACCEPT_LENGTH else "given",
            "host_source": SPEC_HOST_SOURCE, "table": rows}


def assumptions(plan, cal: dict, context: int, buckets: list, program) -> list[str]:
    """What the prediction takes for granted, in words (`program`: the decode step's launches)."""
    cfg, d = plan.config, plan.dtypes
    graph = plan.graphs["decode"]
    sizes = sorted({int(op.attr("size")) for op in graph.ops if op.attr("size") and int(op.attr("size")) > 1})
    measured = "" if cal.get("measured", True) else " (measured: false, not written by a benchmark run)"
    out = [f"calibration {cal.get('path', '<dict>')}: {cal['device']}, {cal['gpus']} GPUs, {cal['date']}{measured}",
           (f"HBM {cal['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 GEMM {cal['gemm_flops_per_s']['bf16'] / 1e12:.0f} "
            f"TFLOP/s, attention kernel {cal.get('attention_flops_per_s', 0) / 1e12:.0f} TFLOP/s, "
            f"{cal['kernel_overhead_s'] * 1e6:.1f} us per Triton kernel, {gemm_launch_seconds(cal) * 1e6:.1f} us per "
            f"GEMM call, {torch_op_seconds(cal) * 1e6:.1f} us per torch op"),
           ("one CUDA-graph replay per step, ops back to back on one stream (no compute/communication "
            "overlap); per op: launches x overhead + max(HBM bytes / bandwidth, FLOPs / rate) + the top-k "
            "select's latency + collectives; the launches are the plan's launch program at each point, "
            "traced on the meta device")]
    if cal.get("schema") == SCHEMA_V1:
        out.append(f"calibration schema {SCHEMA_V1}: no top-k select latency, GEMM calls and torch ops at the "
                   "launch floor (small batches come out short; re-run bench/calibrate.py)")
    elif "topk_select" in cal and any(op.kind == "idx.topk" for op in graph.ops):
        t = cal["topk_select"]
        rows, sec = t["seconds"][0]
        out.append(f"top-k select: one program per token row walks its {context + 1} scores "
                   f"{topk_select_passes(context + 1, cfg.index_topk)} times (measured: {sec * 1e6:.0f} us per "
                   f"launch at {rows:.0f} row(s) of {t['row_len']})")
    out += [(f"every request at context {context}: attention reads min(S, {cfg.index_topk}) keys, its kernel "
             f"walks all {cfg.index_topk} top-k slots; full indexer layers score all S keys"),
            (f"routing uniform at random and balanced: each token picks {cfg.num_experts_per_tok} of "
             f"{cfg.n_routed_experts} experts; a rank reads the experts some token of the step picks (expected)"),
            (f"the plan's dtypes: weights {d.weight}, activations {d.activation}, KV {d.kv_cache}, "
             f"indexer cache {d.index_cache}, as the CUDA runner allocates them"),
            ("no MTP: one token per request per step, TPOT = step time; host work (scheduling, sampling "
             "read-back, HTTP) not included")]
    per_op = program.op_launches()
    for n in sizes:
        kinds = {COLLECTIVE_KINDS[x.name] for op in graph.ops if int(op.attr("size", 1)) == n
                 for x in per_op.get(op.results[0], ()) if x.kind == "collective"}
        base = sorted({measured_ranks(cal, k, n) for k in kinds})
        out.append(f"collectives over {n} GPUs: " + ("measured" if base == [n] else
                   f"extrapolated from the {'/'.join(map(str, base))}-GPU tables at equal per-rank wire bytes "
                   "(latency not scaled with the group)"))
    if buckets:
        out.append(f"batches above the largest CUDA-graph bucket ({max(buckets)} per rank) would run eagerly "
                   "today; their rows price that eager step's launches as a graph replays them, without the "
                   "host's launch time (compile with a larger max_batch)")
    return out
