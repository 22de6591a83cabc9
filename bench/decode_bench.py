"""Decode step of a 2-layer GLM-5.3-width slice on one GPU: glmc (CUDA graphs) vs transformers eager vs
torch.compile of the transformers model vs the HBM roofline. One command, one run:

    python -m bench.decode_bench --out-dir $OUT --commit <git sha>     # CUDA (the H200)
    python -m bench.decode_bench --cpu                                 # CPU dry run: narrow widths, no graphs

Slice: layer 0 dense, layer 1 MoE (256 experts top-8 + shared), both full DSA indexers, bf16, random
weights shared by every competitor (glmc reads the HF parameters in place), router correction bias
zero (HF's init; a random one would crowd every token onto the same few experts) and fresh random
tokens every step, so routing spreads like real traffic's. Context 1024 for every request, batches
1, 32, 128. Transformers eager runs twice: as configured (SDPA picks cuDNN, which re-plans every step
because the KV length changes: ~21 ms of host time per attention call on torch 2.11) and with the
cuDNN SDPA backend off; ratios use the faster. Roofline = bytes that must move (all weights the step reads, the experts
actually touched, lm_head, the KV and indexer-K rows read) / device-to-device copy bandwidth measured
in the same run. A failing competitor (OOM, error, or a torch.compile that outlasts the budget: a
SIGALRM stops it) is reported as failed with its error, never skipped. Also printed: a per-op table for glmc
(each op replayed alone as a CUDA graph; GB/s and TFLOP/s against the measured ceilings).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

from bench import common
from bench.common import bench_ms, ceilings, now, op_calls, step_wall_ms

VIEWS = ("io.input", "tensor.slice", "tensor.view")


# ----------------------------------------------------------------------------- bytes and FLOPs per op
def _weights(rt, name):
    """The weights an op reads: one, or each part of a fused A-projection (never concatenated here)."""
    return [rt.w(n) for n in name] if isinstance(name, tuple) else [rt.w(name)]


def _numel(w):
    return w.q.numel() if hasattr(w, "scale_inv") else w.numel()   # Fp8Weight: its e4m3 values


def op_cost(op, args, rt, ctx):
    """(must-move bytes, other bytes, FLOPs) of one decode op over T tokens at context ctx. Weight bytes
    are as held: a block-FP8 weight (`Fp8Weight.nbytes`) is its e4m3 values plus its fp32 block scales."""
    import torch
    T = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) else 0
    act = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    wb = lambda n: sum(w.nbytes for w in _weights(rt, n))  # noqa: E731
    k = op.kind
    if k in ("linear", "mla.a_proj", "lm.head"):
        return wb(op.attr("weight")), act, 2 * T * sum(_numel(w) for w in _weights(rt, op.attr("weight")))
    if k == "mlp.swiglu":
        names = [f"{op.attr('weight')}.{n}_proj.weight" for n in ("gate", "up", "down")]
        return sum(wb(n) for n in names), act, 2 * T * sum(_numel(rt.w(n)) for n in names)
    if k == "moe.gate":
        return 4 * rt.w(op.attr("weight")).numel(), act, 2 * T * rt.w(op.attr("weight")).numel()
    if k == "moe.experts":
        gate, up, down = rt.experts(op)
        per = (gate.nbytes + up.nbytes + down.nbytes) // gate.shape[0]
        touched = int(args[2].unique().numel())
        return touched * per, act, 2 * T * args[2].shape[1] * 3 * _numel(gate) // gate.shape[0]
    if k.startswith("attn."):
        keys, H = min(ctx, int(args[3].shape[1]) if args[3] is not None else ctx), int(op.attr("heads"))
        R, dr, dn, dv = int(op.attr("kv_lora")), int(op.attr("dr")), int(op.attr("dn")), int(op.attr("dv"))
        kv = T * keys * rt.pool.bytes_per_token_per_layer()[0]   # 656 B per key in FP8, (R + dr) x 2 in bf16
        return wb(op.attr("weight")) + kv, act, 2 * T * H * (dn * R + R * dv + keys * (2 * R + dr))
    if k == "idx.topk":
        hi, di = int(op.attr("heads")), int(op.attr("head_dim"))
        row = rt.pool.bytes_per_token_per_layer()[1]   # 132 B per key in FP8, di x 2 in bf16
        return T * ctx * row, act + 8 * T * rt.max_len, 2 * T * hi * di * ctx
    return 0, act, 0


def per_op_table(runner, batch, ctx, bw, peak, deadline):
    """Replay each decode op alone (CUDA graph) with the inputs of one real step; -> rows."""
    calls = op_calls(runner, lambda: runner.run_tokens(
        "decode", runner.host_vectors(batch, batch.batch_size).to(runner.r2t.device)))
    rows = []
    for op, args, rt, fn in calls:
        if op.kind in VIEWS:
            continue
        must, other, flops = op_cost(op, args, rt, ctx)
        floor = max((must + other) / bw / 1e6, flops / peak / 1e9)
        row = dict(op=f"{op.kind} {op.results[0]}", kind=op.kind, roofline_ms=floor, must_bytes=must)
        if now() < deadline:  # past the deadline the costs still count toward the step's roofline
            ms = bench_ms(lambda: fn(op, args, rt))
            row.update(ms=ms, gbps=(must + other) / ms / 1e6, tflops=flops / ms / 1e9,
                       x_roofline=ms / floor if floor else None)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- competitors
def hf_prefill(model, B, ctx, seed=0):
    """Chunked prefill of B random prompts of ctx tokens; -> (cache, last tokens [B, 1])."""
    import torch
    g = torch.Generator(device=model.device).manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (B, ctx), device=model.device, generator=g)
    chunk, cache = max(32, min(ctx, 4096 // B)), None
    for s in range(0, ctx, chunk):
        out = model(input_ids=ids[:, s:s + chunk], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    return cache, out.logits[:, -1:].argmax(-1)


def sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_steps(fn, cache, tok, warm, steps):
    """Median wall ms (synchronised) of decode steps fn(tok, cache) after `warm` untimed ones. Each step
    feeds fresh random tokens (as glmc's steps do), so routing spreads like real traffic's."""
    import torch
    times, vocab = [], None
    for i in range(warm + steps):
        sync()
        t = now()
        out = fn(input_ids=tok, past_key_values=cache, use_cache=True)
        sync()
        times.append((now() - t) * 1e3)
        vocab = vocab or out.logits.shape[-1]
        tok = torch.randint(0, vocab, tok.shape, device=tok.device)
    return (sorted(times[warm:])[steps // 2] if steps else None), times[:warm]


def profile_step(model, cache, tok):
    """Top ops of one eager HF decode step by CPU and by CUDA time (why eager is slow)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        model(input_ids=tok, past_key_values=cache, use_cache=True)
        sync()
    ka, out = prof.key_averages(), {}
    for name, key in (("by_cpu", "cpu_time_total"), ("by_device", "device_time_total")):
        try:
            out[name] = ka.table(sort_by=key, row_limit=10, max_name_column_width=40)
        except Exception as e:  # sort keys differ across torch versions; the profile is an extra
            out[name] = f"{type(e).__name__}: {e}"
    return out


def run_hf_eager(model, batches, ctx, res, save, key="hf_eager"):
    import torch
    for B in batches:
        try:
            t = now()
            cache, tok = hf_prefill(model, B, ctx)
            prefill_s = now() - t
            ms, _ = hf_steps(model, cache, tok, 2, 5)
            res[B][key] = {"ms": ms, "prefill_s": prefill_s, "profile": profile_step(model, cache, tok)}
        except Exception as e:
            res[B][key] = {"failed": f"{type(e).__name__}: {e}"[:500]}
        cache = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        save()


def run_compile(model, batches, ctx, res, save, deadline):
    """torch.compile of the same HF model (default mode), in-process after eager; SIGALRM bounds the
    compile so one that outlasts the budget is reported as failed (timeout), like an OOM."""
    import signal

    import torch

    def alarm(*_):
        raise TimeoutError("torch.compile + warm-up outlasted the benchmark budget")
    cmodel = torch.compile(model, backend="eager" if not torch.cuda.is_available() else "inductor")
    old = signal.signal(signal.SIGALRM, alarm)
    try:
        for B in sorted(batches, key=lambda b: b != 32):   # the target batch first
            left, cache = int(deadline - now()), None
            if left < 10:
                res[B]["compile"] = {"failed": "not run: benchmark budget spent"}
                continue
            signal.alarm(left)
            try:
                cache, tok = hf_prefill(model, B, ctx)
                ms, warm = hf_steps(cmodel, cache, tok, 3, 5)
                res[B]["compile"] = {"ms": ms, "compile_and_first_steps_s": [round(w / 1e3, 2) for w in warm]}
            except Exception as e:
                res[B]["compile"] = {"failed": f"{type(e).__name__}: {e}"[:500]}
            finally:
                signal.alarm(0)
                cache = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                save()
    finally:
        signal.signal(signal.SIGALRM, old)


# ----------------------------------------------------------------------------- glmc
def moe_sweep(runner, B, dev, dtype):
    """Time the MoE experts op at batch B over a few tile choices; -> (best tiles, rows)."""
    import torch
    from glmc.codegen import triton_moe as tm
    from glmc.codegen import triton_launch as tt
    key = next(k for k in runner.stacks if "experts" in str(k))
    gate, up, down = runner.stacks[key]
    gw = runner.weights[key.replace("experts", "gate.weight")].float()
    x = torch.randn(B, gate.shape[2], device=dev, dtype=dtype)
    c = runner.config
    w, ids = tt.moe_route_logits(x.float() @ gw.T, torch.zeros(gate.shape[0], device=dev), c.num_experts_per_tok,
                                 1, 1, True, 2.5)
    choices = [{}, {"gate_up": dict(block_n=128, block_k=64, num_stages=3), "down": dict(block_n=128, block_k=64)},
               {"gate_up": dict(block_n=32, block_k=128), "down": dict(block_n=32, block_k=128)},
               {"gate_up": dict(block_n=64, block_k=64, num_stages=5), "down": dict(block_n=64, block_k=64)}]
    rows = []
    for t in choices:
        try:
            ms = bench_ms(lambda: tm.moe_experts(x, ids, w, gate, up, down, tiles=t))
        except Exception as e:
            ms = float("inf")
            t = {**t, "error": f"{type(e).__name__}: {e}"[:200]}
        rows.append({"tiles": t, "ms": ms, "touched": int(ids.unique().numel())})
    best = min(rows, key=lambda r: r["ms"])
    return ({} if "error" in best["tiles"] else best["tiles"]), rows


def setup_glmc(model, batches, ctx, dev, dtype, info):
    """Plan, runner over the HF parameters, MoE tile sweep, prefill, capture."""
    import torch
    t = now()
    plan = common.glmc_plan(model, max(batches), "float32" if dtype == torch.float32 else "bfloat16",
                        kv_dtype="bf16")   # the bf16 baseline: bf16 KV too
    info["compile_s"] = now() - t
    c, max_ctx = plan.config, ctx + 64
    weights, stacks = common.glmc_weights(model)
    runner = common.gpu_runner(plan, weights, dev, max(batches), max_ctx, stacks=stacks)
    if dev == "cuda":
        t = now()
        runner.moe_tiles, info["moe_sweep"] = moe_sweep(runner, 32 if 32 in batches else max(batches), dev, dtype)
        if runner.moe_tiles:   # the sweep beat the plan's tiles: those variants are rendered outside the plan
            from glmc.codegen.triton_render import KernelLibrary
            runner.kernels = KernelLibrary.from_plan(plan, jit_extra=True)
        info["moe_sweep_s"], info["moe_tiles"] = now() - t, runner.moe_tiles
    table = common.req_table(max(batches), max_ctx // 64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, c.vocab_size, (ctx,), generator=g).tolist() for _ in range(max(batches))]
    t = now()
    common.prefill(runner, prompts, table, group=max(1, 16384 // ctx))
    if dev == "cuda":
        torch.cuda.synchronize()
    info["prefill_s"] = now() - t
    t = now()
    info["capture_s_per_bucket"] = runner.capture(batches) if dev == "cuda" else {}
    info["capture_s"] = now() - t
    return runner, table, prompts


def measure_glmc(runner, table, prompts, batches, ctx, res, info, deadline):
    """Per batch: graph replay ms, host step ms (inputs copied in, logits read), per-op table, roofline."""
    import torch
    g = torch.Generator().manual_seed(1)
    for B in batches:   # distinct random next tokens: routing spreads over experts like real traffic's
        nxt = torch.randint(0, runner.config.vocab_size, (B,), generator=g).tolist()
        batch = common.decode_batch([p + [t] for p, t in zip(prompts[:B], nxt)], table)
        runner.forward("decode", batch)
        cap = runner.captured.get(B)
        replay = bench_ms(cap.graph.replay, graph=False) if cap else bench_ms(lambda: runner.forward("decode", batch))
        step = step_wall_ms(lambda: runner.forward("decode", batch)["logits"][0, 0].item()) if cap else replay
        res[B]["glmc"] = {"replay_ms": replay, "step_ms": step}
        res[B]["kernels"] = per_op_table(runner, batch, ctx, info["copy_gbps"], info["mm_tflops"], deadline)
        must = sum(r["must_bytes"] for r in res[B]["kernels"])
        res[B]["roofline_bytes"] = must + other_weight_bytes(runner)
        res[B]["roofline_ms"] = res[B]["roofline_bytes"] / info["copy_gbps"] / 1e6


def predict(plan, batches, ctx, calibration, res):
    """The predicted replay (glmc/predict.py via bench/predicted.py) next to the measured one."""
    from bench import predicted

    from glmc.calibration import load
    cal = load(calibration)
    for B in batches:
        res[B]["predicted"] = predicted.compare(f"tp1 B={B} ctx={ctx}", predicted.predict_ms(plan, B, ctx, cal),
                                                res[B].get("glmc", {}).get("replay_ms"))


def other_weight_bytes(runner):
    """Weights read once per step outside the ops costed above: the final norm (embedding rows: negligible)."""
    w = runner.weights.get("model.norm.weight")
    return 0 if w is None else w.numel() * w.element_size()


# ----------------------------------------------------------------------------- main
def summary(res, info):
    lines = [f"{'B':>4} {'glmc replay':>11} {'glmc step':>9} {'HF eager':>9} {'eager-cudnn':>11} {'compile':>9}"
             f" {'roofline':>8} {'glmc/roof':>9} {'eager/glmc':>10} {'compile/glmc':>12}"]
    for B, r in res.items():
        g = r.get("glmc", {}).get("replay_ms")
        e0, e1 = r.get("hf_eager", {}).get("ms"), r.get("hf_eager_nocudnn", {}).get("ms")
        e, c = min((x for x in (e0, e1) if x), default=None), r.get("compile", {}).get("ms")   # the faster eager
        f = lambda v: f"{v:9.3f}" if isinstance(v, float) else f"{'failed' if v is None else v:>9}"  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
        r["ratios"] = {"glmc_over_roofline": g and g / r["roofline_ms"], "eager_over_glmc": e and g and e / g,
                       "compile_over_glmc": c and g and c / g}
        lines.append(f"{B:>4} {f(g):>11} {f(r.get('glmc', {}).get('step_ms')):>9} {f(e0)} {f(e1):>11} {f(c)} "
                     f"{r['roofline_ms']:8.3f} {ratio(g, r['roofline_ms']):>9} {ratio(e, g):>10} {ratio(c, g):>12}")
    return "\n".join(lines)


def kernel_table(res):
    lines = []
    for B, r in res.items():
        lines.append(f"-- glmc ops, batch {B} (ms, GB/s, TFLOP/s, x roofline) --")
        for k in sorted(r.get("kernels", []), key=lambda k: -k.get("ms", 0))[:14]:
            if "ms" in k:
                lines.append(f"{k['op'][:52]:52s} {k['ms']:8.4f} {k['gbps']:8.0f} {k['tflops']:7.1f}"
                             f" {k['x_roofline'] or 0:6.2f}x")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128])
    ap.add_argument("--budget", type=float, default=420, help="seconds for the whole run")
    ap.add_argument("--skip", default="", help="comma list of: eager, compile")
    ap.add_argument("--calibration", help="bench/calibrate.py's file: print the predicted step next to glmc's")
    args = ap.parse_args()
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        args.ctx, args.batches = min(args.ctx, 40), [b for b in args.batches if b <= 2] or [1]
    import torch
    t_start, out_dir = now(), Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.bfloat16)
    info = {"device": "cpu-interpreter" if args.cpu else torch.cuda.get_device_name(), "commit": args.commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "ctx": args.ctx}
    res = {B: {} for B in args.batches}
    path = out_dir / f"decode_bench_{time.strftime('%Y-%m-%d')}.json"
    save = lambda: path.write_text(json.dumps({"info": info, "batches": res}, indent=1, default=str))  # noqa: E731
    info["copy_gbps"], info["mm_tflops"] = ceilings(args.cpu)
    t = now()
    model = common.slice_model(dev, dtype, seed=0, narrow=args.cpu)
    info["model_build_s"] = now() - t
    info["hf_impl"] = {"attn": model.config._attn_implementation,
                       "experts": getattr(model.config, "_experts_implementation", None)}
    with torch.no_grad():  # HF's own init value: routing spreads over experts (a trained bias balances load)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.zero_()
    try:
        runner, table, prompts = setup_glmc(model, args.batches, args.ctx, dev, dtype, info)
        measure_glmc(runner, table, prompts, args.batches, args.ctx, res, info, t_start + args.budget * 0.45)
        if args.calibration:
            try:
                predict(runner.plan, args.batches, args.ctx, args.calibration, res)
            except Exception as e:  # reported; the measurements stand
                info["predicted_failed"] = f"{type(e).__name__}: {e}"[:500]
        runner = None   # free the graphs' pool and the re-laid-out weights before the HF runs
        if dev == "cuda":
            torch.cuda.empty_cache()
    except Exception as e:  # reported, and the other competitors still run
        traceback.print_exc()
        info["glmc_failed"] = f"{type(e).__name__}: {e}"[:1500]
        for B in res:
            res[B].setdefault("glmc", {"failed": info["glmc_failed"]})
            res[B].setdefault("roofline_ms", float("nan"))
    save()
    if "eager" in args.skip:
        for B in res:
            res[B]["hf_eager"] = {"failed": "not run (--skip eager)"}
    else:
        run_hf_eager(model, args.batches, args.ctx, res, save)
        if dev == "cuda":  # SDPA's default cuDNN backend re-plans every step (new KV length): also without it
            torch.backends.cuda.enable_cudnn_sdp(False)
            run_hf_eager(model, args.batches, args.ctx, res, save, key="hf_eager_nocudnn")
            torch.backends.cuda.enable_cudnn_sdp(True)
    if "compile" in args.skip:
        for B in res:
            res[B]["compile"] = {"failed": "not run (--skip compile)"}
    else:
        run_compile(model, args.batches, args.ctx, res, save, t_start + args.budget)
    info["total_s"] = now() - t_start
    table = summary(res, info)
    save()
    print(kernel_table(res))
    print(f"device {info['device']}  copy {info['copy_gbps']:.0f} GB/s  matmul {info['mm_tflops']:.0f} TFLOP/s  "
          + "  ".join(f"{k} {info[k]:.1f}" for k in ("model_build_s", "compile_s", "moe_sweep_s", "prefill_s",
                                                     "capture_s", "total_s") if k in info))
    print(table)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
