"""`glmc plan`'s outputs: the Pareto front as a text table and as an SVG chart (written by hand:
log-log axes, every priced row a grey dot, the front a red line of labelled dots), and `--explain`:
glmc's pick next to SGLang's GLM-5 recipes, term by term."""
from __future__ import annotations

import math
from dataclasses import dataclass

from glmc.plan_search import STEP_TERMS


def render_table(result: dict) -> str:
    """The Pareto front as text, then the best row for the SLO, the dropped count and the assumptions."""
    head = (f"{'candidate':<40} {'conc':>5} {'tok/s/GPU':>10} {'tok/s/user':>10} {'TPOT ms':>8} {'TTFT ms':>8} "
            f"{'GiB':>6}")
    lines = [f"glmc plan: {result['model']} on {result['gpus']} GPUs, in={result['workload']['in']} "
             f"out={result['workload']['out']}: {len(result['rows'])} priced, {len(result['dropped'])} dropped",
             "", "Pareto front (tok/s per GPU against tok/s per user):", head]
    for r in result["pareto"]:
        lines.append(f"{r['candidate']:<40} {r['concurrency']:>5} {r['tok_s_per_gpu']:>10.1f} "
                     f"{r['tok_s_per_user']:>10.1f} {r['tpot_ms']:>8.2f} {r['ttft_ms']:>8.0f} {r['memory_gib']:>6.1f}")
    best = result["best"]
    slo = ", ".join(f"{k}<={v:g}" for k, v in result["slo"].items()) or "no SLO"
    lines += ["", f"best for {slo}: " + (f"{best['candidate']} at concurrency {best['concurrency']} "
                                          f"({best['tok_s_per_gpu']:.1f} tok/s per GPU, {best['tok_s_per_user']:.1f} "
                                          "per user)" if best else "none meets it")]
    lines += ["", "assumptions:"] + [f"- {a}" for a in result["assumptions"]]
    return "\n".join(lines) + "\n"


def render_svg(result: dict, width: int = 720, height: int = 480) -> str:
    """Every priced row as a grey dot, the Pareto front as a line of labelled dots (log-log axes)."""
    rows, front, m = result["rows"], result["pareto"], 60
    if not rows:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"><text x="20" ' \
               f'y="40">no candidate fits</text></svg>\n'
    xs = [math.log10(r["tok_s_per_user"]) for r in rows]
    ys = [math.log10(r["tok_s_per_gpu"]) for r in rows]
    x0, x1, y0, y1 = min(xs), max(xs) + 1e-9, min(ys), max(ys) + 1e-9

    def at(r):
        x = m + (math.log10(r["tok_s_per_user"]) - x0) / (x1 - x0) * (width - 2 * m)
        return x, height - m - (math.log10(r["tok_s_per_gpu"]) - y0) / (y1 - y0) * (height - 2 * m)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="10">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<line x1="{m}" y1="{height - m}" x2="{width - m}" y2="{height - m}" stroke="black"/>',
           f'<line x1="{m}" y1="{m}" x2="{m}" y2="{height - m}" stroke="black"/>',
           f'<text x="{width / 2}" y="{height - 20}" text-anchor="middle">output tok/s per user (log, '
           f'{10 ** x0:.1f} to {10 ** x1:.1f})</text>',
           f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" text-anchor="middle">output '
           f'tok/s per GPU (log, {10 ** y0:.1f} to {10 ** y1:.1f})</text>',
           f'<text x="{m}" y="25" font-size="13">glmc plan: {result["model"]}, {result["gpus"]} GPUs, '
           f'in={result["workload"]["in"]} out={result["workload"]["out"]}</text>']
    out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="#bbb"/>' for x, y in map(at, rows)]
    points = " ".join(f"{x:.1f},{y:.1f}" for x, y in map(at, front))
    out.append(f'<polyline points="{points}" fill="none" stroke="#c33" stroke-width="1.5"/>')
    for r in front:
        x, y = at(r)
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="#c33"/>',
                f'<text x="{x + (5 if x < width / 2 else -5):.1f}" y="{y - 5:.1f}" '
                f'text-anchor="{"start" if x < width / 2 else "end"}">{r["candidate"]} c={r["concurrency"]}</text>']
    return "\n".join(out + ["</svg>"]) + "\n"


@dataclass(frozen=True)
class Recipe:
    """One of SGLang's GLM-5 serving recipes as a glmc candidate over n GPUs."""
    objective: str
    says: str          # `says` and `spec` are formats of the GPU count n
    spec: str
    moe: str
    drafts: int
    measure: str       # the row field the objective maximises


RECIPES = (
    Recipe("latency", "SGLang's latency recipe: TP{n} with EAGLE/MTP speculative decoding, 3 draft tokens",
           "tp{n}", "auto", 3, "tok_s_per_user"),
    Recipe("throughput", "SGLang's throughput recipe: DP attention + DeepEP expert parallelism",
           "dp{n}ep{n}", "a2a", 0, "tok_s_per_gpu"),
)
OTHER_MEASURE = {"tok_s_per_user": "tok_s_per_gpu", "tok_s_per_gpu": "tok_s_per_user"}
MEASURE_WORDS = {"tok_s_per_user": "tok/s per user", "tok_s_per_gpu": "tok/s per GPU"}


def explain_recipes(result: dict) -> dict:
    """`--explain`: per recipe, its own candidate's row next to glmc's pick for the same objective
    (latency: most tok/s per user at concurrency 1; throughput: most tok/s per GPU at the largest
    concurrency, within the SLO) and the predictor's terms per output token, largest difference first."""
    return {"recipes": [_recipe_entry(r, result) for r in RECIPES], "assumptions": [
        "the recipes' candidates are priced as glmc would run them (its kernels, this calibration), "
        "not as SGLang runs them; DeepEP's all-to-all is glmc's a2a MoE lowering",
        "a recipe's KV dtype is fp8 (glmc's default) where it was searched; its collective backend is "
        "whichever of peer memory + NCCL and all NCCL prices better for the objective",
        "terms per output token: each predictor term of the step (verify forward + drafts x draft step) "
        "divided by the accept length; they sum to TPOT"]}


def _recipe_entry(recipe: Recipe, result: dict) -> dict:
    n, kv_dtypes = result["gpus"], result["kv_dtypes"]
    kv = "fp8" if "fp8" in kv_dtypes else kv_dtypes[0]
    drafts = recipe.drafts if recipe.drafts in result["mtp_drafts"] else 0
    spec = recipe.spec.format(n=n)
    candidate = f"{spec} moe={recipe.moe} kv={kv} mtp={drafts}"
    conc, note = _concurrency(recipe, result, f"{candidate} c={max(result['concurrency'])}")
    slo = result["slo"] if recipe.objective == "throughput" else {}
    at = [r for r in result["rows"] if r["concurrency"] == conc]
    pick = _best([r for r in at if _within(r, slo)], recipe.measure)
    own = _best([r for r in at if r["candidate"].split(" nccl")[0] == candidate], recipe.measure)  # either backend
    entry = {"objective": recipe.objective, "recipe": recipe.says.format(n=n), "candidate": candidate,
             "concurrency": conc, "note": note, "measure": recipe.measure, "slo": slo,
             "recipe_row": own, "glmc_row": pick,
             "same": own is not None and own is pick,
             "recipe_within_slo": own is not None and _within(own, slo),
             "dropped": None if own else _why_missing(result, spec, f"{candidate} c={conc}"),
             "terms": _terms(own, pick) if own and pick and own is not pick else []}
    return {**entry, "summary": _summary(entry)}


def _concurrency(recipe: Recipe, result: dict, at_largest: str) -> tuple[int, str | None]:
    """Latency: 1. Throughput: the largest concurrency asked for, else the largest at which some
    candidate fits, with a note naming the recipe's reason at the largest."""
    if recipe.objective == "latency":
        return 1, None
    largest = max(result["concurrency"])
    fits = max((r["concurrency"] for r in result["rows"]), default=largest)
    if fits == largest:
        return largest, None
    reason = next((d["reason"] for d in result["dropped"] if d["candidate"] == at_largest), "not priced")
    return fits, (f"no candidate fits at concurrency {largest}, compared at {fits}; the recipe's "
                  f"{at_largest}: {reason}")


def _best(rows: list[dict], measure: str) -> dict | None:
    return max(rows, default=None, key=lambda r: (r[measure], r[OTHER_MEASURE[measure]]))


def _within(row: dict, slo: dict) -> bool:
    return row["tpot_ms"] <= slo.get("tpot_ms", math.inf) and row["ttft_ms"] <= slo.get("ttft_ms", math.inf)


def _why_missing(result: dict, spec: str, name: str) -> str:
    """The search's reason for a recipe candidate with no row: dropped (memory), invalid spec, not searched."""
    for d in result["dropped"]:
        if d["candidate"] in (name, spec):
            return d["reason"]
    return "not among the searched candidates (--specs, --kv-dtype)"


def _terms(own: dict, pick: dict) -> list[dict]:
    """The predictor's terms per output token of both rows, the largest difference first."""
    out = [{"term": k, "label": label, "recipe_ms": own["step_terms_ms"][k] / own["accept_length"],
            "glmc_ms": pick["step_terms_ms"][k] / pick["accept_length"]} for k, label in STEP_TERMS.items()]
    for t in out:
        t["difference_ms"] = t["recipe_ms"] - t["glmc_ms"]
    return sorted(out, key=lambda t: -abs(t["difference_ms"]))


def _summary(e: dict) -> str:
    """One sentence: the same candidate, the recipe dropped, or the biggest term difference in ms."""
    own, pick, words, c = e["recipe_row"], e["glmc_row"], MEASURE_WORDS[e["measure"]], e["concurrency"]
    missing = f"the recipe's {e['candidate']} at concurrency {c} has no row: {e['dropped']}"
    if pick is None:
        return f"{e['objective']}: no candidate at concurrency {c} " + ("meets the SLO" if e["slo"] else "fits") + \
            ("" if own else f"; {missing}")
    if e["same"]:
        return (f"{e['objective']}: glmc's pick is the recipe's own candidate, {own['candidate']} at concurrency "
                f"{c} ({own[e['measure']]:.1f} {words})")
    if own is None:
        return f"{e['objective']}: {missing}; glmc picks {pick['candidate']} ({pick[e['measure']]:.1f} {words})"
    t = e["terms"][0]
    slo = "" if e["recipe_within_slo"] else " (the recipe misses the SLO)"
    gain = pick[e["measure"]] / own[e["measure"]] - 1
    return (f"{e['objective']}: glmc picks {pick['candidate']} at {pick[e['measure']]:.1f} {words} against the "
            f"recipe's {own[e['measure']]:.1f} ({gain:+.2%}){slo}; the biggest difference is {t['label']}: "
            f"{t['recipe_ms']:.3f} ms per output token in the recipe against {t['glmc_ms']:.3f} ms "
            f"({t['difference_ms']:+.3f} ms)")


SIDE_BY_SIDE = (("spec", lambda r: r["parallel"]), ("MoE lowering", lambda r: r["moe"]),
                ("MTP drafts", lambda r: str(r["mtp_drafts"])), ("KV dtype", lambda r: r["kv_dtype"]),
                ("collective backend", lambda r: "peer+NCCL" if r["p2p"] else "NCCL"),
                ("step ms", lambda r: f"{r['step_ms']:.3f}"), ("TPOT ms", lambda r: f"{r['tpot_ms']:.3f}"),
                ("TTFT ms", lambda r: f"{r['ttft_ms']:.1f}"), ("tok/s per GPU", lambda r: f"{r['tok_s_per_gpu']:.1f}"),
                ("tok/s per user", lambda r: f"{r['tok_s_per_user']:.1f}"))


def _side_by_side(own: dict, pick: dict) -> list[str]:
    return [f"  {'':<44} {'recipe':>12} {'glmc':>12}"] + \
        [f"  {label:<44} {show(own):>12} {show(pick):>12}" for label, show in SIDE_BY_SIDE]


def render_explain(explain: dict) -> str:
    """`--explain` as text: per recipe a side-by-side table and its terms where glmc picks otherwise,
    then its sentence."""
    lines = ["", "explain: glmc's pick against SGLang's GLM-5 recipes"]
    for e in explain["recipes"]:
        slo = ", ".join(f"{k}<={v:g}" for k, v in e["slo"].items())
        lines += ["", f"{e['objective']} ({e['recipe']}): most {MEASURE_WORDS[e['measure']]} at concurrency "
                  f"{e['concurrency']}{' within ' + slo if slo else ''}"]
        if e["note"]:
            lines.append(f"  {e['note']}")
        if e["terms"]:
            lines += _side_by_side(e["recipe_row"], e["glmc_row"])
            lines.append(f"  {'per output token (ms; terms sum to TPOT)':<44} {'recipe':>12} {'glmc':>12} "
                         f"{'difference':>12}")
            lines += [f"  {t['label']:<44} {t['recipe_ms']:>12.3f} {t['glmc_ms']:>12.3f} {t['difference_ms']:>+12.3f}"
                      for t in e["terms"]]
        lines.append(f"  {e['summary']}")
    return "\n".join(lines + ["", "explain assumptions:"] + [f"- {a}" for a in explain["assumptions"]]) + "\n"
