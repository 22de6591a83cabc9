"""`glmc plan`: the parallel spec, MoE lowering and serving settings for a workload on N GPUs.

Compile once, price many: every (parallel spec, MoE lowering, KV dtype) is compiled once (the CUDA
plan; its decode and MTP-draft graphs are priced, with the launches of their launch programs,
`glmc.launches.LaunchCounts`); MTP drafts, concurrency and the prompt's chunks are numbers fed to
`glmc.predict.predict_step` on those graphs, never a recompile. Each candidate is compiled and
priced in one worker process (`run_tasks`), so only its rows travel back. Per candidate and concurrency C
(requests per DP rank r = ceil(C / attn_dp)), with d MTP drafts and an accept length E (tokens a
request gains per step, 1 without MTP):

    step   = decode graph at T = r x (d + 1) tokens per rank (the verify forward) + d x draft graph at T = r
    TPOT   = step / E;  tok/s per user = E / step;  tok/s per GPU = C x E / step / N
    TTFT   = ceil(in / chunk) decode-graph steps of `chunk` tokens at context `in`
    memory = weights + re-laid-out copies + r x (in + out) x KV bytes per token
             + the decode workspace at its CUDA-graph bucket + the graph pool  <=  0.9 x GPU memory
             (with d > 0 also the MTP layer's own weights and its KV)

A candidate that does not fit, or whose spec is invalid for the model, is dropped with the reason.
`assumptions` says in words what each number takes for granted.
"""
from __future__ import annotations

import copy
import itertools
import math
import multiprocessing
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from glmc.compiler import compile_plan
from glmc.config import Options
from glmc.launches import LaunchCounts
from glmc.parallel import ParallelError, parse_parallel
from glmc.passes.costs import weight_bytes_for
from glmc.passes.plan_memory import op_weight_bytes
from glmc.predict import (SMALL_ACCEPT_LENGTH, SMALL_ACCEPT_SOURCE, SPEC_HOST_SOURCE, launch_terms, op_seconds,
                          spec_host_ms)

# a checkout's calibration measured on two H200s (bench/calibrate.py)
DEFAULT_CALIBRATION = Path(__file__).resolve().parents[1] / "bench/results/calibration_nvidia-h200-x2_2026-11-30.json"
MEM_FRACTION = 0.9            # as `glmc explain`: what the runner may use of a GPU's memory
DEFAULT_GPU_MEMORY_GB = 141   # an H200
DEFAULT_CONCURRENCY = (1, 4, 16, 64, 256)
KV_DTYPES = ("fp8", "bf16")
JOBS = min(2, os.cpu_count() or 1)   # compile processes


class PlanSearchError(ValueError):
    """A bad argument of `glmc plan`; the message names it and shows the accepted form."""


@dataclass(frozen=True)
class Workload:
    input_tokens: int
    output_tokens: int

    @property
    def context(self) -> int:
        return self.input_tokens + self.output_tokens


def parse_workload(text: str) -> Workload:
    """`in=8192,out=1024` -> Workload; anything else is a PlanSearchError that shows the form."""
    fields = dict(kv.split("=", 1) for kv in text.split(",") if "=" in kv)
    ok = set(fields) == {"in", "out"} and len(text.split(",")) == 2 and \
        all(re.fullmatch(r"[1-9]\d*", v.strip()) for v in fields.values())
    if not ok:
        raise PlanSearchError(f"--workload {text!r}: expected in=<prompt tokens>,out=<output tokens>, "
                              "both positive integers (e.g. in=8192,out=1024)")
    return Workload(int(fields["in"]), int(fields["out"]))


def parse_numbers(text: str, flag: str) -> tuple[int, ...]:
    """`1,4,16` -> (1, 4, 16): positive integers, else a PlanSearchError naming the flag."""
    parts = [p.strip() for p in text.split(",")]
    if not all(re.fullmatch(r"[1-9]\d*", p) for p in parts):
        raise PlanSearchError(f"{flag} {text!r}: expected comma-separated positive integers (e.g. 1,4,16)")
    return tuple(int(p) for p in parts)


def parse_slo(text: str | None) -> dict:
    """`tpot_ms=20,ttft_ms=2000` -> {"tpot_ms": 20.0, "ttft_ms": 2000.0}; None -> {}."""
    if not text:
        return {}
    out = {}
    for kv in text.split(","):
        key, _, value = kv.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            key = "?"
        if key.strip() not in ("tpot_ms", "ttft_ms") or out.get(key.strip(), 0) <= 0:
            raise PlanSearchError(f"--slo {text!r}: expected tpot_ms=<ms> and/or ttft_ms=<ms>, positive numbers")
    return out


def specs_for(gpus: int, config) -> tuple[list[str], list[dict]]:
    """Every spec over `gpus` GPUs (tpN, tpNepM, dpNepM, dpAtpBepC) valid for `config`, and the
    invalid ones with their reason."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    names = [f"tp{gpus}"] + [f"tp{gpus}ep{e}" for e in divisors if e > 1] + \
        [f"dp{gpus}ep{e}" for e in divisors if e > 1] + \
        [f"dp{a}tp{gpus // a}ep{e}" for a in divisors if 1 < a < gpus for e in divisors if e > 1]
    valid, dropped = [], []
    for name in names:
        try:
            parse_parallel(name, config)
            valid.append(name)
        except ParallelError as e:
            dropped.append({"candidate": name, "reason": str(e)})
    return valid, dropped


def lowerings_for(par) -> list[tuple[str, bool | None]]:
    """The MoE lowerings worth pricing: both a2a and gather (routing by cost) where experts are
    split over ranks that each hold whole experts; otherwise the compiler's own choice."""
    if par.ep > 1 and par.moe_tp == 1:
        return [("a2a", True), ("gather", False)]
    return [("auto", None)]


def accept_lengths(accept: float | None) -> tuple[dict, str]:
    """Accept length by drafts 0-3: from a per-draft acceptance rate a (1 + a + ... + a^d), else
    glmc-small's measured lengths; and the assumption in words."""
    if accept is None:
        return dict(SMALL_ACCEPT_LENGTH), ("MTP accept lengths (tokens per verify step, drafts 1/2/3: "
                                           f"{SMALL_ACCEPT_LENGTH[1]}/{SMALL_ACCEPT_LENGTH[2]}/"
                                           f"{SMALL_ACCEPT_LENGTH[3]}) are glmc-small's measured ones "
                                           f"({SMALL_ACCEPT_SOURCE}), not GLM-5.3's; set --accept")
    if not 0 <= accept <= 1:
        raise PlanSearchError(f"--accept {accept}: a per-draft acceptance rate in [0, 1]")
    lengths = {d: sum(accept ** i for i in range(d + 1)) for d in range(4)}
    return lengths, f"MTP: each draft accepted with probability {accept} given the one before (--accept)"


_LAYER = re.compile(r"^model\.layers\.\d+\.")


def _layerless(value):
    """An attribute value with its weight names' layer index dropped (tuples recursively)."""
    if isinstance(value, tuple):
        return tuple(_layerless(v) for v in value)
    return _LAYER.sub("model.layers.*.", value) if isinstance(value, str) else value


def without_p2p(op):
    """`op` as a `--no-p2p` plan has it: select-collective-backend's threshold is its only trace."""
    return replace(op, attrs=tuple(kv for kv in op.attrs if kv[0] != "p2p_max_bytes"))


# the predictor's per-step terms (glmc.predict.op_seconds) as a row carries them, summing to the step
STEP_TERMS = {"collectives": "collectives", "launches": "launches (kernels, GEMM calls, torch ops)",
              "hbm": "HBM traffic (memory-bound ops)", "compute": "compute (FLOP-bound ops)",
              "topk_select": "top-k select latency",
              "spec_host": "speculative host work (measured)"}


class StepPricer:
    """`glmc.predict.predict_step`'s `step_s` for one graph at many points, fast: ops that differ
    only in their layer's weight names (same kind, attributes, operand and result types) and make
    the same launches at the point cost the same, so each such group is priced once per point and
    counted (a test holds it equal to predict_step). `launches(tokens, context)`: the graph's launch
    program at a point (`LaunchCounts` of its phase)."""

    def __init__(self, graph, dtypes, cal: dict, ranks: int, launches, p2p: bool = True):
        self.graph, self.dtypes, self.cal, self.launches = graph, dtypes, cal, launches
        self.weight_bytes = weight_bytes_for(dtypes)
        for op in graph.ops:
            if int(op.attr("size", 1)) > ranks:
                raise ValueError(f"{op.kind} {op.results[0]}: a group of {op.attr('size')} on {ranks} GPUs")
        self._ops(graph.ops if p2p else [without_p2p(op) for op in graph.ops])

    def _ops(self, ops) -> None:
        self.ops, ids = list(ops), {}
        self.keys = [ids.setdefault((op.kind, _layerless(op.attrs), tuple(self.graph.type_of(v) for v in op.operands),
                                     op.types), len(ids)) for op in self.ops]
        self._groups: dict = {}

    def nccl(self) -> "StepPricer":
        """The same graph priced as a `--no-p2p` plan (`without_p2p`)."""
        other = copy.copy(self)
        other._ops([without_p2p(op) for op in self.ops])
        return other

    def groups(self, program) -> list:
        """[[op, count, its launches]] of the ops priced alike at a point whose program is `program`."""
        if id(program) in self._groups:
            return self._groups[id(program)][1]
        per_op, groups = program.op_launches(), {}
        for op, key in zip(self.ops, self.keys):
            made = per_op.get(op.results[0], ())
            sig = (key, tuple((x.kind, x.name) for x in made))
            if sig in groups:
                groups[sig][1] += 1
            else:
                groups[sig] = [op, 1, made]
        self._groups[id(program)] = (program, list(groups.values()))   # the program held: its id stays its own
        return self._groups[id(program)][1]

    def step_seconds(self, env: dict) -> float:
        return self.step_terms(env)["seconds"]

    def step_terms(self, env: dict) -> dict:
        """{"seconds": the step, and its STEP_TERMS}: each op's max(HBM, compute) counted under the
        one that bounds it, so the terms sum to the step."""
        program = self.launches(env["T"], env["S"])
        terms, ops = dict.fromkeys(STEP_TERMS, 0.0), 0.0
        for op, n, made in self.groups(program):
            t = op_seconds(op, self.graph, env, self.dtypes, self.cal, self.weight_bytes, made)
            ops += n * t["seconds"]
            terms["hbm" if t["memory_s"] >= t["compute_s"] else "compute"] += n * t["data_s"]
            for term, key in (("launches", "overhead_s"), ("topk_select", "latency_s"), ("collectives", "comm_s")):
                terms[term] += n * t[key]
        step, _ = launch_terms(program.step_launches(), self.cal)
        terms["launches"] += step
        return {"seconds": ops + step, **terms}


@dataclass(frozen=True)
class Compiled:
    """One compiled candidate: the graphs that price every number of it and their launch programs."""
    name: str
    par: object
    moe: str
    kv_dtype: str
    spec: object
    decode: object
    draft: object | None
    launches: LaunchCounts


def candidate_tasks(spec, gpus: int, kv_dtypes=KV_DTYPES, only: list[str] | None = None) -> tuple[list, list]:
    """(one compile task per (spec, lowering, KV dtype), dropped [{candidate, reason}])."""
    from glmc.spec import kv_dtyped
    bad = [kv for kv in kv_dtypes if kv not in KV_DTYPES]
    if bad:
        raise PlanSearchError(f"--kv-dtype {','.join(kv_dtypes)}: unknown {', '.join(bad)}; "
                              f"known: {', '.join(KV_DTYPES)}")
    names, dropped = specs_for(gpus, spec.config)
    if only:
        unknown = [s for s in only if s not in names]
        dropped += [{"candidate": s, "reason": f"not a valid spec over {gpus} GPUs for this model"} for s in unknown]
        names = [s for s in names if s in only]
    tasks = [(kv_dtyped(spec, kv), name, kv, moe, forced) for name, kv in itertools.product(names, kv_dtypes)
             for moe, forced in lowerings_for(parse_parallel(name, spec.config))]
    return tasks, dropped


def run_tasks(fn, tasks: list, jobs: int = JOBS, desc: str = "") -> list:
    """[fn(t) for t in tasks], in order, over `jobs` forked worker processes (compiling and pricing
    are pure Python: one core each), with a progress bar on stderr when it is a terminal."""
    bar = tqdm(total=len(tasks), desc=desc, unit="task", leave=False, file=sys.stderr,
               disable=not sys.stderr.isatty() or bool(os.environ.get("TQDM_DISABLE")))
    def counted(results):
        for r in results:
            bar.update()
            yield r
    with bar:
        if jobs > 1 and len(tasks) > 1:
            with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("fork")) as pool:
                return list(counted(pool.map(fn, tasks)))
        return list(counted(map(fn, tasks)))


def _compile_one(task) -> Compiled:
    """One candidate's CUDA plan: its decode (and MTP-draft) graph and their launch programs; a
    module-level function, so a worker process can run it."""
    s, name, kv, moe, forced = task
    par, opts = parse_parallel(name, s.config), Options(moe_a2a=forced, device="cuda")
    plan = compile_plan(s, par, opts, phases=("decode", "mtp_verify", "mtp_draft"))
    return Compiled(name, par, moe, kv, s, plan.graphs["decode"], plan.graphs.get("mtp_draft"), LaunchCounts(plan))


def _compile_and_price(task) -> tuple[list[dict], list[dict]]:
    """`price_candidate` of one compile task (its last item the Pricing), in the worker that compiled
    it: only the rows travel back, not the graphs."""
    *compile_task, pricing = task
    return price_candidate(_compile_one(tuple(compile_task)), pricing)


def _bucket_bytes(workspaces: dict, tokens: int) -> tuple[int, bool]:
    """The decode workspace at `tokens` per rank (its CUDA-graph bucket) and whether one exists."""
    sizes = sorted((int(k), v) for k, v in workspaces.items())
    fit = [v for k, v in sizes if k >= tokens]
    if fit:
        return fit[0], True
    top, top_bytes = sizes[-1]
    return int(top_bytes * tokens / top), False


def mtp_extra_bytes(c: Compiled) -> tuple[int, int]:
    """(weight bytes, KV + indexer bytes per token) the MTP layer adds to a rank: the draft graph's
    weights that the decode graph does not hold (not the shared embedding and lm_head) and its cache."""
    if c.draft is None:
        return 0, 0
    held = {(op.kind, op.attr("weight")) for op in c.decode.ops if op.attr("weight") is not None}
    cuda, extra, seen = Options().device == "cuda", 0, set(held)
    for op in c.draft.ops:
        key = (op.kind, op.attr("weight"))
        if op.attr("weight") is not None and key not in seen:
            seen.add(key)
            extra += sum(op_weight_bytes(op, c.spec.config, c.spec.dtypes, cuda))
    m = c.draft.meta["memory"]
    return extra, m["kv_bytes_per_token"] + m["index_bytes_per_token"]


def memory_check(c: Compiled, requests: int, tokens: int, w: Workload, gpu_bytes: int,
                 mtp: tuple[int, int] = (0, 0)) -> dict:
    """The bytes one rank needs (module docstring) and whether they fit; `mtp`: the MTP layer's
    (weight bytes, cache bytes per token) where drafts run (`mtp_extra_bytes`)."""
    m = c.decode.meta["memory"]
    mtp_weights, mtp_kv = mtp
    kv = requests * w.context * (m["kv_bytes_per_token"] + m["index_bytes_per_token"] + mtp_kv)
    workspace, graphed = _bucket_bytes(m["workspace_bytes"], tokens)
    parts = {"weights": m["weights_bytes"] + m.get("weight_copies_bytes", 0) + mtp_weights, "kv": kv,
             "workspace": workspace, "graph_pool": m.get("graph_pool_bytes", 0)}
    need, limit = sum(parts.values()), int(gpu_bytes * MEM_FRACTION)
    return {"bytes": parts, "need": need, "limit": limit, "fits": need <= limit, "graphed": graphed}


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _pricer(c: Compiled, phase: str, cal: dict, gpus: int, memo: dict, p2p: bool) -> StepPricer:
    """One StepPricer per graph and backend; the NCCL one reuses the p2p one's ops."""
    key = (c.name, c.moe, c.kv_dtype, p2p, phase)
    if key not in memo:
        graph_phase = "decode" if phase == "decode" else "mtp_draft"
        memo[key] = _pricer(c, phase, cal, gpus, memo, True).nccl() if not p2p else \
            StepPricer(c.decode if phase == "decode" else c.draft, c.spec.dtypes, cal, gpus,
                       lambda t, context: c.launches(graph_phase, t, context))
    return memo[key]


def _step(c: Compiled, phase: str, tokens: int, requests: int, context: int, cal: dict, gpus: int,
          memo: dict, p2p: bool = True) -> dict:
    """`predict_step`'s seconds and STEP_TERMS for one of `c`'s graphs at a point, each point priced once."""
    key = (c.name, c.moe, c.kv_dtype, p2p, phase, tokens, requests, context)
    if key not in memo:
        env = {"T": tokens, "B": requests, "S": context, "K": c.spec.config.index_topk}
        memo[key] = _pricer(c, phase, cal, gpus, memo, p2p).step_terms(env)
    return memo[key]


def price(c: Compiled, cal: dict, w: Workload, gpus: int, concurrency: int, drafts: int,
          accept: dict, chunk: int, memo: dict, p2p: bool = True) -> dict:
    """One row: step, TPOT, TTFT, tok/s per GPU and per user for `concurrency` requests, and the
    step's STEP_TERMS in ms (verify forward + drafts x draft step; they sum to step_ms)."""
    dp = c.par.attn_dp
    r = -(-concurrency // dp)
    t = r * (drafts + 1)
    verify = _step(c, "decode", t, t, w.context, cal, gpus, memo, p2p)
    draft = _step(c, "draft", r, r, w.context, cal, gpus, memo, p2p) if drafts else {}
    host = spec_host_ms(drafts, concurrency)
    step = verify["seconds"] + (drafts * draft["seconds"] if drafts else 0) + host / 1e3
    terms = {k: (verify[k] + drafts * draft.get(k, 0.0)) * 1e3 for k in STEP_TERMS}
    terms["spec_host"] = host
    tokens = min(chunk, w.input_tokens)
    chunks = math.ceil(w.input_tokens / tokens)
    ttft = chunks * _step(c, "decode", tokens, 1, w.input_tokens, cal, gpus, memo, p2p)["seconds"]
    e = accept[drafts]
    return {"requests_per_rank": r, "tokens_per_rank": t, "step_ms": step * 1e3, "tpot_ms": step / e * 1e3,
            "ttft_ms": ttft * 1e3, "tok_s_per_gpu": concurrency * e / step / gpus,
            "tok_s_per_user": e / step, "accept_length": e, "step_terms_ms": terms}


@dataclass(frozen=True)
class Pricing:
    """What every candidate is priced at (`search`'s arguments, accept lengths by drafts)."""
    cal: dict
    workload: Workload
    gpus: int
    concurrency: tuple
    drafts: tuple
    accept: dict
    chunk: int
    gpu_memory: tuple


def price_candidate(c: Compiled, p: Pricing) -> tuple[list[dict], list[dict]]:
    """(rows, dropped) of one compiled candidate: each collective backend x MTP drafts x
    concurrency that fits, priced on its graphs; those that do not fit with the bytes that say why."""
    w, rows, dropped, memo = p.workload, [], [], {}
    mtp = mtp_extra_bytes(c) if p.drafts != (0,) else (0, 0)
    for p2p, d, conc in itertools.product((True, False), p.drafts, p.concurrency):
        name = f"{c.name} moe={c.moe} kv={c.kv_dtype} mtp={d}{'' if p2p else ' nccl'}"
        r = -(-conc // c.par.attn_dp)
        mem = memory_check(c, r, r * (d + 1), w, p.gpu_memory[0], mtp if d else (0, 0))
        if not mem["fits"]:
            b = mem["bytes"]
            dropped.append({"candidate": f"{name} c={conc}", "reason": (
                f"needs {_gib(mem['need'])} per GPU > {_gib(mem['limit'])} "
                f"({MEM_FRACTION} x {p.gpu_memory[0] / 1e9:g} GB): "
                f"weights {_gib(b['weights'])} + KV {_gib(b['kv'])} ({r} requests x {w.context} tokens) + "
                f"workspace {_gib(b['workspace'])} + graph pool {_gib(b['graph_pool'])}")})
            continue
        row = {"candidate": name, "parallel": c.name, "moe": c.moe, "kv_dtype": c.kv_dtype, "p2p": p2p,
               "mtp_drafts": d,
               "concurrency": conc, "memory_gib": round(mem["need"] / 2**30, 2), "graphed": mem["graphed"]}
        rows.append({**row, **price(c, p.cal, w, p.gpus, conc, d, p.accept, p.chunk, memo, p2p)})
    return rows, dropped


def pareto(rows: list[dict]) -> list[dict]:
    """The rows no other row beats on both tok/s per GPU and tok/s per user, by tok/s per user."""
    front = [a for a in rows if not any(
        b["tok_s_per_gpu"] >= a["tok_s_per_gpu"] and b["tok_s_per_user"] >= a["tok_s_per_user"] and
        (b["tok_s_per_gpu"], b["tok_s_per_user"]) != (a["tok_s_per_gpu"], a["tok_s_per_user"]) for b in rows)]
    return sorted(front, key=lambda r: (-r["tok_s_per_user"], -r["tok_s_per_gpu"], r["candidate"]))


def best_for_slo(rows: list[dict], slo: dict) -> dict | None:
    """The row of most tok/s per GPU within the SLO (every row without one); None if none meets it."""
    ok = [r for r in rows
          if r["tpot_ms"] <= slo.get("tpot_ms", math.inf) and r["ttft_ms"] <= slo.get("ttft_ms", math.inf)]
    return max(ok, key=lambda r: (r["tok_s_per_gpu"], r["tok_s_per_user"]), default=None)


def search(spec, cal: dict, gpus: int, w: Workload, concurrency=DEFAULT_CONCURRENCY, slo: dict | None = None,
           gpu_memory: tuple[int, str] = (DEFAULT_GPU_MEMORY_GB * 10**9, "default"), accept: float | None = None,
           kv_dtypes=KV_DTYPES, drafts=(0, 1, 2, 3), only: list[str] | None = None,
           prefill_chunk: int | None = None) -> dict:
    """`glmc plan`'s result: rows (every feasible candidate x concurrency), dropped ones with their
    reason, the Pareto front, the best row for the SLO, and the assumptions. `prefill_chunk`: the
    prompt tokens per prefill step (`glmc run --max-batch-tokens`; default the plan's chunk)."""
    tasks, dropped = candidate_tasks(spec, gpus, kv_dtypes, only)
    lengths, accept_note = accept_lengths(accept)
    if not spec.config.num_nextn_predict_layers:
        drafts = (0,)
    chunk, rows = prefill_chunk or Options().chunked_prefill, []
    pricing = Pricing(cal, w, gpus, tuple(concurrency), tuple(drafts), lengths, chunk, gpu_memory)
    for priced, unfit in run_tasks(_compile_and_price, [t + (pricing,) for t in tasks],
                                   desc=f"glmc plan: {len(tasks)} candidates"):
        rows, dropped = rows + priced, dropped + unfit
    front = pareto(rows)
    return {"gpus": gpus, "model": spec.name, "prefill_chunk": chunk,
            "workload": {"in": w.input_tokens, "out": w.output_tokens},
            "concurrency": list(concurrency), "kv_dtypes": list(kv_dtypes), "mtp_drafts": list(drafts),
            "slo": slo or {}, "rows": rows, "pareto": front,
            "best": best_for_slo(rows, slo or {}), "dropped": dropped,
            "assumptions": _assumptions(cal, w, gpu_memory, accept_note, chunk)}


def _assumptions(cal: dict, w: Workload, gpu_memory: tuple, accept_note: str, chunk: int) -> list[str]:
    return [
        f"calibration {cal.get('path', '<dict>')}: {cal['device']}, {cal['gpus']} GPUs, {cal['date']}; "
        "collectives over group sizes it did not measure are extrapolated (glmc.calibration)",
        f"GPU memory {gpu_memory[0] / 1e9:g} GB ({gpu_memory[1]}); a plan may use {MEM_FRACTION} of it",
        f"memory per rank: weights and their re-laid-out copies, KV + indexer cache for requests per rank x "
        f"{w.context} tokens (in + out), the decode workspace at its CUDA-graph bucket and the graph pool; "
        "with MTP also the MTP layer's own weights (its embedding and lm_head are the model's) and cache; "
        "not counted: the prefill workspace, NCCL buffers",
        "step: the decode predictor (glmc.predict) at every request's context = in + out (the longest it "
        "gets), the MTP verify forward priced as a decode step of requests x (drafts + 1) tokens, plus one "
        "draft-graph step per draft, plus the speculative cycle's host work as measured on glmc-small "
        f"({SPEC_HOST_SOURCE}; linear in the concurrency through 1 and 16 requests, extrapolated past 16); "
        "plain decoding's host work (scheduling, sampling, HTTP) overlaps the device and is not included",
        accept_note,
        f"TTFT: no prefill prediction exists; the prompt is priced as ceil(in / {chunk}) decode-graph steps "
        f"of min(in, {chunk}) tokens at context {w.input_tokens} (every token scoring the whole prompt in "
        "the full indexer layers: high), with no queueing and no decode steps interleaved; serve with "
        f"glmc run --max-batch-tokens {chunk} for this chunk",
        "requests per DP rank = ceil(concurrency / attn_dp), routing uniform and balanced",
        f"rows with graphed: false run more tokens per rank than the largest CUDA-graph bucket "
        f"({Options().max_batch}): priced as a graph replay, they would run eagerly; their workspace is "
        "the largest bucket's scaled by tokens",
        "MoE a2a and gather are priced where the spec allows both (routing by the compiler's cost); "
        "auto: the compiler's choice",
        "collective backend: each candidate with the plan's peer-memory thresholds (small collectives "
        "skip NCCL) and, marked nccl, with every collective on NCCL (--no-p2p)",
    ]


MOE_OPTION = {"a2a": True, "gather": False, "auto": None}


def compile_choice(spec, row: dict, out_dir, prefill_chunk: int) -> tuple[str, str]:
    """Compile `row`'s plan (its spec, MoE lowering and KV dtype; every phase, the CUDA target) into
    `out_dir`; returns the directory and the `glmc run` command that serves it with the row's settings."""
    from glmc.explain import explain_plan
    from glmc.report import render
    from glmc.spec import kv_dtyped
    s = kv_dtyped(spec, row["kv_dtype"])
    opts = Options(moe_a2a=MOE_OPTION[row["moe"]], p2p_collectives=row["p2p"])
    plan = compile_plan(s, parse_parallel(row["parallel"], s.config), opts)
    out = Path(out_dir)
    plan.save(out, {"report.md": render(explain_plan(plan))})
    mtp = f" --speculative-num-steps {row['mtp_drafts']}" if row["mtp_drafts"] else ""
    return str(out), (f"glmc run {out} --device cuda --weights HF_DIR "
                      f"--max-running {row['requests_per_rank']} --max-batch-tokens {prefill_chunk}{mtp}")
