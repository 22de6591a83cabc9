"""`glmc plan`'s outputs: the Pareto front as a text table and as an SVG chart (written by hand:
log-log axes, every priced row a grey dot, the front a red line of labelled dots)."""
from __future__ import annotations

import math


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
