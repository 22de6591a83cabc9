"""The one loader: (plan, weights, device, rank) -> a ready `PlanRunner`.

Every way of running a plan goes through `load_runner`: `glmc run` (one rank or many), the Python
API (`glmc.api`), the multi-rank server's ranks and the bench scripts. It

1. makes this rank's collectives (`Comm` over the plan's process groups) unless given one,
2. reads this rank's shard of the weights: from a HF checkpoint directory (`shards.load_rank_weights`,
   FP8 dequantised) or from full tensors held in memory (`shards.cut_rank_weights`, for
   benchmarks with random weights),
3. sizes the KV pool from the plan (`KVPool.for_plan`: the MTP layer exactly when the plan has MTP
   phases) with one scratch page for padding tokens on top of `num_pages`,
4. builds the executor of the plan's target: the torch target in fp32 (`executor.PlanExecutor`)
   or the CUDA target (`cuda_executor.GpuRunner`: fp32 for an fp32 checkpoint, else bf16, the
   router in fp32, running the plan's rendered kernels/*.py and nothing else) and, on a GPU,
   captures the decode graph of every bucket.

Slow steps show progress bars on stderr (off with $TQDM_DISABLE, as ranks other than 0 set it).
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping

import torch
from glmc.codegen.kernel_set import compute_dtype
from glmc.runtime.worker.comm import Comm
from glmc.runtime.worker.executor import PlanExecutor
from glmc.runtime.worker.kv_cache import KVPool
from glmc.runtime.worker.model_runner import DevicePlanRunner, PlanRunner, context_limit
from glmc.runtime.worker.shards import cut_rank_stacks, cut_rank_weights, load_rank_weights
from tqdm import tqdm as _tqdm

from glmc.plan import Plan

Weights = "str | Path | Mapping[str, torch.Tensor]"


def progress(*args, **kwargs):
    """A progress bar on stderr, off when $TQDM_DISABLE is set (read now, not at import: ranks
    other than 0 set it after tqdm was imported)."""
    return _tqdm(*args, disable=bool(os.environ.get("TQDM_DISABLE")), leave=False, **kwargs)


def load_runner(plan: Plan, weights: Weights, *, device: str | torch.device | None = None,
                comm: Comm | None = None, num_pages: int = 256, max_context: int | None = None,
                max_running: int = 32, capture: bool = True, target: str | None = None,
                stacks: dict | None = None) -> PlanRunner:
    """This rank's runner of `plan`. `weights` is a checkpoint directory or a mapping of full
    HF-named tensors; `device` defaults to "cuda" for the CUDA target, else "cpu" (a CUDA-target
    plan on "cpu" runs the same code uncaptured, Triton under TRITON_INTERPRET=1: a dry run).
    The scheduler may hand out `num_pages` pages and `max_running` requests per step.
    `target` overrides the plan's ("cpu": the fp32 torch target, e.g. as the oracle of a CUDA
    plan on the same GPU); `stacks` passes expert weights already stacked per layer
    ({weight prefix: (gate, up, down)}, benchmarks holding HF's fused expert tensors)."""
    target = target or plan.target
    device = torch.device(device or ("cuda" if target == "cuda" else "cpu"))
    comm = comm or Comm(plan.mesh, plan.groups)
    stacks = cut_rank_stacks(stacks, plan, comm.coords) if stacks else None
    t0 = time.perf_counter()
    if target != "cuda":
        local = {n: w.to(device) for n, w in _rank_weights(plan, weights, comm, torch.float32).items()}
        pool = KVPool.for_plan(plan, num_pages + 1, torch.float32, device)
        executor = PlanExecutor(plan, local, pool, comm, device=device, stacks=stacks)
        return PlanRunner(executor, max_context)
    from glmc.runtime.worker.cuda_executor import GpuRunner, to_device_weights

    dtype = compute_dtype(plan.dtypes)
    max_ctx = context_limit(plan.config.max_position_embeddings, num_pages, max_context)
    local = to_device_weights(_rank_weights(plan, weights, comm, dtype), device, dtype)
    pool = KVPool.for_plan(plan, num_pages + 1, dtype, device)
    gpu = GpuRunner(plan, local, pool, comm, max_reqs=max_running, max_context=max_ctx,
                    stacks=stacks)
    loaded, captured = time.perf_counter() - t0, {}
    if capture and device.type == "cuda":
        with progress(total=len(gpu.buckets), desc="capturing CUDA graphs", unit="graph") as bar:
            captured = gpu.capture(progress=bar.update)
    if comm.rank == 0:
        print(f"glmc: {device} runner ({plan.parallel}, rank 0 of {comm.world}): "
              f"weights {loaded:.1f} s, {len(captured)} decode graphs {sorted(captured)} captured "
              f"in {sum(captured.values()):.1f} s", file=sys.stderr, flush=True)
    return DevicePlanRunner(gpu, max_ctx)


def _rank_weights(plan: Plan, weights: Weights, comm: Comm, dtype: torch.dtype) -> dict:
    with progress(total=1, desc="loading weights", unit="shard") as bar:
        if isinstance(weights, Mapping):
            local = {n: w.to(dtype) if w.is_floating_point() else w
                     for n, w in cut_rank_weights(weights, plan, comm.coords).items()}
        else:
            local = load_rank_weights(weights, plan, comm.coords, dtype)
        bar.update()
    return local
