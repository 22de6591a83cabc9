"""Tile and split-K sweep of the block-FP8 w8a8 GEMM (`codegen/triton_fp8.fp8_block_gemm`) at GLM-5.3's
shapes, against its defaults (`triton_fp8.default_config`) and torch._scaled_mm:

    bash bench/with_wheels.sh python -m bench.fp8_gemm_sweep --out-dir $OUT --budget 400   # the H200
    python -m bench.fp8_gemm_sweep --out-dir /tmp/sweep --tiny        # CPU smoke test, TRITON_INTERPRET=1

Shapes: every FP8 GEMM (N, K) the GLM-5.3 plan (tp1, CUDA target) runs, read from its kernel set
(`kernel_set.plan_kernels`: row parts joined as `cuda_target.fp8_parts` joins them), labelled from the
config. Decode (M = 1, 32, 128): microseconds per call and TB/s of the bytes it must move (weight +
its scales + activations + their scales + bf16 output), each call on another copy of the weight
(copies > ROTATE_BYTES, so L2 never holds it), calls captured in one CUDA graph and timed with CUDA
events; first each tile config with its default split count, then split counts for the best tiles.
Prefill (4096 x 6144 x 16384, 4096 x 2048 x 6144, 8192 x 6144 x 2048, the layer's shapes at M = 4096):
TFLOP/s of the tile grid next to torch._scaled_mm in the same run, rowwise scales (a cheaper recipe)
and 1x128 x 128x128 blockwise scales (this kernel's numerics, cuBLAS on sm_90 with CUDA >= 12.9).
Writes fp8_gemm_sweep.json and .md to --out-dir and prints the tables; configs past --budget are
skipped and counted. Nothing here changes a default: the lead sets them from the table.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path


DECODE_M = (1, 32, 128)
# (block_m, block_n, num_warps, num_stages), tried at every decode M whose rows they do not overshoot
DECODE_TILES = [(16, 64, 4, 3), (16, 128, 4, 3), (16, 32, 4, 3), (16, 64, 4, 5), (16, 128, 4, 4), (16, 256, 4, 3),
                (32, 64, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3)]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
PREFILL_TILES = [(128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 3), (64, 128, 4, 4), (128, 256, 8, 3),
                 (128, 128, 4, 3), (128, 64, 4, 4), (256, 128, 8, 3)]
PREFILL_SHAPES = [(4096, 6144, 16384, "issue"), (4096, 2048, 6144, "issue"), (8192, 6144, 2048, "issue")]
ROTATE_BYTES = 128 << 20   # > the H200's 50 MB L2, twice over
TINY = dict(shapes=[(160, 300, "tiny ragged"), (96, 640, "tiny")], decode_m=(1, 5), prefill=[(40, 96, 640, "tiny")],
            decode_tiles=DECODE_TILES[:2], prefill_tiles=[(32, 64, 4, 2), (16, 256, 4, 2)], splits=(1, 2, 5))


def layer_shapes(model: str = "glm_moe_dsa") -> list:
    """[(N, K, label)] of the plan's FP8 GEMMs; `moe` in the label marks those one MoE layer runs."""
    from glmc.codegen.kernel_set import plan_kernels
    from glmc.compiler import compile_plan
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.spec import load_spec, model_path, quantized
    spec = quantized(load_spec(model_path(model)), "fp8")
    c = spec.config
    h, heads = c.hidden_size, c.num_attention_heads
    names = {(c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim, h): "moe: q_a_proj+kv_a_proj_with_mqa",
             (c.index_head_dim, h): "moe: indexer.wk", (c.index_n_heads * c.index_head_dim, c.q_lora_rank):
             "moe: indexer.wq_b", (heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.q_lora_rank): "moe: q_b_proj",
             (h, heads * c.v_head_dim): "moe: o_proj", (2 * c.moe_intermediate_size, h): "moe: shared gate+up",
             (h, c.moe_intermediate_size): "moe: shared down", (2 * c.intermediate_size, h): "dense gate+up",
             (h, c.intermediate_size): "dense down / mtp eh_proj"}
    plan = compile_plan(spec, parse_parallel("tp1", c), Options(device="cuda"))
    gemms = sorted({(x.n, x.k) for x in plan_kernels(plan).values() if x.template == "fp8_block_gemm"})
    return [(n, k, names.get((n, k), "?")) for n, k in gemms]


class Clock:
    """Per-call time of a list of calls: CUDA-graph replays timed by events (GPU), wall time (CPU)."""

    def __init__(self, device):
        import torch
        self.torch, self.cuda = torch, device.type == "cuda"

    def us(self, calls, reps: int = 5) -> float:
        torch = self.torch
        for fn in calls[:2]:
            fn()                           # compiles, and raises here rather than inside a capture
        if not self.cuda:
            t = time.perf_counter()
            for fn in calls:
                fn()
            return (time.perf_counter() - t) / len(calls) * 1e6
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        graph.replay()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(calls))
        del graph
        return statistics.median(times)


class Sweep:
    """One run's operands, clock, deadline and results."""

    def __init__(self, device, budget_s, tiny):
        import torch
        from glmc.codegen import triton_fp8 as tf
        from glmc.codegen.triton_render import sm_count
        self.torch, self.tf, self.dev, self.tiny = torch, tf, device, tiny
        self.clock, self.sms = Clock(device), sm_count(device)
        self.t0, self.budget = time.perf_counter(), budget_s
        self.skipped = {"decode": 0, "prefill": 0}
        self.decode, self.prefill = [], []

    def left(self, until: float) -> bool:
        return time.perf_counter() - self.t0 < self.budget * until

    def operands(self, m, n, k, copies=1):
        torch, tf = self.torch, self.tf
        from glmc.codegen.fp8_ref import Fp8Weight
        g = torch.Generator(device=self.dev).manual_seed(n * 7 + k)
        w = Fp8Weight.quantize(torch.randn(n, k, device=self.dev, generator=g) * k ** -0.5)
        ws = [w] + [Fp8Weight(w.q.clone(), w.scale_inv.clone()) for _ in range(copies - 1)]
        xq, xs = tf.quantize_tokens(torch.randn(m, k, device=self.dev, generator=g))
        return ws, xq, xs

    def output(self, w, xq, xs, tiles=None):
        return self.tf.fp8_block_gemm(xq, xs, w.q, w.scale_inv, **(tiles or {})).float()

    def measure(self, rows, base, ws, xq, xs, tiles, calls, ref):
        """Append {base, tiles, us per call, rel_err against ref} to rows (or the error) -> the row.
        The calls cycle through the weight copies, two outputs taking turns."""
        m, n = xq.shape[0], ws[0].shape[0]
        outs = [self.torch.empty(m, n, dtype=self.torch.bfloat16, device=self.dev) for _ in range(2)]
        fns = [lambda w=ws[i % len(ws)], o=outs[i % 2]: self.tf.fp8_block_gemm(xq, xs, w.q, w.scale_inv, out=o,
                                                                                **tiles) for i in range(calls)]
        row = {**base, "tiles": tiles, "config": config(self, m, n, xq.shape[1], tiles)}
        try:
            err = float((self.output(ws[0], xq, xs, tiles) - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            row.update(us=self.clock.us(fns), rel_err=err)
        except Exception as e:   # out of shared memory / registers: recorded, not fatal
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        return row


def parse_tiles(text: str) -> tuple:
    """'128x64w4s3' -> (128, 64, 4, 3)."""
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", text.strip())
    if not m:
        raise SystemExit(f"--tiles: {text!r} is not of the form 128x64w4s3")
    return tuple(int(x) for x in m.groups())


def tiles_of(t):
    return dict(zip(("block_m", "block_n", "num_warps", "num_stages"), t))


def tile_key(c) -> tuple:
    return c["block_m"], c["block_n"], c["num_warps"], c["num_stages"]


def is_default(s: Sweep, base, t) -> bool:
    """Whether tiles `t` (with the default split rule) are what the default launch already measured."""
    return tile_key(s.tf.default_config(base["M"], base["N"], base["K"], s.sms)) == tuple(t)


def config(s: Sweep, m, n, k, tiles) -> dict:
    """The launch fp8_block_gemm makes for `tiles` (overrides, maybe empty), split count resolved."""
    tf = s.tf
    full = {**tf.default_config(m, n, k, s.sms), **tiles}
    if "splits" not in tiles:
        full["splits"] = tf.fp8_split_count(m, n, k, full["block_m"], full["block_n"], s.sms)
    full["splits"] = tf.even_splits(-(-k // 128), full["splits"])
    programs = -(-m // full["block_m"]) * -(-n // full["block_n"]) * full["splits"]
    return {**full, "programs": programs, "waves": round(programs / s.sms, 2)}


def sweep_decode(s: Sweep, shapes, ms, grid, splits_grid, until):
    """Stage 1: each (shape, M) at its default, then every tile config (default splits), config-major
    so each config reaches every shape before the budget runs out. Stage 2: split counts for the two
    best tile configs of each case."""
    cases = []
    for case in decode_cases(s, shapes, ms):
        base, ws, xq, xs, calls, ref = case
        cases.append(case)
        row = s.measure(s.decode, base, ws, xq, xs, {}, calls, ref)
        row["default"] = True   # the baseline
        if not s.tiny:          # cuBLAS on the same operands, for reference (L2 may hold its one weight)
            row["scaled_mm"] = scaled_mm_rows(s, base, ws[0], xq, xs, ref)
    for t in grid:
        for base, ws, xq, xs, calls, ref in cases:
            if t[0] > max(16, 2 * base["M"]) or is_default(s, base, t):
                continue                       # tiles far taller than the rows waste MMA rows
            if not s.left(until * 0.75):
                s.skipped["decode"] += 1
                continue
            s.measure(s.decode, base, ws, xq, xs, tiles_of(t), calls, ref)
    for base, ws, xq, xs, calls, ref in cases:
        mine = [r for r in s.decode if r.get("us") and "splits" not in r["tiles"]
                and (r["N"], r["K"], r["M"]) == (base["N"], base["K"], base["M"])]
        for r in sorted(mine, key=lambda r: r["us"])[:2]:
            measure_splits(s, (base, ws, xq, xs, calls, ref), tile_key(r["config"]), splits_grid, until,
                           tried={r["config"]["splits"]})
    set_tbps(s.decode)


def measure_splits(s: Sweep, case, t, splits_grid, until, tried=()) -> None:
    """Tile config `t` on one (shape, M) case at each split count of splits_grid, each count the launch
    resolves to (`config`) once and none of `tried`; past the budget, counted as skipped."""
    base, ws, xq, xs, calls, ref = case
    tried = set(tried)
    for sp in splits_grid:
        tiles = {**tiles_of(t), "splits": sp}
        used = config(s, base["M"], base["N"], base["K"], tiles)["splits"]
        if used in tried:
            continue
        tried.add(used)
        if not s.left(until):
            s.skipped["decode"] += 1
            continue
        s.measure(s.decode, base, ws, xq, xs, tiles, calls, ref)


def decode_cases(s: Sweep, shapes, ms, **mark):
    """(base row, weight copies, xq, xs, calls, fp32 reference) of each (shape, M), shape by shape: one
    shape's operands (copies past ROTATE_BYTES, so L2 never holds a weight) serve all its Ms; `mark`
    goes into every base row."""
    for n, k, label in shapes:
        copies = 1 if s.tiny else max(1, min(256, -(-ROTATE_BYTES // (n * k))))
        ws, xq, xs = s.operands(max(ms), n, k, copies)
        for m in ms:
            moved = ws[0].q.nbytes + ws[0].scale_inv.nbytes + xq[:m].nbytes + xs[:m].nbytes + 2 * m * n
            base = {"label": label, "N": n, "K": k, "M": m, "bytes": moved, "copies": copies, **mark}
            calls, ref = 2 if s.tiny else max(copies, 20), s.output(ws[0], xq[:m], xs[:m])
            yield base, ws, xq[:m], xs[:m], calls, ref


def set_tbps(rows) -> None:
    for r in rows:
        r["tbps"] = r.get("us") and r["bytes"] / r["us"] / 1e6


def sweep_grid(s: Sweep, shapes, ms, grid, splits_grid, until):
    """Every (shape, M, tiles, splits) of the product, into s.decode (rows marked grid=True): the
    dense table a split rule is chosen from (stage 2 of sweep_decode only splits the two best)."""
    for case in decode_cases(s, shapes, ms, grid=True):
        for t in grid:
            measure_splits(s, case, t, splits_grid, until)
    set_tbps(s.decode)


def scaled_mm_rows(s: Sweep, base, w, xq, xs, ref):
    """torch._scaled_mm on the same e4m3 operands: rowwise (unit scales) and 1x128 x 128x128 blockwise."""
    torch, out = s.torch, {}
    m, n = xq.shape[0], w.shape[0]
    recipes = {"rowwise": (torch.ones(m, 1, device=s.dev), torch.ones(1, n, device=s.dev)),
               "blockwise": (xs.t().contiguous().t(), w.scale_inv.t())}
    for name, (sa, sb) in recipes.items():
        def fn(sa=sa, sb=sb):
            return torch._scaled_mm(xq, w.q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        try:
            y = fn().float()
            us = s.clock.us([fn] * 3)
            err = float((y - ref).abs().max() / ref.abs().max()) if name == "blockwise" else None
            out[name] = {"us": us, "tflops": 2 * m * n * base["K"] / us / 1e6, "rel_err": err}
        except Exception as e:   # not every build / GPU has every recipe
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def sweep_prefill(s: Sweep, shapes, grid, until):
    cases = []
    for m, n, k, label in shapes:
        ws, xq, xs = s.operands(m, n, k)
        base = {"label": label, "M": m, "N": n, "K": k, "flop": 2 * m * n * k}
        ref = s.output(ws[0], xq, xs)
        row = s.measure(s.prefill, base, ws, xq, xs, {}, 3, ref)
        row.update(default=True, scaled_mm=scaled_mm_rows(s, base, ws[0], xq, xs, ref))
        cases.append((base, ws, xq, xs, ref))
    for t in grid:
        for base, ws, xq, xs, ref in cases:
            if is_default(s, base, t):
                continue
            if not s.left(until):
                s.skipped["prefill"] += 1
                continue
            s.measure(s.prefill, base, ws, xq, xs, tiles_of(t), 3, ref)
    for r in s.prefill:
        r["tflops"] = r.get("us") and r["flop"] / r["us"] / 1e6


# ----------------------------------------------------------------------------- report
def cfg(c) -> str:
    """16x64 w4 s3 k/2: tiles, warps, stages and (when known) the split count."""
    tail = f" k/{c['splits']}" if "splits" in c else ""
    return f"{c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']}{tail}"


def best_of(rows, key):
    """{case: (default row, fastest row)} over rows grouped by `key`."""
    out = {}
    for r in rows:
        if r.get("us"):
            d, b = out.get(key(r), (None, None))
            out[key(r)] = (r if r.get("default") else d, r if b is None or r["us"] < b["us"] else b)
    return out


def uniform_best(rows, key, case) -> dict:
    """Per `key` group: the one tile config (splits by default_config's rule) with the least total time
    over every case of the group, among configs measured on all of them; and the defaults' total."""
    out = {}
    for group in sorted({key(r) for r in rows}):
        mine = [r for r in rows if key(r) == group and r.get("us") and "splits" not in r["tiles"]]
        totals = {}
        for r in mine:
            t = totals.setdefault(tile_key(r["config"]), [0.0, set()])
            t[0] += r["us"]
            t[1].add(case(r))
        full = [(us, tiles) for tiles, (us, seen) in totals.items() if seen == {case(r) for r in mine}]
        if full:
            us, tiles = min(full)
            out[group] = {"tiles": tiles_of(tiles), "total_us": us,
                          "default_total_us": sum(r["us"] for r in mine if r.get("default"))}
    return out


def markdown(s: Sweep, info) -> str:
    lines = [f"# FP8 block GEMM sweep ({info['device']}, {info['date']}, {s.sms} SMs)", "",
             f"copy bandwidth {info['copy_tbps']:.2f} TB/s (read + write); budget {s.budget:.0f} s, "
             f"used {info['total_s']:.0f} s; skipped configs (budget): {s.skipped}", "",
             "## Decode (TB/s of weight + scales + activations + output; L2 defeated)", "",
             "| weight | N x K | M | default | us | TB/s | best | us | TB/s | speed-up | cuBLAS blockwise us |",
             "|" + "---|" * 11]
    dec = best_of(s.decode, lambda r: (r["N"], r["K"], r["M"]))
    for (n, k, m), (d, b) in dec.items():
        dd = f"{cfg(d['config'])} | {d['us']:.1f} | {d['tbps']:.2f}" if d else "- | - | -"
        gain = f"{d['us'] / b['us']:.2f}x" if d else "-"
        cub = ((d or {}).get("scaled_mm") or {}).get("blockwise", {}).get("us")
        lines.append(f"| {b['label']} | {n}x{k} | {m} | {dd} | {cfg(b['config'])} (waves {b['config']['waves']}) "
                     f"| {b['us']:.1f} | {b['tbps']:.2f} | {gain} | {f'{cub:.1f}' if cub else '-'} |")
    lines += ["", "One MoE layer's FP8 GEMMs (the `moe:` rows), summed: default vs per-shape best", ""]
    for m in sorted({m for _, _, m in dec}):
        pairs = [v for (n, k, mm), v in dec.items() if mm == m and v[0] and v[1]["label"].startswith("moe")]
        if pairs:
            d, b = sum(p[0]["us"] for p in pairs), sum(p[1]["us"] for p in pairs)
            lines.append(f"- M = {m}: default {d:.1f} us, best {b:.1f} us ({d / b:.2f}x)")
    lines += ["", "Best single tile config per M (default split rule), total over all shapes:", ""]
    for m, u in uniform_best(s.decode, lambda r: r["M"], lambda r: (r["N"], r["K"])).items():
        lines.append(f"- M = {m}: {cfg(u['tiles'])}: {u['total_us']:.1f} us (defaults {u['default_total_us']:.1f} us)")
    lines += ["", "## Prefill (TFLOP/s) next to torch._scaled_mm (same run, same e4m3 operands)", "",
              "| M x N x K | label | default | TFLOP/s | best | TFLOP/s | rowwise | blockwise | best/rowwise "
              "| best/blockwise |", "|" + "---|" * 10]
    for (m, n, k), (d, b) in best_of(s.prefill, lambda r: (r["M"], r["N"], r["K"])).items():
        sm = (d or {}).get("scaled_mm", {})
        rw, bw = (sm.get(x, {}).get("tflops") for x in ("rowwise", "blockwise"))
        f = lambda v: f"{v:.0f}" if v else "-"  # noqa: E731
        ratio = lambda ref: f"{b['tflops'] / ref:.2f}" if ref else "-"  # noqa: E731
        dd = f"{cfg(d['config'])} | {f(d['tflops'])}" if d else "- | -"
        lines.append(f"| {m}x{n}x{k} | {b['label']} | {dd} | {cfg(b['config'])} | {f(b['tflops'])} | {f(rw)} "
                     f"| {f(bw)} | {ratio(rw)} | {ratio(bw)} |")
    lines += ["", "Best single prefill tile config, total over all prefill shapes:", ""]
    for _, u in uniform_best(s.prefill, lambda r: 0, lambda r: (r["M"], r["N"], r["K"])).items():
        lines.append(f"- {cfg(u['tiles'])}: {u['total_us']:.0f} us (default {u['default_total_us']:.0f} us)")
    bad = [r for r in s.decode + s.prefill if r.get("rel_err", 0) > 2e-2]
    errors = [r for r in s.decode + s.prefill if "error" in r]
    lines += ["", f"{len(bad)} configs disagree with the default's output by > 2% (a bug if any); "
              f"{len(errors)} configs failed to run" + (f", e.g. {errors[0]['tiles']}: {errors[0]['error']}"
                                                       if errors else "")]
    return "\n".join(lines) + "\n"


def copy_tbps(s: Sweep) -> float:
    torch = s.torch
    a = torch.empty((1 << 28) if not s.tiny else 1 << 16, dtype=torch.float32, device=s.dev)
    b = torch.empty_like(a)
    return 2 * a.nbytes / s.clock.us([lambda: b.copy_(a)] * 4) / 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--budget", type=float, default=400, help="seconds for the whole run; configs past it are skipped")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1 (smoke test)")
    ap.add_argument("--decode-m", default=None, help="comma list of decode row counts (default 1,32,128)")
    ap.add_argument("--tiles", default="", help="extra decode tiles, e.g. 128x64w4s3,64x128w8s4")
    ap.add_argument("--no-prefill", action="store_true", help="the decode sweep only")
    ap.add_argument("--grid", default="", help="tiles for a dense tiles x --grid-splits table at --decode-m "
                    "(e.g. 64x64w4s3,64x128w4s4): replaces the decode and prefill sweeps")
    ap.add_argument("--grid-splits", default="1,2,3,4,6,8")
    a = ap.parse_args()
    if a.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    device = torch.device("cpu" if a.tiny else "cuda")
    s = Sweep(device, a.budget, a.tiny)
    shapes = layer_shapes()
    info = {"device": "cpu-interpreter" if a.tiny else torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": os.environ.get("GLMC_COMMIT", "unknown"),
            "sms": s.sms, "layer_shapes": shapes, "copy_tbps": copy_tbps(s)}
    print(f"{info['device']}: {len(shapes)} FP8 GEMM shapes: {shapes}", flush=True)
    if a.tiny:
        shapes, ms, prefill = TINY["shapes"], TINY["decode_m"], TINY["prefill"]
        decode_grid, prefill_grid, splits = TINY["decode_tiles"], TINY["prefill_tiles"], TINY["splits"]
    else:
        ms, decode_grid, prefill_grid, splits = DECODE_M, DECODE_TILES, PREFILL_TILES, SPLITS
    if a.decode_m:
        ms = tuple(int(x) for x in a.decode_m.split(","))
    decode_grid = list(decode_grid) + [parse_tiles(t) for t in a.tiles.split(",") if t]
    if a.no_prefill:
        prefill = []
        prefill = PREFILL_SHAPES + [(4096, n, k, label) for n, k, label in shapes
                                    if (4096, n, k) not in {p[:3] for p in PREFILL_SHAPES}]
    if a.grid:
        sweep_grid(s, shapes, ms, [parse_tiles(t) for t in a.grid.split(",")],
                   [int(x) for x in a.grid_splits.split(",")], until=0.97)
        prefill = []
    else:
        sweep_decode(s, shapes, ms, decode_grid, splits, until=0.5 if prefill else 0.97)
    torch.cuda.empty_cache() if device.type == "cuda" else None
    sweep_prefill(s, prefill, prefill_grid, until=0.97)
    info["total_s"] = time.perf_counter() - s.t0
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = markdown(s, info)
    (out / "fp8_gemm_sweep.json").write_text(json.dumps({"info": info, "skipped": s.skipped, "decode": s.decode,
                                                         "prefill": s.prefill}, indent=1, default=str))
    (out / "fp8_gemm_sweep.md").write_text(report)
    print(report)
    print(f"wrote {out / 'fp8_gemm_sweep.json'} and {out / 'fp8_gemm_sweep.md'}")


if __name__ == "__main__":
    main()
