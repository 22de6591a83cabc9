"""Quality of glmc-small per storage format: held-out perplexity and greedy agreement with bf16.

For models/small (the trained 7.5M-parameter GLM; DSA top-k 64, so attention is sparse at every
context measured) and four formats, as `glmc compile --quantize / --kv-dtype` choose them:
`bf16` (weights and caches unquantised), `fp8_weights` (block-FP8 linear weights, activations
quantised per token per 128 columns: w8a8), `fp8_kv` (FP8 latent KV and indexer key caches, the
default of a bf16 checkpoint) and `fp8_both`; at two contexts C (--contexts, default 512,4096):

- `perplexity`: exp of the mean next-token loss over the first --windows x max(C) + 1 tokens of
  heldout.txt, cut into windows of C tokens (the same text at every C), every position scored;
  the logits come from the `mtp_verify` phase (every position's), --chunk tokens a forward over
  the cache the earlier chunks wrote.
- `agreement`: --prompts prompts of heldout text, evenly spaced, each min(C, positions -
  --continuation) tokens long (C = 512: 512; C = 4096: 3072, so the last token sits at the model's
  position limit, 4096); bf16 writes a --continuation-token greedy continuation (decode steps), then
  every format reads prompt + continuation (teacher-forced, `mtp_verify` in chunks) and counts the
  continuation's positions where its argmax is bf16's token. `first_diff`: per prompt, the first
  position where it is not, i.e. where that format's own greedy run leaves bf16's text (continuation
  length: never). The bf16 row is the same check of bf16 against its own decode steps (prefill and
  decode numerics): 1.0 up to near-ties.

Targets: --cpu runs the torch target, the fp32 oracle: bf16 there is bf16 weights in fp32 math with
fp32 caches; FP8 is emulated (`codegen/fp8_torch_target.py`: activations quantised as the FP8 kernels
do, over weights rounded to FP8 on load; caches rounded through FP8: `kv_fp8="emulate"`). Without
--cpu, the CUDA target on this machine's GPU (bf16 activations; FP8 weights and caches stored as FP8),
every step eager (no CUDA graphs: the numerics are the graphs').

    python -m bench.quality --cpu --out bench/results/quality_cpu_<date>.json
    python -m bench.quality --out bench/results/quality_<gpu>_<date>.json
    [--windows 4] [--prompts 4] [--continuation 1024] [--contexts 512,4096] [--chunk 512]
    [--configs bf16,fp8_weights,fp8_kv,fp8_both]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import ROOT

SMALL = ROOT / "models" / "small"
CONFIGS = {"bf16": (None, "bf16"), "fp8_weights": ("fp8", "bf16"), "fp8_kv": (None, "fp8"),
           "fp8_both": ("fp8", "fp8")}   # name -> (--quantize, --kv-dtype)


def commit() -> str:
    """HEAD's short hash; a copy of the tree without git (a GPU host) says $GLMC_COMMIT."""
    if os.environ.get("GLMC_COMMIT"):
        return os.environ["GLMC_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load(name: str, cpu: bool, rows: int, pages_per_row: int):
    """(executor, plan) of one format over `rows` requests of `pages_per_row` pages."""
    from glmc.codegen import fp8_torch_target
    from glmc.runtime.worker.loader import load_runner

    from glmc.api import plan_for
    quant, kv = CONFIGS[name]
    plan = plan_for(SMALL, device="cuda", max_running=rows, quantize=quant, kv_dtype=kv)
    pages = rows * pages_per_row + 1
    if not cpu:
        return load_runner(plan, SMALL, device="cuda", num_pages=pages, max_running=rows, capture=False).executor, plan
    runner = load_runner(plan, SMALL, device="cpu", target="cpu", num_pages=pages, max_running=rows, kv_fp8="emulate")
    if quant == "fp8":
        runner.executor.impls = fp8_torch_target.IMPLS
    return runner.executor, plan


def all_logits(ex, seqs: list[list[int]], table, chunk: int) -> list:
    """fp32 logits [len(s), V] (host) at every position of each sequence, fed `chunk` tokens per
    request a forward (`mtp_verify`: the target model's logits at every token) over rows 0.."""
    import torch
    from glmc.runtime.worker.forward_batch import ForwardBatch
    out = [[] for _ in seqs]
    for start in range(0, max(map(len, seqs)), chunk):
        live = [i for i, s in enumerate(seqs) if len(s) > start]
        parts = [seqs[i][start:start + chunk] for i in live]
        batch = ForwardBatch.build("extend", parts, live, [start] * len(live), table)
        logits = ex.forward("mtp_verify", batch)["logits"].float().cpu()
        for i, piece in zip(live, torch.split(logits, [len(p) for p in parts])):
            out[i].append(piece)
    return [torch.cat(o) for o in out]


def perplexity(ex, ids: list[int], context: int, rows: int, table, chunk: int) -> float:
    """exp(mean next-token loss) over windows of `context` tokens of ids (len = k x context + 1)."""
    import torch
    import torch.nn.functional as F
    windows = [ids[i:i + context + 1] for i in range(0, len(ids) - 1, context)]
    nll, count = 0.0, 0
    for b in range(0, len(windows), rows):
        group = windows[b:b + rows]
        for w, lg in zip(group, all_logits(ex, [w[:-1] for w in group], table, chunk)):
            nll += float(F.cross_entropy(lg, torch.tensor(w[1:]), reduction="sum"))
            count += len(w) - 1
    return math.exp(nll / count)


def greedy(ex, prompts: list[list[int]], steps: int, table) -> list[list[int]]:
    """Each prompt's `steps` greedy tokens: one prefill, then decode steps."""
    from bench import common
    seqs = [list(p) for p in prompts]
    nxt = common.prefill(ex, prompts, table).argmax(-1).tolist()
    out = [[] for _ in prompts]
    for _ in range(steps):
        for s, o, t in zip(seqs, out, nxt):
            s.append(t)
            o.append(t)
        if len(out[0]) == steps:
            break
        nxt = ex.forward("decode", common.decode_batch(seqs, table))["logits"].argmax(-1).tolist()
    return out


def agreement(ex, prompts, continuations, table, chunk: int) -> dict:
    """Teacher-forced argmax over each prompt + continuation against the continuation's tokens."""
    seqs = [p + c[:-1] for p, c in zip(prompts, continuations)]
    same, first = 0, []
    for p, c, lg in zip(prompts, continuations, all_logits(ex, seqs, table, chunk)):
        hits = [int(t) == x for t, x in zip(lg[len(p) - 1:].argmax(-1).tolist(), c)]
        same += sum(hits)
        first.append(hits.index(False) if False in hits else len(c))
    return {"agreement": same / sum(map(len, continuations)), "first_diff": first}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the torch target (fp32 oracle, FP8 emulated)")
    ap.add_argument("--out")
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[512, 4096])
    ap.add_argument("--windows", type=int, default=4, help="perplexity text: windows x max(contexts) tokens")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--continuation", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512, help="tokens per request per scoring forward")
    ap.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS))
    ap.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    a = ap.parse_args(argv)
    import torch
    from tokenizers import Tokenizer

    from bench import common
    from glmc.spec import load_spec
    if a.threads:
        torch.set_num_threads(a.threads)
    if "bf16" not in a.configs:
        a.configs = ["bf16", *a.configs]   # the reference of the agreement
    cfg = load_spec(SMALL).config
    ids = Tokenizer.from_file(str(SMALL / "tokenizer.json")).encode(
        (SMALL / "heldout.txt").read_text(encoding="utf-8")).ids
    text = ids[:a.windows * max(a.contexts) + 1]
    if len(text) < a.windows * max(a.contexts) + 1:
        sys.exit(f"quality: heldout.txt has {len(ids)} tokens, fewer than {a.windows} x {max(a.contexts)} + 1")
    prompt_len = {c: min(c, cfg.max_position_embeddings - a.continuation) for c in a.contexts}
    stride = len(ids) // a.prompts
    prompts = {c: [ids[i * stride:i * stride + n] for i in range(a.prompts)] for c, n in prompt_len.items()}
    longest = max(max(a.contexts), max(prompt_len.values()) + a.continuation)
    rows = max(a.prompts, min(8, a.windows * max(a.contexts) // min(a.contexts)))
    ppr = -(-longest // 64)
    table = common.req_table(rows, ppr)
    out = {"device": "cpu: torch target, fp32 (FP8 emulated)" if a.cpu else torch.cuda.get_device_name(),
           "target": "cpu" if a.cpu else "cuda", "date": time.strftime("%Y-%m-%d"), "commit": commit(),
           "command": "python -m bench.quality " + " ".join(sys.argv[1:] if argv is None else argv),
           "model": "models/small", "config": cfg.model_dump(mode="json"),
           "settings": {"contexts": a.contexts, "perplexity_tokens": len(text) - 1, "prompts": a.prompts,
                        "prompt_tokens": {str(c): n for c, n in prompt_len.items()},
                        "continuation": a.continuation, "chunk": a.chunk},
           "results": {}}
    continuations = {}
    for name in a.configs:
        t0 = time.perf_counter()
        ex, plan = load(name, a.cpu, rows, ppr)
        row = {"weights": plan.dtypes.weight, "kv_cache": plan.dtypes.kv_cache,
               "index_cache": plan.dtypes.index_cache, "perplexity": {}, "agreement": {}, "first_diff": {}}
        for c in a.contexts:
            row["perplexity"][str(c)] = round(perplexity(ex, text, c, rows, table, a.chunk), 4)
            if name == "bf16":
                continuations[c] = greedy(ex, prompts[c], a.continuation, table)
            agree = agreement(ex, prompts[c], continuations[c], table, a.chunk)
            row["agreement"][str(c)] = round(agree["agreement"], 4)
            row["first_diff"][str(c)] = agree["first_diff"]
            print(f"quality {name} C={c}: perplexity {row['perplexity'][str(c)]}, greedy agreement "
                  f"{row['agreement'][str(c)]}, first differing token {agree['first_diff']}", flush=True)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        out["results"][name] = row
        del ex
    print(json.dumps({k: v for k, v in out.items() if k != "config"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
