"""The serving benchmark on one GPU, one command: a GLM-5.3-width slice checkpoint, `glmc run
--device cuda` at concurrency up to 128, bench/serve_bench.py at concurrency 1, 8, 32 and 128 against the
warm server, a profile of served steps, then bench/decode_bench.py's graph-replay step at the same
batches, and every serving run's TPOT next to that step. bench/serve_gpu.sh wraps it for the device:

    python -m bench.serve_gpu --out-dir $OUT --budget 540     # CUDA (the H200)
    python -m bench.serve_gpu --cpu --out-dir /tmp/sg           # CPU dry run: narrow widths, fp32, the
                                                                # same runner uncaptured, interpreted Triton

1. Checkpoint: config.json of the 2-layer slice (bench/common.py's GLM53 + SLICE: hidden 6144,
   64 heads, q_lora 2048, kv_lora 512, nope/rope/v 192/64/256, 256 experts top-8 + shared, moe_inter
   2048, layer 0 dense, layer 1 MoE, both full DSA indexers 32 x 128, index_topk 2048, vocab 154880),
   random bf16 weights drawn on the GPU and streamed to one safetensors file, and models/tiny's
   tokenizer (vocab 512). The router correction bias is zero (HF's init; a random one crowds every
   token onto a few experts), and lm_head rows >= the tokenizer's vocab are zero, so greedy picks
   tokens the tokenizer can print (every streamed chunk carries text) while the lm_head GEMV still
   reads all 154880 rows.
2. `glmc run --weights <slice> --device cuda --port 0` (SERVER_FLAGS: --max-running 128, --num-pages 4096
   = 128 requests x the whole --max-context 2048, so no request is ever retracted; --profile-dir) in its
   own session (log: server.log). Its start-up captures the decode graphs and compiles every kernel
   variant serving hits, so there is no warm-up traffic: /metrics' glmc_kernel_binaries_compiled is read
   before and after each run, and the delta (compiles a served request waited for) must be 0.
3. serve_bench runs (RUNS: fixed seeded workloads, in the order c1, c32, c8, c128; one that outlasts
   the budget is stopped and reported). Then c32's workload, seed 5, as c32_prof: once it is in steady
   state (Profiler), POST /start_profile {"num_steps": 5}: torch.profiler traces (host and device) of
   5 served steps (profile/, trace gzipped). Separate from c32 because starting the profiler and
   exporting the trace stall the engine thread; c32_prof's row shows that cost, and its ITL p99
   outside the profiled window is reported with the profile.
4. The server is stopped (its GPU memory freed) and bench/decode_bench.py runs glmc alone (--skip
   eager,compile) at batches 1,8,32,128, context --step-ctx (default 512: the served requests' mean
   context, prompt + half the output, is 509-592 tokens in these workloads): graph replay ms and whole
   step ms (inputs in, logits read) per batch. Each run's TPOT p50 is divided by the step at its
   concurrency, and the issue's targets are checked (TARGETS).
Budget: the decode benchmark's share (DECODE_RESERVE_S) and the server's stop are kept back from the
start; a serving run that no longer fits before that is skipped and says so.
Out dir (at most 8 files, for the device's return): summary.json (everything below, one file),
serve_runs.json (every run's serve_bench JSON, per-request rows included), decode_bench.json,
server.log, profile/engine_steps_*.json.gz and .txt, serve_gpu.log (serve_gpu.sh's tee).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import common

ROOT = Path(__file__).resolve().parents[1]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# bf16 KV: the cache decode_bench's step (the ratios' denominator) runs (FP8 KV: bench/long_context_bench.py)
SERVER_FLAGS = {"gpu": "--num-pages 4096 --max-context 2048 --max-running 128 --max-batch-tokens 2048 --kv-dtype bf16",
                # the dry run: warm-up compiles (interprets) prompts up to 64 tokens, not 2048
                "cpu": "--num-pages 64 --max-context 256 --max-running 4 --max-batch-tokens 64"}
# (name, concurrency = the decode batch compared, serve_bench arguments); serve_bench's defaults for the
# rest: chat prompts of 8-32 / 32-128 / 128-384 words (one bucket drawn per request), half of them
# opening with one of 2 system prompts of 160 words, all requests sent at once, greedy, ignore_eos
# Run in this order (the targets' runs first, should the budget run short); the table sorts by concurrency.
RUNS = {"gpu": (("c1", 1, "--num-requests 16 --concurrency 1 --min-tokens 64 --max-tokens 64 --seed 2 "
                 "--prompt-words 8,640"),   # prompts up to ~2K tokens (the TTFT target's range)
                ("c32", 32, "--num-requests 128 --concurrency 32 --min-tokens 32 --max-tokens 128 --seed 0"),
                ("c8", 8, "--num-requests 32 --concurrency 8 --min-tokens 32 --max-tokens 128 --seed 3"),
                ("c128", 128, "--num-requests 256 --concurrency 128 --min-tokens 32 --max-tokens 128 --seed 4")),
        # interpreted Triton takes minutes per long prompt: a few short ones
        "cpu": (("c1", 1, "--num-requests 2 --concurrency 1 --min-tokens 4 --max-tokens 4 --seed 2 "
                 "--prompt-words 4,8 --shared-frac 0"),
                ("c2", 2, "--num-requests 3 --concurrency 2 --min-tokens 4 --max-tokens 8 --seed 0 "
                 "--prompt-words 4,8 --shared-frac 0"))}
# the least time a run needs (s): one that would get less is skipped rather than cut short
RUN_MIN_S = {"gpu": {"c1": 15, "c8": 15, "c32": 25, "c128": 30, "c32_prof": 25},
             "cpu": {"c1": 60, "c2": 60, "c2_prof": 60}}
# The profile: after RUNS, the workload of `base` with another seed (its prompts not in the prefix cache
# yet) as run `name`, with POST /start_profile for `steps` engine steps once it is in steady state (at
# most `max_wait` s in: see Profiler). A separate run, so that the profiler's start-up and trace export
# (they stall the engine thread) stay out of the measured runs; its row in the table shows their cost.
PROFILE = {"gpu": {"name": "c32_prof", "base": "c32", "seed": 5, "steps": 5, "max_wait": 6.0},
           "cpu": {"name": "c2_prof", "base": "c2", "seed": 5, "steps": 2, "max_wait": 5.0}}


def all_runs(kind: str) -> list[tuple[str, int, str]]:
    """RUNS, then the profiled run."""
    pr = PROFILE[kind]
    return [*RUNS[kind], *((pr["name"], c, re.sub(r"--seed \d+", f"--seed {pr['seed']}", a))
                           for n, c, a in RUNS[kind] if n == pr["base"])]
DECODE_RESERVE_S, STOP_RESERVE_S = {"gpu": 110, "cpu": 300}, 40
# the serving targets: (run, what, op, bound, text); the step is decode_bench's graph replay at the batch
TODAY_TOK_S = 578.0
TARGETS = (("c1", "tpot_p50_over_replay", "<=", 1.15, "single-stream TPOT p50 within 1.15x of the B=1 replay"),
           ("c1", "ttft_p99_ms", "<", 100.0, "TTFT p99 at concurrency 1 under 100 ms, prompts up to 2K"),
           ("c32", "tpot_p50_over_replay", "<=", 1.5, "concurrency-32 TPOT p50 within 1.5x of the B=32 replay"),
           ("c32", "output_tokens_per_s", ">=", 5 * TODAY_TOK_S, f"concurrency-32 output tok/s >= 5 x {TODAY_TOK_S:g}"))
METRICS = ("kernel_binaries_compiled", "steps_total", "prefill_tokens_total", "generation_tokens_total",
           "prefix_cache_hit_tokens_total", "requests_retracted_total", "requests_rejected_total")


def now():
    return time.perf_counter()


# ----------------------------------------------------------------------------- checkpoint
def slice_config(narrow: bool, dtype_name: str) -> dict:
    # narrow: vocab 512, the tokenizer's (the engine refuses a tokenizer larger than the model)
    cfg = {**common.GLM53, **common.SLICE, **(dict(common.NARROW, vocab_size=512) if narrow else {})}
    for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
        cfg.pop(k)
    cfg.update(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", dtype=dtype_name,
               num_nextn_predict_layers=0, hidden_act="silu", attention_bias=False,
               head_dim=cfg["qk_rope_head_dim"])
    return cfg


def _init(name, shape, dtype, device, gen, printable):
    """bench/common.randomize_on_device_'s scales; zero router bias; lm_head rows past the
    tokenizer's vocab zero."""
    import torch
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    if len(shape) == 1:
        return t.normal_(1.0, 0.2, generator=gen)
    t.normal_(0.0, 1.0 if name.endswith("embed_tokens.weight") else shape[-1] ** -0.5, generator=gen)
    if name == "lm_head.weight":
        t[printable:].zero_()
    return t


def write_checkpoint(d: Path, narrow: bool, device: str) -> dict:
    """config.json, model.safetensors (streamed: one tensor on the host at a time), tokenizer."""
    import torch
    from glmc.runtime.worker.checkpoint import expected_tensors

    from glmc.spec import config_from_hf
    dtype, dname = (torch.float32, "float32") if narrow else (torch.bfloat16, "bfloat16")
    d.mkdir(parents=True, exist_ok=True)
    if (d / "written.json").exists():  # a warm machine's earlier call wrote it
        return {**json.loads((d / "written.json").read_text()), "reused": True}
    cfg = slice_config(narrow, dname)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in TOKENIZER_FILES:
        (d / f).write_bytes((ROOT / "models" / "tiny" / f).read_bytes())
    printable = len(json.loads((d / "tokenizer.json").read_text())["model"]["vocab"])
    shapes = sorted(expected_tensors(config_from_hf(cfg)).items())
    code, size = ("F32", 4) if narrow else ("BF16", 2)
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes:
        n = size * int(torch.tensor(shape).prod())
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    gen = torch.Generator(device=device).manual_seed(0)
    with open(d / "model.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for name, shape in shapes:
            t = _init(name, shape, dtype, device, gen, printable)
            f.write(t.cpu().contiguous().view(torch.uint8).numpy())
    done = {"tensors": len(shapes), "bytes": off, "tokenizer_vocab": printable}
    (d / "written.json").write_text(json.dumps(done))
    return done


# ----------------------------------------------------------------------------- server
def start_server(ckpt: Path, out: Path, cpu: bool, deadline: float) -> tuple[subprocess.Popen, str]:
    args = ["--weights", str(ckpt), "--port", "0", "--log-level", "warning",
            *SERVER_FLAGS["cpu" if cpu else "gpu"].split(), "--profile-dir", str(out / "profile")]
    cmd = common.command("serve_gpu", "--serve-cpu", *args) if cpu else \
        [sys.executable, "-m", "glmc.cli", "run", "--device", "cuda", *args]
    log = out / "server.log"
    # `glmc run`'s cwd is outside the repo: there `glmc` is the installed package, not the repo's
    # glmc/ folder (the CPU server is this module, found from the repo root)
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=ROOT if cpu else "/tmp",
                            env={**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"})
    while not (m := re.search(r"serving \S+ at (http://\S+/v1)", log.read_text())):
        if proc.poll() is not None:
            raise RuntimeError(f"glmc run exited ({proc.returncode}) before serving: "
                               f"{log.read_text()[-1500:]}")
        if now() > deadline:
            stop_server(proc)
            raise TimeoutError("glmc run did not start before the budget's start-up share was spent")
        time.sleep(0.5)
    return proc, m.group(1)


def stop_server(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def serve_cpu(argv) -> None:
    """The dry run's server: `glmc run --device cuda`'s engine, with the CudaExecutor on the host."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from glmc.runtime.engine.engine import Engine
    from glmc.runtime.engine.startup import warm_up
    from glmc.runtime.engine.tokenizer import Tokenizer
    from glmc.runtime.serving.http_process import serve
    from glmc.runtime.serving.server import ServerOptions
    from glmc.runtime.worker.loader import load_runner

    from glmc.api import plan_for
    ap = argparse.ArgumentParser()
    for k in ("--weights", "--port", "--log-level", "--num-pages", "--max-context", "--max-running",
              "--max-batch-tokens", "--profile-dir"):
        ap.add_argument(k)
    a = ap.parse_args(argv)
    running = int(a.max_running)
    runner = load_runner(plan_for(a.weights, device="cuda", max_running=running), a.weights,
                         device="cpu", num_pages=int(a.num_pages), max_context=int(a.max_context),
                         max_running=running)
    engine = Engine(runner, Tokenizer.from_dir(a.weights), max_running=running,
                    max_batch_tokens=int(a.max_batch_tokens))
    warm_up(engine)
    serve(engine, Path(a.weights).name, "127.0.0.1", int(a.port), a.log_level,
          ServerOptions(profile_dir=a.profile_dir))


def scrape(root: str) -> dict[str, float]:
    """glmc_* samples of /metrics without labels (counters, gauges), by name less the prefix."""
    import httpx
    out = {}
    for line in httpx.get(root + "/metrics", timeout=10).text.splitlines():
        if line.startswith("glmc_") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name.removeprefix("glmc_")] = float(value)
    return out


# ----------------------------------------------------------------------------- serving runs
class Profiler(threading.Thread):
    """POST /start_profile {"num_steps": steps} once the run is in steady state: at least `delay` s in,
    the run's first 4 x concurrency tokens generated (its first prefills done, decoding under way)
    and 3/4 of the concurrency running (/metrics, polled every 0.1 s); `max_wait` s into the run it goes
    ahead regardless, and once the run's client has exited it gives up (a profile still pending when the
    run ends would record the next run's steps).
    The answer's paths, the server's state and the window (perf_counter: CLOCK_MONOTONIC, the clock of
    serve_bench's rows) land in .result."""
    def __init__(self, root: str, delay: float, steps: int, max_wait: float, concurrency: int):
        super().__init__(daemon=True)
        self.root, self.delay, self.max_wait, self.conc = root, delay, max_wait, concurrency
        self.result = {"num_steps": steps}

    def begin(self, t_run: float, client: subprocess.Popen):
        self.result["t_run"], self.client = t_run, client
        self.base = scrape(self.root).get("generation_tokens_total", 0)
        self.start()

    def run(self):
        import httpx
        r, t_run = self.result, self.result["t_run"]
        try:
            while True:
                time.sleep(0.1)
                state = scrape(self.root)
                steady = (now() - t_run >= self.delay
                          and state.get("generation_tokens_total", 0) - self.base >= 4 * self.conc
                          and state.get("num_requests_running", 0) >= max(1, 0.75 * self.conc))
                if steady or now() - t_run > self.max_wait or self.client.poll() is not None:
                    break
            r["steady"] = steady
            if self.client.poll() is not None:
                r["error"] = "not profiled: the run ended first"
                return
            r["state_at_start"] = {k: state.get(k) for k in ("num_requests_running", "num_requests_waiting")}
            r["state_at_start"]["run_tokens_generated"] = state.get("generation_tokens_total", 0) - self.base
            r["t_start"] = now()
            resp = httpx.post(self.root + "/start_profile", json={"num_steps": r["num_steps"]}, timeout=180)
            r["t_end"] = now()
            r.update(status=resp.status_code, **(resp.json() if resp.status_code == 200 else {"error": resp.text[:500]}))
        except Exception as e:  # reported; the run's numbers stand
            r["error"] = f"{type(e).__name__}: {e}"[:500]


def run_bench(name, args, url, work, cpu, timeout, profiler=None) -> dict:
    path = work / f"serve_{name}.json"
    path.unlink(missing_ok=True)
    cmd = common.command("serve_bench", "--url", url, "--out", str(path), "--note", f"bench.serve_gpu run {name}",
                         *args.split())
    if cpu:
        cmd += ["--device", "cpu dry run (CudaExecutor uncaptured, narrow slice)"]
    t = now()
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        if profiler is not None:
            profiler.begin(t, p)
        stdout, stderr = p.communicate(timeout=max(1, timeout))
        res = {"rc": p.returncode, "stdout": stdout[-2500:], "stderr": stderr[-1500:]}
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        res = {"rc": None, "error": f"stopped after {timeout:.0f} s (budget)"}
    res["seconds"] = round(now() - t, 1)
    if path.exists():
        full = json.loads(path.read_text())
        res["summary"], res["config"], res["rows"] = full["summary"], full["config"], full["rows"]
        res["commit"] = full.get("commit")
    print(f"[{name}] {json.dumps({k: v for k, v in res.items() if k not in ('summary', 'config', 'rows')})[:3000]}",
          flush=True)
    return res


def workload_stats(rows) -> dict:
    """Prompt tokens (min/mean/max) and mean context while decoding (prompt + half the output)."""
    ok = [r for r in rows if not r.get("error") and r.get("prompt_tokens") is not None]
    if not ok:
        return {}
    p = [r["prompt_tokens"] for r in ok]
    return {"prompt_tokens_min": min(p), "prompt_tokens_mean": round(sum(p) / len(p), 1),
            "prompt_tokens_max": max(p), "output_tokens_per_request": [min(r["output_tokens"] for r in ok),
                                                                       max(r["output_tokens"] for r in ok)],
            "mean_decode_context": round(sum(r["prompt_tokens"] + r["output_tokens"] / 2 for r in ok) / len(ok), 1)}


def itl_outside(rows, t0, t1) -> dict:
    """ITL p99 of the gaps that do not overlap [t0, t1] (the profiled steps), and how many did."""
    from bench import serve_bench
    inside, outside = 0, []
    for r in rows:
        if r.get("error") or r.get("ttft_s") is None:
            continue
        a = r["start_s"] + r["ttft_s"]
        for gap in r["itl_s"]:
            b = a + gap
            if b > t0 and a < t1:
                inside += 1
            else:
                outside.append(gap * 1e3)
            a = b
    return {"itl_p99_ms_outside_profile": serve_bench.pct(outside, 99), "itls_overlapping_profile": inside}


def save_profile(prof: dict, run_rows) -> dict:
    """gzip the trace (Perfetto opens .json.gz; the device returns files up to 16 MiB) and place the
    profiled window in the run."""
    trace = prof.get("trace")
    if trace and Path(trace).exists():
        with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        Path(trace).unlink()
        prof["trace"] = trace + ".gz"
        prof["trace_bytes"] = Path(prof["trace"]).stat().st_size
    if "t_start" in prof and "t_end" in prof:
        prof["window_s_into_run"] = [round(prof["t_start"] - prof["t_run"], 2), round(prof["t_end"] - prof["t_run"], 2)]
        prof.update(itl_outside(run_rows or [], prof["t_start"], prof["t_end"]))
    return prof


# ----------------------------------------------------------------------------- decode step
def decode_step(batches, ctx, work, out, cpu, timeout, commit) -> dict:
    """bench/decode_bench.py, glmc only: {batch: {replay_ms, step_ms}} + its info."""
    d = work / "decode_bench"
    shutil.rmtree(d, ignore_errors=True)
    cmd = common.command("decode_bench", "--out-dir", str(d), "--commit", commit,
                         "--batches", ",".join(map(str, batches)), "--skip", "eager,compile", "--ctx", str(ctx),
                         # its --budget only bounds the per-op tables (to 45% of it): keep them short
                         "--budget", str(int(min(timeout, 300 if cpu else 120)))) + (["--cpu"] if cpu else [])
    t = now()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1, timeout), cwd=ROOT)
        res = {"rc": p.returncode, "tail": (p.stdout + p.stderr)[-3000:]}
    except subprocess.TimeoutExpired as e:
        res = {"rc": None, "error": f"stopped after {timeout:.0f} s (budget)",
               "tail": ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))[-2000:]}
    res["seconds"] = round(now() - t, 1)
    found = sorted(d.glob("decode_bench_*.json"))
    if found:
        shutil.copy(found[-1], out / "decode_bench.json")
        full = json.loads(found[-1].read_text())
        res["info"] = {k: v for k, v in full["info"].items() if k not in ("moe_sweep",)}
        res["batches"] = {int(B): {k: r.get("glmc", {}).get(k) for k in ("replay_ms", "step_ms", "failed")}
                          | {"roofline_ms": r.get("roofline_ms")} for B, r in full["batches"].items()}
    print(f"[decode_bench] rc={res['rc']} {res['seconds']} s {json.dumps(res.get('batches'))}", flush=True)
    return res


# ----------------------------------------------------------------------------- summary
def ratios(info) -> None:
    """Per run: TPOT p50 / decode step at the run's concurrency, and the issue's targets."""
    steps = info.get("decode_step", {}).get("batches", {})
    for name, r in info["runs"].items():
        s, B = r.get("summary"), r.get("concurrency")
        st = steps.get(B) or steps.get(str(B)) or {}
        tpot = s and s["tpot_ms"]["p50"]
        r["step"] = {"batch": B, "replay_ms": st.get("replay_ms"), "step_ms": st.get("step_ms"),
                     "tpot_p50_over_replay": tpot / st["replay_ms"] if tpot and st.get("replay_ms") else None,
                     "tpot_p50_over_step": tpot / st["step_ms"] if tpot and st.get("step_ms") else None}
    info["targets"] = []
    for run, what, op, bound, text in TARGETS:
        r = info["runs"].get(run, {})
        s = r.get("summary") or {}
        value = {"tpot_p50_over_replay": r.get("step", {}).get("tpot_p50_over_replay"),
                 "ttft_p99_ms": (s.get("ttft_ms") or {}).get("p99"),
                 "output_tokens_per_s": s.get("output_tokens_per_s")}[what]
        ok = None if value is None else (value <= bound if op == "<=" else value < bound if op == "<" else value >= bound)
        info["targets"].append({"run": run, "what": what, "target": f"{op} {bound:g}", "value": value,
                                "met": ok, "text": text})


def table(info) -> str:
    f = lambda v, d=1: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{d}f}"  # noqa: E731
    lines = [f"{'run':<8} {'conc':>4} {'req':>4} {'err':>3} {'tok/s':>7} {'TTFT p50/p99 ms':>16} "
             f"{'TPOT p50/p99 ms':>16} {'ITL p99':>8} {'compiles':>8} {'replay ms':>9} {'step ms':>8} "
             f"{'TPOT/replay':>11} {'TPOT/step':>9}"]
    for name, r in sorted(info["runs"].items(), key=lambda kv: (kv[1].get("concurrency", 0), kv[0])):
        s, st = r.get("summary"), r.get("step", {})
        if not s:
            why = r.get("error") or f"no summary (rc {r.get('rc')})"
            lines.append(f"{name:<8} {r.get('concurrency', '-'):>4} {why}")
            continue
        comp = r.get("metrics_delta", {}).get("kernel_binaries_compiled")
        lines.append(f"{name:<8} {r['concurrency']:>4} {s['requests']:>4} {s['errors']:>3} {f(s['output_tokens_per_s']):>7} "
                     f"{f(s['ttft_ms']['p50']) + ' / ' + f(s['ttft_ms']['p99']):>16} "
                     f"{f(s['tpot_ms']['p50'], 2) + ' / ' + f(s['tpot_ms']['p99'], 2):>16} {f(s['itl_ms']['p99']):>8} "
                     f"{'-' if comp is None else int(comp):>8} {f(st.get('replay_ms'), 3):>9} {f(st.get('step_ms'), 3):>8} "
                     f"{f(st.get('tpot_p50_over_replay'), 2):>11} {f(st.get('tpot_p50_over_step'), 2):>9}")
    if info.get("device") == "cpu":
        lines.append("(cpu dry run: the targets are the H200's; here they only check the plumbing)")
    for t in info.get("targets", []):
        v = t["value"]
        lines.append(f"target {t['run']:<4} {t['what']:<22} {t['target']:<8} value {f(v, 2):>8}  "
                     f"{'MET' if t['met'] else 'missed' if t['met'] is False else 'not measured'}  ({t['text']})")
    return "\n".join(lines)


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the server's threads by role. The engine's process (`pid`):
    the engine thread (named glmc-engine by the engine) and the rest (the pipe's reader, torch's
    threads); its HTTP process (`runtime/serving/http_process.py`, the spawned child that is not
    multiprocessing's resource tracker): the event loop (its main thread: HTTP, SSE) and the rest
    (intake pool). {} where /proc is not there."""
    out: dict[str, float] = {}
    for proc, http in [(pid, False), *((c, True) for c in _http_children(pid))]:
        for tid, comm, cpu in _threads(proc):
            role = ("event_loop" if tid == proc else "http_other") if http else \
                "engine" if comm == "glmc-engine" else "other"
            out[role] = out.get(role, 0.0) + cpu
    return out


def _threads(pid: int):
    """(tid, comm, cpu seconds) of each thread of `pid`."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        yield int(tid), comm, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _http_children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            kids += map(int, Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except OSError:
            continue
    def cmdline(p):
        try:
            return Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            return b""
    return [k for k in kids if b"spawn_main" in cmdline(k) and b"resource_tracker" not in cmdline(k)]


def cpu_per_token(before: dict, after: dict, summary: dict | None) -> dict:
    """Each role's CPU seconds over a run and per output token (us)."""
    toks = (summary or {}).get("output_tokens") or 0
    secs = {k: after[k] - before.get(k, 0.0) for k in after}
    return {"cpu_s": secs, "us_per_output_token": {k: v / toks * 1e6 for k, v in secs.items()} if toks else None}


# ----------------------------------------------------------------------------- main
def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-cpu":
        return serve_cpu(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="dry run on the host (narrow slice, interpreted Triton)")
    ap.add_argument("--out-dir", default="/tmp/serve_gpu", help="results (at most 8 files; default %(default)s)")
    ap.add_argument("--work-dir", default="/tmp/serve_gpu_work", help="scratch: per-run JSONs, decode_bench's "
                    "(default %(default)s)")
    ap.add_argument("--ckpt-dir", help="the slice checkpoint, reused when there (default /tmp/glmc_slice, "
                    "--cpu /tmp/glmc_slice_cpu)")
    ap.add_argument("--budget", type=float, help="seconds for everything (default 540; --cpu 1800)")
    ap.add_argument("--profile-delay", type=float, help="seconds into the profiled run before POST "
                    "/start_profile (default 1; it also waits for steady state: see Profiler)")
    ap.add_argument("--step-ctx", type=int, default=512, help="decode_bench's context (the served "
                    "requests' mean context while decoding is 509-592; default %(default)s)")
    ap.add_argument("--skip-decode-bench", action="store_true", help="no decode step (no ratios)")
    ap.add_argument("--prefill-check", action="store_true", help="then bench/gpu_prefill_check.py, if time is left")
    ap.add_argument("--server-args", default="", help="flags added to the server's (an A/B, e.g. --no-prefill-graphs)")
    ap.add_argument("--runs", help="only these runs, comma-separated (e.g. c32,c128; default all)")
    ap.add_argument("--profile-base", help="the run whose workload the profiled run repeats (default c32)")
    a = ap.parse_args()
    if a.profile_base:
        kind0 = "cpu" if a.cpu else "gpu"
        PROFILE[kind0].update(base=a.profile_base, name=f"{a.profile_base}_prof")
    kind = "cpu" if a.cpu else "gpu"
    SERVER_FLAGS[kind] = f"{SERVER_FLAGS[kind]} {a.server_args}".strip()
    if a.runs:
        RUNS[kind] = tuple(r for r in RUNS[kind] if r[0] in a.runs.split(","))
    t0, out, work = now(), Path(a.out_dir), Path(a.work_dir)
    a.ckpt_dir = a.ckpt_dir or ("/tmp/glmc_slice_cpu" if a.cpu else "/tmp/glmc_slice")
    budget = a.budget or (1800.0 if a.cpu else 540.0)
    delay = 1.0 if a.profile_delay is None else a.profile_delay
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if a.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    dev = "cpu" if a.cpu else "cuda"
    commit = os.environ.get("GLMC_COMMIT", "unknown")
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "commit": commit,
            "device": "cpu" if a.cpu else torch.cuda.get_device_name(), "budget_s": budget,
            "server_flags": SERVER_FLAGS[kind] + f" --profile-dir {out / 'profile'}",
            "workload": {name: {"concurrency": c, "serve_bench": args} for name, c, args in all_runs(kind)},
            "workload_defaults": "serve_bench defaults: chat prompts of 8-32 / 32-128 / 128-384 words (one "
                                 "bucket per request) unless --prompt-words, --shared-frac 0.5 of them open with "
                                 "one of 2 system prompts of 160 words, --request-rate inf (all sent at once), "
                                 "temperature 0, ignore_eos, streamed",
            "stages": {}, "runs": {}}
    save = lambda: (out / "summary.json").write_text(json.dumps(info, indent=1, default=str))  # noqa: E731
    # what must stay for the decode benchmark and the server's stop
    serving_end = t0 + budget - (0 if a.skip_decode_bench else DECODE_RESERVE_S[kind]) - STOP_RESERVE_S
    proc, all_rows = None, {}
    try:
        t = now()
        info["checkpoint"] = write_checkpoint(Path(a.ckpt_dir), a.cpu, dev)
        info["stages"]["checkpoint_s"] = round(now() - t, 1)
        save()
        if dev == "cuda":
            torch.cuda.empty_cache()
        t = now()
        first = RUNS[kind][0][0]
        proc, url = start_server(Path(a.ckpt_dir), out, a.cpu, serving_end - RUN_MIN_S[kind].get(first, 25))
        root = url.removesuffix("/v1")
        info["stages"]["server_start_s"] = round(now() - t, 1)
        info["server_log_start"] = [ln for ln in (out / "server.log").read_text().splitlines() if ln.startswith("glmc")]
        before, cpu_before = scrape(root), thread_cpu(proc.pid)
        info["compiled_at_startup"] = before.get("kernel_binaries_compiled")
        save()
        pr = PROFILE[kind]
        for name, conc, args in all_runs(kind):
            left = serving_end - now()
            if left < RUN_MIN_S[kind].get(name, 25):
                info["runs"][name] = {"concurrency": conc, "error": f"not run: budget spent ({left:.0f} s left "
                                      f"before the decode benchmark's share, {RUN_MIN_S[kind].get(name, 25)} s needed)"}
                save()
                continue
            prof = Profiler(root, delay, pr["steps"], pr["max_wait"], conc) if name == pr["name"] else None
            r = run_bench(name, args, url, work, a.cpu, left, prof)
            all_rows[name] = r.pop("rows", None)
            r = info["runs"][name] = {"concurrency": conc, **r}
            after, cpu_after = scrape(root), thread_cpu(proc.pid)
            r["metrics_delta"] = {k: after.get(k, 0) - before.get(k, 0) for k in METRICS}
            r["server_cpu"] = cpu_per_token(cpu_before, cpu_after, r.get("summary"))
            cpu_before = cpu_after
            before = after
            if r.get("summary"):
                r["workload_stats"] = workload_stats(all_rows[name])
            if prof is not None:
                wait = 30 if not a.cpu else 300
                prof.join(timeout=wait)
                info["profile"] = {"run": name, **save_profile(prof.result, all_rows[name]),
                                   **({"pending": f"no answer {wait} s after the run"} if prof.is_alive() else {})}
            save()
            (out / "serve_runs.json").write_text(json.dumps(
                {n: {**{k: v for k, v in info["runs"][n].items() if k not in ("stdout", "stderr")}, "rows": rows}
                 for n, rows in all_rows.items()}, default=str))
        import httpx
        info["metrics_final"] = httpx.get(root + "/metrics", timeout=10).text.splitlines()
    except Exception as e:  # reported; what was measured is kept
        import traceback
        traceback.print_exc()
        info["error"] = f"{type(e).__name__}: {e}"[:3000]
    finally:
        if proc is not None:
            t = now()
            info["server_rc"] = stop_server(proc)
            info["stages"]["server_stop_s"] = round(now() - t, 1)
            info["server_log_end"] = (out / "server.log").read_text()[-3000:]
        for name, conc, _ in all_runs(kind):   # what an early stop left out
            info["runs"].setdefault(name, {"concurrency": conc, "error": f"not run: {info.get('error', '?')}"[:200]})
        save()
    if a.skip_decode_bench:
        info["decode_step"] = {"skipped": "--skip-decode-bench"}
    else:
        left = t0 + budget - now() - 5
        batches = sorted({c for _, c, _ in RUNS[kind]})
        if left >= (60 if not a.cpu else 120):
            info["decode_step"] = decode_step(batches, a.step_ctx, work, out, a.cpu, left, commit)
        else:
            info["decode_step"] = {"skipped": f"budget spent: {left:.0f} s left"}
    ratios(info)
    save()
    check = ROOT / "bench" / "gpu_prefill_check.py"
    left = t0 + budget - now() - 5
    if a.prefill_check and check.exists() and not a.cpu and left > 30:
        t = now()
        try:
            p = subprocess.run(common.command("gpu_prefill_check", "--out", str(work / "prefill_check.json"),
                                              "--budget", str(max(20, int(left - 45)))),
                               capture_output=True, text=True, timeout=left, cwd=ROOT)
            info["prefill_check"] = {"rc": p.returncode, "tail": (p.stdout + p.stderr)[-3000:]}
        except subprocess.TimeoutExpired:
            info["prefill_check"] = {"rc": None, "error": f"stopped after {left:.0f} s (budget)"}
        info["prefill_check"]["seconds"] = round(now() - t, 1)
    info["stages"]["total_s"] = round(now() - t0, 1)
    info["table"] = table(info)
    save()
    brief = {k: v for k, v in info.items() if k not in ("runs", "table", "workload", "workload_defaults",
                                                        "decode_step", "metrics_final", "server_log_end", "targets")}
    brief["decode_step"] = {k: v for k, v in info.get("decode_step", {}).items() if k not in ("info", "tail")}
    brief["decode_step"]["info"] = {k: v for k, v in info.get("decode_step", {}).get("info", {}).items()
                                    if k in ("ctx", "moe_tiles", "capture_s", "total_s", "glmc_failed")}
    if info.get("decode_step", {}).get("rc") not in (0, None) or "glmc_failed" in brief["decode_step"]["info"]:
        brief["decode_step"]["tail"] = info["decode_step"].get("tail", "")[-1500:]
    print(json.dumps(brief, indent=1, default=str)[:5000])
    print(info["table"])


if __name__ == "__main__":
    main()
