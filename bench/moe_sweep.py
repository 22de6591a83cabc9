"""Tile and split-K sweep of the routed-expert kernels (`triton_moe.moe_experts`, `moe_experts_fp8`) at
GLM-5.3's expert shapes, per token count: how far from the byte floor the defaults are, and which
(block_n, block_k, num_warps, num_stages, splits) per stage is fastest.

    bash bench/with_wheels.sh python -m bench.moe_sweep --out-dir $OUT --budget 300    # the H200
    python -m bench.moe_sweep --tiny --out-dir /tmp/moe_sweep                              # CPU smoke

Shapes: 256 experts, hidden 6144, intermediate 2048, top-8; every expert's weights are allocated
(bf16: 19.3 GB, FP8: 9.7 GB + scales) so the ones a step touches are never in L2; random weights and
a fixed-seed random routing (distinct experts per token, as the router gives) per T in 1, 2, 4, 8,
32, 128. Each point is the whole op (align_rows, both stages, the split-K reduction, the combine; FP8:
the activation quantiser too) timed as CUDA-graph replays of several calls, median of 5, as decode
runs it. Bytes = the distinct experts touched (their weights, FP8 scales included) + x and the fp32
output; TB/s against HBM_TBPS (the H200's 4.8 TB/s): `x floor` = time / (bytes / 4.8 TB/s).

Search per (dtype, T): from the defaults (`moe_launch` + the contexts' `make`, written out in full), one
stage at a time (gate/up, then down), one step of SEARCH_STEPS at a time over the grid (splits x block_n
jointly, then block_k [bf16], num_warps, num_stages, splits again), keeping a change when it is >= 1%
faster and its output matches the default's (max |diff| / max |default| <= MAX_REL_DIFF). The full
cross product is ~10^3 points per stage; this walks ~30. Triton compiles each tile context once (row
and split counts are not specialised), so later T reuse the binaries. Each (dtype, T) gets its
CASE_WEIGHT share of what is left of --budget (T = 1 and 2 first and most); a search cut short, or a
case not reached, says so in the table. --tiny: 8 experts, hidden 256, inter 128, top-2,
T = 1, 2, a two-value grid, under TRITON_INTERPRET=1 on the CPU (wall time: checks the script only).
Writes moe_sweep.json (every point) and moe_sweep.md (the table) to --out-dir, and prints the table.

--padding (instead of the sweep): the op at padded steps (PADDED: real tokens, step rows), its padding
tokens (one token's route) dropped as the runtime drops them (`pad=`) against run as before: us and
experts touched each way (moe_sweep_padding.json).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

HBM_TBPS = 4.8          # H200 HBM3e peak, the issue's floor
MAX_REL_DIFF = 2e-2     # a config whose output differs more from the default's is rejected (bug, not speed)
MIN_GAIN = 0.01         # a change is kept when it is at least this much faster
FULL = dict(experts=256, hidden=6144, inter=2048, top_k=8, tokens=(1, 2, 4, 8, 32, 128),
            grid={"splits": (1, 2, 4, 8), "block_n": (16, 32, 64, 128), "block_k": (64, 128, 256),
                  "num_warps": (2, 4, 8), "num_stages": (2, 3, 4, 5, 6)})
TINY = dict(experts=8, hidden=256, inter=128, top_k=2, tokens=(1, 2),
            grid={"splits": (1, 2), "block_n": (32, 64), "block_k": (64,), "num_warps": (4,), "num_stages": (3,)})
# one stage's parameters searched jointly per step, in this order (splits x block_n: split K and narrower
# tiles are two ways to the same parallelism, and the FP8 gate/up tile may only narrow once split)
SEARCH_STEPS = (("splits", "block_n"), ("block_k",), ("num_warps",), ("num_stages",), ("splits",))
CASE_WEIGHT = {1: 3, 2: 2}   # budget shares: decode's T = 1, 2 first (compiles are paid by the first cases)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--budget", type=float, default=300, help="seconds for the whole run (default 300)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--padding", action="store_true", help="instead of the sweep: padding tokens dropped "
                    "(pad=) against run, at PADDED steps (moe_sweep_padding.json)")
    return ap.parse_args()


def make_weights(shape, dtype, dev, seed):
    """gate, up [E, I, H] and down [E, H, I]: bf16 tensors, or FP8 (random e4m3 values, scales ~ 1/sqrt(K))."""
    import torch
    from glmc.codegen.fp8_ref import Fp8Weight
    E, hidden, inter = shape["experts"], shape["hidden"], shape["inter"]
    g = torch.Generator(device=dev).manual_seed(seed)
    out = []
    for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)):
        w = torch.randn(E, n, k, device=dev, generator=g, dtype=torch.bfloat16)
        if dtype == "bf16":
            out.append(w * k ** -0.5)
            continue
        scales = torch.full((E, -(-n // 128), -(-k // 128)), k ** -0.5, device=dev)
        out.append(Fp8Weight(w.to(torch.float8_e4m3fn), scales))
        del w
    return out


def routing(T, shape, dev, seed):
    """Fixed-seed routing: top_k distinct experts per token, normalised weights."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed + T)
    ids = torch.rand(T, shape["experts"], generator=g).topk(shape["top_k"], dim=1).indices
    w = torch.rand(T, shape["top_k"], generator=g) + 0.1
    return (w / w.sum(1, keepdim=True)).to(dev), ids.to(dev)


def moved_bytes(weights, ids, T, shape) -> int:
    """Weights of the distinct experts touched (FP8: q + scales) + x (bf16) + the fp32 output."""
    E = shape["experts"]
    per_expert = sum(w.nbytes for w in weights) // E
    return int(ids.unique().numel()) * per_expert + T * shape["hidden"] * (2 + 4)


def time_us(fn, dev) -> float:
    """Median us per call: CUDA-graph replays of n calls (n ~ 4 ms of work), 5 replays; CPU: wall time of one."""
    import torch
    if dev == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    n = max(2, min(50, round(4.0 / max(start.elapsed_time(end), 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    del graph
    return statistics.median(times)


class Case:
    """One (dtype, T): its inputs, the default's output, and every point timed."""

    def __init__(self, dtype, T, shape, weights, dev, floor_tbps):
        import torch
        from glmc.codegen import triton_moe as tm
        self.dtype, self.T, self.dev, self.tm = dtype, T, dev, tm
        self.run_fn = tm.moe_experts_fp8 if dtype == "fp8" else tm.moe_experts
        self.weights = weights
        self.w, self.ids = routing(T, shape, dev, seed=1)
        self.x = torch.randn(T, shape["hidden"], device=dev, dtype=torch.bfloat16)
        self.bytes = moved_bytes(weights, self.ids, T, shape)
        self.floor_us = self.bytes / (floor_tbps * 1e12) * 1e6
        self.touched = int(self.ids.unique().numel())
        self.want = None
        self.points: list[dict] = []

    def run(self, tiles):
        return self.run_fn(self.x, self.ids, self.w, *self.weights, tiles=tiles)

    def measure(self, tiles) -> dict:
        """Time one tiles dict; errors (a tile that does not fit, a bad combination) are recorded."""
        point = {"tiles": tiles}
        try:
            got = self.run(tiles).float()
            if self.want is None:
                self.want = got
            diff = float((got - self.want).abs().max() / self.want.abs().max().clamp_min(1e-30))
            point["rel_diff"] = diff
            if diff > MAX_REL_DIFF:
                point["error"] = f"output differs from the default's by {diff:.2e}"
            else:
                point["us"] = time_us(lambda: self.run(tiles), self.dev)
                point["tbps"] = self.bytes / point["us"] / 1e6
                point["x_floor"] = point["us"] / self.floor_us
        except Exception as e:   # out of shared memory, an invalid FP8 tile, ...
            point["error"] = f"{type(e).__name__}: {e}"[:200]
        self.points.append(point)
        return point


def default_tiles(case: Case) -> dict:
    """The default launch written out in full: `moe_launch`'s splits and each stage context's tiles."""
    tm, E, hidden, inter = case.tm, case.weights[0].shape[0], case.x.shape[1], case.weights[0].shape[1]
    fp8 = case.dtype == "fp8"
    launch = tm.moe_launch(case.ids.numel(), E, hidden, inter, _sms(case.dev), fp8=fp8)
    ctx_cls = tm.MoeExpertsFp8Ctx if fp8 else tm.MoeExpertsCtx
    out = {}
    for stage, down, n_in, n_out in (("gate_up", False, hidden, inter), ("down", True, inter, hidden)):
        splits = launch[stage]["splits"]
        ctx = ctx_cls.make(down, n_in, n_out, case.ids.shape[1], case.x.dtype, launch["block_m"], splits > 1)
        out[stage] = {"splits": splits, "block_n": ctx.block_n, "num_warps": ctx.num_warps,
                      "num_stages": ctx.num_stages, **({} if fp8 else {"block_k": ctx.block_k})}
    return out


def search(case: Case, grid: dict, deadline: float) -> tuple[dict, dict]:
    """Coordinate search from the defaults (module docstring); -> (the default's point, the best)."""
    default = best = case.measure({})
    if "us" not in best:
        return default, best
    default["tiles"] = current = default_tiles(case)
    for stage in ("gate_up", "down"):
        for params in SEARCH_STEPS:
            if "block_k" in params and case.dtype == "fp8":
                continue                   # FP8 K steps are the 128-wide scale blocks
            for values in itertools.product(*(grid[p] for p in params)):
                if time.perf_counter() > deadline:
                    best["note"] = "(search cut short by the budget)"
                    return default, best
                trial = {s: dict(t) for s, t in current.items()}
                trial[stage].update(zip(params, values))
                if trial == current:
                    continue
                point = case.measure(trial)
                if "us" in point and point["us"] < best["us"] * (1 - MIN_GAIN):
                    best, current = point, trial
    return default, best


def _sms(dev) -> int:
    import torch
    from glmc.codegen.triton_render import sm_count
    return sm_count(torch.device(dev))


def align_us(case: Case) -> dict:
    """align_rows alone (the sort by expert every call starts with): as the op runs it (one moe_align
    launch at decode sizes) and as torch ops."""
    tm, E = case.tm, case.weights[0].shape[0]
    bm = tm.block_m_for(case.ids.numel(), E)
    return {"op": time_us(lambda: tm.align_rows(case.ids, E, bm, lib=tm.JIT), case.dev),
            "torch": time_us(lambda: tm.align_rows(case.ids, E, bm), case.dev)}


# (real tokens, padded step): a one-GPU decode bucket (3 -> 4, 5 -> 8, 13 -> 16) and tp8's batch 1 (1 -> 8)
PADDED = ((3, 4), (5, 8), (13, 16), (1, 8))


def padding_rows(shape, weights, dev) -> list[dict]:
    """The op at each PADDED step with its padding tokens (one token's route, as a step's padding rows
    all are) dropped (`pad=`, what the runtime passes) and run (pad=None): us, experts touched, floor."""
    import torch
    from glmc.codegen import triton_moe as tm
    rows = []
    for dtype, (real, T) in itertools.product(("bf16", "fp8"), PADDED):
        w, ids = routing(T, shape, dev, seed=1)
        ids[real:] = ids[real]                                  # padding: one token's route
        slot = 1 << 20
        loc = torch.where(torch.arange(T, device=dev) < real, torch.arange(T, device=dev), slot)
        x = torch.randn(T, shape["hidden"], device=dev, dtype=torch.bfloat16)
        fn = tm.moe_experts_fp8 if dtype == "fp8" else tm.moe_experts
        row = {"dtype": dtype, "real": real, "T": T}
        for name, pad, touched in (("dropped", (loc, slot), ids[:real]), ("run", None, ids)):
            b = moved_bytes(weights[dtype], touched, T, shape)
            us = time_us(lambda pad=pad: fn(x, ids, w, *weights[dtype], pad=pad), dev)
            row[name] = {"us": us, "touched": int(touched.unique().numel()), "floor_us": b / (HBM_TBPS * 1e12) * 1e6}
        rows.append(row)
        print(f"padding {dtype} {real} real of {T}: dropped {row['dropped']['us']:.1f} us "
              f"({row['dropped']['touched']} experts), run {row['run']['us']:.1f} us ({row['run']['touched']})",
              flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| dtype | T | experts touched | MB moved | floor us | align_rows us (torch ops) | default us "
            "| default TB/s | default x floor | best us | best TB/s | best x floor | best tiles |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['dtype']} | {r['T']} | | | | | | | | | | | {r['skipped']} |")
            continue
        d, b = r["default"], r["best"]

        def f(p, key, fmt):
            return format(p[key], fmt) if key in p else p.get("error", "-")[:40]
        lines.append(f"| {r['dtype']} | {r['T']} | {r['touched']} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.1f} "
                     f"| {r['align_us']['op']:.1f} ({r['align_us']['torch']:.1f}) | {f(d, 'us', '.1f')} "
                     f"| {f(d, 'tbps', '.2f')} | {f(d, 'x_floor', '.2f')} "
                     f"| {f(b, 'us', '.1f')} | {f(b, 'tbps', '.2f')} | {f(b, 'x_floor', '.2f')} "
                     f"| `{json.dumps(b.get('tiles'))}`{' ' + b['note'] if 'note' in b else ''} |")
    return "\n".join(lines)


def write(out: Path, meta: dict, rows: list, points: list) -> str:
    """moe_sweep.json and moe_sweep.md (after every case: a crash keeps what was measured); -> the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_sweep.json").write_text(json.dumps({"meta": meta, "rows": rows, "points": points}, indent=1))
    md = (f"# MoE experts sweep ({meta['device']}, {meta['sms']} SMs, commit {meta['commit']})\n\n"
          f"Floor: bytes moved / {HBM_TBPS} TB/s (x floor = {HBM_TBPS} TB/s / achieved TB/s). Default = "
          f"`moe_launch` + the contexts' `make`; best = the coordinate search's (tiles per stage).\n\n" + table(rows))
    (out / "moe_sweep.md").write_text(md + "\n")
    return md


def main():
    a = parse_args()
    if a.tiny:
        os.environ["TRITON_INTERPRET"] = "1"       # before triton is imported
    import torch
    t_end = time.perf_counter() + a.budget
    shape = TINY if a.tiny else FULL
    dev = "cpu" if a.tiny else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("moe_sweep: no CUDA device (use --tiny for the CPU smoke run)")
    out = Path(a.out_dir)
    meta = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (TRITON_INTERPRET=1)",
            "sms": _sms(dev), "shape": {k: v for k, v in shape.items() if k != "grid"}, "grid": shape["grid"],
            "hbm_tbps": HBM_TBPS, "commit": os.environ.get("GLMC_COMMIT", "unknown"), "budget_s": a.budget}
    weights = {dtype: make_weights(shape, dtype, dev, seed=0) for dtype in ("bf16", "fp8")}
    if a.padding:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "moe_sweep_padding.json"
        path.write_text(json.dumps({"meta": meta, "rows": padding_rows(shape, weights, dev)}, indent=1))
        print(f"wrote {path}")
        return
    cases = [(T, dtype) for T in shape["tokens"] for dtype in ("bf16", "fp8")]
    rows, points = [], []
    for i, (T, dtype) in enumerate(cases):
        left = t_end - time.perf_counter()
        if left <= 0:
            rows.append({"dtype": dtype, "T": T, "skipped": "skipped: out of --budget"})
            continue
        case = Case(dtype, T, shape, weights[dtype], dev, HBM_TBPS)
        share = CASE_WEIGHT.get(T, 1) / sum(CASE_WEIGHT.get(t, 1) for t, _ in cases[i:])
        default_point, best = search(case, shape["grid"], time.perf_counter() + left * share)
        row = {"dtype": dtype, "T": T, "touched": case.touched, "bytes": case.bytes, "floor_us": case.floor_us,
               "align_us": align_us(case), "default": default_point, "best": best,
               "points": len(case.points), "case_s": time.perf_counter() - (t_end - left)}
        rows.append(row)
        points += [{"dtype": dtype, "T": T, **p} for p in case.points]
        print(table([row]).splitlines()[-1], flush=True)
        write(out, meta, rows, points)
    print(write(out, meta, rows, points))


if __name__ == "__main__":
    main()
