"""Run a compiled plan on one GPU: prefill, decode (and MTP verify / draft) captured as one CUDA
graph per bucket.

`CudaExecutor(plan, weights, pool, comm, max_reqs=, max_context=)` is a `PlanExecutor` whose op table
is `codegen.cuda_target.IMPLS` and whose step state (`GpuStep`) holds device index tensors. The
runner owns a device copy of req_to_token (`r2t`, one spare row for padding): prefill copies its
requests' rows in; every decode step (eager or replayed) first writes r2t[row, pos] = out_cache_loc
itself (one `step_inputs` launch, with the ids below), so the graph needs nothing from the host but
four int64 vectors. An input id < 0 (`FUTURE_TOKEN`) is the token last recorded for the token's
row (`record_tokens`, called by the engine after sampling on the device): the graph reads it from
`last_token`, so the host can queue step N+1 before it has read step N's tokens.

`capture(buckets)` records, per bucket b of `graphs["decode"].meta["cuda_graph_buckets"]`, the decode
graph over static buffers [ids | positions | slots | rows] x b (largest first, one memory pool).
`forward("decode", batch)` pads the batch to the smallest bucket >= B (padding rows: token 0 at
position 0 of the spare row, KV slot = the pool's last slot, which allocators never hand out),
copies the four vectors in and replays; B above the largest bucket, or an uncaptured runner, runs
eagerly with the same code. No host sync inside the captured region (see cuda_target).

Prefill (and mixed prefill + decode) steps replay the prefill graph of the smallest captured token
count >= T (`prefill_buckets`, up to the engine's token budget; one-rank plans): the same
per-token ops plus the gather of each request's last token (static [L] `last` indices, L = up
to max_reqs requests), with attention and indexer sized for PREFILL_GRAPH_MAX_LEN positions; a
step with more tokens or requests, or a longer sequence, runs the same ops eagerly.

The MTP phases run through the same per-token body (`run_tokens`): every op of the CUDA target is
per token (attention reads the paged KV through r2t up to the token's own position, after the
layer's KV write of every token of the step), so a verify step of B requests x (N+1) tokens, or a
draft-extend over the kept positions, is a decode step over more tokens, several per row.
`mtp_verify` returns the logits and final hidden states of every token; `mtp_draft` takes a
`hidden` row per token (static buffer [b, hidden] in its graphs). `capture(phases=MTP_PHASES...)`
records them per token bucket: verify at the plan's `mtp_verify` buckets (decode buckets x the
verify width), draft at those and the decode buckets (a draft-extend carries up to N + 1 tokens
per request, a chain step one); with prefill graphs (one rank) both also at the prefill token
counts above those, for speculative steps that carry prompts' chunks.
A greedy speculative cycle (verify, acceptance, the draft-extend over every verified position
and the draft chain at positions computed from the accepted counts) runs as one graph per decode
bucket of requests (`cycle`, phase `mtp_cycle`, one rank), read back once by the speculator;
the cycle after it, over the same requests, as a second graph per bucket that makes its own
verify inputs from the last cycle's outputs on the device (`cycle_after`, `mtp_cycle_next`), so it
is queued before that cycle is read. Made by `runtime/worker/loader.py` (`load_runner`), which also captures the graphs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from glmc.codegen import triton_launch as tt
from glmc.codegen.cuda_target import IMPLS as CUDA_IMPLS
from glmc.codegen.fp8_ref import Fp8Weight
from glmc.codegen.kernel_set import compute_dtype
from glmc.codegen.triton_render import KernelLibrary
from glmc.runtime.worker.checkpoint import weight_dtype
from glmc.runtime.worker.comm import Comm
from glmc.runtime.worker.executor import PlanExecutor, Step
from glmc.runtime.worker.forward_batch import ForwardBatch, to_device
from glmc.runtime.worker.kv_cache import KVPool
from glmc.runtime.worker.model_runner import cycle_accepted, cycle_chain_step, cycle_last_kept, cycle_next

from glmc.plan import Plan

# Prefill (and mixed prefill + decode) steps replay a graph of the smallest of these token counts
# that holds them. Eager, such a step is host-bound: on the H200 at GLM-5.3 width a mixed step of
# a 512-token chunk and 32 decodes took 13-19 ms of host time for ~6 ms of kernels (2026-12-01).
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
# The graphs' attention and indexer read up to this many positions per token whatever the step's
# longest sequence (a graph's shapes are fixed), so a step with a longer sequence runs eagerly.
PREFILL_GRAPH_MAX_LEN = 4096
# An eager prefill step whose requests average at least this many tokens scores its indexer keys
# with the token-block kernel (a key tile shared by a request's 64 consecutive tokens); a block of
# many short requests would score most of its tokens one by one in a single program there. Graphs
# (steps of any mix, captured once) keep the per-token kernel.
TOKEN_RUN = 64


def prefill_buckets(max_batch_tokens: int) -> list[int]:
    """Token counts to capture prefill graphs at for steps of up to `max_batch_tokens` tokens."""
    top = min(max_batch_tokens, PREFILL_GRAPH_TOKENS[-1])
    return sorted({b for b in PREFILL_GRAPH_TOKENS if b < top} | {top})


@dataclass
class GpuStep(Step):
    """Step state on the device (fulfils `codegen.context.CudaStepContext`): per-token
    rows/positions, the device table, workspace width."""
    rows: torch.Tensor = None
    pad_slot: int = -1
    dp_loc: torch.Tensor | None = None
    pos: torch.Tensor = None
    lens: torch.Tensor = None
    r2t: torch.Tensor = None
    max_len: int = 0
    last_rows: torch.Tensor | None = None
    token_runs: bool = False   # prefill whose requests average >= TOKEN_RUN tokens (indexer_scores' tiled)
    moe_tiles: dict = field(default_factory=dict)
    kernels: KernelLibrary = None

    def derived(self, key, make):
        return self.ex.derived(key, make)


GRAPH_PHASES = ("decode", "mtp_verify", "mtp_draft")   # the phases run per token (`run_tokens`)
MTP_PHASES = ("mtp_verify", "mtp_draft")
CYCLE = "mtp_cycle"   # a greedy speculative cycle, verify to the last draft, as one graph (`cycle`)
CHAIN = "mtp_cycle_next"   # the cycle after the last one, its inputs made from that one's outputs (`cycle_after`)
# Pinned staging buffers per graph, used in turn: the host queues up to this many replays of one
# graph ahead of the device before it waits for the oldest one's input copy (a speculative cycle
# replays the draft graph of one bucket N - 1 times in a row, without reading anything back).
NUM_STAGING = 4


@dataclass
class Captured:
    graph: object          # torch.cuda.CUDAGraph
    packed: torch.Tensor   # [4 (+ dp_rows), b] int64 device: `CudaExecutor.host_vectors`
    staged: list           # NUM_STAGING x (pinned `packed`, pinned `last` or None, torch.cuda.Event
    # after its last host->device copy): the staging buffers, used in turn
    out: dict              # static outputs: logits, next_ids, hidden
    counts: dict = field(default_factory=dict)  # the collectives one replay runs (as captured)
    hidden: torch.Tensor | None = None  # mtp_draft: [b, hidden] static input rows
    # int64 static input beside `packed`: prefill: [L] each request's last token (padded 0);
    # mtp_cycle: [b, 2N + 1] each request's first verified position, drafts, the slots after it (`cycle`);
    # mtp_cycle_next: [b, 3N] the slots of the 3N positions after the last cycle's first (`cycle_after`)
    extra: torch.Tensor | None = None
    turn: int = 0                       # the staging buffers' next


class CudaExecutor(PlanExecutor):
    def __init__(self, plan: Plan, weights, pool: KVPool, comm: Comm | None, max_reqs: int,
                 max_context: int, stacks: dict | None = None, max_batch_tokens: int = 0):
        super().__init__(plan, weights, pool, comm, impls=CUDA_IMPLS, device=pool.device,
                         stacks=stacks)
        self.max_context, self.pad_row, self.scratch = max_context, max_reqs, pool.num_slots - 1
        # attention DP with the MoE's rows gathered over it: every DP rank's padding, as slots (`host_vectors`)
        mesh = plan.mesh
        self.dp_rows = mesh["attn_dp"] if mesh["attn_dp"] > 1 and mesh["attn_tp"] == 1 and mesh["ep"] > 1 else 0
        self.r2t = torch.full((max_reqs + 1, max_context), self.scratch, dtype=torch.int64, device=pool.device)
        self.last_token = torch.zeros(max_reqs + 1, dtype=torch.int64, device=pool.device)
        # exactly the plan's kernels; a benchmark that sets MoE tile overrides (`moe_tiles`) also
        # swaps in a library that may render variants outside the plan
        self.moe_tiles: dict = {}
        self.kernels = KernelLibrary.from_plan(plan)
        self.dtype = compute_dtype(plan.dtypes)   # activations (and mtp_draft's hidden input)
        self._derived: dict = {}
        self.captured: dict[int, Captured] = {}   # decode graphs by bucket
        self.mtp_captured: dict[str, dict[int, Captured]] = {p: {} for p in MTP_PHASES}
        self.prefill_captured: dict[int, Captured] = {}
        self.cycle_captured: dict[int, Captured] = {}   # mtp_cycle graphs by requests
        self.chain_captured: dict[int, Captured] = {}   # mtp_cycle_next graphs by requests
        # per cycle bucket: the last cycle's outputs and inputs that the next one starts from
        # (`cycle_after`), static buffers outside the graphs' pool; and which the last cycle wrote
        self.cycle_state: dict[int, dict[str, torch.Tensor]] = {}
        self._last_cycle: tuple[int | None, dict] | None = None
        self.num_prefill_replays = 0   # prefill steps that replayed a graph
        split = plan.mesh.token_split_size
        self.buckets = [b for b in plan.decode_buckets if b % split == 0]
        verify = [b for b in plan.graphs["mtp_verify"].meta.get("cuda_graph_buckets", [])
                  if b % split == 0] if "mtp_verify" in plan.graphs else []
        # prefill graphs on one rank only: ranks would pick buckets by their own longest sequence
        prefill = prefill_buckets(max_batch_tokens) if max_batch_tokens and comm.world == 1 else []
        self.prefill_max_len = min(max_context, PREFILL_GRAPH_MAX_LEN)
        # the plan's verify width N + 1 (its verify buckets are the decode buckets x it): cycle
        # graphs per decode bucket on one rank without attention DP
        width = verify[0] // self.buckets[0] if verify and self.buckets else 0
        self.cycle_steps = width - 1
        cycle = self.buckets if width and comm.world == 1 and not self.dp_rows else []
        # a speculative step that carries prompts' chunks runs them through mtp_verify and the MTP
        # layer over their positions: with prefill graphs, those phases get the prefill token counts too
        chunks = [b for b in prefill if b > verify[-1]] if verify else []
        self.phase_buckets = {"decode": self.buckets, "mtp_verify": verify + chunks,
                              "mtp_draft": sorted(set(self.buckets) | set(verify) | set(chunks)) if verify else [],
                              "prefill": prefill, CYCLE: cycle, CHAIN: cycle}
        self.timings: dict = {}
        self.last_bucket: int | None = None   # the bucket the last decode step replayed

    def derived(self, key, make):
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    # ------------------------------------------------------------------ one step over device tensors
    def _step(self, graph, ids, vectors, lens, max_len, last_rows=None, token_runs=False) -> GpuStep:
        """The step over `host_vectors` on the device, its token ids `ids` (FUTURE_TOKEN filled in)."""
        _, pos, loc, rows = vectors[:4]
        return GpuStep(self, graph, None, {"input_ids": ids, "positions": pos}, loc, rows=rows,
                       pad_slot=self.scratch, dp_loc=vectors[4:].reshape(-1) if self.dp_rows else None, pos=pos,
                       lens=lens, r2t=self.r2t, max_len=max_len, last_rows=last_rows, token_runs=token_runs,
                       moe_tiles=self.moe_tiles, kernels=self.kernels)

    def _outputs(self, graph, values) -> dict:
        logits, hidden, ids = (values[v] for v in graph.step_outputs())
        return {"logits": logits, "hidden": hidden, "next_ids": ids}

    def record_tokens(self, rows: list[int], tokens: torch.Tensor) -> None:
        """last_token[rows] = tokens (device), queued on the stream: later FUTURE_TOKEN ids read it."""
        self.last_token.index_copy_(0, to_device(torch.tensor(rows, dtype=torch.int64), self.last_token.device),
                                    tokens.to(self.last_token.device, torch.int64))

    def run_tokens(self, phase, vectors, hidden=None, max_len=None) -> dict:
        """The captured region of a per-token phase over `host_vectors` on the device: fill in
        FUTURE_TOKEN ids, each token's own slot into the device table, then every op of the phase
        (`hidden`: mtp_draft's input rows)."""
        ids, pos, loc, rows = vectors[:4]
        ids, lens = tt.step_inputs(ids, self.last_token, rows, pos, loc, self.r2t, self.kernels)
        graph = self.graphs[phase]
        step = self._step(graph, ids, vectors, lens, max_len or self.max_context)
        if hidden is not None:
            step.feeds["hidden"] = hidden
        return self._outputs(graph, self.run_ops(graph, step, phase))

    def host_vectors(self, batch: ForwardBatch, size: int, dp_tokens=None) -> torch.Tensor:
        """[4 + dp_rows, size] int64: ids, positions, slots, rows per token, padded with the spare
        row; then (attention DP, the MoE's rows gathered over it) one row per DP rank, its tokens as
        slot 0 and its padding as the scratch slot (`dp_tokens`: every rank's count; default this
        batch's), which the MoE reads as the gathered rows' `loc` (`cuda_target.padding_rows`)."""
        t = batch.num_tokens
        v = torch.empty(4 + self.dp_rows, size, dtype=torch.int64)
        v[0].zero_(), v[1].zero_(), v[2].fill_(self.scratch), v[3].fill_(self.pad_row)
        if self.dp_rows:
            v[4:].fill_(self.scratch)
            for d, n in enumerate(dp_tokens or [t] * self.dp_rows):
                v[4 + d, :n] = 0
        v[0, :t], v[1, :t], v[2, :t] = batch.input_ids, batch.positions, batch.out_cache_loc
        # numpy: torch's CPU repeat_interleave cost ~0.4 ms per call on the H200 host (2026-12-01)
        v[3, :t] = torch.from_numpy(np.repeat(batch.req_pool_indices.numpy(), batch.extend_lens.numpy()))
        return v

    def _load_rows(self, batch: ForwardBatch, width: int | None = None) -> None:
        """Copy the batch's requests' req_to_token rows (up to `width`, default max_context) into
        the device table."""
        rows = batch.req_pool_indices
        width = min(width or self.max_context, self.max_context, batch.req_to_token.shape[1])
        self.r2t[to_device(rows, self.r2t.device), :width] = to_device(batch.req_to_token[rows, :width],
                                                                        self.r2t.device)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, phase: str, batch: ForwardBatch, hidden=None, dp_tokens=None) -> dict:
        if phase not in ("prefill", *GRAPH_PHASES):
            raise ValueError(f"CudaExecutor: no phase {phase!r} (prefill, {', '.join(GRAPH_PHASES)})")
        if batch.device_positions is not None and phase not in MTP_PHASES:
            raise ValueError(f"CudaExecutor: device positions are for verify and draft steps, not {phase}")
        if phase in MTP_PHASES and phase not in self.graphs:
            raise ValueError(f"CudaExecutor: the plan has no {phase} phase (no MTP layer)")
        longest = int(batch.seq_lens.max()) if batch.batch_size else 1   # idle: padding only
        if longest > self.max_context:
            raise ValueError(f"CudaExecutor: seq_len {longest} > max_context {self.max_context}")
        B = batch.batch_size
        if phase == "decode":   # every rank of a DP/TP group runs the same bucket (collectives)
            need = self.padded_tokens(B, dp_tokens)
            bucket = next((b for b in sorted(self.captured) if b >= need), None)
            self.last_bucket = bucket
            if bucket is not None:
                return self._replay(bucket, batch, dp_tokens=dp_tokens)
            self._load_rows(batch)
            vectors = to_device(self.host_vectors(batch, need, dp_tokens), self.r2t.device)
            return {k: v[:B] for k, v in self.run_tokens("decode", vectors).items()}
        if phase in MTP_PHASES:
            return self._mtp(phase, batch, hidden, dp_tokens, longest)
        self._load_rows(batch)
        size = self.padded_tokens(batch.num_tokens, dp_tokens)
        bucket = next((b for b in sorted(self.prefill_captured) if b >= size), None)
        if bucket is not None and longest <= self.prefill_max_len \
                and B <= self.prefill_captured[bucket].extra.numel():
            self.num_prefill_replays += 1
            return self._replay(bucket, batch, self.prefill_captured[bucket])
        vectors = to_device(self.host_vectors(batch, size, dp_tokens), self.r2t.device)
        last = to_device(self._last_tokens(batch, B), self.r2t.device)
        return self.prefill_body(vectors, last, longest, token_runs=batch.num_tokens >= TOKEN_RUN * B)

    def prefill_body(self, vectors, last, max_len, token_runs=False) -> dict:
        """A prefill (or mixed) step's ops over `host_vectors` on the device: outputs of each
        request's last token (`last`: its index among the step's tokens). The device table already
        holds the rows. `token_runs`: the requests average >= TOKEN_RUN tokens (GpuStep.token_runs)."""
        ids, pos, loc, rows = vectors[:4]
        ids, lens = tt.step_inputs(ids, self.last_token, rows, pos, loc, self.r2t, self.kernels)   # r2t: as loaded
        graph = self.graphs["prefill"]
        step = self._step(graph, ids, vectors, lens, max_len, last, token_runs)
        return self._outputs(graph, self.run_ops(graph, step, "prefill"))

    @staticmethod
    def _last_tokens(batch: ForwardBatch, size: int) -> torch.Tensor:
        """[size] int64: each request's last token among the step's tokens, padded with 0."""
        last = torch.zeros(size, dtype=torch.int64)
        last[:batch.batch_size] = torch.cumsum(batch.extend_lens, 0) - 1
        return last

    def _mtp(self, phase: str, batch: ForwardBatch, hidden, dp_tokens, longest: int) -> dict:
        """A verify or draft step: every token's outputs ([T, ...]), replayed from the smallest
        captured token bucket that fits, else eager over the same body. The device table gets the
        rows' positions below the step's own first (a request's first step may start past
        positions the device never computed: prefix-cache hits) unless `batch.rows_on_device`;
        the step writes its own."""
        T = batch.num_tokens
        if T and not batch.rows_on_device and int(batch.prefix_lens.max()):
            self._load_rows(batch, width=int(batch.prefix_lens.max()))
        need = self.padded_tokens(T, dp_tokens)
        caps = self.mtp_captured[phase]
        bucket = next((b for b in sorted(caps) if b >= need), None)
        if bucket is not None:
            return self._replay(bucket, batch, caps[bucket], hidden, dp_tokens)
        vectors = to_device(self.host_vectors(batch, need, dp_tokens), self.r2t.device)
        self._device_inputs(vectors, batch)
        if hidden is not None:
            hidden = torch.cat([hidden.to(self.dtype), hidden.new_zeros(need - T, hidden.shape[1],
                                                                       dtype=self.dtype)])
        out = self.run_tokens(phase, vectors, hidden, max_len=longest)
        return {k: v[:T] for k, v in out.items()}

    def _replay(self, bucket: int, batch: ForwardBatch, cap: Captured | None = None, hidden=None,
                dp_tokens=None, extra: torch.Tensor | None = None) -> dict:
        """Replay `cap` (default: the decode graph of `bucket`) over `batch`; `extra`: the host
        values of a cycle graph's `Captured.extra` (a prefill graph's are the batch's). No batch:
        a chained cycle's graph, whose token vectors it makes itself (`cycle_after`)."""
        cap = cap or self.captured[bucket]
        host, extra_host, copied = cap.staged[cap.turn]
        cap.turn = (cap.turn + 1) % len(cap.staged)
        copied.synchronize()                 # this buffer's previous copy to the device is done
        if batch is not None:
            host.copy_(self.host_vectors(batch, cap.packed.shape[1], dp_tokens))
            cap.packed.copy_(host, non_blocking=True)
            self._device_inputs(cap.packed, batch)
        if cap.extra is not None:
            if extra is None:   # a prefill graph: outputs per request
                extra_host.copy_(self._last_tokens(batch, cap.extra.numel()))
            else:
                extra_host.copy_(extra)
            cap.extra.copy_(extra_host, non_blocking=True)
        copied.record()
        if cap.hidden is not None:
            T = batch.num_tokens
            cap.hidden[:T].copy_(hidden)
            cap.hidden[T:].zero_()
        cap.graph.replay()
        self.comm.add(cap.counts)
        if extra is not None:
            return cap.out
        n = batch.batch_size if cap.extra is not None else batch.num_tokens
        return {k: v[:n] for k, v in cap.out.items()}

    # ------------------------------------------------------------------ a speculative cycle, one graph
    @torch.no_grad()
    def cycle(self, batch: ForwardBatch, table: torch.Tensor, num_steps: int) -> tuple:
        """A greedy speculative cycle (`speculative.MtpSpeculator._run_on_device`) in one replay:
        `batch` is the verify, R requests x (N + 1) tokens ([own token, N drafts], the drafts as
        `device_ids`); `table` [R, 2N + 1] int64 (host): each request's first verified position,
        its number of drafts (those past it pad the verify), then the KV slots of the 2N - 1
        positions after the first (the chain's, pages held). -> on the device: accepted [R] (the
        leading drafts, of its own, equal to the target's greedy token before them), target
        [R (N + 1)] (that token at every verified position) and drafts [R, N] (the MTP chain from
        each request's last kept position). The graph of the smallest captured bucket >= R
        (`capture(phases=(CYCLE,))`, the plan's N only), else the same body eagerly. One rank only."""
        R, N = batch.batch_size, num_steps
        if self.comm.world != 1:
            raise ValueError("CudaExecutor.cycle runs on one rank (the speculator drives several through verify and draft)")
        if batch.num_tokens != R * (N + 1):
            raise ValueError(f"CudaExecutor.cycle: {batch.num_tokens} tokens for {R} requests x {N + 1}")
        if R and not batch.rows_on_device and int(batch.prefix_lens.max()):
            self._load_rows(batch, width=int(batch.prefix_lens.max()))
        caps = self.cycle_captured if N == self.cycle_steps else {}
        bucket = next((b for b in sorted(caps) if b >= R), None)
        if bucket is not None:   # padding requests: no drafts, scratch slots
            padded = torch.full((bucket, table.shape[1]), self.scratch, dtype=torch.int64)
            padded[:, :2] = 0
            padded[:R] = table
            out = self._replay(bucket, batch, caps[bucket], extra=padded)
        else:
            vectors = to_device(self.host_vectors(batch, batch.num_tokens), self.r2t.device)
            self._device_inputs(vectors, batch)
            out = self.cycle_body(vectors, to_device(table, self.r2t.device), N, self._new_state(R, N))
        self._last_cycle = (bucket, out)
        return out["accepted"][:R], out["target"][:R * (N + 1)], out["drafts"][:R]

    @torch.no_grad()
    def cycle_after(self, window: torch.Tensor, num_steps: int) -> tuple:
        """The greedy cycle after the last `cycle` (or `cycle_after`) over the same R requests, each
        with N drafts in both, queued before that one is read: its verify's ids, positions, slots
        and its table are made on the device from that cycle's outputs (`model_runner.cycle_next`)
        and `window` [R, 3N] int64 (host): the KV slots of the 3N positions after each request's
        first verified position in that cycle (pages held). -> as `cycle`. The `mtp_cycle_next`
        graph of that cycle's bucket (inputs: the window), else the same body eagerly. The outputs
        (of both) live in buffers outside the graphs' pool, valid until the next cycle."""
        R, N = window.shape[0], num_steps
        if self._last_cycle is None:
            raise ValueError("CudaExecutor.cycle_after: no cycle before it")
        bucket, state = self._last_cycle
        if bucket is not None and bucket in self.chain_captured:   # padding requests: scratch slots
            padded = torch.full((bucket, window.shape[1]), self.scratch, dtype=torch.int64)
            padded[:R] = window
            out = self._replay(bucket, None, self.chain_captured[bucket], extra=padded)
        else:
            out = self.chain_body(state, to_device(window, self.r2t.device), N)
        self._last_cycle = (bucket, out)
        return out["accepted"][:R], out["target"][:R * (N + 1)], out["drafts"][:R]

    def _new_state(self, R: int, N: int) -> dict:
        """A cycle's outputs and the inputs the next starts from (`cycle_after`): accepted [R],
        target [R (N + 1)], drafts [R, N], table [R, 2N + 1], rows [R]; padding requests as
        `cycle` pads them (no drafts, position 0, the spare row)."""
        dev = self.r2t.device
        z = dict(dtype=torch.int64, device=dev)
        return {"accepted": torch.zeros(R, **z), "target": torch.zeros(R * (N + 1), **z),
                "drafts": torch.zeros(R, N, **z), "table": torch.zeros(R, 2 * N + 1, **z),
                "rows": torch.full((R,), self.pad_row, **z)}

    def _state(self, bucket: int, N: int) -> dict:
        if bucket not in self.cycle_state:
            self.cycle_state[bucket] = self._new_state(bucket, N)
        return self.cycle_state[bucket]

    def chain_body(self, state: dict, window: torch.Tensor, N: int) -> dict:
        """`cycle_after`'s region: the next cycle's verify inputs and table from `state` (the last
        cycle's, `cycle_next`) and the window, then `cycle_body` over them, into `state`."""
        ids, positions, loc, table = cycle_next(state["table"], state["accepted"], state["target"],
                                                state["drafts"], window, N)
        rows = state["rows"][:, None].expand(-1, N + 1).reshape(-1)
        return self.cycle_body(torch.stack([ids, positions, loc, rows]), table, N, state)

    def cycle_body(self, vectors: torch.Tensor, table: torch.Tensor, N: int, state: dict | None = None) -> dict:
        """`cycle` over `host_vectors` of the verify and the table on the device (the captured
        region): verify; the target's greedy tokens (the plan's sampler at temperature 0) and the
        accepted counts; the draft-extend over every verified position fed the target's token
        there; the first draft from each last kept position; N - 1 chain steps at positions and
        slots computed from the counts. Outputs (and the table and rows, for `cycle_after`) are
        written into `state` (`_new_state`; default a new one) and returned as it."""
        T = vectors.shape[1]
        R = T // (N + 1)
        out = self.run_tokens("mtp_verify", vectors)
        dev = vectors.device

        def greedy():   # the sampler's parameters at temperature 0, made before any capture (no copies in one)
            zero, izero = torch.zeros(T, device=dev), torch.zeros(T, dtype=torch.int64, device=dev)
            return zero, izero, zero + 1.0, zero, izero, izero
        target = tt.sample(out["logits"], *self.derived(("greedy", T), greedy), lib=self.kernels)
        accepted = cycle_accepted(target, vectors[0], table, N)
        drafted = self.run_tokens("mtp_draft", torch.cat([target[None], vectors[1:4]]), out["hidden"])
        rows = cycle_last_kept(accepted, N)
        token = drafted["logits"].index_select(0, rows).argmax(-1)
        hidden = drafted["hidden"].index_select(0, rows)
        drafts, req_rows = [token], vectors[3].view(R, N + 1)[:, 0]
        for k in range(1, N):
            chain = torch.stack([token, *cycle_chain_step(table, accepted, k), req_rows])
            drafted = self.run_tokens("mtp_draft", chain, hidden)
            token, hidden = drafted["logits"].argmax(-1), drafted["hidden"]
            drafts.append(token)
        state = state if state is not None else self._new_state(R, N)
        for name, value in (("accepted", accepted), ("target", target), ("drafts", torch.stack(drafts, 1)),
                            ("table", table), ("rows", req_rows)):
            state[name].copy_(value)
        return state

    @staticmethod
    def _device_inputs(vectors: torch.Tensor, batch: ForwardBatch) -> None:
        """Ids, positions and slots computed on the device (speculative drafts, a chain step after
        an unread acceptance) over the host's in `host_vectors` on the device."""
        T = batch.num_tokens
        for i, v in ((0, batch.device_ids), (1, batch.device_positions), (2, batch.device_loc)):
            if v is not None:
                vectors[i, :T].copy_(v)

    def release(self) -> None:
        """Drop the captured graphs (they hold NCCL work) and wait for the device: NCCL
        communicators are destroyed only after no graph can launch on them."""
        self.captured.clear()
        self.prefill_captured.clear()
        self.cycle_captured.clear()
        self.chain_captured.clear()
        for caps in self.mtp_captured.values():
            caps.clear()
        if self.r2t.is_cuda:
            torch.cuda.synchronize(self.r2t.device)

    # ------------------------------------------------------------------ CUDA graphs
    @torch.no_grad()
    def capture(self, buckets=None, warmup: int = 2, progress=None, phases=("decode",)) -> dict:
        """Capture each phase's graph per bucket (default: the plan's, `phase_buckets`; `buckets`
        overrides the decode buckets); -> seconds per decode bucket (MTP phases: in
        `timings[(phase, bucket)]`). `progress()` is called after each graph (a progress bar's update)."""
        pool = torch.cuda.graph_pool_handle()
        # one warm-up stream for every graph: torch keeps a 32 MiB cuBLAS workspace per stream that
        # ran a GEMM, so a stream per bucket held 11 x 32 MiB more (passes/step_memory.graph_pool)
        side = torch.cuda.Stream()
        for phase in phases:
            chosen = buckets if phase == "decode" and buckets else self.phase_buckets[phase]
            for b in sorted(chosen, reverse=True):
                t0 = time.perf_counter()
                cap = self._capture_one(phase, b, warmup, pool, side)
                self._graphs_of(phase)[b] = cap
                self.timings[b if phase == "decode" else (phase, b)] = time.perf_counter() - t0
                if progress is not None:
                    progress()
        return {b: t for b, t in self.timings.items() if isinstance(b, int)}

    def _graphs_of(self, phase: str) -> dict[int, Captured]:
        own = {"decode": self.captured, "prefill": self.prefill_captured, CYCLE: self.cycle_captured,
               CHAIN: self.chain_captured}
        return own[phase] if phase in own else self.mtp_captured[phase]

    def num_graphs(self, phases=("decode",)) -> int:
        """How many graphs `capture(phases=phases)` records with the plan's buckets."""
        return sum(len(self.phase_buckets[p]) for p in phases)

    def _capture_one(self, phase: str, b: int, warmup: int, pool, side: torch.cuda.Stream) -> Captured:
        """One graph: `b` tokens (mtp_cycle, mtp_cycle_next: `b` requests of N + 1 tokens)."""
        dev, N = self.r2t.device, self.cycle_steps
        tokens = b * (N + 1) if phase in (CYCLE, CHAIN) else b
        packed = torch.zeros(4 + self.dp_rows, tokens, dtype=torch.int64, device=dev)
        packed[2].fill_(self.scratch), packed[3].fill_(self.pad_row)
        hidden = (torch.zeros(b, self.config.hidden_size, dtype=self.dtype, device=dev)
                  if phase == "mtp_draft" else None)
        extra = None
        if phase == "prefill":   # up to max_reqs requests per step
            extra = torch.zeros(min(b, self.pad_row), dtype=torch.int64, device=dev)
        elif phase == CYCLE:
            extra = torch.full((b, 2 * N + 1), self.scratch, dtype=torch.int64, device=dev)
            extra[:, :2] = 0
        elif phase == CHAIN:
            extra = torch.full((b, 3 * N), self.scratch, dtype=torch.int64, device=dev)

        def body():
            if phase == "prefill":
                return self.prefill_body(packed, extra, self.prefill_max_len)
            if phase == CYCLE:
                return self.cycle_body(packed, extra, N, self._state(b, N))
            if phase == CHAIN:   # (the warm-up runs chain from whatever the state holds: padding)
                return self.chain_body(self._state(b, N), extra, N)
            return self.run_tokens(phase, packed, hidden)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):        # compile kernels, create handles, fill caches
            for _ in range(warmup):
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        saved = self.comm.reset()
        with torch.cuda.graph(graph, pool=pool):
            out = body()
        counts = self.comm.reset()            # one step's collectives, credited per replay
        self.comm.add(saved)
        torch.cuda.synchronize()
        staged = [(torch.empty(packed.shape, dtype=torch.int64).pin_memory(),
                   None if extra is None else torch.empty(extra.shape, dtype=torch.int64).pin_memory(),
                   torch.cuda.Event()) for _ in range(NUM_STAGING)]
        return Captured(graph, packed, staged, out, counts, hidden, extra)


def to_device_weight(w, device, dtype, fp32: bool = False):
    """One checkpoint tensor on `device`: FP8 weights (`Fp8Weight`) stay FP8 with their fp32 block
    scales, the rest in the compute dtype `dtype` (fp32 where `fp32`: the router's weight and bias)."""
    return w.to(device) if isinstance(w, Fp8Weight) else w.to(device, torch.float32 if fp32 else dtype)


def to_device_weights(weights: dict, device, dtype) -> dict:
    """`to_device_weight` of every named tensor; the router's stay fp32 (`checkpoint.FP32_WEIGHTS`)."""
    return {n: to_device_weight(w, device, dtype, weight_dtype(n, dtype) == torch.float32) for n, w in weights.items()}
