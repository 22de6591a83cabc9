"""Human-readable rendering of `explain` output, and the article cross-check for GLM-5.3."""
from __future__ import annotations

from glmc import article

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "dispatch", "combine", "broadcast")


def _b(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def _step_table(per_step: dict) -> list[str]:
    rows = ["| collective | count | of them peer-memory one-shot | message bytes | wire bytes / rank |",
            "|---|---:|---:|---:|---:|"]
    for k in KINDS:
        if k in per_step:
            r = per_step[k]
            rows.append(f"| {k} | {r['count']} | {r.get('p2p', 0)} | {_b(r['message_bytes'])} | "
                        f"{_b(r['wire_bytes'])} |")
    return rows if len(rows) > 2 else ["(no communication)"]


def _layer_table(per_layer: dict) -> list[str]:
    """One row per distinct per-layer pattern (consecutive layers with the same bill merge)."""
    rows = ["| layers | collectives (message bytes of each) |", "|---|---|"]
    keyed = sorted(per_layer.items(), key=lambda kv: (kv[0] == "-", int(kv[0]) if kv[0] != "-" else 0))
    groups: list[list] = []
    for layer, cells in keyed:
        sig = ", ".join(f"{k} " + " + ".join(_b(x) for x in c["messages"])
                        for k, c in sorted(cells.items()))
        if groups and groups[-1][1] == sig and layer != "-":
            groups[-1][0].append(layer)
        else:
            groups.append([[layer], sig])
    for layers, sig in groups:
        name = "prologue/epilogue" if layers == ["-"] else \
            (layers[0] if len(layers) == 1 else f"{layers[0]}..{layers[-1]} ({len(layers)})")
        rows.append(f"| {name} | {sig} |")
    return rows


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, -1] -> '0-2, 5, final'."""
    nums = sorted(set(x for x in layers if x >= 0))
    parts, start = [], None
    for i, x in enumerate(nums):
        start = x if start is None else start
        if i + 1 == len(nums) or nums[i + 1] != x + 1:
            parts.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(parts + (["final"] if -1 in layers else []))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _predicted(p: dict) -> list[str]:
    """The `predicted` section: the step at the explain point by op kind, the batch table, assumptions."""
    pt, cal = p["point"], p["calibration"]
    out = [f"## Predicted decode step ({cal['device']}, calibration {cal['path']})", "",
           (f"At T={pt['point']['T']} tokens per DP rank, context {pt['point']['S']}: **{_ms(pt['step_s'])} ms** = "
            f"data {_ms(pt['data_s'])} ms (per op the larger of HBM bytes / bandwidth and FLOPs / rate; "
            f"{_b(pt['hbm_bytes'])}, {pt['flops'] / 1e9:.1f} GFLOP in all) + launches {_ms(pt['overhead_s'])} ms "
            f"({pt['kernels']:.0f} kernels, {pt['torch_ops']:.0f} torch ops) + top-k select latency "
            f"{_ms(pt.get('latency_s', 0.0))} ms + communication "
            f"{_ms(pt['comm_s'])} ms ({pt['collectives']:.0f} collectives)"), "",
           "| op kind | count | ms | data ms | launch ms | comm ms | bound |", "|---|---:|---:|---:|---:|---:|---|"]
    for kind, r in list(pt["by_kind"].items())[:12]:
        if r["seconds"] > 0:
            bound = "-" if not r["data_s"] else "compute" if r["compute_s"] > r["memory_s"] else "memory"
            bound = "latency" if r.get("latency_s", 0.0) > r["data_s"] else bound
            out.append(f"| {kind} | {r['count']} | {_ms(r['seconds'])} | {_ms(r['data_s'])} | "
                       f"{_ms(r['overhead_s'])} | {_ms(r['comm_s'])} | {bound} |")
    out += ["", ("| batch per rank | step ms | TPOT ms | tokens/s (all GPUs) | comm ms | launch ms | graph bucket "
                 "| KV fits |"), "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in p["table"]:
        fits = "-" if r["kv_fits"] is None else "yes" if r["kv_fits"] else "no"
        out.append(f"| {r['batch_per_rank']} | {r['step_ms']:.2f} | {r['tpot_ms']:.2f} | {r['tokens_per_s']:,.0f} | "
                   f"{r['comm_ms']:.2f} | {r['overhead_ms']:.2f} | {r['graph_bucket'] or 'none'} | {fits} |")
    out += ["", "Assumptions:", *(f"- {a}" for a in p["assumptions"])]
    return out + (_mtp(p["mtp"]) if p.get("mtp") else [])


def _mtp(m: dict) -> list[str]:
    """The `predicted.mtp` table: a served speculative cycle by drafts and batch per rank."""
    accept = ", ".join(f"{e:.2f}" for e in m["accept_lengths"].values())
    out = ["", "## Predicted with MTP drafts", "",
           (f"A cycle = verify at t (N + 1) tokens + draft-extend (a draft step at t (N + 1)) + (N - 1) draft "
            f"steps at t + the host's work per cycle ({m['host_source']}); TPOT = cycle / accept length "
            f"(N = 1..{len(m['accept_lengths'])}: {accept}; {m['accept_source']})."), "",
           "| batch per rank | drafts | verify ms | draft-extend ms | draft ms | host ms | cycle ms | TPOT ms "
           "| speedup |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in m["table"]:
        out.append(f"| {r['batch_per_rank']} | {r['drafts']} | {r['verify_ms']:.2f} | {r['draft_extend_ms']:.2f} | "
                   f"{r['draft_ms']:.2f} | {r['host_ms']:.2f} | {r['cycle_ms']:.2f} | {r['tpot_ms']:.2f} | "
                   f"{r['speedup']:.2f}x |")
    return out


def _formats(w: dict) -> str:
    """How the weights are held (plan.json's `weights`), after the weight bytes."""
    if not w.get("fp8_ops"):
        return f" (linear weights {w['linear_weights']})" if w else ""
    return (f"; {', '.join(w['fp8_ops'])} weights {w['linear_weights']} ({w['fp8_tensors']:,} tensors); "
            + "; ".join(w["not_fp8"]))


def _workspaces(m: dict, context: int) -> list[str]:
    """Step workspaces above what the runner holds (cuda target; `explain.workspace_memory`)."""
    if not m.get("decode_workspace_bytes"):
        return []
    top = max(m["decode_workspace_bytes"], key=int)
    pool, pt = m["graph_pool"], m["prefill_point"]
    return [f"- decode step workspace (context {context}): {_b(m['decode_workspace_bytes'][top])} at "
            f"{top} tokens; decode graphs of every bucket keep {_b(m['graph_pool_bytes'])} (outputs "
            f"{_b(pool['outputs'])}, cuBLAS workspaces {_b(pool['workspaces'])}; their pool reserves at "
            f"least {_b(pool['pool_reserved'])})",
            f"- prefill step workspace ({pt['tokens']} tokens, {pt['requests']} request(s), indexer over "
            f"{pt['max_len']} positions): {_b(m['prefill_workspace_bytes'])}, peak at `{m['prefill_peak_op']}`; "
            f"indexer workspace {_b(m['indexer_workspace_bytes'])}"]


def _quality(q: dict) -> list[str]:
    """The recorded quality table (`explain.recorded_quality`), this plan's formats marked."""
    cs, st = q["settings"]["contexts"], q["settings"]
    head = [f"perplexity @{c}" for c in cs] + [f"agreement @{c}" for c in cs]
    out = [f"## Quality (recorded for models/small: {q['device']}, {q['date']}, commit {q['commit']}; "
           f"{q['source']})", "",
           f"Held-out perplexity ({st['perplexity_tokens']} tokens of heldout.txt in windows of each context) and "
           f"greedy agreement with the bf16 run over {st['continuation']}-token continuations of {st['prompts']} "
           f"prompts of {' / '.join(str(v) for v in st['prompt_tokens'].values())} tokens (`python -m bench.quality`).",
           "", "| format | weights | KV + indexer cache | " + " | ".join(head) + " |",
           "|---|---|---|" + "---:|" * len(head)]
    for r in q["rows"]:
        name = r["format"] + (" (this plan)" if r["format"] == q["formats"] else "")
        cells = [str(r["perplexity"][str(c)]) for c in cs] + [f"{r['agreement'][str(c)]:.1%}" for c in cs]
        out.append(f"| {name} | {r['weights']} | {r['kv_cache']} | " + " | ".join(cells) + " |")
    return out


def _launches(by_phase: dict) -> list[str]:
    """Launches per step and per layer of the plan's launch programs (launch/<phase>.txt)."""
    out = ["## Launches (launch/<phase>.txt: rank 0's program per step)", "",
           "| phase | tokens | per step | triton / gemm / torch / collective | per layer (layers) |",
           "|---|---|---|---|---|"]
    for phase, programs in by_phase.items():
        for tokens, p in programs.items():
            kinds = " / ".join(str(p["step"].get(k, 0)) for k in ("triton", "gemm", "torch", "collective"))
            layers = "; ".join(f"{n} ({_ranges(ls)})" for n, ls in p["layers"].items())
            out.append(f"| {phase} | {tokens} | {sum(p['step'].values())} | {kinds} | {layers} |")
    return out


def render(d: dict) -> str:
    p, m, f = d["params"], d["memory"], d["flops_per_token"]
    out = [f"# glmc explain: {d['model']} on {d['parallel']['spec']} (world {d['parallel']['world']})",
           "", "## Parameters",
           f"- total: {p['total'] / 1e9:.1f} B (+ MTP layer {p['mtp'] / 1e9:.2f} B)",
           f"- active per token: {p['active_per_token'] / 1e9:.1f} B",
           f"- per rank: {p['per_rank'] / 1e9:.1f} B", "", "## Memory per rank",
           f"- weights: {_b(m['weights_bytes_per_rank'])}{_formats(d.get('weights') or {})}",
           f"- KV cache: {m['kv_elements_per_token_per_layer']} elements per token per layer, "
           f"{_b(m['kv_bytes_per_token'])} per token (all layers)",
           f"- indexer cache: {_b(m['index_bytes_per_token'])} per token "
           f"({m['full_indexer_layers']} full layers; {m['shared_indexer_layers']} shared layers hold none)",
           *_workspaces(m, d['comm']['decode']['point']['S']),
           f"- fits: {m['kv_tokens_per_rank']:,} KV tokens per rank in {_b(m['hbm_bytes'])} x 0.9; "
           f"max context at batch {d['comm']['decode']['point']['B']} per rank: "
           f"{m['max_context_at_batch']:,}", "", "## FLOPs per token",
           f"- decode (model, batch 1, context {d['comm']['decode']['point']['S']}): "
           f"{f['decode'] / 1e9:.1f} GFLOP",
           f"- decode as executed on this plan (all ranks): {f['executed_decode'] / 1e9:.1f} GFLOP"]
    for phase, c in d["comm"].items():
        pt = c["point"]
        out += ["", f"## Communication: {phase} (T={pt['T']} tokens per DP rank, context {pt['S']})",
                "", *_step_table(c["per_step"]), "", "Per layer:", "", *_layer_table(c["per_layer"])]
    if d["moe_alternatives"]:
        out += ["", "## MoE lowerings (decode step)"]
        for name, per_step in d["moe_alternatives"].items():
            out += ["", f"{name}:", "", *_step_table(per_step)]
        out += ["", "Chosen: " + ", ".join(
            f"{ph} {m['choice']} (est. us {m['est_us']})"
            + (f", routing {m['routing']} (est. us {m['routing_est_us']})" if "routing" in m else "")
            for ph, m in d["moe_lowering"].items())]
    out += ["", "## Fusions"]
    for ph, rules in d["fusions"].items():
        out.append(f"- {ph}: " + (", ".join(f"{k} x{v}" for k, v in sorted(rules.items())) or "none"))
        for kind, layers in sorted(d["fused_ops"].get(ph, {}).items()):
            out.append(f"  - `{kind}` x{len(layers)}: layers {_ranges(layers)}")
    if d.get("kernels"):
        out += ["", f"## Triton kernels ({len(d['kernels'])}, in kernels/: what the runtime imports)", "",
                "| file | rendered from |", "|---|---|",
                *(f"| `{name}.py` | `{ctx}` |" for name, ctx in d["kernels"].items())]
    if d.get("launches"):
        out += ["", *_launches(d["launches"])]
    if d.get("predicted"):
        out += ["", *_predicted(d["predicted"])]
    if d.get("quality"):
        out += ["", *_quality(d["quality"])]
    if article.applies(d):
        out += ["", "## Against the GLM-5.3 article", "", *article.cross_check(d)]
    return "\n".join(out) + "\n"
