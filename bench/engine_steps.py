"""Where a served step's time goes, without HTTP: the engine in this process, one workload, per-step
timings and a cProfile of the loop. For finding host time per step and comparing commits on one machine.

    bash bench/with_wheels.sh python -m bench.engine_steps --out-dir $OUT [--concurrency 32] [--label x]

1. The serve_gpu slice checkpoint (bench/serve_gpu.py's write_checkpoint: GLM-5.3 width, 2 layers,
   random bf16 weights; reused when --ckpt-dir has it) and the engine `glmc run --device cuda` builds
   for serve_gpu's flags (max_running 128, 4096 pages, max_context 2048, max_batch_tokens 2048, bf16 KV),
   start-up warm-up included.
2. serve_bench's c32 workload (seed 0: 128 requests, 32-128 output tokens, greedy, ignore_eos), each
   chat-templated and tokenised; --concurrency requests are kept in flight: a finished one is replaced
   by the next before the following step, as a client at that concurrency does (minus HTTP).
3. Every `engine.step()` is timed (wall) and classed by what the scheduler gave it: decode-only or
   mixed (prefill tokens in it). cProfile runs over the whole loop (its overhead inflates host time:
   the per-step table comes from a second, unprofiled pass over the same workload, prefix cache
   flushed in between).
Only APIs that exist since commit 71c9667 are used, so an older glmc wheel can run it too.
Out: engine_steps_<label>.json (steps, summary, top functions) and .txt (the cProfile table).
"""
from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import os
import pstats
import time
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(ckpt: Path, cpu: bool):
    from glmc.api import plan_for
    from glmc.runtime.engine.startup import build_engine
    params = inspect.signature(plan_for).parameters   # kv_dtype: a keyword, or a RunConfig field
    extra = {"kv_dtype": "bf16"} if "kv_dtype" in params or "settings" in params else {}
    device = "cpu" if cpu else "cuda"
    plan = plan_for(ckpt, device="cuda", max_running=128, **extra)
    return build_engine(plan, ckpt, device=device, num_pages=64 if cpu else 4096,
                        max_context=256 if cpu else 2048, max_running=4 if cpu else 128,
                        max_batch_tokens=64 if cpu else 2048)


def workload(engine, seed: int, n: int, lo: int, hi: int, words: tuple | None, shared: float) -> list:
    from bench import serve_bench
    from glmc.runtime.engine.request import SamplingParams
    a = Namespace(seed=seed, num_requests=n, min_tokens=lo, max_tokens=hi, prompt_words=words,
                  prefix_words=160, num_prefixes=2, shared_frac=shared)
    out = []
    for spec in serve_bench.make_workload(a):
        text = engine.tokenizer.apply_chat_template(spec["messages"])
        ids = engine.tokenizer.encode(text)
        out.append((ids, SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)))
    return out


def drive(engine, work: list, concurrency: int) -> list[dict]:
    """Keep `concurrency` requests in flight; time every step; -> per-step rows."""
    sched = engine.scheduler
    seen: list = []
    orig = sched.schedule

    def schedule(*args, **kw):   # what each step was given (prefill tokens vs decode rows)
        out = orig(*args, **kw)
        batches = out if isinstance(out, list) else [out]
        pre = dec = 0
        for b in batches:
            if b is None:
                continue
            for r, n in zip(b.reqs, b.extend_lens):
                if n == 1 and r.is_decoding:
                    dec += 1
                else:
                    pre += n
        seen.append((pre, dec))
        return out
    sched.schedule = schedule
    queue, live, rows = list(work), [], []
    try:
        while queue or live:
            live = [r for r in live if not r.finished]
            while queue and len(live) < concurrency:
                ids, params = queue.pop(0)
                req = engine.make_request(ids, params)
                engine.submit(req)
                live.append(req)
            n0 = len(seen)
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            pre, dec = seen[n0] if len(seen) > n0 else (0, 0)
            rows.append({"ms": dt * 1e3, "prefill_tokens": pre, "decode_rows": dec})
        while engine.step():
            pass
    finally:
        sched.schedule = orig
    return rows


def summarize(rows: list[dict], out_tokens: int, wall: float) -> dict:
    def stat(sel):
        ms = sorted(r["ms"] for r in sel)
        if not ms:
            return None
        return {"steps": len(ms), "mean_ms": sum(ms) / len(ms), "p50_ms": ms[len(ms) // 2],
                "sum_s": sum(ms) / 1e3, "prefill_tokens": sum(r["prefill_tokens"] for r in sel),
                "mean_decode_rows": sum(r["decode_rows"] for r in sel) / len(sel)}
    return {"wall_s": wall, "output_tokens": out_tokens, "tok_s": out_tokens / wall,
            "all": stat(rows), "decode_only": stat([r for r in rows if not r["prefill_tokens"]]),
            "mixed": stat([r for r in rows if r["prefill_tokens"]]),
            "decode_only_b_ge_28": stat([r for r in rows if not r["prefill_tokens"] and r["decode_rows"] >= 28])}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="/tmp/engine_steps")
    ap.add_argument("--ckpt-dir", default="/tmp/glmc_slice")
    ap.add_argument("--label", default=os.environ.get("GLMC_COMMIT", "run"))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--cpu", action="store_true", help="dry run: narrow slice, interpreted Triton")
    a = ap.parse_args()
    if a.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from bench import serve_gpu
    import torch
    ckpt = Path(a.ckpt_dir)
    t = time.perf_counter()
    serve_gpu.write_checkpoint(ckpt, a.cpu, "cpu" if a.cpu else "cuda")
    t_ckpt = time.perf_counter() - t
    t = time.perf_counter()
    engine = build(ckpt, a.cpu)
    t_build = time.perf_counter() - t
    n, lo, hi, words, shared = (6, 2, 4, (4, 8), 0.0) if a.cpu else (128, 32, 128, None, 0.5)
    work = workload(engine, 0, n, lo, hi, words, shared)
    res = {"label": a.label, "device": "cpu" if a.cpu else torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "concurrency": a.concurrency,
           "checkpoint_s": t_ckpt, "build_s": t_build, "prompt_tokens": sum(len(i) for i, _ in work)}
    passes = {}
    for name in ("warm", "plain", "profiled"):
        engine.flush_cache()
        prof = cProfile.Profile() if name == "profiled" else None
        t = time.perf_counter()
        if prof:
            prof.enable()
        rows = drive(engine, work, a.concurrency)
        if prof:
            prof.disable()
        wall = time.perf_counter() - t
        passes[name] = summarize(rows, sum(p.max_tokens for _, p in work), wall)
        if name == "plain":
            res["steps"] = rows
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(45)
            s.write("\n\n=== by cumulative ===\n")
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
            (out / f"engine_steps_{a.label}.txt").write_text(s.getvalue())
        print(name, json.dumps(passes[name]), flush=True)
    res["passes"] = passes
    (out / f"engine_steps_{a.label}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
