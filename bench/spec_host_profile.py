"""Where a speculative cycle's host time goes: wall time per engine function, exclusive of callees.

    python -m bench.spec_host_profile --out FILE                 # the GPU: glmc-small, N = 0 and 3
    python -m bench.spec_host_profile --cpu --gen 8               # dry run on the CPU
    [--drafts 0,3] [--concurrency 1,16] [--gen 64] [--general] [--unchained]

glmc-small (models/small) in an in-process engine as `mtp_gpu_check --parts small` builds it (CUDA
graphs for decode, verify and draft); per draft count and concurrency a warm-up wave, then a wave of
greedy requests of 96 held-out tokens whose prefill steps (until each has its first token) are
left out: each
remaining engine step's wall time, and for the functions of the speculative loop, the scheduler,
the runner and the executor (`WATCHED`) their calls per step and wall time per step exclusive of
the watched functions they call. What no watched function covers is the `rest` row (the engine's
own step loop, metrics). Greedy cycles run whole on the device (`device_cycles`: how many steps
did; each queued from the one before's outputs before that one is read, `overlap_cycles`);
`--general` profiles each N > 0 again with every cycle on the general path, `--unchained` with
device cycles each read before the next is queued. Plain decoding (N = 0) overlaps its host work
with the device, so its step is the larger of the two. Measures; changes nothing.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

from bench import mtp_gpu_check as mg

WATCHED = {
    "speculator": ("_prepare", "_run", "_sample", "read", "_extend", "_draft_extend", "_draft", "_chain",
                   "_add_drafts", "_append", "_stream", "_append_now", "_with_drafts", "_pack", "_unpack",
                   "_on_device", "_run_on_device", "_accept", "_take", "_chain_next", "_finish",
                   "_queue_device", "_chainable", "_split"),
    "scheduler": ("schedule",),
    "rank": ("reserve", "rollback", "commit", "offer_pages", "schedule"),
    "runner": ("verify_dp", "draft_dp", "forward_dp", "forward", "step"),
    "executor": ("_replay", "_load_rows", "host_vectors", "run_tokens", "_mtp"),
    "engine": ("append_token", "append_tokens", "update_gauges"),
}


class Timers:
    """Exclusive wall time and calls per watched function (nested calls subtract from their caller)."""

    def __init__(self):
        self.excl, self.calls, self.stack = collections.Counter(), collections.Counter(), []

    def wrap(self, obj, name: str, key: str) -> None:
        if not hasattr(obj, name):
            return
        orig = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            self.stack.append(0.0)
            try:
                return orig(*a, **k)
            finally:
                d = time.perf_counter() - t
                self.excl[key] += d - self.stack.pop()
                self.calls[key] += 1
                if self.stack:
                    self.stack[-1] += d
        setattr(obj, name, timed)

    def watch(self, e) -> None:
        owners = {"speculator": [e.speculator], "scheduler": [e.scheduler], "rank": e.scheduler.ranks,
                  "runner": [e.runner], "executor": [e.runner.executor], "engine": [e]}
        for group, names in WATCHED.items():
            for obj in owners[group]:
                if obj is not None:
                    for n in names:
                        self.wrap(obj, n, f"{group}.{n}")

    def clear(self) -> None:
        self.excl.clear()
        self.calls.clear()


def profile(dev: str, drafts: int, concurrency: list[int], gen: int, prompts: list, variant: str = "") -> dict:
    """`variant` "general": every cycle takes the speculative loop's general path (no cycle run
    whole on the device: `MtpSpeculator.device_cycles` off); "unchained": device cycles, each read
    before the next is queued (`MtpSpeculator.overlap_cycles` off)."""
    import torch
    from glmc.runtime.engine.sampling import SamplingParams
    greedy = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    e = mg.small_engine(drafts, dev)
    if variant == "general":
        e.speculator.device_cycles = False
    elif variant == "unchained":
        e.speculator.overlap_cycles = False
    timers = Timers()
    timers.watch(e)
    out = {}
    for c in concurrency:
        mg.run_wave(e, [(p, greedy) for p in prompts[:c]])   # warm-up: every bucket this wave meets
        reqs = [e.make_request(p, greedy) for p in prompts[:c]]
        for r in reqs:
            e.submit(r)
        while not all(r.output_ids for r in reqs):   # the prefill chunks
            e.step()
        if dev == "cuda":
            torch.cuda.synchronize()
        timers.clear()
        device_cycles = e.speculator.num_device_cycles if e.speculator else 0
        walls = []
        while not all(r.finished for r in reqs):
            t = time.perf_counter()
            e.step()
            walls.append(time.perf_counter() - t)
        while e.step():
            pass
        n = max(len(walls), 1)
        rows = {k: {"calls_per_step": timers.calls[k] / n, "ms_per_step": 1e3 * v / n}
                for k, v in sorted(timers.excl.items(), key=lambda kv: -kv[1])}
        rows["rest"] = {"calls_per_step": 1.0, "ms_per_step": 1e3 * (sum(walls) - sum(timers.excl.values())) / n}
        out[f"c{c}"] = {"steps": len(walls), "step_ms_mean": 1e3 * sum(walls) / n,
                        "device_cycles": (e.speculator.num_device_cycles if e.speculator else 0) - device_cycles,
                        "step_ms_median": 1e3 * sorted(walls)[len(walls) // 2] if walls else None,
                        "functions": rows}
        r = out[f"c{c}"]
        print(f"N={drafts}{' ' + variant if variant else ''} c={c}: {r['steps']} steps ({r['device_cycles']} "
              f"on the device), mean {r['step_ms_mean']:.2f} ms, median {r['step_ms_median']:.2f} ms", flush=True)
        for k, f in list(rows.items())[:14]:
            print(f"   {k:28s} {f['calls_per_step']:6.1f} calls  {f['ms_per_step']:7.3f} ms per step")
    del e
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run: the torch target on the CPU")
    ap.add_argument("--out")
    ap.add_argument("--drafts", type=lambda s: [int(x) for x in s.split(",")], default=[0, 3])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--gen", type=int, default=64, help="tokens per request")
    ap.add_argument("--general", action="store_true",
                    help="also profile each N > 0 with every cycle on the speculative loop's general path")
    ap.add_argument("--unchained", action="store_true",
                    help="also profile each N > 0 with each device cycle read before the next is queued")
    a = ap.parse_args(argv)
    if a.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    prompts = mg.small_prompts()
    dev = "cpu" if a.cpu else "cuda"
    res = {"date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("GLMC_COMMIT", "unknown"),
           "device": dev, "gen_tokens": a.gen, "prompt_tokens": 96, "runs": {}}
    if not a.cpu:
        import torch
        res["device"] = torch.cuda.get_device_name()
    for n in a.drafts:
        res["runs"][f"N={n}"] = profile(dev, n, a.concurrency, a.gen, prompts)
        for variant in [v for v in ("general", "unchained") if n and getattr(a, v)]:
            res["runs"][f"N={n} {variant}"] = profile(dev, n, a.concurrency, a.gen, prompts, variant)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
