"""FP8 decode of the GLM-5.3-width slice against glmc bf16 and the FP8 roofline, and the FP8 kernels
alone. One command, one run (~4-6 min on an H200; --budget bounds it):

    python -m bench.fp8_decode_bench --out-dir $OUT --commit <git sha>    # CUDA (the H200)
    python -m bench.fp8_decode_bench --cpu                                # CPU dry run: narrow, tiny M, no graphs

Slice and traffic as bench/decode_bench.py (2 layers at GLM-5.3 width, random bf16 weights, router bias
zero, fresh random tokens every step, context --ctx for every request), run twice with the plan's kernel
tiles (no MoE tile sweep for either):
- glmc bf16: bf16 weights, bf16 KV (decode_bench's baseline);
- glmc FP8: the weights quantised to block FP8 on load (e4m3 + a fp32 scale per 128 x 128), FP8 KV
  (656-byte latent rows, 132-byte indexer rows).
Per batch (1, 32, 128): each one's CUDA-graph replay, and its roofline = bytes that must move (the
weights each op reads as held, incl. FP8 block scales; the experts the step touches; the KV and indexer
rows read, in the pool's format) / device-to-device copy bandwidth measured in this run. Targets (the
issue): FP8 within 1.25x of the FP8 roofline at batch 32 and 128, 1.4x at batch 1.

Kernel table: the FP8 block GEMM (`triton_fp8.fp8_block_gemm`, activations already quantised) on every
distinct FP8 weight the slice's decode runs (as the op table joins them), at M = 1, 32, 128: TB/s of
weight + activation bytes; the FP8 MoE kernel (`triton_moe.moe_experts_fp8`, random routing) at the same
M; and at prefill shapes (M x N x K = 4096 x 6144 x 16384, 8192^3, the slice's linears at M = 4096)
TFLOP/s of the block GEMM next to `torch._scaled_mm` on the same e4m3 operands, measured here: rowwise
scales (fp32 [M, 1] and [1, N], bf16 out), else per-tensor scales; an error is recorded, not fatal. The
issue's target: the block GEMM at >= 50% of `_scaled_mm`. Nothing here tunes a kernel.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from pathlib import Path

from bench import common
from bench import decode_bench as db

PREFILL_SHAPES = [(4096, 6144, 16384, "a GLM-5.3 prefill GEMM"), (8192, 8192, 8192, "square")]
TARGET = {1: 1.4}   # x FP8 roofline; other batches 1.25


# ----------------------------------------------------------------------------- the two glmc runs
def run_variant(model, weights, stacks, batches, ctx, dev, dtype, fp8, info, deadline):
    """Plan, runner, prefill, capture, replay per batch (decode_bench.measure_glmc) -> {B: result}."""
    import torch
    key, t = ("fp8" if fp8 else "bf16"), common.now()
    plan = common.glmc_plan(model, max(batches), "float32" if dtype == torch.float32 else "bfloat16", fp8=fp8,
                        kv_dtype="fp8" if fp8 else "bf16")
    runner = common.gpu_runner(plan, weights, dev, max(batches), ctx + 64, stacks=stacks)
    table = common.req_table(max(batches), (ctx + 64) // 64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, plan.config.vocab_size, (ctx,), generator=g).tolist() for _ in range(max(batches))]
    common.prefill(runner, prompts, table, group=max(1, 16384 // ctx))
    info[f"{key}_setup_s"] = common.now() - t
    if dev == "cuda":
        t = common.now()
        runner.capture(batches)
        info[f"{key}_capture_s"] = common.now() - t
    res = {B: {} for B in batches}
    db.measure_glmc(runner, table, prompts, batches, ctx, res, info, deadline)
    info[f"{key}_weights"], info[f"{key}_kv"] = plan.weight_formats["linear_weights"], plan.dtypes.kv_cache
    return res, runner


# ----------------------------------------------------------------------------- kernels alone
def fp8_matrices(runner) -> dict:
    """{label: Fp8Weight} of every distinct FP8 GEMM weight the decode graph runs, joined as the CUDA
    target joins row parts (`cuda_target.fp8_parts`); labels without the layer number, one per shape."""
    import re

    from glmc.codegen.cuda_target import fp8_parts
    from glmc.codegen.fp8_ref import Fp8Weight
    out, shapes = {}, set()
    for op in runner.graphs["decode"].ops:
        w = op.attr("weight")
        if op.kind == "mlp.swiglu":
            groups = [(f"{w}.gate_proj.weight", f"{w}.up_proj.weight"), (f"{w}.down_proj.weight",)]
        elif op.kind in ("linear", "mla.a_proj"):
            groups = [w if isinstance(w, tuple) else (w,)]
        else:
            continue
        for names in groups:
            ws = [runner.weight(n) for n in names]
            starts = [sum(w.shape[0] for w in ws[:i]) for i in range(len(ws))]
            for col, part, _ in fp8_parts(ws)[0]:
                if isinstance(part, Fp8Weight) and tuple(part.shape) not in shapes:
                    shapes.add(tuple(part.shape))
                    inside = [n for n, s in zip(names, starts) if col <= s < col + part.shape[0]]
                    label = "+".join(re.sub(r"\.weight$", "", n).split(".")[-1] for n in inside)
                    out[f"{label} {tuple(part.shape)}"] = part
    return out


def time_or_none(fn, deadline):
    return common.bench_ms(fn) if common.now() < deadline else None


def decode_kernel_rows(runner, Ms, deadline) -> list:
    """FP8 block GEMM per weight and the FP8 MoE kernel at M tokens: ms and TB/s of the bytes they move."""
    import torch
    from glmc.codegen import triton_fp8 as tf
    from glmc.codegen import triton_moe as tm
    from glmc.codegen import triton_launch as tt
    dev, rows = runner.pool.device, []
    for label, w in fp8_matrices(runner).items():
        n, k = w.shape
        for m in Ms:
            xq, xs = tf.quantize_tokens(torch.randn(m, k, device=dev))
            out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            moved = w.nbytes + xq.nbytes + xs.nbytes + out.nbytes
            ms = time_or_none(lambda: tf.fp8_block_gemm(xq, xs, w.q, w.scale_inv, out=out), deadline)
            rows.append({"kernel": "fp8_block_gemm", "weight": label, "M": m, "N": n, "K": k, "bytes": moved,
                         "ms": ms, "tbps": ms and moved / ms / 1e9})
    key = next(k for k in runner.stacks if not isinstance(k, tuple))
    gate, up, down = runner.stacks[key]
    E, _, hidden = gate.shape
    gw = runner.weights[key.replace("experts", "gate.weight")].float()
    c = runner.config
    for m in Ms:
        x = torch.randn(m, hidden, device=dev, dtype=runner.pool.dtype)
        wts, ids = tt.moe_route_logits(x.float() @ gw.T, torch.zeros(E, device=dev), c.num_experts_per_tok, 1, 1,
                                       True, 2.5)
        touched = int(ids.unique().numel())
        moved = touched * (gate.nbytes + up.nbytes + down.nbytes) // E + 2 * x.nbytes
        ms = time_or_none(lambda: tm.moe_experts_fp8(x, ids, wts, gate, up, down), deadline)
        rows.append({"kernel": "moe_experts_fp8", "weight": f"{key} E{E}", "M": m, "touched": touched,
                     "bytes": moved, "ms": ms, "tbps": ms and moved / ms / 1e9})
    return rows


def scaled_mm(xq, wq, m, n):
    """torch._scaled_mm on e4m3 x [M, K] and W [N, K] (as B = W^T, column-major): rowwise scales, else
    per-tensor; -> (fn, mode, errors)."""
    import torch
    dev, errors = xq.device, []
    modes = [("rowwise", torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)),
             ("per-tensor", torch.ones((), device=dev), torch.ones((), device=dev))]
    for mode, sa, sb in modes:
        fn = lambda: torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
        try:
            fn()
            return fn, mode, errors
        except Exception as e:   # not every build / device has every scaling mode
            errors.append(f"{mode}: {type(e).__name__}: {e}"[:300])
    return None, None, errors


def prefill_kernel_rows(runner, shapes, deadline) -> list:
    """TFLOP/s of the FP8 block GEMM and of torch._scaled_mm at prefill shapes (M, N, K, label)."""
    import torch
    from glmc.codegen import fp8_ref
    from glmc.codegen import triton_fp8 as tf
    dev, rows = runner.pool.device, []
    for m, n, k, label in shapes:
        row = {"shape": f"{m}x{n}x{k}", "label": label}
        try:
            w = fp8_ref.Fp8Weight.quantize(torch.randn(n, k, device=dev) * k ** -0.5)
            xq, xs = tf.quantize_tokens(torch.randn(m, k, device=dev))
            flop = 2 * m * n * k
            ms = time_or_none(lambda: tf.fp8_block_gemm(xq, xs, w.q, w.scale_inv), deadline)
            fn, mode, errors = scaled_mm(xq, w.q, m, n)
            ref = time_or_none(fn, deadline) if fn else None
            row.update(block_ms=ms, block_tflops=ms and flop / ms / 1e9, scaled_mm_mode=mode,
                       scaled_mm_ms=ref, scaled_mm_tflops=ref and flop / ref / 1e9,
                       block_over_scaled_mm=ms and ref and ref / ms, scaled_mm_errors=errors)
        except Exception as e:
            row["failed"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
    return rows


def slice_prefill_shapes(runner, m) -> list:
    return [(m, w.shape[0], w.shape[1], label) for label, w in fp8_matrices(runner).items()]


# ----------------------------------------------------------------------------- report
def summary(res) -> str:
    lines = [f"{'B':>4} {'bf16 ms':>8} {'fp8 ms':>8} {'fp8 roof':>8} {'fp8/roof':>8} {'target':>6} "
             f"{'bf16 roof':>9} {'bf16/fp8':>8}"]
    for B in res["fp8"]:
        b, f = res["bf16"][B], res["fp8"][B]
        bm, fm = b.get("glmc", {}).get("replay_ms"), f.get("glmc", {}).get("replay_ms")
        roof, target = f.get("roofline_ms"), TARGET.get(B, 1.25)
        x = fm and roof and fm / roof
        f["ratios"] = {"fp8_over_fp8_roofline": x, "target": target, "target_met": bool(x and x <= target),
                       "bf16_over_fp8": bm and fm and bm / fm}
        g = lambda v: f"{v:8.3f}" if isinstance(v, float) else f"{'-':>8}"  # noqa: E731
        lines.append(f"{B:>4} {g(bm)} {g(fm)} {g(roof)} {g(x)} {target:>5}x {g(b.get('roofline_ms')):>9} "
                     f"{g(f['ratios']['bf16_over_fp8'])}")
    return "\n".join(lines)


def kernel_lines(kernels) -> str:
    lines = ["-- FP8 kernels at decode shapes (ms, TB/s) --"]
    for r in kernels.get("decode", []):
        ms = f"{r['ms']:8.4f} {r['tbps']:6.2f}" if r["ms"] else "  not run (budget)"
        lines.append(f"{r['kernel']:16s} {r['weight'][:44]:44s} M={r['M']:<4} {ms}")
    lines.append("-- prefill shapes: FP8 block GEMM vs torch._scaled_mm (TFLOP/s) --")
    for r in kernels.get("prefill", []):
        if "failed" in r:
            lines.append(f"{r['shape']:18s} {r['label'][:40]:40s} failed: {r['failed'][:80]}")
            continue
        f = lambda v: f"{v:7.1f}" if v else "      -"  # noqa: E731
        ratio = f"{r['block_over_scaled_mm']:.2f}" if r["block_over_scaled_mm"] else "-"
        lines.append(f"{r['shape']:18s} {r['label'][:40]:40s} block {f(r['block_tflops'])}  _scaled_mm "
                     f"({r['scaled_mm_mode'] or 'failed'}) {f(r['scaled_mm_tflops'])}  ratio {ratio}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128])
    ap.add_argument("--budget", type=float, default=330, help="seconds for the whole run (timings past it: skipped)")
    args = ap.parse_args()
    prefill_m, shapes = 4096, PREFILL_SHAPES
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        args.ctx, args.batches = min(args.ctx, 40), [b for b in args.batches if b <= 2] or [1]
        prefill_m, shapes = 4, [(4, 128, 256, "narrow stand-in for 4096x6144x16384")]
    import torch
    t0, out_dir = common.now(), Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.bfloat16)
    info = {"device": "cpu-interpreter" if args.cpu else torch.cuda.get_device_name(), "commit": args.commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "ctx": args.ctx}
    res, kernels = {"bf16": {}, "fp8": {}}, {}
    path = out_dir / f"fp8_decode_bench_{time.strftime('%Y-%m-%d')}.json"
    save = lambda: path.write_text(json.dumps({"info": info, "batches": res, "kernels": kernels},  # noqa: E731
                                              indent=1, default=str))
    info["copy_gbps"], info["mm_tflops"] = common.ceilings(args.cpu)
    model = common.slice_model(dev, dtype, seed=0, narrow=args.cpu)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.zero_()
    weights, stacks = common.glmc_weights(model)
    budget = lambda f: t0 + args.budget * f  # noqa: E731
    for key, fp8, frac in (("bf16", False, 0.0), ("fp8", True, 0.55)):   # bf16: costs only, no per-op timing
        try:
            res[key], runner = run_variant(model, weights, stacks, args.batches, args.ctx, dev, dtype, fp8, info,
                                           budget(frac))
            if fp8:
                kernels["decode"] = decode_kernel_rows(runner, [1, 2] if args.cpu else [1, 32, 128], budget(0.8))
                kernels["prefill"] = prefill_kernel_rows(runner, shapes + slice_prefill_shapes(runner, prefill_m),
                                                         budget(1.0))
            runner = None
        except Exception as e:   # reported; the other variant still runs
            traceback.print_exc()
            info[f"{key}_failed"] = f"{type(e).__name__}: {e}"[:1500]
            res[key] = {B: {"glmc": {"failed": info[f"{key}_failed"]}} for B in args.batches}
        gc.collect()             # the runner's graphs and weights go before the next variant's
        if dev == "cuda":
            torch.cuda.empty_cache()
        save()
    info["total_s"] = common.now() - t0
    table = summary(res)
    save()
    print(db.kernel_table(res["fp8"]))
    print(kernel_lines(kernels))
    print(f"device {info['device']}  copy {info['copy_gbps']:.0f} GB/s  bf16 matmul {info['mm_tflops']:.0f} TFLOP/s"
          f"  total {info['total_s']:.0f} s")
    print(table)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
