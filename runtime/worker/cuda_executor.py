"""Run a compiled plan on one GPU: eager prefill, decode captured as one CUDA graph per bucket.

`GpuRunner(graphs, config, weights, pool, max_reqs=, max_context=)` is a `PlanExecutor` whose op table
is `codegen.cuda_target.IMPLS` and whose step state (`GpuStep`) holds device index tensors. The
runner owns a device copy of req_to_token (`r2t`, one spare row for padding): prefill copies its
requests' rows in; every decode step (eager or replayed) first writes r2t[row, pos] = out_cache_loc
itself, so the graph needs nothing from the host but four int64 vectors.

`capture(buckets)` records, per bucket b of `graphs["decode"].meta["cuda_graph_buckets"]`, the decode
graph over static buffers [ids | positions | slots | rows] x b (largest first, one memory pool).
`forward("decode", batch)` pads the batch to the smallest bucket >= B (padding rows: token 0 at
position 0 of the spare row, KV slot = the pool's last slot, which allocators never hand out),
copies the four vectors in and replays; B above the largest bucket, or an uncaptured runner, runs
eagerly with the same code. No host sync inside the captured region (see cuda_target).
`build_runner(ckpt_dir, ...)` compiles the tp1 plan for a HF checkpoint and loads its weights.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from glmc.codegen.cuda_target import IMPLS as CUDA_IMPLS
from glmc.runtime.worker.executor import PlanExecutor, Step
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.kv_cache import KVPool

FP32_WEIGHTS = ("mlp.gate.weight", "e_score_correction_bias")  # the router stays fp32 (HF, SGLang)


@dataclass
class GpuStep(Step):
    """Step state on the device: per-token rows/positions, the device table, workspace width."""
    rows: torch.Tensor = None
    pos: torch.Tensor = None
    r2t: torch.Tensor = None
    max_len: int = 0
    last_rows: torch.Tensor | None = None
    moe_tiles: dict = field(default_factory=dict)

    def derived(self, key, make):
        return self.ex.derived(key, make)


@dataclass
class Captured:
    graph: object          # torch.cuda.CUDAGraph
    packed: torch.Tensor   # [4, b] int64 device: ids, positions, slots, rows
    host: torch.Tensor     # [4, b] int64 pinned staging buffer
    out: dict              # static outputs: logits, next_ids, hidden
    copied: object = None  # torch.cuda.Event: the last host->device copy of `host` is done


class GpuRunner(PlanExecutor):
    def __init__(self, graphs, config, weights, pool: KVPool, max_reqs: int, max_context: int,
                 stacks: dict | None = None, moe_tiles: dict | None = None):
        super().__init__(graphs, config, weights, pool, impls=CUDA_IMPLS, device=pool.device)
        self._stacks.update(stacks or {})
        self.max_context, self.pad_row, self.scratch = max_context, max_reqs, pool.num_slots - 1
        self.r2t = torch.full((max_reqs + 1, max_context), self.scratch, dtype=torch.int64, device=pool.device)
        self.moe_tiles = moe_tiles or {}
        self._derived: dict = {}
        self.captured: dict[int, Captured] = {}
        self.buckets = list(graphs["decode"].meta.get("cuda_graph_buckets", []))
        self.timings: dict = {}

    def derived(self, key, make):
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    # ------------------------------------------------------------------ one step over device tensors
    def _step(self, graph, batch, ids, pos, loc, rows, max_len, last_rows=None) -> GpuStep:
        return GpuStep(self, graph, batch, {"input_ids": ids, "positions": pos}, loc, rows=rows, pos=pos,
                       r2t=self.r2t, max_len=max_len, last_rows=last_rows, moe_tiles=self.moe_tiles)

    def _outputs(self, graph, values) -> dict:
        head = next(op for op in graph.ops if op.kind == "lm.head")
        sample = next(op for op in graph.ops if op.kind == "sample.tokens")
        return {"logits": values[sample.operands[0]], "hidden": values[head.operands[0]],
                "next_ids": values[graph.ops[-1].result]}

    def _decode_body(self, ids, pos, loc, rows) -> dict:
        """The captured region: own slot into the device table, then every decode op."""
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
        self.r2t[rows.to(self.r2t.device), :width] = batch.req_to_token[rows, :width].to(self.r2t.device)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, phase: str, batch: ForwardBatch, hidden=None, dp_tokens=None) -> dict:
        if phase not in ("prefill", "decode"):
            raise NotImplementedError(f"GpuRunner: phase {phase!r} (MTP) is not wired yet")
        if int(batch.seq_lens.max()) > self.max_context:
            raise ValueError(f"GpuRunner: seq_len {int(batch.seq_lens.max())} > max_context {self.max_context}")
        B = batch.batch_size
        if phase == "decode":
            bucket = next((b for b in sorted(self.captured) if b >= B), None)
            if bucket is not None:
                return self._replay(bucket, batch)
            self._load_rows(batch)
            ids, pos, loc, rows = self._host_vectors(batch, B).to(self.r2t.device)
            return {k: v[:B] for k, v in self._decode_body(ids, pos, loc, rows).items()}
        self._load_rows(batch)
        ids, pos, loc, rows = self._host_vectors(batch, batch.num_tokens).to(self.r2t.device)
        last = (torch.cumsum(batch.extend_lens, 0) - 1).to(self.r2t.device)
        graph = self.graphs["prefill"]
        values = self.run_ops(graph, self._step(graph, batch, ids, pos, loc, rows, int(batch.seq_lens.max()),
                                                last), "prefill")
        return self._outputs(graph, values)

    def _replay(self, bucket: int, batch: ForwardBatch) -> dict:
        cap = self.captured[bucket]
        cap.copied.synchronize()             # the previous step's copy has read the staging buffer
        cap.host.copy_(self._host_vectors(batch, bucket))
        cap.packed.copy_(cap.host, non_blocking=True)
        cap.copied.record()
        cap.graph.replay()
        return {k: v[:batch.batch_size] for k, v in cap.out.items()}

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
            with torch.cuda.graph(graph, pool=pool):
                out = self._decode_body(*packed)
            torch.cuda.synchronize()
            host = torch.empty(4, b, dtype=torch.int64).pin_memory()
            self.captured[b] = Captured(graph, packed, host, out, torch.cuda.Event())
            self.timings[b] = time.perf_counter() - t0
            if progress is not None:
                progress()
        return dict(self.timings)


def to_device_weights(weights: dict, device, dtype) -> dict:
    """Checkpoint tensors on `device` in the compute dtype; the router weight and bias stay fp32."""
    return {n: w.to(device, torch.float32 if n.endswith(FP32_WEIGHTS) else dtype) for n, w in weights.items()}


def build_runner(ckpt_dir, device="cuda", dtype=None, max_reqs=8, max_context=1024, num_pages=None):
    """(GpuRunner, spec) for the tp1 plan of a HF checkpoint directory (weights in `dtype`: default
    fp32 for an fp32 checkpoint, bf16 otherwise; the KV pool in the same dtype)."""
    from glmc.runtime.worker.comm import Coords
    from glmc.runtime.worker.shards import load_rank_weights

    from glmc.compiler import compile_plan
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.spec import load_spec

    spec = load_spec(ckpt_dir)
    c = spec.config
    par = parse_parallel("tp1", c)
    graphs = compile_plan(spec, par, Options(device="cuda", max_batch=max_reqs)).graphs
    dtype = dtype or (torch.float32 if spec.dtypes.activation == "fp32" else torch.bfloat16)
    weights = load_rank_weights(ckpt_dir, c, [graphs[p] for p in ("prefill", "decode")], Coords(0, par.mesh))
    return GpuRunner(graphs, c, to_device_weights(weights, device, dtype),
                     make_pool(c, device, dtype, max_reqs, max_context, num_pages),
                     max_reqs=max_reqs, max_context=max_context), spec


def make_pool(c, device, dtype, max_reqs, max_context, num_pages=None) -> KVPool:
    """A KV pool with room for max_reqs requests of max_context tokens, plus page 0 and a scratch page."""
    from glmc.runtime.worker.kv_cache import PAGE_SIZE
    layers = c.num_hidden_layers + c.num_nextn_predict_layers
    full = {i for i, t in enumerate(c.layer_indexer_types()) if t == "full"}
    full |= set(range(c.num_hidden_layers, layers))
    pages = num_pages or max_reqs * -(-max_context // PAGE_SIZE) + 2
    return KVPool(layers, full, pages, c.kv_lora_rank, c.qk_rope_head_dim, c.index_head_dim, dtype, device)
