"""Run a compiled plan on one GPU: eager prefill, decode captured as one CUDA graph per bucket.

`GpuRunner(plan, weights, pool, comm, max_reqs=, max_context=)` is a `PlanExecutor` whose op table
is `codegen.cuda_target.IMPLS` and whose step state (`GpuStep`) holds device index tensors. The
runner owns a device copy of req_to_token (`r2t`, one spare row for padding): prefill copies its
requests' rows in; every decode step (eager or replayed) first writes r2t[row, pos] = out_cache_loc
itself, so the graph needs nothing from the host but four int64 vectors. An input id < 0
(`FUTURE_TOKEN`) is the token last recorded for the token's row (`record_tokens`, called by the
engine after sampling on the device): the graph reads it from `last_token`, so the host can queue
step N+1 before it has read step N's tokens.

`capture(buckets)` records, per bucket b of `graphs["decode"].meta["cuda_graph_buckets"]`, the decode
graph over static buffers [ids | positions | slots | rows] x b (largest first, one memory pool).
`forward("decode", batch)` pads the batch to the smallest bucket >= B (padding rows: token 0 at
position 0 of the spare row, KV slot = the pool's last slot, which allocators never hand out),
copies the four vectors in and replays; B above the largest bucket, or an uncaptured runner, runs
eagerly with the same code. No host sync inside the captured region (see cuda_target).
Made by `runtime/worker/loader.py` (`load_runner`), which also captures the graphs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from glmc.codegen.cuda_target import IMPLS as CUDA_IMPLS
from glmc.codegen.fp8_ref import Fp8Weight
from glmc.codegen.triton_render import KernelLibrary
from glmc.runtime.worker.comm import Comm
from glmc.runtime.worker.executor import PlanExecutor, Step
from glmc.runtime.worker.forward_batch import ForwardBatch, to_device
from glmc.runtime.worker.kv_cache import KVPool

from glmc.plan import Plan

FP32_WEIGHTS = ("mlp.gate.weight", "e_score_correction_bias")  # the router stays fp32 (HF, SGLang)


@dataclass
class GpuStep(Step):
    """Step state on the device (fulfils `codegen.context.CudaStepContext`): per-token
    rows/positions, the device table, workspace width."""
    rows: torch.Tensor = None
    pos: torch.Tensor = None
    r2t: torch.Tensor = None
    max_len: int = 0
    last_rows: torch.Tensor | None = None
    moe_tiles: dict = field(default_factory=dict)
    kernels: KernelLibrary = None

    def derived(self, key, make):
        return self.ex.derived(key, make)


@dataclass
class Captured:
    graph: object          # torch.cuda.CUDAGraph
    packed: torch.Tensor   # [4, b] int64 device: ids, positions, slots, rows
    host: torch.Tensor     # [4, b] int64 pinned staging buffer
    out: dict              # static outputs: logits, next_ids, hidden
    copied: object = None  # torch.cuda.Event: the last host->device copy of `host` is done
    counts: dict = field(default_factory=dict)  # the collectives one replay runs (as captured)


class GpuRunner(PlanExecutor):
    def __init__(self, plan: Plan, weights, pool: KVPool, comm: Comm | None, max_reqs: int,
                 max_context: int, stacks: dict | None = None):
        super().__init__(plan, weights, pool, comm, impls=CUDA_IMPLS, device=pool.device,
                         stacks=stacks)
        self.max_context, self.pad_row, self.scratch = max_context, max_reqs, pool.num_slots - 1
        self.r2t = torch.full((max_reqs + 1, max_context), self.scratch, dtype=torch.int64, device=pool.device)
        self.last_token = torch.zeros(max_reqs + 1, dtype=torch.int64, device=pool.device)
        # exactly the plan's kernels; a benchmark that sets MoE tile overrides (`moe_tiles`) also
        # swaps in a library that may render variants outside the plan
        self.moe_tiles: dict = {}
        self.kernels = KernelLibrary.from_plan(plan)
        self._derived: dict = {}
        self.captured: dict[int, Captured] = {}
        split = plan.mesh["attn_tp"] if plan.mesh["ep"] > 1 else 1   # tokens split over attn_tp
        self.buckets = [b for b in plan.decode_buckets if b % split == 0]
        self.timings: dict = {}
        self.last_bucket: int | None = None   # the bucket the last decode step replayed

    def derived(self, key, make):
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    # ------------------------------------------------------------------ one step over device tensors
    def _step(self, graph, batch, ids, pos, loc, rows, max_len, last_rows=None) -> GpuStep:
        return GpuStep(self, graph, batch, {"input_ids": ids, "positions": pos}, loc, rows=rows, pos=pos,
                       r2t=self.r2t, max_len=max_len, last_rows=last_rows, moe_tiles=self.moe_tiles,
                       kernels=self.kernels)

    def _outputs(self, graph, values) -> dict:
        head = next(op for op in graph.ops if op.kind == "lm.head")
        sample = next(op for op in graph.ops if op.kind == "sample.tokens")
        return {"logits": values[sample.operands[0]], "hidden": values[head.operands[0]],
                "next_ids": values[graph.ops[-1].result]}

    def record_tokens(self, rows: list[int], tokens: torch.Tensor) -> None:
        """last_token[rows] = tokens (device), queued on the stream: later FUTURE_TOKEN ids read it."""
        self.last_token.index_copy_(0, to_device(torch.tensor(rows, dtype=torch.int64), self.last_token.device),
                                    tokens.to(self.last_token.device, torch.int64))

    def _decode_body(self, ids, pos, loc, rows) -> dict:
        """The captured region: fill in FUTURE_TOKEN ids, own slot into the device table, then
        every decode op."""
        ids = torch.where(ids < 0, self.last_token[rows], ids)
        self.r2t[rows, pos] = loc
        graph = self.graphs["decode"]
        return self._outputs(graph, self.run_ops(graph, self._step(graph, None, ids, pos, loc, rows,
                                                                   self.max_context), "decode"))

    def _host_vectors(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        """[4, size] int64: ids, positions, slots, rows per token, padded with the spare row."""
        t = batch.num_tokens
        v = torch.empty(4, size, dtype=torch.int64)
        v[0].zero_(), v[1].zero_(), v[2].fill_(self.scratch), v[3].fill_(self.pad_row)
        v[0, :t], v[1, :t], v[2, :t] = batch.input_ids, batch.positions, batch.out_cache_loc
        v[3, :t] = batch.req_pool_indices.repeat_interleave(batch.extend_lens)
        return v

    def _load_rows(self, batch: ForwardBatch) -> None:
        """Copy the batch's requests' req_to_token rows (up to max_context) into the device table."""
        rows = batch.req_pool_indices
        width = min(self.max_context, batch.req_to_token.shape[1])
        self.r2t[to_device(rows, self.r2t.device), :width] = to_device(batch.req_to_token[rows, :width],
                                                                        self.r2t.device)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, phase: str, batch: ForwardBatch, hidden=None, dp_tokens=None) -> dict:
        if phase not in ("prefill", "decode"):
            raise NotImplementedError(f"GpuRunner: phase {phase!r} (MTP) is not wired yet")
        longest = int(batch.seq_lens.max()) if batch.batch_size else 1   # idle: padding only
        if longest > self.max_context:
            raise ValueError(f"GpuRunner: seq_len {longest} > max_context {self.max_context}")
        B = batch.batch_size
        if phase == "decode":   # every rank of a DP/TP group runs the same bucket (collectives)
            need = self.padded_tokens(B, dp_tokens)
            bucket = next((b for b in sorted(self.captured) if b >= need), None)
            self.last_bucket = bucket
            if bucket is not None:
                return self._replay(bucket, batch)
            self._load_rows(batch)
            ids, pos, loc, rows = to_device(self._host_vectors(batch, need), self.r2t.device)
            return {k: v[:B] for k, v in self._decode_body(ids, pos, loc, rows).items()}
        self._load_rows(batch)
        size = self.padded_tokens(batch.num_tokens, dp_tokens)
        ids, pos, loc, rows = to_device(self._host_vectors(batch, size), self.r2t.device)
        ids = torch.where(ids < 0, self.last_token[rows], ids)
        last = to_device(torch.cumsum(batch.extend_lens, 0) - 1, self.r2t.device)
        graph = self.graphs["prefill"]
        values = self.run_ops(graph, self._step(graph, batch, ids, pos, loc, rows, longest,
                                                last), "prefill")
        return self._outputs(graph, values)

    def _replay(self, bucket: int, batch: ForwardBatch) -> dict:
        cap = self.captured[bucket]
        cap.copied.synchronize()             # the previous step's copy has read the staging buffer
        cap.host.copy_(self._host_vectors(batch, bucket))
        cap.packed.copy_(cap.host, non_blocking=True)
        cap.copied.record()
        cap.graph.replay()
        self.comm.add(cap.counts)
        return {k: v[:batch.batch_size] for k, v in cap.out.items()}

    def release(self) -> None:
        """Drop the captured graphs (they hold NCCL work) and wait for the device: NCCL
        communicators are destroyed only after no graph can launch on them."""
        self.captured.clear()
        if self.r2t.is_cuda:
            torch.cuda.synchronize(self.r2t.device)

    # ------------------------------------------------------------------ CUDA graphs
    @torch.no_grad()
    def capture(self, buckets=None, warmup: int = 2, progress=None) -> dict:
        """Capture the decode graph for each bucket (default: the plan's); -> seconds per bucket.
        `progress()` is called after each bucket (a progress bar's update)."""
        buckets = sorted(buckets or self.buckets, reverse=True)
        pool = torch.cuda.graph_pool_handle()
        for b in buckets:
            t0 = time.perf_counter()
            packed = torch.zeros(4, b, dtype=torch.int64, device=self.r2t.device)
            packed[2].fill_(self.scratch), packed[3].fill_(self.pad_row)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):        # compile kernels, create handles, fill caches
                for _ in range(warmup):
                    self._decode_body(*packed)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            saved = self.comm.reset()
            with torch.cuda.graph(graph, pool=pool):
                out = self._decode_body(*packed)
            counts = self.comm.reset()            # one step's collectives, credited per replay
            self.comm.add(saved)
            torch.cuda.synchronize()
            host = torch.empty(4, b, dtype=torch.int64).pin_memory()
            self.captured[b] = Captured(graph, packed, host, out, torch.cuda.Event(), counts)
            self.timings[b] = time.perf_counter() - t0
            if progress is not None:
                progress()
        return dict(self.timings)


def to_device_weights(weights: dict, device, dtype) -> dict:
    """Checkpoint tensors on `device` in the compute dtype; the router weight and bias stay fp32;
    FP8 weights (`Fp8Weight`) stay FP8 with their fp32 block scales."""
    return {n: w.to(device) if isinstance(w, Fp8Weight) else
            w.to(device, torch.float32 if n.endswith(FP32_WEIGHTS) else dtype) for n, w in weights.items()}
