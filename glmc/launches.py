"""A CUDA plan's launch programs (`codegen/launch_program.py`), traced on the meta device: what
`glmc compile --device cuda` writes as `launch/<phase>.txt` and what `glmc.predict` prices.

`meta_executor` builds a rank of a plan as the runtime does, on tensors without data;
`launch_programs` / `launch_texts` trace the programs the plan directory holds; `LaunchCounts`
traces (sampled, `trace(sample=True)`) the program of any phase at any token count and context
a prediction asks for, each once.
"""
from __future__ import annotations

import dataclasses

import torch

from glmc.plan import Plan
from glmc.run_config import RunConfig


def meta_executor(plan: Plan, rank: int = 0, run: RunConfig | None = None):
    """Rank `rank` of a CUDA plan as the runtime builds it (`CudaExecutor`, the plan's kernels, its
    weights in their formats and KV pool sized by `run`), alone (`LoneComm`) and on the meta device:
    every shape is real, nothing is allocated and no kernel runs. What `launch_program.trace` runs."""
    from glmc.codegen.fp8_ref import Fp8Weight
    from glmc.codegen.kernel_set import compute_dtype
    from glmc.codegen.weight_formats import fp8_weights
    from glmc.runtime.worker.checkpoint import expected_tensors, weight_dtype
    from glmc.runtime.worker.comm import LoneComm
    from glmc.runtime.worker.cuda_executor import CudaExecutor
    from glmc.runtime.worker.executor import rank_expert_names
    from glmc.runtime.worker.kv_cache import KVPool
    from glmc.runtime.worker.model_runner import context_limit
    from glmc.runtime.worker.shards import rank_shards
    from glmc.target import FP8_BLOCK

    run, meta = run or RunConfig(), torch.device("meta")
    dtype, fp8, comm = compute_dtype(plan.dtypes), fp8_weights(plan), LoneComm(plan.mesh, rank)
    shapes = expected_tensors(plan.config, mtp=plan.has_mtp)

    def weight(name, shape):
        if name in fp8:
            blocks = [-(-d // FP8_BLOCK) for d in shape[-2:]]
            return Fp8Weight(torch.empty(shape, dtype=torch.float8_e4m3fn, device=meta),
                             torch.empty(*shape[:-2], *blocks, dtype=torch.float32, device=meta))
        return torch.empty(shape, dtype=weight_dtype(name, dtype), device=meta)

    weights = {}
    for name, cut in rank_shards(plan.graphs.values(), comm.coords).items():
        if name in shapes:
            shape = list(shapes[name])
            if cut is not None:
                shape[cut[0]] //= cut[2]
            weights[name] = shape
    stacks = {}
    for op in (op for g in plan.graphs.values() for op in g.ops if op.kind == "moe.experts"):
        names = rank_expert_names(op, comm.coords.of("ep"))
        if op.attr("weight") not in stacks:
            stacks[op.attr("weight")] = tuple(weight(part[0], [len(part), *weights[part[0]]]) for part in names)
        for n in (n for part in names for n in part):
            weights.pop(n, None)
    weights = {n: weight(n, s) for n, s in weights.items()}
    max_ctx = context_limit(plan.config.max_position_embeddings, run.num_pages, run.max_context)
    pool = KVPool.for_plan(plan, run.num_pages + 1, dtype, meta, "store")
    return CudaExecutor(plan, weights, pool, comm, max_reqs=run.max_running, max_context=max_ctx, stacks=stacks,
                        max_batch_tokens=run.max_batch_tokens)


def launch_programs(plan: Plan, run: RunConfig | None = None, rank: int = 0) -> dict[str, list]:
    """The launch programs of a CUDA plan's rank `rank` (`codegen.launch_program`), traced on the
    meta device at the settings of `run` (default `RunConfig()`): decode at its smallest and largest
    captured bucket, prefill at one chunk of the step's token budget (`max_batch_tokens`, as a
    prefill graph runs it). -> {phase: [Program, ...]}."""
    from glmc.codegen.launch_program import trace

    run = run or RunConfig()
    ex = meta_executor(plan, rank, run)
    split = plan.mesh.token_split_size
    buckets = ex.phase_buckets["decode"]
    chunk = -(-run.max_batch_tokens // split) * split
    decode = [trace(ex, "decode", buckets[0])]        # warms the executor up for the rest
    decode += [trace(ex, "decode", buckets[-1], warm=False)] if len(buckets) > 1 else []
    return {"decode": decode, "prefill": [trace(ex, "prefill", chunk, warm=False)]}


def launch_texts(plan: Plan, run: RunConfig | None = None) -> dict[str, str]:
    """`launch/<phase>.txt` of a CUDA plan's directory: `launch_programs`, rank 0, as text."""
    return {f"launch/{phase}.txt": "".join(p.text() for p in progs)
            for phase, progs in launch_programs(plan, run).items()}


class LaunchCounts:
    """The launch programs of rank `rank` of a CUDA plan, sampled (`trace(sample=True)`: per op
    the launches of the whole program), by (phase, tokens per rank, context), each traced once on
    the meta device: `counts(phase, tokens, context)` -> `Program`. The program is the one the
    runtime would run for `tokens`: the phase's CUDA graph of the smallest captured bucket that
    holds them, else (above the largest, or a phase without graphs) an eager step of `tokens`
    padded to the mesh's token split; its executor serves requests of up to `context` tokens
    (the attention and top-k select launches depend on it)."""

    def __init__(self, plan: Plan, rank: int = 0, run: RunConfig | None = None):
        if plan.target != "cuda":
            raise ValueError(f"the step-time prediction prices a CUDA plan's launches; this plan targets "
                             f"{plan.target!r} (compile it with --device cuda)")
        self.plan, self.rank, self.run = plan, rank, run or RunConfig()
        self._executors: dict = {}
        self._programs: dict = {}

    def executor(self, context: int):
        if context not in self._executors:
            from glmc.runtime.worker.kv_cache import PAGE_SIZE
            pages = max(self.run.num_pages, -(-(context + 1) // PAGE_SIZE) + 1)
            run = dataclasses.replace(self.run, num_pages=pages, max_context=context + 1)
            self._executors[context] = meta_executor(self.plan, self.rank, run)
        return self._executors[context]

    def tokens(self, phase: str, tokens: int, context: int) -> int:
        """The token count the runtime's step for `tokens` runs at (class docstring)."""
        ex = self.executor(context)
        bucket = next((b for b in ex.phase_buckets.get(phase, []) if b >= tokens), None)
        return bucket or ex.padded_tokens(tokens, None)

    def __call__(self, phase: str, tokens: int, context: int):
        from glmc.codegen.launch_program import trace

        t = self.tokens(phase, tokens, context)
        key = (phase, t, context)
        if key not in self._programs:
            ex = self.executor(context)
            warm = not any(k[2] == context for k in self._programs)
            self._programs[key] = trace(ex, phase, t, warm=warm, sample=True)
        return self._programs[key]
