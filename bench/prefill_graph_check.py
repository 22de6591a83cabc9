"""Prefill steps replayed from CUDA graphs against the same steps run eagerly, one command:

    bash bench/with_wheels.sh python -m bench.prefill_graph_check --out-dir $OUT     # the H200

glmc-small (models/small) in an in-process engine on the GPU, twice: with prefill graphs (captured per
token count up to --max-batch-tokens, `cuda_executor.prefill_buckets`) and without (`prefill_graphs=False`,
every prefill and mixed step eager). 16 held-out prompts of 96 tokens, greedy, 48 tokens each, submitted one
per engine step so that most steps mix a prefill chunk with running decodes. Reports whether the outputs are
equal token for token (else the first differing position per request), how many steps replayed a prefill
graph, and the wall time of the whole wave (host time included).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "models" / "small"


def wave(engine, prompts, params):
    reqs, t0 = [], time.perf_counter()
    for p in prompts:   # one new request per step: its prefill rides with the running decodes
        reqs.append(engine.make_request(p, params))
        engine.submit(reqs[-1])
        engine.step()
    while not all(r.finished for r in reqs):
        engine.step()
    while engine.step():
        pass
    return [r.output_ids for r in reqs], time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "/tmp/prefill_graph_check"))
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--max-batch-tokens", type=int, default=256)
    a = ap.parse_args()
    from glmc.api import build_engine
    from glmc.runtime.engine.sampling import SamplingParams
    from glmc.runtime.engine.tokenizer import Tokenizer
    ids = Tokenizer.from_dir(SMALL).encode((SMALL / "heldout.txt").read_text(encoding="utf-8"))
    stride = len(ids) // 16
    prompts = [ids[i * stride:i * stride + 96] for i in range(16)]
    greedy = SamplingParams(max_tokens=a.gen, temperature=0.0, ignore_eos=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": os.environ.get("GLMC_COMMIT", "unknown"),
           "gen": a.gen, "prompt_tokens": 96, "max_batch_tokens": a.max_batch_tokens, "runs": {}}
    tokens = {}
    for graphs in (False, True):
        e = build_engine(SMALL, device="cuda", max_running=16, max_batch_tokens=a.max_batch_tokens,
                         num_pages=256, prefill_graphs=graphs)
        gpu = e.runner.executor
        wave(e, prompts, greedy)   # warm (caches, allocator)
        e.flush_cache()
        before = gpu.num_prefill_replays
        tokens[graphs], wall = wave(e, prompts, greedy)
        out["runs"]["graphs" if graphs else "eager"] = {
            "wall_s": wall, "prefill_graphs": sorted(gpu.prefill_captured),
            "prefill_replays": gpu.num_prefill_replays - before, "steps": e.metrics.value("steps_total")}
        print(json.dumps(out["runs"]["graphs" if graphs else "eager"]), flush=True)
        e.runner.close() if hasattr(e.runner, "close") else None
        del e
    diffs = [next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), None)
             for g, w in zip(tokens[True], tokens[False])]
    out["equal"] = sum(d is None for d in diffs)
    out["first_difference"] = diffs
    print(f"greedy equal with and without prefill graphs: {out['equal']}/16 (first differences {diffs})")
    Path(a.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(a.out_dir) / "prefill_graph_check.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
