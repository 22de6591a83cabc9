"""MTP speculative decoding on the GPU, one command:

    bash bench/with_wheels.sh python -m bench.mtp_gpu_check --out-dir $OUT     # the H200
    python -m bench.mtp_gpu_check --cpu                                         # dry run, Triton interpreted

1. small: glmc-small (models/small, the trained checkpoint) in an in-process engine on the GPU, plain
   and with N = 1, 2, 3 drafts (verify and draft replayed from their CUDA graphs): greedy output on
   held-out text equal to plain greedy token for token (else the first differing position), the
   accept length, and the TPOT at concurrency 1 and 16 (engine steps, host time included: the
   wave's wall time / tokens per request, its prefill included); with drafts, a served cycle (the
   median engine step after the prefill) against its graph replays (verify + draft-extend + N - 1
   draft steps at the cycle's buckets, device time; and the greedy cycle's one graph), the device
   reads per cycle and the share of cycles run whole on the device.
2. serve: `glmc run --device cuda` of glmc-small without and with N = 3 drafts, bench/serve_bench.py
   at concurrency 1 and 16 against each (fixed seeded chat workload, 64 tokens per request):
   output tok/s, TTFT, TPOT and the server's accept length (/metrics).
3. width: a GLM-5.3-width slice with an MTP layer (layer 0 dense, 1 MoE with a full indexer, 2 MoE
   with a shared one, the MTP layer; random weights, bf16 and (`--weights bf16,fp8`, the default)
   block FP8 as GLM-5.3 is served (744B parameters fit eight H200s only in FP8); FP8 KV at context
   `--ctx`). Each layer's
   ops and the head (final norm, lm_head, sampling) are captured as a CUDA graph of their own, with
   the inputs of one real step, and replayed: the time per layer kind of a decode step of B tokens
   and of a verify step of B x (N + 1) tokens, and of the MTP draft step (MTP layer + shared head)
   at B and B x (N + 1) tokens. From these, scaled to GLM-5.3's 78 layers (3 dense, 75 MoE; full
   indexers every 4th layer) and the small model's accept length, the predicted TPOT with and without
   MTP at concurrency 1 and 16:
       plain = head(B) + sum_kind count_kind x layer_kind(B)
       mtp   = [verify(B(N+1)) + draft(B(N+1)) (draft-extend, an upper bound) + (N - 1) draft(B)
                + host(N, B)] / accept(N)
   host(N, B): the speculative cycle's host work that the device does not hide, as measured on
   glmc-small (`glmc.predict.spec_host_ms`, from a recorded run of part 1); plain decoding overlaps
   its host work, so plain is graph time. One GPU holding every layer (the whole model does not fit
   one GPU; the ratio is what the prediction is about, and it says which term limits it).
4. rank (`--parts rank`, not in the default): the same slice compiled for `--parallel` (tp8ep8, as
   GLM-5.3 is served on eight H200s) and rank 0 of it run alone on this GPU (`LoneComm`: its shard
   of heads and experts, collectives that keep shapes and move nothing, the other ranks' tokens
   drawn at random, so that the router spreads them as it spreads random tokens). Each segment is
   replayed without its collectives, once per EP rank's expert range; a segment costs the slowest rank's compute plus
   the calibrated collectives of its ops (`--calibration`, glmc/predict.py's comm_s), and the
   prediction is part 3's formula over those segments: a rank's compute measured, its links modelled.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

from bench import common

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "models" / "small"
CALIBRATION = ROOT / "bench" / "results" / "calibration_nvidia-h200-x2_2026-11-30_derived.json"
STEPS = (1, 2, 3)
# GLM-5.3: 78 layers, the first 3 dense, a full indexer on every 4th layer (index_topk_freq 4)
FULL_MODEL = {"layers": 78, "dense": 3, "full_every": 4}


def now():
    return time.perf_counter()


# ----------------------------------------------------------------------------- 1. the small model
def small_engine(n, device):
    from glmc.api import build_engine
    return build_engine(SMALL, device=device, warmup=device == "cuda", overlap=False if n else None,
                        max_running=16, speculative_num_steps=n, num_pages=256)


def run_wave(e, specs):
    """-> each request's tokens, the wave's wall time and each engine step's wall time."""
    reqs = [e.make_request(p, s) for p, s in specs]
    for r in reqs:
        e.submit(r)
    t0 = now()
    steps = []
    while not all(r.finished for r in reqs):
        t = now()
        e.step()
        steps.append(now() - t)
    while e.step():   # an overlapped loop's last queued step
        pass
    wall = now() - t0
    return [r.output_ids for r in reqs], wall, steps


def replay_ms(cap, reps=20) -> float:
    """Mean device time of one replay of a captured graph (its inputs as the engine left them)."""
    import torch
    cap.graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        cap.graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def cycle_replays_ms(executor, c: int, n: int) -> dict | None:
    """The graph replays of one speculative cycle of c requests (no host): verify and draft-extend
    at the bucket of c x (N + 1) tokens (the draft-extend's upper bound), N - 1 chain steps at c's;
    None where the engine captured no MTP graphs (the CPU dry run)."""
    caps = getattr(executor, "mtp_captured", {})

    def bucket(phase, tokens):
        return next((b for b in sorted(caps.get(phase, {})) if b >= tokens), None)
    v, d, chain = bucket("mtp_verify", c * (n + 1)), bucket("mtp_draft", c * (n + 1)), bucket("mtp_draft", c)
    if None in (v, d, chain):
        return None
    r = {"verify_ms": replay_ms(caps["mtp_verify"][v]), "draft_extend_ms": replay_ms(caps["mtp_draft"][d]),
         "draft_ms": replay_ms(caps["mtp_draft"][chain])}
    r["cycle_ms"] = r["verify_ms"] + r["draft_extend_ms"] + (n - 1) * r["draft_ms"]
    one = next((cap for b, cap in sorted(getattr(executor, "cycle_captured", {}).items()) if b >= c), None)
    if one is not None and executor.cycle_steps == n:   # the greedy cycle as one graph
        r["one_graph_ms"] = replay_ms(one)
    return r


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)) if len(a) != len(b) else None)


def small_prompts(n=16, length=96) -> list[list[int]]:
    """`n` prompts of `length` tokens of glmc-small's held-out text, evenly spaced."""
    from glmc.runtime.engine.tokenizer import Tokenizer
    ids = Tokenizer.from_dir(SMALL).encode((SMALL / "heldout.txt").read_text(encoding="utf-8"))
    stride = len(ids) // n
    return [ids[i * stride:i * stride + length] for i in range(n)]


def check_small(device, gen, concurrencies):
    from glmc.runtime.engine.sampling import SamplingParams
    greedy = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    prompts = small_prompts()
    out = {"gen_tokens": gen, "prompt_tokens": 96, "runs": {}}
    want = {}
    for n in (0, *STEPS):
        e = small_engine(n, device)
        row = {}
        for c in concurrencies:
            before = dict(e.metrics.counters)
            reads = getattr(e.speculator, "num_reads", 0)
            on_device = getattr(e.speculator, "num_device_cycles", 0)
            tokens, wall, steps = run_wave(e, [(p, greedy) for p in prompts[:c]])
            after = e.metrics.counters
            verifies = after.get("spec_verify_steps_total", 0) - before.get("spec_verify_steps_total", 0)
            accepted = after.get("spec_accepted_tokens_total", 0) - before.get("spec_accepted_tokens_total", 0)
            r = {"wall_s": wall, "tpot_ms": wall / gen * 1e3, "tok_s": c * gen / wall}
            if n:
                r["accept_length"] = (accepted + verifies) / verifies if verifies else None
                # a served cycle: the median engine step after the wave's first (its prefill)
                r["cycle_ms"] = sorted(steps[1:])[len(steps[1:]) // 2] * 1e3 if len(steps) > 1 else None
                r["reads_per_cycle"] = (e.speculator.num_reads - reads) / len(steps)   # every step reads once
                r["device_cycles"] = (e.speculator.num_device_cycles - on_device) / len(steps)   # whole on the device
                diffs = [first_difference(t, w) for t, w in zip(tokens, want[c])]
                r["equal_to_plain"] = sum(d is None for d in diffs)
                r["first_difference"] = diffs
            else:
                want[c] = tokens
            row[f"c{c}"] = r
            print(f"small N={n} c={c}: TPOT {r['tpot_ms']:.2f} ms, {r['tok_s']:.0f} tok/s"
                  + (f", accept {r['accept_length']:.2f}, equal {r['equal_to_plain']}/{c}" if n else ""), flush=True)
        if n and hasattr(e.runner.executor, "mtp_captured"):
            ex = e.runner.executor
            row["graphs"] = {**{p: sorted(c) for p, c in ex.mtp_captured.items()}, "mtp_cycle": sorted(ex.cycle_captured),
                             "mtp_cycle_next": sorted(ex.chain_captured)}
        for c in concurrencies if n else ():   # after the waves: the replays write KV where they left it
            r = row[f"c{c}"]
            r["replays"] = graphs = cycle_replays_ms(getattr(e.runner, "executor", None), c, n)
            if graphs and r["cycle_ms"]:
                r["cycle_over_replays"] = r["cycle_ms"] / graphs["cycle_ms"]
            print(f"small N={n} c={c}: served cycle {r['cycle_ms']:.2f} ms, reads/cycle {r['reads_per_cycle']}"
                  + (f", graph replays {graphs['cycle_ms']:.2f} ms ({r['cycle_over_replays']:.2f}x)"
                     if graphs else ", no graphs captured"), flush=True)
        out["runs"][f"N={n}"] = row
        e.runner.close() if hasattr(e.runner, "close") else None
        del e
    return out


# ----------------------------------------------------------------------------- 2. served
def check_serve(out_dir: Path, cpu: bool):
    """One server per draft count, serve_bench at each concurrency against it; -> summaries."""
    import subprocess

    from bench import serve_bench as sb
    runs = {}
    cwd = os.getcwd()
    os.chdir("/tmp")   # `python -m glmc.cli` must find the installed glmc, not the repo's glmc/ folder
    try:
        for n in (0, 3):
            args = ("--device cpu --weights glmc-tiny" if cpu else "--device cuda") + " --max-running 16"
            args += f" --speculative-num-steps {n}" if n else ""
            proc, url = sb.launch(args, out_dir / f"server_N{n}.log")
            try:
                for c in ((1,) if cpu else (1, 16)):
                    path = out_dir / f"serve_N{n}_c{c}.json"
                    tokens = 8 if cpu else 64
                    cmd = common.command("serve_bench", "--url", url, "--num-requests",
                                         str(max(8, 4 * c) if not cpu else 2), "--concurrency", str(c),
                                         "--min-tokens", str(tokens), "--max-tokens", str(tokens), "--seed", "1",
                                         "--out", str(path))
                    subprocess.run(cmd, check=True, timeout=300, cwd=ROOT)
                    got = json.loads(path.read_text())
                    runs[f"N={n} c{c}"] = got["summary"]   # with "speculative": the accept length
                    print(f"serve N={n} c={c}: " + json.dumps({k: v for k, v in got["summary"].items()
                                                              if "p50" in k or "tokens_per_s" in k}), flush=True)
            finally:
                sb.stop(proc)
    finally:
        os.chdir(cwd)
    return runs


# ----------------------------------------------------------------------------- 3. GLM-5.3 width
def slice_with_mtp(dev, dtype, narrow, fp8=False, parallel="tp1"):
    """HF slice of 4 layers (dense full, MoE full, MoE shared, MoE full): the last becomes the MTP
    layer; -> (glmc plan for `parallel` with MTP phases, weights, expert stacks). fp8: block-FP8
    linear weights (the loader quantises the random bf16 ones on load, as gpu_plan_check's width
    slice)."""
    import tempfile

    import torch
    from glmc.compiler import compile_plan
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.spec import load_spec
    model = common.slice_model(dev, dtype, seed=0, narrow=narrow, num_hidden_layers=4,
                           indexer_types=["full", "full", "shared", "full"])
    weights, stacks = common.glmc_weights(model)
    h = model.config.hidden_size
    g = torch.Generator(device=dev).manual_seed(5)
    p = "model.layers.3."
    weights[p + "enorm.weight"] = torch.ones(h, device=dev, dtype=dtype)
    weights[p + "hnorm.weight"] = torch.ones(h, device=dev, dtype=dtype)
    weights[p + "shared_head.norm.weight"] = torch.ones(h, device=dev, dtype=dtype)
    weights[p + "eh_proj.weight"] = (torch.randn(h, 2 * h, generator=g, device=dev) * (2 * h) ** -0.5).to(dtype)
    raw = model.config.to_dict()
    raw.update(model_type="glm_moe_dsa", dtype="bfloat16", num_hidden_layers=3, num_nextn_predict_layers=1,
               indexer_types=["full", "full", "shared"], mlp_layer_types=raw["mlp_layer_types"][:3])
    if fp8:
        raw["quantization_config"] = common.FP8_CONFIG
    d = Path(tempfile.mkdtemp(prefix="glmc_mtp_slice_"))
    (d / "config.json").write_text(json.dumps(raw))
    spec = load_spec(d)
    # the MoE's gather form in every phase: a lone rank (the rank part) cannot run an all-to-all, and
    # the prefill (8K-token chunks would take it) only fills the caches here
    plan = compile_plan(spec, parse_parallel(parallel, spec.config),
                        Options(device="cuda", max_batch=16, mtp_draft_tokens=4, moe_a2a=False))
    return model, plan, weights, stacks


def segment_calls(runner, phase, batch, hidden, size=None):
    """Run `phase` once eagerly (`size` tokens after padding; default the batch's), recording every
    op call; -> {segment: [(op, args, step, implementation)]}: a layer's calls ("layer<i>") and the
    rest ("head": the final norm, lm_head, sampling; the MTP prologue)."""
    from collections import OrderedDict
    size = size or batch.num_tokens
    calls = common.op_calls(runner, lambda: runner.run_tokens(
        phase, runner.host_vectors(batch, size).to(runner.r2t.device), hidden))
    groups = OrderedDict()
    for op, args, rt, fn in calls:
        if op.kind in ("io.input",):
            continue
        key = f"layer{op.layer}" if op.layer is not None else "head"
        groups.setdefault(key, []).append((op, args, rt, fn))
    return groups


def segment_bench(dev):
    """ms of one call of a segment: CUDA-graph replays on the GPU, wall time of one eager call on the CPU."""
    from bench.common import bench_ms
    return (lambda fn: bench_ms(fn)) if dev == "cuda" else (lambda fn: bench_ms(fn, graph=False))


def segment_ms(runner, phase, batch, hidden, bench):
    """Each segment of `segment_calls` replayed as a CUDA graph of its own, with the inputs of one
    real step; -> {segment: ms}."""
    groups = segment_calls(runner, phase, batch, hidden)
    return {k: bench(lambda cs=cs: [fn(op, args, rt) for op, args, rt, fn in cs]) for k, cs in groups.items()}


def width_steps(dev, plan, weights, stacks, ctx, batches, budget_end, out, comm=None):
    """The slice's runner (`comm`: its collectives; default the plan's), max(batches) requests of ctx
    random tokens prefilled; then (B, T, runner, batch, hidden) for every B in batches and every step
    of T = B (N + 1) tokens, N in 0 and STEPS (per request: the verify of N drafts; hidden: the draft
    step's input rows, padded as the runner pads T). Stops at budget_end (out["skipped"] says where);
    out["setup_s"]: the load and prefill."""
    import torch
    from glmc.runtime.worker.forward_batch import ForwardBatch
    t0 = now()
    B_max = max(batches)
    runner = common.gpu_runner(plan, weights, dev, B_max, ctx + 64, stacks=stacks, comm=comm)
    table = common.req_table(B_max, (ctx + 64) // 64)
    g = torch.Generator().manual_seed(0)
    vocab = plan.config.vocab_size
    prompts = [torch.randint(0, vocab, (ctx,), generator=g).tolist() for _ in range(B_max)]
    common.prefill(runner, prompts, table, group=max(1, 8192 // ctx))
    out["setup_s"] = now() - t0
    for B in batches:
        for T in sorted({B * (n + 1) for n in (0, *STEPS)}):
            if now() > budget_end:
                out["skipped"] = f"budget spent at B={B} T={T}"
                return
            per = T // B
            ids = [torch.randint(0, vocab, (per,), generator=g).tolist() for _ in range(B)]
            batch = ForwardBatch.build("extend" if per > 1 else "decode", ids, list(range(B)), [ctx] * B, table)
            hid = torch.randn(runner.padded_tokens(T, None), plan.config.hidden_size, device=dev, dtype=runner.dtype)
            yield B, T, runner, batch, hid


def check_width(dev, narrow, ctx, budget_end, batches=(1, 16), fp8=False):
    import torch
    _, plan, weights, stacks = slice_with_mtp(dev, torch.bfloat16, narrow, fp8)
    out = {"ctx": ctx, "weights": "fp8" if fp8 else "bf16", "segments": {}}
    bench = segment_bench(dev)
    for B, T, runner, batch, hid in width_steps(dev, plan, weights, stacks, ctx, batches, budget_end, out):
        verify = T > B
        row = {"verify" if verify else "decode": segment_ms(runner, "mtp_verify" if verify else "decode",
                                                            batch, None, bench),
               "draft": segment_ms(runner, "mtp_draft", batch, hid, bench)}
        out["segments"][f"B={B} T={T}"] = row
        print(f"width {out['weights']} B={B} T={T}: " + ", ".join(f"{ph} " + " ".join(f"{k} {v:.3f}" for k, v in seg.items())
                                                              for ph, seg in row.items()), flush=True)
    return out


# ----------------------------------------------------------------------------- 4. one rank of a mesh
# what a rank's collectives and the one-shot kernel's fused add + RMSNorm cost comes from the calibration
COMM_KINDS = ("comm.", "fused.allreduce_add_rms", "fused.reduce_scatter_add_rms")


def peer_tokens(tokens, experts, seed=0):
    """LoneComm's `peer` for a step of `tokens` real tokens: what the other ranks contribute to an
    all-gather, other tokens. Part p's row j is the step's row p R + j (R rows per rank). A real
    token's row is, for floating values (hidden rows), random normal at x's RMS: the router, which
    runs again on the gathered rows, routes such rows independently, as random tokens route; for
    expert ids (where the plan gathers them), this rank's row j through a permutation of the
    experts of its own: an independent uniform set of distinct experts. Padding rows all alike
    (padding is one token): one shared random row, row 0 through one shared permutation."""
    import torch
    g = torch.Generator().manual_seed(seed)
    made = {}

    def draw(key, make):
        if key not in made:
            made[key] = make()
        return made[key]

    def peer(part, x):
        R, rows = x.shape[0], []
        rms = x.float().pow(2).mean().sqrt() if x.is_floating_point() else None
        for j in range(R):
            key, src = (part * R + j, x[j]) if part * R + j < tokens else ("pad", x[0])
            if rms is not None:
                noise = draw(("rows", key, tuple(src.shape)), lambda: torch.randn(tuple(src.shape), generator=g))
                rows.append((noise.to(x.device) * rms).to(x.dtype))
            else:
                perm = draw(("ids", key), lambda: torch.randperm(experts, generator=g))
                rows.append(perm.to(x.device)[src.long()].to(x.dtype))
        return torch.stack(rows)
    return peer


def as_ep_rank(calls, shift, experts):
    """`calls` with every moe.experts op's ids rotated down by `shift` (mod `experts`): rank 0's
    kernels, whose experts are 0 .. E/ep - 1, then do the work of the rank whose experts start at
    `shift` (the tokens routed to it, its count of distinct experts) on rank 0's weights."""
    import torch
    out = []
    for op, args, rt, fn in calls:
        if op.kind == "moe.experts" and shift:
            args = [(a.long() - shift).remainder(experts).to(a.dtype)
                    if torch.is_tensor(a) and not a.is_floating_point() else a for a in args]
        out.append((op, args, rt, fn))
    return out


def ep_rank_ms(groups, ep, experts, bench):
    """{EP rank: {segment: ms}} of `segment_calls`' groups replayed without their collectives
    (COMM_KINDS), as each EP rank's experts (`as_ep_rank`); ranks past 0 only the segments with a
    moe.experts op (the rest is the same work on every rank)."""
    out = {}
    for r in range(ep):
        out[r] = {}
        for k, calls in groups.items():
            if r and not any(c[0].kind == "moe.experts" for c in calls):
                continue
            calls = as_ep_rank([c for c in calls if not c[0].kind.startswith(COMM_KINDS)], r * (experts // ep), experts)
            out[r][k] = bench(lambda cs=calls: [fn(op, args, rt) for op, args, rt, fn in cs])
    return out


def experts_touched(groups, ep, experts):
    """{segment: [distinct experts its step's real tokens route to, per EP rank]} of the segments
    with a moe.experts op (padding tokens, which run no expert, left out as `cuda_target.padding_rows`
    finds them)."""
    import torch
    from glmc.codegen.cuda_target import padding_rows
    out = {}
    for k, calls in groups.items():
        for op, args, rt, _ in calls:
            if op.kind != "moe.experts":
                continue
            ids = next(a for a in args if torch.is_tensor(a) and not a.is_floating_point())
            pad = padding_rows(op, ids, rt)
            real = ids if pad is None else ids[pad[0] != pad[1]]
            used = real.reshape(-1).unique().tolist()
            out[k] = [sum(r * experts // ep <= e < (r + 1) * experts // ep for e in used) for r in range(ep)]
    return out


def comm_ms(plan, phase, env, cal, launches):
    """{segment: ms} of the calibrated collectives of `phase`'s ops at `env` (glmc/predict.py's
    comm_s: the one-shot kernel's time where the plan runs it, else NCCL's); `launches`: the plan's
    `glmc.launches.LaunchCounts`."""
    from glmc.passes.costs import weight_bytes_for
    from glmc.predict import op_seconds
    graph, wb, out = plan.graphs[phase], weight_bytes_for(plan.dtypes), {}
    made = launches(phase, env["T"], env["S"]).op_launches()
    for op in graph.ops:
        key = f"layer{op.layer}" if op.layer is not None else "head"
        out[key] = out.get(key, 0.0) + op_seconds(op, graph, env, plan.dtypes, cal, wb,
                                                  made.get(op.results[0], ()))["comm_s"] * 1e3
    return out


def check_rank(dev, narrow, ctx, budget_end, parallel, calibration, batches=(1, 16), fp8=False):
    """One rank of `parallel` measured alone on this GPU (`LoneComm`: rank 0's shard, collectives that
    keep shapes and move nothing, the peers' tokens from `peer_tokens`): each segment of
    a decode / verify step and of a draft step replayed without its collectives, once per EP rank's
    expert range (`as_ep_rank`); a segment's compute is the slowest rank's (the ranks meet at every
    collective), and the calibrated collectives are added. -> the segments in `predict`'s form
    (compute + collectives) and the parts."""
    import torch
    from glmc.calibration import load
    from glmc.launches import LaunchCounts
    from glmc.runtime.worker.comm import LoneComm
    _, plan, weights, stacks = slice_with_mtp(dev, torch.bfloat16, narrow, fp8, parallel)
    cal, launches = load(calibration), LaunchCounts(plan)
    lone = LoneComm(plan.mesh, rank=0)
    cfg = plan.config
    E, ep = cfg.n_routed_experts, plan.mesh["ep"]
    out = {"parallel": parallel, "rank": lone.rank, "ep_ranks": ep, "ctx": ctx, "weights": "fp8" if fp8 else "bf16",
           "calibration": calibration, "segments": {}, "parts": {}}
    bench = segment_bench(dev)
    for B, T, runner, batch, hid in width_steps(dev, plan, weights, stacks, ctx, batches, budget_end, out, lone):
        size = hid.shape[0]
        env = {"T": size, "B": size, "S": ctx, "K": cfg.index_topk}
        lone.peer = peer_tokens(T * plan.mesh["attn_dp"], E)   # DP: every rank holds T tokens
        row, parts = {}, {}
        for name, phase, hidden in (("verify", "mtp_verify", None) if T > B else ("decode", "decode", None),
                                    ("draft", "mtp_draft", hid)):
            groups = segment_calls(runner, phase, batch, hidden, size)
            ranks = ep_rank_ms(groups, ep, E, bench)
            compute = {k: max(r[k] for r in ranks.values() if k in r) for k in ranks[0]}
            comm = comm_ms(plan, phase, env, cal, launches)
            row[name] = {k: compute[k] + comm.get(k, 0.0) for k in compute}
            parts[name] = {"compute_ms": compute, "comm_ms": comm, "per_rank_ms": ranks,
                           "experts_per_rank": experts_touched(groups, ep, E)}
        lone.peer = None
        out["segments"][f"B={B} T={T}"] = row
        out["parts"][f"B={B} T={T}"] = parts
        print(f"rank {parallel} {out['weights']} B={B} T={T}: " + ", ".join(
            f"{ph} " + " ".join(f"{k} {parts[ph]['compute_ms'][k]:.3f}+{parts[ph]['comm_ms'].get(k, 0):.3f}"
                                for k in seg) for ph, seg in row.items()), flush=True)
    return out


def mtp_cycle(plain, draft1, verify, extend, n, requests, accept) -> dict:
    """One speculative cycle of `n` drafts (ms): verify + draft-extend + n - 1 draft steps + the
    measured host time per cycle at `requests` (`glmc.predict.spec_host_ms`), per accepted token
    against a plain step, and the term that limits it."""
    from glmc.predict import spec_host_ms
    host = spec_host_ms(n, requests)
    cycle = verify + extend + (n - 1) * draft1 + host
    tpot = cycle / accept
    terms = {"verify/plain": verify / plain, "drafts/plain": (extend + (n - 1) * draft1) / plain,
             "host/plain": host / plain}
    return {"verify_ms": verify, "draft_extend_ms": extend, "host_ms": host, "cycle_ms": cycle,
            "accept_length": accept, "tpot_ms": tpot, "speedup": plain / tpot,
            "terms": terms, "limit": max(terms, key=terms.get)}


def predict(width, accept):
    """The whole GLM-5.3's time per token with and without MTP (module docstring)."""
    L, dense, every = FULL_MODEL["layers"], FULL_MODEL["dense"], FULL_MODEL["full_every"]
    full = {i for i in range(L) if i % every == 0}
    counts = {"dense_full": sum(i in full for i in range(dense)),
              "dense_shared": sum(i not in full for i in range(dense)),
              "moe_full": sum(i in full for i in range(dense, L)),
              "moe_shared": sum(i not in full for i in range(dense, L))}

    def step(seg):
        indexer = seg["layer1"] - seg["layer2"]        # a full indexer's share (MoE full - MoE shared)
        kinds = {"dense_full": seg["layer0"], "dense_shared": max(seg["layer0"] - indexer, 0.0),
                 "moe_full": seg["layer1"], "moe_shared": seg["layer2"]}
        return seg["head"] + sum(counts[k] * kinds[k] for k in counts), kinds

    rows = {}
    for B in (1, 2, 16):
        seg = width["segments"].get(f"B={B} T={B}")
        if not seg:
            continue
        plain, kinds = step(seg["decode"])
        draft1 = sum(seg["draft"].values())
        row = {"plain_ms": plain, "per_layer_ms": kinds, "draft_step_ms": draft1, "mtp": {}}
        for n in STEPS:
            big = width["segments"].get(f"B={B} T={B * (n + 1)}")
            if not big or n not in accept:
                continue
            verify, _ = step(big["verify"])
            extend = sum(big["draft"].values())
            row["mtp"][n] = mtp_cycle(plain, draft1, verify, extend, n, B, accept[n])
        rows[f"c{B}"] = row
    return {"counts": counts, "rows": rows}


def predict_mesh(accept: dict, calibration: str, parallel: str = "tp8ep8", context: int = 8192) -> dict:
    """The whole GLM-5.3 (FP8 weights, FP8 KV) on `parallel`'s GPUs, by `glmc explain`'s calibrated
    cost model (glmc/predict.py) over the plan's own phase graphs: decode at B tokens per rank,
    mtp_verify at B (N + 1), mtp_draft at B (N + 1) (the draft-extend, an upper bound) and at B (each
    chain step); the same cycle formula as `predict`. The model, not a measurement."""
    from glmc.calibration import load
    from glmc.compiler import compile_plan
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.predict import predict_step
    from glmc.spec import load_spec, model_path
    spec = load_spec(model_path("glm_moe_dsa"))
    plan = compile_plan(spec, parse_parallel(parallel, spec.config), Options(device="cuda", mtp_draft_tokens=4))
    cal = load(calibration)

    def ms(phase, T):
        env = {"T": T, "B": T, "S": context, "K": plan.config.index_topk}
        return predict_step(plan.graphs[phase], env, plan.dtypes, cal, plan.world)["step_s"] * 1e3
    rows = {}
    for B in (1, 16):
        plain, draft1 = ms("decode", B), ms("mtp_draft", B)
        row = {"plain_ms": plain, "draft_step_ms": draft1, "mtp": {}}
        for n in STEPS:
            if n not in accept:
                continue
            verify, extend = ms("mtp_verify", B * (n + 1)), ms("mtp_draft", B * (n + 1))
            row["mtp"][n] = mtp_cycle(plain, draft1, verify, extend, n, B, accept[n])
        rows[f"c{B}"] = row
    return {"parallel": parallel, "context": context, "calibration": calibration, "rows": rows}


def print_prediction(name: str, pred: dict) -> None:
    for c, row in pred["rows"].items():
        for n, m in row["mtp"].items():
            print(f"{name} {c} N={n}: plain {row['plain_ms']:.2f} ms, MTP {m['tpot_ms']:.2f} ms per token "
                  f"(accept {m['accept_length']:.2f}): speedup {m['speedup']:.2f}x; limited by {m['limit']} "
                  f"({', '.join(f'{k} {v:.2f}' for k, v in m['terms'].items())})", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on the host: narrow widths, Triton interpreted")
    ap.add_argument("--out-dir", default="/tmp/mtp_gpu_check")
    ap.add_argument("--parts", default="small,serve,width", help="comma list of small, serve, width, rank")
    ap.add_argument("--gen", type=int, help="tokens generated per request (small; default 48, --cpu 8)")
    ap.add_argument("--concurrency", help="comma list (small; default 1,16, --cpu 1,2)")
    ap.add_argument("--ctx", type=int, default=4096, help="context of the width slice's requests")
    ap.add_argument("--budget", type=float, default=480)
    ap.add_argument("--weights", default="bf16,fp8", help="width part: weight formats, each its own slice")
    ap.add_argument("--accept", default="", help="N=a,... accept lengths for the prediction (default: measured)")
    ap.add_argument("--calibration", help="bench/calibrate.py's file: also predict the whole GLM-5.3 on tp8ep8 "
                    "with glmc explain's cost model (the rank part's collectives: default "
                    f"{CALIBRATION.relative_to(ROOT)})")
    ap.add_argument("--parallel", help="rank part: the mesh whose rank 0 is measured (default tp8ep8, --cpu tp2ep2; "
                    "under attention DP, B is per DP rank, every rank holding B requests)")
    a = ap.parse_args()
    if a.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    dev = "cpu" if a.cpu else "cuda"
    t0 = now()
    Path(a.out_dir).mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d"),
           "commit": os.environ.get("GLMC_COMMIT", "unknown"), "args": vars(a)}
    parts = a.parts.split(",")
    out = Path(a.out_dir)
    path = out / f"mtp_gpu_check_{res['date']}.json"

    def save():   # after every part: a run cut short keeps what it measured
        res["seconds"] = now() - t0
        path.write_text(json.dumps(res, indent=1, default=str))
    if "small" in parts:
        conc = tuple(int(c) for c in a.concurrency.split(",")) if a.concurrency else (1, 2) if a.cpu else (1, 16)
        res["small"] = check_small(dev, a.gen or (8 if a.cpu else 48), conc)
        save()
    accept = {int(k.split("=")[0]): float(k.split("=")[1]) for k in a.accept.split(",") if k}
    if not accept and "small" in res:   # greedy accept length of the widest wave (c1 is one prompt)
        accept = {n: res["small"]["runs"][f"N={n}"][f"c{max(conc)}"]["accept_length"] for n in STEPS}
    if "serve" in parts:
        res["serve"] = check_serve(out.resolve(), a.cpu)
        save()
    for fmt in a.weights.split(",") if "width" in parts else ():
        key = "width" if fmt == "bf16" else f"width_{fmt}"
        res[key] = check_width(dev, a.cpu, 80 if a.cpu else a.ctx, t0 + a.budget, (1, 2) if a.cpu else (1, 16),
                               fp8=fmt == "fp8")
        res[key.replace("width", "prediction")] = pred = predict(res[key], accept)
        print_prediction(f"GLM-5.3, {fmt} weights (one GPU's measured layers x 78)", pred)
        save()
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    for fmt in a.weights.split(",") if "rank" in parts else ():
        key = f"rank_{fmt}"
        parallel = a.parallel or ("tp2ep2" if a.cpu else "tp8ep8")
        res[key] = check_rank(dev, a.cpu, 80 if a.cpu else a.ctx, t0 + a.budget, parallel,
                              a.calibration or str(CALIBRATION), (1, 2) if a.cpu else (1, 16), fp8=fmt == "fp8")
        res[f"prediction_rank_{fmt}"] = pred = predict(res[key], accept)
        print_prediction(f"GLM-5.3 {parallel}, {fmt} weights (a rank's measured layers x 78 + calibrated collectives)",
                         pred)
        save()
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if a.calibration and accept:
        res["prediction_mesh"] = predict_mesh(accept, a.calibration)
        print_prediction(f"GLM-5.3 {res['prediction_mesh']['parallel']} (calibrated model)", res["prediction_mesh"])
    save()
    print(f"wrote {path} in {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
