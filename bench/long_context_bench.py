"""Decode at long context: the 2-layer GLM-5.3-width slice at contexts 1K-128K,
batches 1/8/32, glmc (CUDA graphs) next to transformers and the roofline. One command, one run:

    python -m bench.long_context_bench --out-dir $OUT --budget 480        # CUDA (the H200)
    python -m bench.long_context_bench --cpu                              # CPU smoke: narrow, interpreted
    python -m bench.long_context_bench --prefill 8192,32768 --chunk 8192  # chunked prefill instead

The context (`--fill`): `model` (the default) prefills each request's ctx random tokens through the
plan in chunks of `--chunk` tokens, so the KV and indexer caches hold what the model writes there
(the indexer scores a decode token's top-k selects from, and the KV rows it then reads, are the
model's); `random` fills every slot of the paged KV pool and of the indexer key cache with N(0, 1)
values through `KVPool`'s writers (so an FP8 pool holds valid e4m3 rows and scales; seconds instead
of a prefill, scores of another spread). Each request's row of the request table owns `ctx` tokens;
the decode token sits at position ctx. Timed: the captured decode graph's replay and the whole step
with the host (inputs in, logits read; median wall time of back-to-back steps), as
bench/decode_bench.py; both KV dtypes (fp8: the plan's default for bf16 checkpoints; bf16), fp8 first.
Roofline = bytes that must move per step / the device-to-device copy bandwidth measured here: the
weights the step reads (experts touched, lm_head, ...), per full-indexer layer per request ctx x
the indexer bytes per key, per layer per request min(ctx, index_topk) selected KV rows x bytes per
row (decode_bench.op_cost's accounting). Per-kernel table at each point: indexer scores, top-k
select, sparse MLA decode (the latent split-K kernel + combine over the selected rows), each
captured and replayed alone, with time, achieved GB/s and its own byte floor. Top-k micro-bench:
2048 of 8K-128K scores at batch 1 and 32, glmc's kernel vs torch.topk (the issue's target: < 30 us
at 128K). Transformers: the same model (cuDNN SDPA off, decode_bench's faster eager variant) over a
cache grown from a short prefill to ctx with random values, each point under a SIGALRM time limit;
failures (OOM, time) are reported as failures. A point that does not fit is reported with the
bytes it needs and the bytes free; points past the budget are skipped, the largest first, and say so.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from bench import common
from bench import decode_bench as db

GIB = 2**30
HF_PROMPT = 37     # the short prefill HF's cache is grown from (a length no weight dimension has)
SEGMENTS = (1024, 2048, 4096, 8192, 16384)   # top-k micro-bench: split segment sizes also timed


def fail(e: BaseException) -> dict:
    return {"failed": f"{type(e).__name__}: {e}"[:400]}


# ----------------------------------------------------------------------------- glmc: pool, step, kernels
def fill_pool_(pool, chunk=1 << 18):
    """Random N(0, 1) rows in every slot of every cache, through the pool's writers, in chunks."""
    import torch
    g = torch.Generator(device=pool.device).manual_seed(0)
    for s0 in range(0, pool.num_slots, chunk):
        loc = torch.arange(s0, min(s0 + chunk, pool.num_slots), device=pool.device)
        rnd = lambda d: torch.randn(loc.numel(), d, generator=g, device=pool.device)  # noqa: E731
        for layer in range(pool.num_layers):
            pool.write_kv(layer, loc, rnd(pool.kv_lora_rank), rnd(pool.qk_rope_head_dim))
        for layer in pool.full_layers:
            pool.write_index_k(layer, loc, rnd(pool.index_head_dim))


def load_table_(runner, table, rows):
    """The request table's first `rows` rows into a GPU runner's device table (`r2t`), as a prefill
    would load them: a captured decode step writes only its own token's slot there, so a cache
    filled without a prefill is otherwise read through the pool's scratch slot at every position.
    A runner without a device table (the torch target) reads the batch's table: nothing to do."""
    r2t = getattr(runner, "r2t", None)
    if r2t is not None:
        w = min(r2t.shape[1], table.shape[1])
        r2t[:rows, :w] = table[:rows, :w].to(r2t.device)


def fill_by_prefill_(runner, rows, ctx, table, chunk, seed=0):
    """Request rows 0..rows-1: ctx random tokens each, prefilled through the plan (eager `prefill`
    forwards of at most `chunk` tokens: whole prompts grouped when ctx < chunk, else chunks)."""
    import torch
    from glmc.runtime.worker.forward_batch import ForwardBatch
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, runner.config.vocab_size, (rows, ctx), generator=g)
    step = min(ctx, chunk)
    group = max(1, chunk // step)
    for r0 in range(0, rows, group):
        rs = list(range(r0, min(rows, r0 + group)))
        for p in range(0, ctx, step):
            ids = [prompts[r, p:p + step].tolist() for r in rs]
            runner.forward("prefill", ForwardBatch.build("extend", ids, rs, [p] * len(rs), table))


def pool_bytes(plan, batch, ctx):
    """(KV pool bytes of `batch` requests of ctx + 64 tokens, per-token bytes per layer (kv, index))."""
    from glmc.runtime.worker.kv_cache import PAGE_SIZE, KVPool
    probe = KVPool.for_plan(plan, 1, device="cpu", fp8="store")
    pages = batch * -(-(ctx + 64) // PAGE_SIZE) + 1
    return pages * PAGE_SIZE * probe.bytes_per_token(), probe.bytes_per_token_per_layer()


def workspace_bytes(plan, batch, ctx):
    """Step buffers that grow with ctx: fp32 indexer scores per full layer, the split MLA partials."""
    c = plan.config
    return 2 * batch * (ctx + 64) * 4 * len(plan.full_indexer_layers()) + batch * c.num_attention_heads * 64 * 520 * 4


def fitting_batches(plan, batches, ctx, free, info_point):
    """The batches whose pool + workspaces fit in `free` bytes (less 4 GiB headroom); the others
    get their numbers in info_point."""
    ok = []
    for B in batches:
        need = pool_bytes(plan, B, ctx)[0] + workspace_bytes(plan, B, ctx) + 4 * GIB
        if need <= free:
            ok.append(B)
        else:
            info_point[B] = {"failed": f"does not fit: pool + workspaces {need / GIB:.1f} GiB (4 GiB headroom "
                                       f"included) > {free / GIB:.1f} GiB free"}
    return ok


def decode_batch_at(runner, B, ctx, table, seed=0):
    """B requests (rows 0..B-1) of ctx cached tokens, each decoding one fresh random token."""
    import torch
    from glmc.runtime.worker.forward_batch import ForwardBatch
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, runner.config.vocab_size, (B,), generator=g).tolist()
    return ForwardBatch.build("decode", [[t] for t in toks], list(range(B)), [ctx] * B, table)


def kernel_rows(runner, batch, ctx, bw):
    """Indexer scores, top-k select, sparse MLA decode of the first full layer, each alone."""
    import torch
    from glmc.codegen import triton_launch as tt
    from glmc.codegen.launch_model import TOPK_CHUNK
    calls = common.op_calls(runner, lambda: runner.run_tokens(
        "decode", runner.host_vectors(batch, batch.batch_size).to(runner.r2t.device)))
    op, args, rt, _ = next(c for c in calls if c[0].kind == "idx.topk")
    q, w, layer = args[:3]          # then the positions q is turned by, where the plan folds its RoPE
    heads, k, T = int(op.attr("heads")), int(op.attr("k")), q.shape[0]
    kv_row, idx_row = rt.pool.bytes_per_token_per_layer()
    rope = tt.QueryRope.of(op)      # each kernel as the plan runs it: queries turned as loaded
    scores = tt.indexer_scores(q, w, rt.pool.index_k[layer], rt.r2t, rt.rows, rt.pos, rt.max_len, lib=rt.kernels,
                               w_scale=heads ** -0.5, rope=rope)
    slots = tt.topk_select(scores, rt.pos + 1, k, TOPK_CHUNK, rt.kernels, slots_of=(rt.r2t, rt.rows))
    attn = next(c for c in calls if c[0].kind.startswith("attn."))[0]
    H, R, dr = int(attn.attr("heads")), int(attn.attr("kv_lora")), int(attn.attr("dr"))
    q_lat, q_pe = (torch.randn(T, H, d, device=q.device, dtype=q.dtype) for d in (R, dr))   # activation dtype
    keys = min(ctx + 1, k)
    jobs = [
        ("indexer scores", lambda: tt.indexer_scores(q, w, rt.pool.index_k[layer], rt.r2t, rt.rows, rt.pos,
                                                     rt.max_len, lib=rt.kernels, w_scale=heads ** -0.5, rope=rope),
         T * (ctx + 1) * (idx_row + 4)),                                  # keys read, fp32 scores written
        ("top-k select", lambda: tt.topk_select(scores, rt.pos + 1, k, TOPK_CHUNK, rt.kernels,
                                                slots_of=(rt.r2t, rt.rows)),
         T * ((ctx + 1) * 4 + k * 4)),                                    # scores read, slots written
        ("sparse MLA decode", lambda: tt.sparse_mla_latent(q_lat, q_pe, rt.pool.kv[layer], rt.r2t, rt.rows, rt.pos,
                                                           slots, float(attn.attr("scale")), slots=slots,
                                                           lib=rt.kernels, rope=tt.QueryRope.of(attn)),
         T * (keys * kv_row + H * (2 * R + dr) * q_lat.element_size())),  # selected rows, q in, out
    ]
    rows = []
    for name, fn, floor_bytes in jobs:
        try:
            ms = common.bench_ms(fn)
            rows.append({"kernel": name, "ms": ms, "floor_bytes": floor_bytes, "floor_ms": floor_bytes / bw / 1e6,
                         "gbps": floor_bytes / ms / 1e6, "x_floor": ms / (floor_bytes / bw / 1e6)})
        except Exception as e:   # reported; the next kernel still runs
            rows.append({"kernel": name, **fail(e)})
    return rows


def glmc_point(runner, B, ctx, table, info):
    """Replay and whole-step ms, roofline bytes, per-kernel rows at one (batch, context)."""
    batch = decode_batch_at(runner, B, ctx, table, seed=B)
    runner.forward("decode", batch)
    cap = runner.captured.get(B)
    replay = common.bench_ms(cap.graph.replay, graph=False) if cap else common.bench_ms(lambda: runner.forward("decode", batch))
    step = common.step_wall_ms(lambda: runner.forward("decode", batch)["logits"][0, 0].item()) if cap else replay
    ops = db.per_op_table(runner, batch, ctx, info["copy_gbps"], info["mm_tflops"], deadline=0)  # costs only
    must = sum(r["must_bytes"] for r in ops) + db.other_weight_bytes(runner)
    roof = must / info["copy_gbps"] / 1e6
    return {"replay_ms": replay, "step_ms": step, "roofline_bytes": must, "roofline_ms": roof,
            "x_roofline": replay / roof, "kernels": kernel_rows(runner, batch, ctx, info["copy_gbps"])}


def run_glmc(model, kv_dtype, contexts, batches, dev, dtype, info, deadline, save, fill="model", chunk=8192):
    """Every (context, batch) point of one KV dtype, the caches filled by `fill` (module docstring);
    -> {ctx: {B: point}}. Contexts in increasing order, so a spent budget skips the largest."""
    import torch
    out = {}
    t = common.now()
    plan = common.glmc_plan(model, max(batches), "float32" if dtype == torch.float32 else "bfloat16", kv_dtype=kv_dtype)
    info[f"compile_s_{kv_dtype}"] = common.now() - t
    weights, stacks = common.glmc_weights(model)
    for ctx in contexts:
        point = out.setdefault(ctx, {})
        if common.now() > deadline:
            point.update({B: {"failed": "skipped: benchmark budget spent"} for B in batches})
            continue
        free = torch.cuda.mem_get_info()[0] if dev == "cuda" else 64 * GIB
        fits = fitting_batches(plan, batches, ctx, free, point)
        if not fits:
            continue
        runner = None
        try:
            t = common.now()
            runner = common.gpu_runner(plan, weights, dev, max(fits), ctx + 64, stacks=stacks)
            table = common.req_table(max(fits), (ctx + 64 + 63) // 64)
            if fill == "model":
                fill_by_prefill_(runner, max(fits), ctx, table, chunk)   # prefill loads the rows' table
            else:
                fill_pool_(runner.pool)
                load_table_(runner, table, max(fits))
            # a captured decode step writes only its own token's slot into the device table: the
            # context's positions must already map to their slots there (else they all read the
            # pool's scratch slot: one key and one KV row, every score tied)
            if not torch.equal(runner.r2t[:max(fits), :ctx].cpu(), table[:max(fits), :ctx]):
                raise RuntimeError(f"ctx {ctx}: the runner's device table does not hold the requests' slots")
            point["setup"] = {"fill": fill, "runner_and_fill_s": common.now() - t,
                              "pool_gib": pool_bytes(plan, max(fits), ctx)[0] / GIB}
            t = common.now()
            point["setup"]["capture_s"] = runner.capture(fits) if dev == "cuda" else {}
            for B in fits:
                if common.now() > deadline:
                    point[B] = {"failed": "skipped: benchmark budget spent"}
                    continue
                try:
                    point[B] = glmc_point(runner, B, ctx, table, info)
                except Exception as e:
                    point[B] = fail(e)
        except Exception as e:   # reported; the next context still runs
            for B in fits:
                point.setdefault(B, fail(e))
        runner = None
        if dev == "cuda":
            torch.cuda.empty_cache()
        save()
    return out


# ----------------------------------------------------------------------------- chunked prefill
def run_prefill(model, kv_dtype, lengths, chunk, dev, dtype, info, deadline, profile=False, indexer_tiles=()):
    """Chunked prefill: one prompt of each length in chunks of `chunk` tokens, each
    an eager `prefill` forward over the cache its predecessors wrote. Per chunk: the time (run twice,
    the second timed: the first compiles the kernels of a new shape; it rewrites the same KV), the
    FLOPs the plan's cost model counts (`estimate_cost.bill` at T = chunk, S = prefix + chunk: the
    GEMMs, MHA-form attention over each token's selected keys, the indexer's scores over every key
    up to each token: its quadratic part) and that FLOP count at the bf16 matmul rate measured in the
    run (the roofline); with `profile`, the SM clock after it and `op_times` (per op kind); with
    `indexer_tiles`, the longest prompt's last chunk also gets `indexer_tiles_micro`; -> rows."""
    import torch
    from glmc.passes.estimate_cost import bill
    from glmc.runtime.worker.forward_batch import ForwardBatch
    plan = common.glmc_plan(model, 1, "float32" if dtype == torch.float32 else "bfloat16", kv_dtype=kv_dtype)
    weights, stacks = common.glmc_weights(model)
    n_max, k = max(lengths), model.config.index_topk
    runner = common.gpu_runner(plan, weights, dev, 1, n_max + 64, stacks=stacks)
    table = common.req_table(1, -(-(n_max + 64) // 64))
    g, rows = torch.Generator().manual_seed(1), []
    rate = info["mm_tflops"] * 1e12
    for n in lengths:
        toks = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        for p in range(0, n, chunk):
            c = min(chunk, n - p)
            row = {"kv": kv_dtype, "length": n, "prefix": p, "chunk": c}
            rows.append(row)
            if common.now() > deadline:
                row["failed"] = "skipped: benchmark budget spent"
                continue
            batch = ForwardBatch.build("extend", [toks[p:p + c]], [0], [p], table)
            try:
                runner.forward("prefill", batch)
                if dev == "cuda":
                    torch.cuda.synchronize()
                t = common.now()
                runner.forward("prefill", batch)
                if dev == "cuda":
                    torch.cuda.synchronize()
                ms = (common.now() - t) * 1e3
            except Exception as e:   # reported; the next prompt still runs
                row.update(fail(e))
                break
            env = {"T": c, "B": 1, "S": p + c, "K": k, "prefill": True}
            flops = bill(plan.graphs["prefill"], env, plan.dtypes)["totals"]["flops"]
            roof = flops / rate * 1e3
            row.update(ms=ms, flops=flops, roof_ms=roof, x_roof=ms / roof, tflops=flops / ms / 1e9)
            if profile:
                row["sm_clock_mhz"] = sm_clock_mhz()
                row["ops"] = op_times(runner, batch, plan.graphs["prefill"], env, plan.dtypes, rate)
            if indexer_tiles and p + c == n == n_max:   # the longest prompt's last chunk
                row["indexer_tiles"] = indexer_tiles_micro(runner, batch, indexer_tiles)
    return rows


def indexer_tiles_micro(runner, batch, tiles) -> list:
    """The indexer scores of `batch`'s tokens over the first full layer's cache (as the prefill just
    wrote it), per-token kernel and the token-block kernel at each of `tiles` ("block_m:block_n:warps:
    stages"): time (graph replays) and the largest difference from the per-token scores."""
    import torch
    from glmc.codegen import triton_launch as tt
    calls = common.op_calls(runner, lambda: runner.forward("prefill", batch))
    op, args, rt, _ = next(c for c in calls if c[0].kind == "idx.topk")
    (q, w, layer), heads = args[:3], int(op.attr("heads"))   # (then the positions q is turned by)

    def scores(tiled):
        return tt.indexer_scores(q, w, rt.pool.index_k[layer], rt.r2t, rt.rows, rt.pos, rt.max_len,
                                 lib=tt.JIT, w_scale=heads ** -0.5, tiled=tiled,   # tiles not in the plan
                                 rope=tt.QueryRope.of(op))
    want = scores(False)
    fin = torch.isfinite(want)
    out = [{"tiles": "per token", "us": common.bench_ms(lambda: scores(False)) * 1e3}]
    for t in tiles:
        bm, bn, w_, st = (int(x) for x in t.split(":"))
        cfg = dict(block_m=bm, block_n=bn, num_warps=w_, num_stages=st)
        r = {"tiles": cfg}
        try:
            got = scores(cfg)
            r["max_rel_diff"] = float(((got - want)[fin]).abs().max() / want[fin].abs().max())
            r["same_inf"] = bool(torch.equal(torch.isinf(got), torch.isinf(want)))
            r["us"] = common.bench_ms(lambda: scores(cfg)) * 1e3
        except Exception as e:   # out of resources etc.
            r.update(fail(e))
        out.append(r)
    # the top-k select of the same rows: the plan's (split radix select past TOPK_CHUNK) against one
    # program per row holding the whole row in registers (chunk = the row's width) at several warps
    from glmc.codegen.launch_model import TOPK_CHUNK
    k, lens = int(op.attr("k")), rt.pos + 1
    base = tt.topk_select(want, lens, k, TOPK_CHUNK)
    sel = [{"select": f"chunk {TOPK_CHUNK}", "us": common.bench_ms(lambda: tt.topk_select(want, lens, k, TOPK_CHUNK)) * 1e3}]
    chunk = 1 << (int(want.shape[1]) - 1).bit_length()
    for w_ in (8, 16, 32):
        r = {"select": f"chunk {chunk} warps {w_}"}
        try:
            r["same"] = bool(torch.equal(tt.topk_select(want, lens, k, chunk, num_warps=w_), base))
            r["us"] = common.bench_ms(lambda: tt.topk_select(want, lens, k, chunk, num_warps=w_)) * 1e3
        except Exception as e:   # out of resources etc.
            r.update(fail(e))
        sel.append(r)
    return out + sel


def sm_clock_mhz():
    """The GPU's SM clock now (nvidia-smi), or None: a chunk that runs slower than an equal one
    earlier may be a lower clock (power), not more work."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return int(out[0]) if out else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def op_times(runner, batch, graph, env, dtypes, rate) -> list:
    """Where one prefill forward's time goes, per op kind: one more eager forward with a CUDA event
    pair around every op (stream order: an op's pair spans its kernels), summed by kind, next to the
    FLOPs the cost model counts for those ops and that count at `rate`; -> rows, slowest kind first."""
    import torch
    from glmc.passes.costs import op_cost
    from glmc.passes.estimate_cost import weight_bytes_for
    wb, cuda = weight_bytes_for(dtypes), torch.cuda.is_available() and runner.r2t.is_cuda
    flops = {}
    for op in graph.ops:
        flops[op.kind] = flops.get(op.kind, 0) + op_cost(op, graph, env, wb).flops
    marks = []

    def timed(f):
        def run(op, args, rt):
            if not cuda:
                t = time.perf_counter()
                out = f(op, args, rt)
                marks.append((op.kind, t, time.perf_counter()))
                return out
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = f(op, args, rt)
            b.record()
            marks.append((op.kind, a, b))
            return out
        return run
    common.with_impls(runner, timed, lambda: runner.forward("prefill", batch))
    if cuda:
        torch.cuda.synchronize()
    per = {}
    for kind, a, b in marks:
        n, ms = per.get(kind, (0, 0.0))
        per[kind] = (n + 1, ms + (a.elapsed_time(b) if cuda else (b - a) * 1e3))
    rows = [{"op": kind, "calls": n, "ms": ms, "flops": flops.get(kind, 0), "roof_ms": flops.get(kind, 0) / rate * 1e3}
            for kind, (n, ms) in per.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def prefill_table(rows, top_ops=10):
    out = ["  kv  length  prefix  chunk   ms     TFLOP  TFLOP/s  roof ms  x roof"]
    for r in rows:
        if "ms" not in r:
            out.append(f"{r['kv']:>4} {r['length']:7d} {r['prefix']:7d} {r['chunk']:6d}  {r.get('failed', '')}")
            continue
        out.append(f"{r['kv']:>4} {r['length']:7d} {r['prefix']:7d} {r['chunk']:6d} {r['ms']:7.2f} "
                   f"{r['flops'] / 1e12:8.2f} {r['tflops']:8.1f} {r['roof_ms']:8.2f} {r['x_roof']:7.2f}"
                   + (f"  SM {r['sm_clock_mhz']} MHz" if r.get("sm_clock_mhz") else ""))
        for o in r.get("indexer_tiles", []):
            out.append(f"        indexer {str(o.get('tiles', o.get('select'))):60s} {o.get('us', 0):9.1f} us"
                       + (f"  same {o['same']}" if "same" in o else "")
                       + (f"  diff {o['max_rel_diff']:.1e} same -inf {o['same_inf']}" if "max_rel_diff" in o else "")
                       + f" {o.get('failed', '')}")
        for o in r.get("ops", [])[:top_ops]:
            out.append(f"        {o['op']:24s} {o['calls']:4d} calls {o['ms']:8.2f} ms  roof {o['roof_ms']:7.2f} ms"
                       + (f"  x{o['ms'] / o['roof_ms']:.1f}" if o["roof_ms"] else ""))
    return "\n".join(out)


# ----------------------------------------------------------------------------- top-k micro-benchmark
def launch_times(fn, calls: int = 20) -> list:
    """Device time of each kernel one call of fn launches, in launch order (us, median over
    `calls` eager calls under torch.profiler): where a multi-launch kernel's time goes."""
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.device_time > 0), key=lambda e: e.time_range.start)
    per = len(kernels) // calls
    if not per or len(kernels) % calls:
        return []
    return [round(statistics.median(kernels[c * per + i].device_time for c in range(calls)), 2) for i in range(per)]


def topk_micro(lengths, batches, k, dev, deadline):
    """glmc's top-k select vs torch.topk: k of n random fp32 scores per row (graph replays)."""
    import torch
    from glmc.codegen import triton_launch as tt
    from glmc.codegen.launch_model import TOPK_CHUNK
    rows = []
    for n in lengths:
        for B in batches:
            if common.now() > deadline:
                rows.append({"n": n, "batch": B, "failed": "skipped: benchmark budget spent"})
                continue
            r = {"n": n, "batch": B}
            try:
                scores = torch.randn(B, n, device=dev)
                lens = torch.full((B,), n, device=dev, dtype=torch.int64)
                got = tt.topk_select(scores, lens, k, TOPK_CHUNK)
                kk = min(k, n)          # n < k: every position, -1 padded (torch.topk: all n)
                want = torch.topk(scores, kk, dim=-1).indices.sort(-1).values
                r["agrees_with_torch"] = bool(torch.equal(got[:, :kk], want) and bool((got[:, kk:] == -1).all()))
                r["glmc_us"] = common.bench_ms(lambda: tt.topk_select(scores, lens, k, TOPK_CHUNK)) * 1e3
                r["torch_topk_us"] = common.bench_ms(lambda: torch.topk(scores, kk, dim=-1)) * 1e3
                if n > TOPK_CHUNK:   # the split's segment size (topk_segment's choice is `glmc_us`)
                    r["by_segment_us"] = {seg: common.bench_ms(lambda seg=seg: tt.topk_select(
                        scores, lens, k, TOPK_CHUNK, segment=seg)) * 1e3 for seg in SEGMENTS if seg < n}
                if dev == "cuda":
                    r["launch_us"] = launch_times(lambda: tt.topk_select(scores, lens, k, TOPK_CHUNK))
            except Exception as e:
                r.update(fail(e))
            rows.append(r)
    return rows


# ----------------------------------------------------------------------------- transformers
def cached_tensors(model, cache):
    """(owner, attribute, tensor) of every cached tensor with a HF_PROMPT-long dim: the cache's
    layers, and modules that keep their own (an indexer's key cache, in some transformers versions)."""
    import torch
    owners = list(getattr(cache, "layers", [])) + [m for m in model.modules()]
    return [(o, name, t) for o in owners for name, t in list(vars(o).items())
            if isinstance(t, torch.Tensor) and t.dim() >= 3 and HF_PROMPT in t.shape]


def short_prefill(model, B):
    import torch
    ids = torch.randint(0, model.config.vocab_size, (B, HF_PROMPT), device=model.device)
    return model(input_ids=ids, use_cache=True).past_key_values, ids[:, -1:]


def grown_cache(model, B, ctx):
    """HF's own cache after a HF_PROMPT-token prefill, every cached tensor's sequence dim grown to
    ctx with random values of its dtype (the structure is whatever this transformers version keeps)."""
    import torch
    cache, tok = short_prefill(model, B)
    for owner, name, t in cached_tensors(model, cache):
        shape = list(t.shape)
        shape[shape.index(HF_PROMPT)] = ctx
        setattr(owner, name, torch.randn(shape, device=t.device, dtype=t.dtype))
    return cache, tok


def hf_cache_bytes(model, B, ctx):
    """Bytes the grown cache will hold, from a batch-1 short prefill's tensors."""
    cache, _ = short_prefill(model, 1)
    return sum(t.nbytes for _, _, t in cached_tensors(model, cache)) * B * ctx / HF_PROMPT


def run_hf(model, contexts, batches, dev, deadline, per_point_s, save):
    """HF decode ms per (ctx, batch), each point under a SIGALRM limit; -> {ctx: {B: row}}."""
    import torch

    def alarm(*_):
        raise TimeoutError(f"HF point outlasted its {per_point_s:.0f} s limit")
    out, old = {}, signal.signal(signal.SIGALRM, alarm)
    if dev == "cuda":   # decode_bench: cuDNN SDPA re-plans every step; the variant without it is faster
        torch.backends.cuda.enable_cudnn_sdp(False)
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)   # inference: no autograd graph over a 128K cache
    try:
        for ctx in contexts:
            for B in batches:
                row = out.setdefault(ctx, {}).setdefault(B, {})
                left = deadline - common.now()
                if left < 5:
                    row.update(failed="skipped: benchmark budget spent")
                    continue
                cache = None
                signal.alarm(max(1, int(min(left, per_point_s))))
                try:
                    need = hf_cache_bytes(model, B, ctx)
                    free = torch.cuda.mem_get_info()[0] if dev == "cuda" else 64 * GIB
                    row["cache_gib"] = need / GIB
                    if need > free:
                        row["failed"] = f"does not fit: HF cache {need / GIB:.1f} GiB > {free / GIB:.1f} GiB free"
                        continue
                    cache, tok = grown_cache(model, B, ctx)
                    row["cache_len"] = cache.get_seq_length()
                    row["ms"], _ = db.hf_steps(model, cache, tok, 1, 3)
                except Exception as e:
                    row.update(fail(e))
                finally:
                    signal.alarm(0)
                    cache = None
                    if dev == "cuda":
                        torch.cuda.empty_cache()
                save()
    finally:
        signal.signal(signal.SIGALRM, old)
        torch.set_grad_enabled(grad)
        if dev == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(True)
    return out


# ----------------------------------------------------------------------------- report
def fmt(v, w=9, p=3):
    return f"{v:{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-' if v is None else v:>{w}}"


def step_table(res):
    lines = [f"{'kv':>4} {'ctx':>7} {'B':>3} {'replay ms':>9} {'step ms':>9} {'roof ms':>9} {'x roof':>7}"
             f" {'HF ms':>9} {'HF/glmc':>8}  note"]
    for kv, by_ctx in res["glmc"].items():
        for ctx, by_b in by_ctx.items():
            for B, r in by_b.items():
                if B == "setup":
                    continue
                hf = res["hf"].get(ctx, {}).get(B, {})
                g, h = r.get("replay_ms"), hf.get("ms")
                hf_ratio = h / g if g and h else None
                note = r.get("failed") or (f"HF: {hf['failed'][:60]}" if "failed" in hf else "")
                lines.append(f"{kv:>4} {ctx:>7} {B:>3} {fmt(g)} {fmt(r.get('step_ms'))} {fmt(r.get('roofline_ms'))}"
                             f" {fmt(r.get('x_roofline'), 7, 2)} {fmt(h)} {fmt(hf_ratio, 8, 2)}  {note}")
    return "\n".join(lines)


def kernel_table(res):
    lines = [f"{'kv':>4} {'ctx':>7} {'B':>3} {'kernel':18s} {'us':>9} {'GB/s':>7} {'floor us':>9} {'x floor':>8}"]
    for kv, by_ctx in res["glmc"].items():
        for ctx, by_b in by_ctx.items():
            for B, r in by_b.items():
                for k in r.get("kernels", []) if B != "setup" else []:
                    lines.append(f"{kv:>4} {ctx:>7} {B:>3} {k['kernel']:18s} {fmt(k.get('ms', 0) * 1e3, 9, 1)}"
                                 f" {fmt(k.get('gbps'), 7, 0)} {fmt(k.get('floor_ms', 0) * 1e3, 9, 1)}"
                                 f" {fmt(k.get('x_floor'), 8, 2)} {k.get('failed', '')}")
    return "\n".join(lines)


def topk_table(rows):
    lines = [f"{'n':>7} {'B':>3} {'glmc us':>9} {'torch.topk us':>13} {'same set':>8}"]
    for r in rows:
        segs = " ".join(f"{seg}:{us:.1f}" for seg, us in r.get("by_segment_us", {}).items())
        if r.get("launch_us"):
            segs += f"  launches (eager, device us): {r['launch_us']}"
        lines.append(f"{r['n']:>7} {r['batch']:>3} {fmt(r.get('glmc_us'), 9, 1)} {fmt(r.get('torch_topk_us'), 13, 1)}"
                     f" {str(r.get('agrees_with_torch', '-')):>8} {r.get('failed', '')}"
                     + (f"  by segment: {segs}" if segs else ""))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def ints(s):
    return [int(x) for x in s.split(",")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="smoke run: narrow widths, TRITON_INTERPRET=1, no graphs")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--contexts", type=ints, default=[1024, 8192, 32768, 131072])
    ap.add_argument("--batches", type=ints, default=[1, 8, 32])
    ap.add_argument("--kv-dtypes", default="fp8,bf16", help="KV cache dtypes, measured in this order")
    ap.add_argument("--topk-lengths", type=ints, default=[1025, 4096, 8192, 32768, 65536, 131072])
    ap.add_argument("--budget", type=float, default=480, help="seconds for the whole run")
    ap.add_argument("--hf-point-s", type=float, default=40, help="time limit of one transformers point")
    ap.add_argument("--skip", default="", help="comma list of: hf, topk")
    ap.add_argument("--prefill", type=ints, default=[], help="prompt lengths to prefill in chunks (e.g. 8192,32768): "
                    "instead of the decode points, the chunked prefill table")
    ap.add_argument("--chunk", type=int, default=8192, help="--prefill's chunk (tokens per forward), and "
                    "--fill model's")
    ap.add_argument("--fill", choices=("model", "random"), default="model",
                    help="decode points: the caches as the model's prefill writes them, or random values")
    ap.add_argument("--indexer-tiles", default="", help="--prefill: the indexer's token-block kernel at these "
                    "block_m:block_n:warps:stages (comma list) on the longest prompt's last chunk, next to the "
                    "per-token kernel")
    ap.add_argument("--profile", action="store_true", help="--prefill: per chunk, each op kind's time (one more "
                    "forward with CUDA events around every op) and the SM clock")
    args = ap.parse_args()
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        if args.prefill:
            args.prefill, args.chunk = [n for n in args.prefill if n <= 300] or [200], min(args.chunk, 96)
        if args.contexts == ap.get_default("contexts"):
            args.contexts = [96, 200]
        args.batches = [b for b in args.batches if b <= 2] or [1]
        args.topk_lengths = [n for n in args.topk_lengths if n <= 300] or [200]
    import torch
    t0, out_dir = common.now(), Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.bfloat16)
    info = {"device": "cpu-interpreter" if args.cpu else torch.cuda.get_device_name(), "commit": args.commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "args": vars(args)}
    res = {"info": info, "glmc": {}, "hf": {}, "topk": []}
    path = out_dir / f"long_context_bench_{time.strftime('%Y-%m-%d_%H%M')}.json"
    save = lambda: path.write_text(json.dumps(res, indent=1, default=str))  # noqa: E731
    info["copy_gbps"], info["mm_tflops"] = common.ceilings(args.cpu)
    model = common.slice_model(dev, dtype, seed=0, narrow=args.cpu)
    with torch.no_grad():   # decode_bench: HF's zero bias spreads routing like real traffic
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.zero_()
    info["model_build_s"], k = common.now() - t0, model.config.index_topk
    budget_end = t0 + args.budget
    if args.prefill:
        res["prefill"] = []
        for kv in args.kv_dtypes.split(","):
            res["prefill"] += run_prefill(model, kv, args.prefill, args.chunk, dev, dtype, info, budget_end,
                                          args.profile, [t for t in args.indexer_tiles.split(",") if t])
            save()
        info["total_s"] = common.now() - t0
        save()
        print(f"device {info['device']}  bf16 matmul {info['mm_tflops']:.0f} TFLOP/s  total {info['total_s']:.0f} s")
        print(prefill_table(res["prefill"]))
        print(f"saved {path}")
        return
    kv_dtypes = args.kv_dtypes.split(",")
    # budget shares, in priority order: glmc fp8, top-k micro, transformers, glmc bf16
    for i, kv in enumerate(kv_dtypes):
        if i == 1:   # the second KV dtype runs after the top-k micro-bench and transformers
            if "topk" not in args.skip:
                res["topk"] = topk_micro(args.topk_lengths, sorted({args.batches[0], args.batches[-1]}), k, dev,
                                         budget_end - 0.3 * args.budget)
            if "hf" not in args.skip:
                res["hf"] = run_hf(model, args.contexts, args.batches, dev, budget_end - 0.2 * args.budget,
                                   args.hf_point_s, save)
            save()
        share = budget_end - (0.45 * args.budget if i == 0 and len(kv_dtypes) > 1 else 0)
        try:
            res["glmc"][kv] = run_glmc(model, kv, args.contexts, args.batches, dev, dtype, info, share, save,
                                       args.fill, args.chunk)
        except Exception as e:   # reported; the other parts still run
            res["glmc"][kv] = {"failed": fail(e)}
        save()
    if len(kv_dtypes) == 1:
        if "topk" not in args.skip:
            res["topk"] = topk_micro(args.topk_lengths, sorted({args.batches[0], args.batches[-1]}), k, dev, budget_end)
        if "hf" not in args.skip:
            res["hf"] = run_hf(model, args.contexts, args.batches, dev, budget_end, args.hf_point_s, save)
    info["total_s"] = common.now() - t0
    save()
    print(f"device {info['device']}  copy {info['copy_gbps']:.0f} GB/s  total {info['total_s']:.0f} s")
    print(step_table(res))
    print(kernel_table(res))
    print(topk_table(res["topk"]))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
