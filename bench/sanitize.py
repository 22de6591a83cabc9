"""Every kernel of a plan under compute-sanitizer: memcheck and racecheck over real steps.

    python -m bench.sanitize --out-dir $OUT                # the GPU: each part under each tool
    python -m bench.sanitize --cpu                         # dry run: the workloads interpreted, no tool
    [--tools memcheck,racecheck] [--parts plan_check,tp8ep8,dp8ep8] [--ctx 1024] [--prefill-tokens 16384]

Each part is a workload this module runs in a child process under `compute-sanitizer --tool T`
(`--workload PART`), the tool's verdict read from its `ERROR SUMMARY` line:
- `plan_check`: `bench/gpu_plan_check.py`'s tiny check (fp32 tiny checkpoint: prefill, then decode
  steps replayed from the plan's CUDA graphs, greedy tokens against transformers).
- `tp8ep8`, `dp8ep8`, any spec: rank 0 of that mesh alone on this GPU (`LoneComm`, as
  `mtp_gpu_check --parts rank` runs it) over the GLM-5.3-width slice with an MTP layer
  (`mtp_gpu_check.slice_with_mtp`: a dense and two MoE layers, full and shared indexers; block-FP8
  weights, FP8 KV and indexer caches), every step eager: `--requests` prompts of `--ctx` random
  tokens prefilled `--prefill-tokens` a forward (16384: the forward size after which a lone tp8ep8
  rank once reported an illegal access at the next decode step), then a decode step of 1 and of
  every request, a verify of N + 1 = 4 tokens per request and a draft step.
Under memcheck the rank parts run with `PYTORCH_NO_CUDA_MEMORY_CACHING=1`: every tensor is its own
allocation, so an access past a tensor's end leaves it (torch's caching allocator would hand the
sanitizer one large segment that hides it); a CUDA graph replays the launches its eager step makes,
so the eager steps check the same kernels. `plan_check` keeps torch's allocator (its graphs need
the caching allocator's pools), so memcheck sees only accesses outside every segment there.
Writes sanitize_<date>.json: per part and tool, the error count, the first report lines, the
workload's own result and the wall time. Measures; changes nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench import ROOT, common

TOOLS = ("memcheck", "racecheck")
PARTS = ("plan_check", "tp8ep8", "dp8ep8")
SUMMARY = re.compile(r"=+ ERROR SUMMARY: (\d+) errors?")
# racecheck ends with its own line: "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
RACES = re.compile(r"=+ RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
DONE = "sanitize workload done: "


def verdict(output: str) -> dict:
    """A compute-sanitizer run's output -> {errors (None: no summary line: the tool did not finish;
    memcheck's ERROR SUMMARY, racecheck's RACECHECK SUMMARY errors), first: its first report lines,
    workload: the workload's own result line (JSON) if it printed one; race_warnings: racecheck's
    warnings (hazards it could not prove)}."""
    counts = [int(m) for m in SUMMARY.findall(output)]
    races = [(int(e), int(w)) for e, w in RACES.findall(output)]
    counts += [e for e, _ in races]
    lines = [ln for ln in output.splitlines() if ln.startswith("=========") and " SUMMARY" not in ln]
    done = [ln[len(DONE):] for ln in output.splitlines() if ln.startswith(DONE)]
    out = {"errors": sum(counts) if counts else None, "first": lines[:40],
           "workload": json.loads(done[-1]) if done else None}
    if races:
        out["race_warnings"] = sum(w for _, w in races)
    return out


# ----------------------------------------------------------------------------- workloads
def plan_check(dev: str) -> dict:
    from bench import gpu_plan_check
    return gpu_plan_check.check_tiny(dev, capture=dev == "cuda", steps=4)


def lone_rank(dev: str, parallel: str, ctx: int, requests: int, prefill_tokens: int) -> dict:
    """Rank 0 of `parallel` alone: prefill, decode, verify and draft steps, eager (module docstring)."""
    import torch
    from bench.mtp_gpu_check import peer_tokens, slice_with_mtp
    from glmc.runtime.worker.comm import LoneComm
    from glmc.runtime.worker.forward_batch import ForwardBatch
    narrow = dev != "cuda"
    model, plan, weights, stacks = slice_with_mtp(dev, torch.bfloat16 if dev == "cuda" else torch.float32,
                                                  narrow, fp8=dev == "cuda", parallel=parallel)
    lone = LoneComm(plan.mesh, rank=0)
    runner = common.gpu_runner(plan, weights, dev, requests, ctx + 64, stacks=stacks, comm=lone)
    del model, weights, stacks   # the slice's bf16 weights (every expert): the runner holds its own shard
    if dev == "cuda":
        torch.cuda.empty_cache()
    table = common.req_table(requests, (ctx + 64) // 64)
    g = torch.Generator().manual_seed(0)
    vocab, E, dp = plan.config.vocab_size, plan.config.n_routed_experts, plan.mesh["attn_dp"]
    prompts = [torch.randint(0, vocab, (ctx,), generator=g).tolist() for _ in range(requests)]
    common.prefill(runner, prompts, table, group=max(1, prefill_tokens // ctx))
    steps = []
    for B in sorted({1, requests}):
        lone.peer = peer_tokens(B * dp, E)
        nxt = torch.randint(0, vocab, (B,), generator=g).tolist()
        runner.forward("decode", common.decode_batch([p + [t] for p, t in zip(prompts[:B], nxt)], table))
        steps.append(f"decode B={B}")
    B, n = requests, 4
    lone.peer = peer_tokens(B * n * dp, E)
    ids = [torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(B)]
    batch = ForwardBatch.build("extend", ids, list(range(B)), [ctx] * B, table)
    out = runner.forward("mtp_verify", batch)
    runner.forward("mtp_draft", batch, hidden=out["hidden"])
    steps += [f"verify T={B * n}", f"draft T={B * n}"]
    lone.peer = None
    if dev == "cuda":
        torch.cuda.synchronize()
    return {"parallel": parallel, "ctx": ctx, "requests": requests, "prefill_tokens_per_forward":
            max(1, prefill_tokens // ctx) * ctx, "steps": steps}


def workload(a) -> dict:
    dev = "cpu" if a.cpu else "cuda"
    if a.workload == "plan_check":
        return plan_check(dev)
    return lone_rank(dev, a.workload, a.ctx, a.requests, a.prefill_tokens)


# ----------------------------------------------------------------------------- driver
def clean(row: dict, cpu: bool) -> bool:
    """The part ran to its end, its own check (if any) passed, and the tool found nothing."""
    done = row["rc"] == 0 and row["workload"] is not None and row["workload"].get("pass", True)
    return done and (cpu or row["errors"] == 0)


def _gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name()


def run_part(part: str, tool: str | None, a, timeout_s: float) -> dict:
    """One part in a child process, under `tool` (None: plain, the CPU dry run)."""
    cmd = [sys.executable, "-m", "bench.sanitize", "--workload", part, "--ctx", str(a.ctx),
           "--requests", str(a.requests), "--prefill-tokens", str(a.prefill_tokens)] + (["--cpu"] if a.cpu else [])
    env = dict(os.environ)
    if tool is not None:
        cmd = ["compute-sanitizer", "--tool", tool, "--print-limit", "20", "--error-exitcode", "9",
               *(["--leak-check", "no"] if tool == "memcheck" else []), *cmd]
        if tool == "memcheck" and part != "plan_check":
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        output, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"), None
    row = {"part": part, "tool": tool, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1), **verdict(output)}
    if rc != 0:
        row["tail"] = output.splitlines()[-30:]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run: the workloads interpreted, no sanitizer")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--tools", type=lambda s: s.split(","), default=list(TOOLS))
    ap.add_argument("--parts", type=lambda s: s.split(","), default=list(PARTS))
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=16384, help="tokens per prefill forward")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per part and tool")
    ap.add_argument("--workload", help=argparse.SUPPRESS)   # the child: run one part's steps
    a = ap.parse_args(argv)
    if a.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    if a.workload:
        print(DONE + json.dumps(workload(a), default=str), flush=True)
        return
    rows = []
    for part in a.parts:
        for tool in [None] if a.cpu else a.tools:
            row = run_part(part, tool, a, a.timeout)
            rows.append(row)
            print(f"{part} {tool or 'plain'}: errors {row['errors']}, rc {row['rc']}, {row['wall_s']} s", flush=True)
            for line in row["first"][:10] + row.get("tail", [])[-10:]:
                print("   " + line)
    res = {"date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("GLMC_COMMIT", "unknown"),
           "device": "cpu (interpreted, no sanitizer)" if a.cpu else _gpu_name(),
           "settings": {"ctx": a.ctx, "requests": a.requests, "prefill_tokens": a.prefill_tokens},
           "runs": rows, "clean": all(clean(r, a.cpu) for r in rows)}
    if a.out_dir:
        out = Path(a.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"sanitize_{res['date']}.json").write_text(json.dumps(res, indent=1))
    print("clean" if res["clean"] else "NOT CLEAN")
    sys.exit(0 if res["clean"] else 1)


if __name__ == "__main__":
    main()
