"""Serving benchmark: replay a mixed, seeded chat workload against an OpenAI-compatible server.

    python -m bench.serve_bench --url http://127.0.0.1:8000/v1   # a running server
    python -m bench.serve_bench --launch "--parallel dp2ep2"      # start `glmc run` here

Workload (same for a given --seed): --num-requests chat requests, all streamed; prompt lengths
drawn from short / medium / long buckets (or one --prompt-words LO,HI range), output lengths
uniform in [--min-tokens, --max-tokens] (ignore_eos, so every request produces exactly that
many); a --shared-frac share of them open with one of --num-prefixes long system prompts
(prefix-cache hits). Requests arrive as a Poisson process at --request-rate per second (inf: all
at once), at most --concurrency in flight.

Measured on the client (whose one-time set-up is paid by a GET /models before the clock starts,
so the first request's TTFT is the server's): TTFT (request sent -> first content chunk), ITL (gaps between content
chunks; a token whose text is held back, e.g. half a UTF-8 character, merges into the next chunk),
TPOT (per request: (e2e - TTFT) / (output tokens - 1)), end-to-end latency, requests/s and output
tokens/s over the whole run (token counts from the server's usage). From the server's /metrics
(difference over the run): with speculative decoding (`--launch "... --speculative-num-steps N"`),
drafts verified, draft and accepted tokens, the accept length (accepted drafts + 1 per verify)
and the cycles by path (chained, device, general).
The JSON (config, device,
date, git commit, summary, per-request rows) goes to bench/results/serve_<device>_<date>.json
unless --out says otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the model reads every token and the compiler plans each collective so that a step of "
         "decode moves as few bytes as the hardware allows while sparse attention keeps only the "
         "keys that matter for this query").split()
BUCKETS = ((8, 32), (32, 128), (128, 384))  # prompt words: short, medium, long


def make_workload(a) -> list[dict]:
    rng = random.Random(a.seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(a.prefix_words))
                for _ in range(a.num_prefixes)]
    buckets = (tuple(a.prompt_words),) if getattr(a, "prompt_words", None) else BUCKETS
    reqs = []
    for i in range(a.num_requests):
        lo, hi = rng.choice(buckets)
        user = f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
        messages = [{"role": "user", "content": user}]
        shared = rng.random() < a.shared_frac
        if shared:
            messages.insert(0, {"role": "system", "content": rng.choice(prefixes)})
        reqs.append({"messages": messages, "max_tokens": rng.randint(a.min_tokens, a.max_tokens),
                     "shared_prefix": shared})
    return reqs


async def one(client: httpx.AsyncClient, model: str, spec: dict) -> dict:
    body = {"model": model, "messages": spec["messages"], "max_tokens": spec["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    row = {"max_tokens": spec["max_tokens"], "shared_prefix": spec["shared_prefix"], "error": None}
    t0, stamps, usage = time.perf_counter(), [], None
    try:
        async with client.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                row["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return row
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    stamps.append(time.perf_counter())
    except httpx.HTTPError as e:
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    end = time.perf_counter()
    row.update(ttft_s=stamps[0] - t0 if stamps else None, e2e_s=end - t0, start_s=t0, end_s=end,
               itl_s=[b - a for a, b in zip(stamps, stamps[1:])],
               prompt_tokens=usage and usage["prompt_tokens"],
               output_tokens=usage and usage["completion_tokens"],
               cached_tokens=usage and usage.get("prompt_tokens_details", {}).get("cached_tokens"))
    if not usage:
        row["error"] = "no usage chunk"
    return row


async def replay(a, url: str, model: str, workload: list[dict]) -> list[dict]:
    rng, gate = random.Random(a.seed + 1), asyncio.Semaphore(a.concurrency)
    limits = httpx.Limits(max_connections=a.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=a.timeout, limits=limits) as client:
        # the client's first request pays its own one-time set-up (~0.1-0.25 s of lazy imports
        # and connection machinery in this process, measured 2026-12-01): pay it before the clock
        await client.get("/models")

        async def gated(spec):
            async with gate:
                return await one(client, model, spec)
        tasks = []
        for spec in workload:
            tasks.append(asyncio.create_task(gated(spec)))
            if math.isfinite(a.request_rate):
                await asyncio.sleep(rng.expovariate(a.request_rate))
        return await asyncio.gather(*tasks)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if not r["error"]]
    span = (max(r["end_s"] for r in ok) - min(r["start_s"] for r in ok)) if ok else float("nan")
    out_tok = sum(r["output_tokens"] for r in ok)
    s = {"requests": len(rows), "errors": len(rows) - len(ok), "duration_s": span,
         "requests_per_s": len(ok) / span, "output_tokens_per_s": out_tok / span,
         "input_tokens_per_s": sum(r["prompt_tokens"] for r in ok) / span,
         "output_tokens": out_tok, "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
         "cached_prompt_tokens": sum(r["cached_tokens"] or 0 for r in ok)}
    series = {"ttft_ms": [r["ttft_s"] * 1e3 for r in ok if r["ttft_s"] is not None],
              "itl_ms": [x * 1e3 for r in ok for x in r["itl_s"]],
              "tpot_ms": [(r["e2e_s"] - r["ttft_s"]) * 1e3 / (r["output_tokens"] - 1) for r in ok
                          if r["ttft_s"] is not None and r["output_tokens"] > 1],
              "e2e_ms": [r["e2e_s"] * 1e3 for r in ok]}
    for name, values in series.items():
        s[name] = {"mean": sum(values) / len(values) if values else None,
                   **{f"p{q}": pct(values, q) for q in (50, 90, 99)}}
    return s


SPEC_COUNTERS = ("spec_verify_steps_total", "spec_draft_tokens_total", "spec_accepted_tokens_total")


CYCLE_PATHS = ("chained", "device", "general")


def spec_counters(url: str) -> dict[str, float]:
    """The server's speculative-decoding counters, its cycles by path among them (0 where absent:
    a server without them)."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    series = [*SPEC_COUNTERS, *(f'spec_cycles_total{{path="{p}"}}' for p in CYCLE_PATHS)]
    return {k: float(m.group(1)) if (m := re.search(rf"^glmc_{re.escape(k)} (\S+)$", text, re.M)) else 0.0
            for k in series}


def spec_summary(before: dict, after: dict) -> dict | None:
    d = {k.removeprefix("spec_").removesuffix("_total"): after[k] - before[k] for k in SPEC_COUNTERS}
    if not d["verify_steps"]:
        return None
    cycles = {p: after[k] - before[k] for p in CYCLE_PATHS if (k := f'spec_cycles_total{{path="{p}"}}')}
    return {**d, "accept_length": d["accepted_tokens"] / d["verify_steps"] + 1, "cycles": cycles}


def device_name() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()) \
        if Path("/proc/cpuinfo").exists() else None
    return f"cpu: {cpu.group(1).strip() if cpu else platform.processor()} x{os.cpu_count()}"


def git_commit() -> str:
    def git(*args):
        try:  # a copy of the tree on a GPU host may have no git (nor .git): then $GLMC_COMMIT, else "unknown"
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout
        except OSError:
            return ""
    head = git("rev-parse", "HEAD").strip() or os.environ.get("GLMC_COMMIT") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")


def launch(args: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`glmc run --port 0 ARGS` in its own session; returns it and its URL."""
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "glmc.cli", "run", "--port", "0",
                             "--log-level", "warning", *shlex.split(args)], stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while not (m := re.search(r"serving \S+ at (http://\S+/v1)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"glmc run did not start; see {log}")
        time.sleep(0.2)
    return proc, m.group(1)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def report(s: dict) -> str:
    lines = [f"requests {s['requests']} (errors {s['errors']}) in {s['duration_s']:.2f} s",
             f"requests/s {s['requests_per_s']:.2f}   output tokens/s {s['output_tokens_per_s']:.1f}"
             f"   input tokens/s {s['input_tokens_per_s']:.1f}",
             f"prompt tokens {s['prompt_tokens']} (cached {s['cached_prompt_tokens']}), "
             f"output tokens {s['output_tokens']}",
             f"{'ms':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        lines.append(f"{k[:-3]:<8}" + "".join(f"{s[k][q]:>10.1f}" if s[k][q] is not None
                                               else f"{'-':>10}" for q in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--url", help="the server's /v1 base URL")
    g.add_argument("--launch", metavar="ARGS", help="start `glmc run --port 0 ARGS` and stop it after")
    ap.add_argument("--model", help="model id (default: the server's first)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson)")
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=lambda v: [int(x) for x in v.split(",")], metavar="LO,HI",
                    help="user-prompt words uniform in [LO, HI] (default: the buckets " +
                    ", ".join(f"{lo}-{hi}" for lo, hi in BUCKETS) + ", one drawn per request)")
    ap.add_argument("--shared-frac", type=float, default=0.5)
    ap.add_argument("--num-prefixes", type=int, default=2)
    ap.add_argument("--prefix-words", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--device", help="label of the serving device (default: this host's GPU/CPU)")
    ap.add_argument("--note", default="", help="free text stored with the result")
    ap.add_argument("--out", help="JSON path (default bench/results/serve_<device>_<date>.json)")
    a = ap.parse_args(argv)
    proc, url = None, a.url
    if a.launch is not None:
        proc, url = launch(a.launch, Path(os.environ.get("TMPDIR", "/tmp")) / "glmc_serve_bench.log")
    try:
        model = a.model or httpx.get(url + "/models", timeout=30).json()["data"][0]["id"]
        workload = make_workload(a)
        before = spec_counters(url)
        rows = asyncio.run(replay(a, url, model, workload))
        spec = spec_summary(before, spec_counters(url))
    finally:
        if proc is not None:
            stop(proc)
    summary = summarize(rows)
    summary["speculative"] = spec
    print(report(summary))
    if spec:
        print(f"speculative: {spec['verify_steps']:.0f} verifies, {spec['draft_tokens']:.0f} draft "
              f"tokens, {spec['accepted_tokens']:.0f} accepted, accept length "
              f"{spec['accept_length']:.2f}; cycles "
              + ", ".join(f"{n:.0f} {path}" for path, n in spec["cycles"].items()))
    device = a.device or device_name()
    date = datetime.datetime.now(datetime.timezone.utc)
    result = {"device": device, "date": date.isoformat(timespec="seconds"), "commit": git_commit(),
              "model": model, "url": url, "server": f"glmc run {a.launch}" if a.launch is not None
              else None, "note": a.note, "config": {k: v if not isinstance(v, float) or math.isfinite(v)
                                                    else str(v) for k, v in vars(a).items()
                                                    if k not in ("out", "url", "launch")},
              "summary": summary, "rows": rows}
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")[:40]
    out = Path(a.out or ROOT / "bench" / "results" / f"serve_{slug}_{date:%Y-%m-%d}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
