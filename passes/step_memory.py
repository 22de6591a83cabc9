"""The peak bytes one step of the CUDA target holds above what the runner already holds.

`step_memory(graph, target, cfg, mode)` walks a lowered phase graph in execution order on an
`Arena`: first what the GPU runner puts on the device before the ops run (`prologue`), then each op's
allocations as `MODELS` replays them. A value's storage is freed after its last use, as the executor
drops it (`PlanExecutor.run_ops`, `Graph.dead_after`; a storage goes when no value viewing it is
left), except the step's outputs (`Graph.step_outputs`). -> `StepMemory`: the peak, the bytes left
at the end, per op (live at its start, its peak, live at its end) and the kinds counted without a
model.

Modes, as `runtime/worker/cuda_executor.CudaExecutor` runs a phase:
- "eager": `forward("decode")` without a graph: the batch's req_to_token rows copied into the device
  table (transient), the four [T] int64 vectors, then the body;
- "graph": the captured body of one bucket: the static [4, b] buffer is the runner's, so only the
  body's own FUTURE_TOKEN fill-in;
- "prefill": as eager, plus the last token of each request ([B] int64).

`graph_pool(...)` is what capturing every decode bucket adds (see its docstring).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from glmc.ir import Graph

from . import comm_memory, moe_memory, op_memory  # noqa: F401  (register their models)
from .step_arena import MODELS, Arena, Step, Target, Val, generic

CUBLAS_WORKSPACE_SM90 = 32 * 2**20   # torch's cuBLAS workspace per (handle, stream) on Hopper


@dataclass
class StepMemory:
    peak: int
    end: int
    regions: list = field(default_factory=list)    # (op, live at start, peak, live at end)
    guessed: set = field(default_factory=set)      # op kinds counted by `generic`
    outputs: int = 0                               # bytes of logits, hidden and next ids
    prologue: int = 0                              # bytes the prologue left allocated

    @property
    def body_peak(self) -> int:
        """The ops' peak above what the prologue left: the same in every mode."""
        return max((r[2] for r in self.regions), default=self.prologue) - self.prologue

    def peak_as(self, target: Target, mode: str, rounding: int = 1) -> int:
        """This step's peak had it run in `mode` (its ops allocate the same; only the prologue differs)."""
        arena = Arena(rounding)
        prologue(arena, target, mode)
        return max(arena.peak, arena.live + self.body_peak)


def prologue(arena: Arena, t: Target, mode: str) -> dict:
    """The device tensors the runner makes before the ops: -> feeds {name: Val}."""
    T = t.tokens
    if mode != "graph":
        arena.free(arena.alloc(t.requests * 8), arena.alloc(t.requests * t.max_len * 8))   # _load_rows
        vectors = arena.alloc(4 * T * 8)                     # ids, positions, slots, rows
    else:
        vectors = 0                                          # the capture's static buffer
    ids, _lens = arena.alloc(T * 8), arena.alloc(T * 8)     # step_inputs: ids, pos + 1
    if mode == "prefill":
        arena.alloc(t.requests * 8)                          # each request's last token
    return {"input_ids": Val(ids, 8), "positions": Val(vectors, 8, False), "hidden": Val(0, t.act)}


def step_memory(graph: Graph, target: Target, cfg, mode: str = "eager", rounding: int = 1) -> StepMemory:
    """One step of `graph` at `target` in `mode` (module docstring); `rounding` 512 books each
    allocation as the CUDA caching allocator's block, 1 counts tensor bytes (the CPU measurement)."""
    arena = Arena(rounding)
    step = Step(arena, target, graph, cfg, {})
    step.feeds = prologue(arena, target, mode)
    first = arena.peak
    vals: dict[str, Val | None] = {}
    out = StepMemory(0, 0)
    users = {v.buf: 1 for v in step.feeds.values()}     # the step holds its feeds to its end
    for op, dead in zip(graph.ops, graph.dead_after()):
        start = arena.live
        arena.peak = start
        if op.kind not in MODELS:
            out.guessed.add(op.kind)
        res = MODELS.get(op.kind, generic)(op, [vals.get(v) for v in op.operands], step)
        res = res if isinstance(res, tuple) else (res,)
        for name, v in zip(op.results, res):
            vals[name] = v
            if v is not None:
                users[v.buf] = users.get(v.buf, 0) + 1
        out.regions.append((op, start, arena.peak, arena.live))   # as LiveBytes: the op's own call
        _free(dead, vals, users, arena)
        for v in dead:                                    # what the step held with a value goes with it
            arena.free(*step.memo.pop(v, ()))
    out.prologue = out.regions[0][1] if out.regions else arena.live
    out.peak = max([first] + [r[2] for r in out.regions])
    out.end = arena.live
    out.outputs = sum(arena.bytes_of(vals[v].buf) for v in graph.step_outputs() if vals.get(v) is not None)
    return out


def _free(dead, vals, users, arena) -> None:
    """Drop the values `dead` (an op's `Graph.dead_after`); a storage goes when no value viewing it
    is left."""
    for v in dead:
        val = vals.pop(v, None)
        if val is not None:
            users[val.buf] -= 1
            if not users[val.buf]:
                arena.free(val.buf)


def graph_pool(steps: dict, targets: dict, rounding: int = 512, workspace: int = CUBLAS_WORKSPACE_SM90) -> dict:
    """What capturing every decode bucket (`CudaExecutor.capture`: largest first, one private pool
    shared by all) adds to the device's allocated bytes, from each bucket's step (`steps`
    {bucket: StepMemory}, any mode) and `targets` {bucket: Target}:

    - each bucket's static [4, b] int64 input buffer (allocated outside the pool);
    - each graph's outputs (logits, final hidden states, sampled ids), which stay allocated in the
      pool for the graph's life; everything else a capture allocates is freed when the captured
      body returns, and the next (smaller) capture reuses those blocks;
    - one cuBLAS workspace per (handle, stream) that runs a GEMM (torch keeps them for the process):
      the warm-up's side stream (one for every bucket) and the shared capture stream, whose
      workspace is allocated during the first capture (so it is in the pool).

    -> {allocated (the sum: what memory_allocated grows by), outputs, inputs, workspaces,
    pool_reserved (the pool's segments at least: the largest of, over captures in order, the
    outputs kept so far + that capture's peak, + the capture stream's workspace; the allocator's
    splitting and 2 MB segments add to it)}."""
    kept = inputs = reserved = 0
    for b in sorted(steps, reverse=True):
        m = steps[b]
        reserved = max(reserved, kept + m.peak_as(targets[b], "graph", rounding))
        kept += m.outputs
        inputs += -(-4 * b * 8 // rounding) * rounding
    spaces = 2 * workspace if steps else 0
    return {"allocated": kept + inputs + spaces, "outputs": kept, "inputs": inputs, "workspaces": spaces,
            "pool_reserved": reserved + workspace}
