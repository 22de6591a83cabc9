"""MTP acceptance on the small trained model (models/small) and held-out text, CPU, torch target.

    python -m bench.mtp_accept_bench [--steps 1,2,3] [--temperatures 0,1] [--rules standard,matching]
                                     [--prompts 8 --prompt-len 96 --max-tokens 48] [--out FILE]
                                     [--weights DIR]   (another checkpoint of the small model's shape)

For each N (`--steps`), temperature and rule: --prompts seeded requests (seed i), each a
--prompt-len window of models/small/heldout.txt (evenly spaced), generating --max-tokens tokens
(ignore_eos), through the speculative engine; reports the accept length (accepted drafts + 1 per
verify, `Metrics.accept_length`) and the wall time. Rules at temperature > 0: `standard` is the
engine's (standard speculative sampling, drafts drawn from q), `matching` the one before it
(argmax drafts kept only where they equal the plain sampler's draw), kept here for comparison.
Greedy requests have one rule (exact argmax matching): only `standard` runs at temperature 0.
The JSON (config, date, rows) goes to --out (default bench/results/mtp_accept_<date>.json).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "models" / "small"


def accept_length(num_steps: int, temperature: float, args) -> tuple[float, dict]:
    from glmc.api import build_engine
    from glmc.runtime.engine.sampling import SamplingParams
    e = build_engine(args.weights, warmup=False, speculative_num_steps=num_steps)
    ids = e.tokenizer.encode((args.weights / "heldout.txt").read_text(encoding="utf-8"))
    stride = len(ids) // args.prompts
    reqs = [e.make_request(ids[i * stride:i * stride + args.prompt_len], SamplingParams(
        max_tokens=args.max_tokens, temperature=temperature, seed=i, ignore_eos=True))
        for i in range(args.prompts)]
    for r in reqs:
        e.submit(r)
    while not all(r.finished for r in reqs):
        e.step()
    counters = e.metrics.counters
    return e.metrics.accept_length, {k: counters[k] for k in (
        "spec_verify_steps_total", "spec_draft_tokens_total", "spec_accepted_tokens_total")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    ap.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[1.0])
    ap.add_argument("--rules", type=lambda s: s.split(","), default=["standard", "matching"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", type=Path, default=SMALL, help="checkpoint directory with its heldout.txt")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch

    from glmc.runtime.engine import speculative
    torch.set_num_threads(args.threads)
    standard_drafts, rows = speculative.draw_drafts, []
    for temperature in args.temperatures:
        for rule in args.rules if temperature > 0 else ["standard"]:
            speculative.draw_drafts = standard_drafts if rule == "standard" else \
                lambda logits, reqs: (logits.argmax(-1), [None] * len(reqs))
            for n in args.steps:
                t0 = time.perf_counter()
                length, counters = accept_length(n, temperature, args)
                rows.append({"N": n, "temperature": temperature, "rule": rule, "accept_length": length,
                             "seconds": time.perf_counter() - t0, **counters})
                print(f"N={n} T={temperature} {rule:9} accept length {length:.3f} "
                      f"({rows[-1]['seconds']:.1f} s)", flush=True)
    speculative.draw_drafts = standard_drafts
    date = time.strftime("%Y-%m-%d")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"mtp_accept_{date}.json"
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": date, "device": "cpu", "model": str(args.weights), "config": config,
                               "rows": rows}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
