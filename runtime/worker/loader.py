"""The one loader: (plan, weights, device, rank) -> a ready `PlanRunner`.

Every way of running a plan goes through `load_runner`: `glmc run` (one rank or many), the Python
API (`glmc.api`), the multi-rank server's ranks and the bench scripts. It

1. makes this rank's collectives (`Comm` over the plan's process groups) unless given one,
2. reads this rank's shard of the weights: from a HF checkpoint directory (`shards.load_rank_weights`),
   from full tensors held in memory (`shards.iter_rank_weights`, for benchmarks with random
   weights) or made on the device (a random checkpoint directory: `random_weights`), in the
   formats the plan states (`codegen.weight_formats`): under an FP8 plan its FP8
   weights stay e4m3 + 128 x 128 block scales (`Fp8Weight`; quantised on load where the checkpoint
   holds them unquantised, `--quantize fp8`), FP8 tensors of other weights are dequantised; the
   torch target holds the FP8 weights' values dequantised in fp32,
3. sizes the KV pool from the plan (`KVPool.for_plan`: the MTP layer exactly when the plan has MTP
   phases) with one scratch page for padding tokens on top of `num_pages`; the caches the plan
   stores fp8 (`dtypes.kv_cache`, `index_cache`) are FP8 on the CUDA target (FlashMLA's 656-byte
   latent rows, 132-byte indexer keys per 64-token pages) and fp32 on the torch target (which
   computes everything in fp32; `kv_fp8="emulate"` rounds their values through FP8 instead, the
   oracle of the CUDA target's FP8 KV),
4. builds the executor of the plan's target: the torch target in fp32 (`executor.PlanExecutor`)
   or the CUDA target (`cuda_executor.CudaExecutor`: fp32 for an fp32 checkpoint, else bf16, the
   router in fp32, running the plan's rendered kernels/*.py and nothing else) and, on a GPU,
   captures the decode graph of every bucket.

Slow steps show progress bars on stderr (off with $TQDM_DISABLE, as ranks other than 0 set it).
"""
from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping

import torch
from glmc.codegen.fp8_ref import Fp8Weight
from glmc.codegen.kernel_set import compute_dtype
from glmc.codegen.weight_formats import fp8_weights
from glmc.runtime.worker.checkpoint import detect_mtp, expected_tensors, weight_dtype
from glmc.runtime.worker.comm import Comm, Coords
from glmc.runtime.worker.executor import PlanExecutor, pop_expert_stacks, rank_expert_names
from glmc.runtime.worker.kv_cache import KVPool
from glmc.runtime.worker.model_runner import DevicePlanRunner, PlanRunner, context_limit
from glmc.runtime.worker.random_weights import RandomWeights
from glmc.runtime.worker.shards import cut_rank_stacks, iter_rank_weights, load_rank_weights, rank_shards
from tqdm import tqdm as _tqdm

from glmc.plan import Plan
from glmc.run_config import RunConfig, with_settings

Weights = "str | Path | Mapping[str, torch.Tensor]"


def progress(*args, **kwargs):
    """A progress bar on stderr, off when $TQDM_DISABLE is set (read now, not at import: ranks
    other than 0 set it after tqdm was imported). Work of one step (`total=1`) gets one line
    instead: its bar would only show 0% and then 100%, carriage returns in a log."""
    quiet = bool(os.environ.get("TQDM_DISABLE"))
    if kwargs.get("total") == 1:
        return _Line(kwargs.get("desc", ""), quiet)
    return _tqdm(*args, disable=quiet, leave=False, **kwargs)


class _Line:
    """`progress` of one step: `glmc: <desc>` on stderr as it starts; `update` does nothing."""

    def __init__(self, desc: str, quiet: bool):
        if not quiet:
            print(f"glmc: {desc}", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> _Line:
        return self

    def __exit__(self, *exc) -> None:
        pass


def load_runner(plan: Plan, weights: Weights, run: RunConfig | None = None, *, comm: Comm | None = None,
                target: str | None = None, stacks: dict | None = None, **settings) -> PlanRunner:
    """This rank's runner of `plan` with the settings of `run` (`glmc.run_config.RunConfig`; its
    fields may also come as keywords): `device`, a KV pool of `num_pages` pages (the scheduler may
    hand out that many, and `max_running` requests per step), `max_context`, `kv_fp8` (what becomes
    of the caches the plan stores fp8, `KVPool.for_plan`), and on a GPU the graphs it captures
    (`capture`: the decode buckets; with `speculative_num_steps` > 0 also the MTP verify and draft
    graphs of a plan with MTP phases, and on one rank a greedy cycle's graph per decode bucket
    when the run's N is the plan's; with `prefill_graphs`, prefill graphs for steps of up to
    `max_batch_tokens` tokens on one-rank plans, `cuda_executor.prefill_buckets`). A CUDA-target
    plan on "cpu" runs the same code uncaptured, Triton under TRITON_INTERPRET=1: a dry run.
    `weights` is a checkpoint directory (a random one makes its weights on the device:
    `random_weights`) or a mapping of full HF-named tensors. `target` overrides the plan's ("cpu":
    the fp32 torch target, e.g. as the oracle of a CUDA plan on the same GPU); `stacks` passes
    expert weights already stacked per layer ({weight prefix: (gate, up, down)}, benchmarks holding
    HF's fused expert tensors)."""
    run = with_settings(run, **settings)
    target = target or plan.target
    device = torch.device(run.device)
    num_pages, max_context = run.num_pages, run.max_context
    comm = comm or Comm(plan.mesh, plan.groups)
    fp8 = fp8_weights(plan)
    given = _rank_stacks(cut_rank_stacks(stacks, plan, comm.coords), fp8, target) if stacks else {}
    t0 = time.perf_counter()
    if target != "cuda":
        local = _rank_weights(plan, weights, comm, torch.float32, fp8, False, device)
        stacks = _moved({**stack_experts(local, plan, comm.coords), **given}, lambda w: w.to(device))
        local = {n: w.to(device) for n, w in local.items()}
        pool = KVPool.for_plan(plan, num_pages + 1, torch.float32, device, run.kv_fp8 or "none")
        executor = PlanExecutor(plan, local, pool, comm, device=device, stacks=stacks)
        return PlanRunner(executor, max_context)
    from glmc.runtime.worker.cuda_executor import CHAIN, CYCLE, MTP_PHASES, CudaExecutor, to_device_weight, to_device_weights

    dtype = compute_dtype(plan.dtypes)
    max_ctx = context_limit(plan.config.max_position_embeddings, num_pages, max_context)
    local = _rank_weights(plan, weights, comm, dtype, fp8, True, device)
    stacks = _moved({**stack_experts(local, plan, comm.coords), **given},
                    lambda w: to_device_weight(w, device, dtype))
    local = to_device_weights(local, device, dtype)
    pool = KVPool.for_plan(plan, num_pages + 1, dtype, device, run.kv_fp8 or "store")
    gpu = CudaExecutor(plan, local, pool, comm, max_reqs=run.max_running, max_context=max_ctx, stacks=stacks,
                       max_batch_tokens=run.max_batch_tokens if run.prefill_graphs else 0)
    loaded, captured = time.perf_counter() - t0, {}
    phases = ("decode", *MTP_PHASES) if run.speculative_num_steps and plan.has_mtp else ("decode",)
    if len(phases) > 1 and gpu.phase_buckets[CYCLE] and gpu.cycle_steps == run.speculative_num_steps:
        phases += (CYCLE, CHAIN)   # greedy cycles in one graph (one rank), and chained
    phases += ("prefill",) if gpu.phase_buckets["prefill"] else ()
    if run.capture and device.type == "cuda":
        with progress(total=gpu.num_graphs(phases), desc="capturing CUDA graphs", unit="graph") as bar:
            gpu.capture(progress=bar.update, phases=phases)
        captured = gpu.timings
    if comm.rank == 0:
        others = {p: sorted(gpu.mtp_captured[p]) for p in MTP_PHASES if gpu.mtp_captured[p]}
        others.update({CYCLE: sorted(gpu.cycle_captured)} if gpu.cycle_captured else {})
        others.update({CHAIN: sorted(gpu.chain_captured)} if gpu.chain_captured else {})
        others.update({"prefill": sorted(gpu.prefill_captured)} if gpu.prefill_captured else {})
        print(f"glmc: {device} runner ({plan.parallel}, rank 0 of {comm.world}): "
              f"weights {loaded:.1f} s, {len(gpu.captured)} decode graphs {sorted(gpu.captured)}"
              f"{''.join(f', {len(b)} {p} graphs {b}' for p, b in others.items())} captured "
              f"in {sum(captured.values()):.1f} s", file=sys.stderr, flush=True)
    return DevicePlanRunner(gpu, max_ctx)


def _rank_weights(plan: Plan, weights: Weights, comm: Comm, dtype: torch.dtype, fp8: frozenset,
                  keep_fp8: bool, device: torch.device) -> dict:
    """This rank's weights in `dtype`; the names in `fp8` as `Fp8Weight` (keep_fp8) or as the
    values of their FP8 form in `dtype` (quantised and dequantised when they come unquantised).
    From a checkpoint directory; or from a mapping of full tensors, or the weights a random
    checkpoint directory makes on `device` (`RandomWeights`), one tensor at a time, each converted
    as it is cut. First checks that they fit the device's memory."""
    source = weights if isinstance(weights, Mapping) else RandomWeights.in_dir(weights, plan.config, device)
    if isinstance(source, RandomWeights):
        source = source.on(device)
    shapes = (source.shapes if isinstance(source, RandomWeights) else
              {n: tuple(w.shape) for n, w in source.items()} if source is not None else
              expected_tensors(plan.config, **detect_mtp(weights)))
    shards = rank_shards(plan.graphs.values(), comm.coords)
    _check_fits(plan, comm, shards, shapes, fp8 if keep_fp8 else frozenset(), dtype, device)
    if source is None:
        with progress(total=1, desc="loading weights", unit="shard") as bar:
            local = load_rank_weights(weights, plan, comm.coords, dtype, keep_fp8=fp8)
            local = {n: _as_planned(n, w, dtype, fp8, keep_fp8) for n, w in local.items()}
            bar.update()
        return local
    names = [n for n in shards if n in source]
    desc = "making random weights" if isinstance(source, RandomWeights) else "cutting weights"
    local = {}
    with progress(total=len(names), desc=desc, unit="tensor") as bar:
        for name, w in iter_rank_weights(source, shards):
            local[name] = _as_planned(name, w, dtype, fp8, keep_fp8)
            bar.update()
    return local


def _as_planned(name: str, w, dtype: torch.dtype, fp8: frozenset, keep_fp8: bool):
    """One weight in the loader's format (see `_rank_weights`)."""
    if name in fp8:
        q = w if isinstance(w, Fp8Weight) else Fp8Weight.quantize(w)
        return q if keep_fp8 else q.dequant(dtype)
    return w.to(weight_dtype(name, dtype)) if w.is_floating_point() else w


def _check_fits(plan: Plan, comm: Comm, shards: dict, shapes: dict, fp8: frozenset, dtype: torch.dtype,
                device: torch.device) -> None:
    """ValueError when this rank's weights (its `shards` of `shapes`: `fp8` names at one byte per
    value plus block scales, the rest in `dtype`) exceed the device's whole memory."""
    need = 0
    for name, spec in shards.items():
        if name not in shapes:
            continue
        numel = math.prod(shapes[name]) // (spec[2] if spec else 1)
        need += numel + numel // 128**2 * 4 if name in fp8 else numel * dtype.itemsize
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[1]
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        hint = ("; the CPU target holds every weight in fp32" if device.type == "cpu" else
                "" if fp8 else " or store its linear weights FP8 (--quantize fp8)")
        raise ValueError(f"{plan.parallel}: rank {comm.rank}'s weights need {need / 2**30:.1f} GiB "
                         f"({'FP8 linears, ' if fp8 else ''}{str(dtype).removeprefix('torch.')}), more than the "
                         f"{device.type} memory of {have / 2**30:.1f} GiB: spread the model over more "
                         f"ranks (--parallel){hint}")


def stack_experts(local: dict, plan: Plan, coords: Coords) -> dict:
    """{weight prefix: (gate, up, down)} stacks of this rank's experts (its ep slice) of every
    `moe.experts` op, their per-expert entries popped from `local` as they are stacked, so every
    expert weight is held once, in its stack (`PlanExecutor.expert_stacks` reads the stacks). Ops
    whose experts `local` lacks (a benchmark passed them stacked) are left to the given stacks."""
    out = {}
    for op in (op for g in plan.graphs.values() for op in g.ops if op.kind == "moe.experts"):
        key, ep_rank = op.attr("weight"), coords.of("ep")
        if key not in out and rank_expert_names(op, ep_rank)[0][0] in local:
            out[key] = pop_expert_stacks(local, op, ep_rank)
    return out


def _moved(stacks: dict, move) -> dict:
    """`move` (to the device, in its dtype) applied to every part of every expert stack."""
    return {key: tuple(move(w) for w in parts) for key, parts in stacks.items()}


def _rank_stacks(stacks: dict, fp8: frozenset, target: str) -> dict:
    """Expert stacks in the plan's format: under an FP8 plan quantised per expert (`Fp8Weight`
    stacks on the CUDA target, their dequantised values in the stacks' dtype on the torch target)."""
    if not fp8:
        return stacks
    out = {}
    for key, parts in stacks.items():
        quantised = [Fp8Weight.quantize(w) for w in parts]
        out[key] = tuple(quantised if target == "cuda" else
                         [q.dequant(w.dtype) for q, w in zip(quantised, parts)])
    return out
