"""Model runners: the engine's seam to the device, which owns the paged KV memory.

`ModelRunner` is the contract; `ReferenceRunner` runs the fp32 torch `ReferenceModel` (the
numerical oracle); `PlanRunner` runs a compiled plan's executor on the host, `DevicePlanRunner`
one on an accelerator (`cuda_executor.CudaExecutor`). Plan runners are made by
`runtime/worker/loader.py::load_runner`, the one loader.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

import torch
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.kv_cache import PAGE_SIZE, KVPool


class ModelRunner(ABC):
    """Runs one `ForwardBatch` on a device that owns the paged KV memory.

    Contract: `forward(batch)` writes the KV (and indexer keys) of every new token at
    `batch.out_cache_loc`, reads earlier tokens through `batch.req_to_token`, and returns logits
    [B, vocab_size] of each request's last new token, on the runner's device (fp32 on the host; the
    compute dtype on a GPU, where the engine samples them with `kernels`, the plan's sampler).
    The runner never allocates slots: the scheduler hands out pages 0..num_pages-1 (of
    `page_size` tokens) and positions below `max_context`; a runner that needs scratch slots
    (e.g. padding tokens of a compiled plan) keeps them in pages numbered num_pages and above.

    With attention data parallelism (`num_dp` > 1) each DP rank has its own KV pool of
    `num_pages` pages and its own req_to_token rows: `forward_dp(batches)` runs batch i on DP
    rank i, all in one step (an idle rank gets `ForwardBatch.idle`, as collectives need every rank),
    and returns each rank's logits (an empty tensor for an idle rank).

    Overlap (`supports_overlap`): the engine may queue step N+1 before it has read step N's tokens.
    It then calls `record_tokens(rows, tokens)` after sampling each step (tokens still on the
    device), and an input id `FUTURE_TOKEN` (-1) in a later batch means "the token last recorded for
    this request's row": the runner fills it in where the tokens are, without a host round trip.

    Speculative decoding (`supports_speculative`: the plan has MTP phases and the runner runs them):
    `verify(batch)` is a target forward like `forward` that returns the logits and the final hidden
    states of every new token ([T, vocab], [T, hidden]: the `mtp_verify` phase), and
    `draft(batch, hidden)` runs the MTP layer: new token t of `batch` sits at position p, carries the
    id of the token at p + 1 and `hidden[t]` (the target's, or the MTP layer's own from the previous
    draft step), writes the MTP layer's KV at `out_cache_loc[t]` (its own pool layer, paged in
    lockstep with the target's) and returns its logits (the guess for p + 2) and its hidden states.
    Both take the batch's `device_ids` (when set) as its token ids: ids already on the runner's
    device, so the speculator feeds drafts and accepted tokens without reading them back; `draft`
    takes `device_positions` / `device_loc` (when set) as each token's position and KV slot, so a
    draft step can follow an acceptance the host has not read.
    """

    vocab_size: int
    num_pages: int
    max_context: int
    page_size: int = PAGE_SIZE
    num_dp: int = 1
    kernels = None  # the plan's KernelLibrary when the logits are on a GPU (its sampler kernel)
    supports_overlap: bool = False
    supports_speculative: bool = False
    supports_cycle: bool = False   # `cycle`: a greedy speculative cycle in one call (one rank)

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...

    def record_tokens(self, rows: list[int], tokens: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not overlap steps")

    def verify(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} does not run speculative decoding")

    def draft(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} does not run speculative decoding")

    def cycle(self, batch: ForwardBatch, table: torch.Tensor, num_steps: int) -> tuple:
        """A greedy speculative cycle in one call (`cuda_executor.CudaExecutor.cycle`: verify,
        acceptance, draft-extend and chain; -> accepted, target tokens, drafts on the device).
        `table` [R, 2N + 1] int64: per request its first verified position, its number of drafts,
        then the KV slots of the 2N - 1 positions after the first (`cycle_accepted`,
        `cycle_chain_step` read it)."""
        raise NotImplementedError(f"{type(self).__name__} does not run a speculative cycle in one call")

    def cycle_after(self, window: torch.Tensor, num_steps: int) -> tuple:
        """The cycle after the last `cycle` over the same requests, its inputs made on the device
        from that one's unread outputs (`cycle_next`; `window` [R, 3N]: the slots after each
        request's first verified position there): `cuda_executor.CudaExecutor.cycle_after`."""
        raise NotImplementedError(f"{type(self).__name__} does not run a speculative cycle in one call")

    def verify_dp(self, batches: list[ForwardBatch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`verify` on every DP rank at once (idle ranks get `ForwardBatch.idle`)."""
        if len(batches) != 1:
            raise ValueError(f"{type(self).__name__} has one DP rank, got {len(batches)} batches")
        return [self.verify(batches[0])]

    def draft_dp(self, batches: list[ForwardBatch], hiddens: list[torch.Tensor]
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`draft` on every DP rank at once (idle ranks: an idle batch and an empty hidden)."""
        if len(batches) != 1:
            raise ValueError(f"{type(self).__name__} has one DP rank, got {len(batches)} batches")
        return [self.draft(batches[0], hiddens[0])]

    def forward_dp(self, batches: list[ForwardBatch]) -> list[torch.Tensor]:
        if len(batches) != 1:
            raise ValueError(f"{type(self).__name__} has one DP rank, got {len(batches)} batches")
        return [self.forward(batches[0])]


def cycle_accepted(target: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, N: int) -> torch.Tensor:
    """A greedy cycle's accepted counts [R]: per request (N + 1 verified positions, `ids` its verify
    input [own token, N drafts], `target` the target's token at each position) the leading drafts
    equal to the target's token before them, among its own (`table`'s draft count; those past
    it pad the verify). `table`: the cycle table (`ModelRunner.cycle`), on the tokens' device."""
    R = target.numel() // (N + 1)
    held = target.view(R, N + 1)[:, :N] == ids.view(R, N + 1)[:, 1:]
    held &= torch.arange(N, device=target.device)[None, :] < table[:, 1:2]
    return held.long().cumprod(1).sum(1)


def cycle_last_kept(accepted: torch.Tensor, N: int) -> torch.Tensor:
    """Each request's last kept verified position, as a row of the cycle's [R (N + 1)] tokens."""
    return torch.arange(0, accepted.numel() * (N + 1), N + 1, device=accepted.device) + accepted


def cycle_chain_step(table: torch.Tensor, accepted: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain step k's (1..N-1) position and KV slot per request [R], from the cycle table and
    the accepted counts: position first + accepted + k, its slot from the table's."""
    return table[:, 0] + accepted + k, table[:, 2:].gather(1, (accepted + (k - 1))[:, None])[:, 0]


def cycle_next(table: torch.Tensor, accepted: torch.Tensor, target: torch.Tensor, drafts: torch.Tensor,
               window: torch.Tensor, N: int) -> tuple:
    """The greedy cycle after one whose counts are not read yet, on the device. Per request (each
    with N drafts in both): the verify's ids [the target's token after the last kept position, the
    N drafts], their positions (first + accepted + 1 + j) and KV slots, and its cycle table.
    `table`, `accepted`, `target`, `drafts`: the cycle's (`ModelRunner.cycle`); `window` [R, 3N]:
    the KV slots of positions first + 1 .. first + 3N (pages held). -> ids, positions, slots
    [R (N + 1)] each, table [R, 2N + 1]."""
    R, dev = accepted.numel(), accepted.device
    a = accepted.long()[:, None]
    ids = torch.cat([target.view(R, N + 1).gather(1, a), drafts.view(R, N)], 1).reshape(-1)
    live = table[:, 1:2] > 0   # padding requests (no drafts: a graph bucket's spare rows) stay at 0
    first = torch.where(live, table[:, :1] + 1 + a, 0)
    j = torch.arange(2 * N, device=dev)[None, :]
    slots = window.gather(1, a + j)                  # positions first + 1 + a + j: the next cycle's
    positions = (first + j[:, :N + 1]).reshape(-1)
    nxt = torch.cat([first, live.long() * N, slots[:, 1:]], 1)
    return ids, positions, slots[:, :N + 1].reshape(-1), nxt


def context_limit(max_position_embeddings: int, num_pages: int, max_context: int | None) -> int:
    """The longest sequence a runner serves: the model's positions, the pool, and the caller's cap."""
    limit = min(max_position_embeddings, num_pages * PAGE_SIZE)
    return min(max_context or limit, limit)


class ReferenceRunner(ModelRunner):
    """`ModelRunner` over the fp32 torch `ReferenceModel` and its own `KVPool`."""

    def __init__(self, config, weights: dict[str, torch.Tensor], num_pages: int,
                 max_context: int | None = None):
        """`config` is the model's `glmc.config.GlmConfig`."""
        from glmc.runtime.worker.reference_model import ReferenceModel

        c = config
        mtp = f"model.layers.{c.num_hidden_layers}.eh_proj.weight" in weights
        num_layers = c.num_hidden_layers + mtp  # the MTP block gets a KV layer of its own
        full = c.full_indexer_layers() | ({c.num_hidden_layers} if mtp else set())
        self.pool = KVPool(num_layers, full, num_pages, c.kv_lora_rank, c.qk_rope_head_dim,
                           c.index_head_dim)
        self.model = ReferenceModel(config, weights, self.pool)
        self.vocab_size, self.num_pages = c.vocab_size, num_pages
        self.max_context = context_limit(c.max_position_embeddings, num_pages, max_context)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch)


class PlanRunner(ModelRunner):
    """`ModelRunner` over a compiled plan's executor for one rank of the plan's mesh: the torch
    target's `PlanExecutor` (or any executor with its `forward(phase, batch, dp_tokens=)` and
    `pool`, e.g. `cuda_executor.CudaExecutor`). The executor writes padding tokens to the pool's last
    slot, so the runner reports one page fewer than the pool has: the scheduler never hands out
    the scratch page.

    `run(phase, batch, dp_tokens)` is the per-rank step that `distributed.DistRunner` drives; `forward` picks
    the phase from the batch (decode batches run the decode graph, all else the prefill graph).
    """

    def __init__(self, executor, max_context: int | None = None):
        self.executor, c = executor, executor.config
        self.vocab_size, self.num_pages = c.vocab_size, executor.pool.num_pages - 1
        self.max_context = context_limit(c.max_position_embeddings, self.num_pages, max_context)
        self.supports_overlap = executor.comm.world == 1   # followers of a group never sample
        # over several ranks the engine drives the MTP phases through `distributed.DistRunner`
        self.runs_mtp = "mtp_draft" in executor.graphs and "mtp_verify" in executor.graphs
        self.supports_speculative = executor.comm.world == 1 and self.runs_mtp
        self._last = torch.zeros(0, dtype=torch.int64)   # row -> last recorded token (host)

    def record_tokens(self, rows: list[int], tokens: torch.Tensor) -> None:
        if rows and max(rows) >= len(self._last):
            self._last = torch.cat([self._last, torch.zeros(max(rows) + 1 - len(self._last),
                                                            dtype=torch.int64)])
        self._last[rows] = tokens.cpu()

    def _resolve(self, batch: ForwardBatch) -> ForwardBatch:
        """`batch` with its `device_ids` as its ids and its `device_positions` / `device_loc` as its
        positions, lengths and slots (the executor's tensors live on the host), and FUTURE_TOKEN
        ids replaced by the recorded tokens of their rows."""
        if batch.device_ids is not None:
            batch = dataclasses.replace(batch, input_ids=batch.device_ids.to(batch.input_ids.device),
                                        device_ids=None)
        if batch.device_positions is not None:   # each request's tokens at consecutive positions
            pos = batch.device_positions.to(batch.positions.device)
            first = pos[torch.cumsum(batch.extend_lens, 0) - batch.extend_lens] if batch.batch_size else pos
            batch = dataclasses.replace(batch, positions=pos, prefix_lens=first,
                                        seq_lens=first + batch.extend_lens,
                                        out_cache_loc=batch.device_loc.to(pos.device),
                                        device_positions=None, device_loc=None)
        future = batch.input_ids < 0
        if not bool(future.any()):
            return batch
        rows = batch.req_pool_indices.repeat_interleave(batch.extend_lens)
        ids = batch.input_ids.clone()
        ids[future] = self._last[rows[future]]
        return dataclasses.replace(batch, input_ids=ids)

    @staticmethod
    def phase_of(batches: list[ForwardBatch]) -> str:
        """The graph a step runs on every rank: decode only when no rank extends."""
        return "decode" if all(b.mode in ("decode", "idle") for b in batches) else "prefill"

    def run(self, phase: str, batch: ForwardBatch, dp_tokens: list[int] | None = None):
        return self.executor.forward(phase, self._resolve(batch), dp_tokens=dp_tokens)["logits"]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.run(self.phase_of([batch]), batch)

    def verify(self, batch: ForwardBatch, dp_tokens: list[int] | None = None):
        out = self.executor.forward("mtp_verify", self._resolve(batch), dp_tokens=dp_tokens)
        return out["logits"], out["hidden"]

    def draft(self, batch: ForwardBatch, hidden: torch.Tensor, dp_tokens: list[int] | None = None):
        out = self.executor.forward("mtp_draft", self._resolve(batch), hidden=hidden, dp_tokens=dp_tokens)
        return out["logits"], out["hidden"]

    def close(self) -> None:
        """Release device state (captured graphs) before the process group goes away."""
        self.executor.release()


class DevicePlanRunner(PlanRunner):
    """`PlanRunner` over an executor whose tensors live on an accelerator (`cuda_executor.CudaExecutor`).
    The scheduler hands batches of any size: the executor pads a decode batch to its smallest
    CUDA-graph bucket (eager above the largest) and slices the padding off again. Its logits stay
    on the device in the compute dtype (for a replayed graph, views of a static buffer that the next
    step overwrites: the engine samples them, on the device, before it queues the next step), and
    FUTURE_TOKEN ids are filled in on the device (inside the decode graph). Speculative decoding
    runs the plan's MTP phases the same way (verify and draft graphs per token bucket); their
    outputs are views of static buffers too, read or copied before the same phase runs again; their
    batches' `device_ids` are copied into the graphs' static id buffer on the device."""

    @property
    def kernels(self):
        return self.executor.kernels

    @property
    def supports_cycle(self) -> bool:
        return self.supports_speculative and bool(self.executor.phase_buckets.get("mtp_cycle"))

    def cycle(self, batch: ForwardBatch, table: torch.Tensor, num_steps: int) -> tuple:
        return self.executor.cycle(batch, table, num_steps)

    def cycle_after(self, window: torch.Tensor, num_steps: int) -> tuple:
        return self.executor.cycle_after(window, num_steps)

    def record_tokens(self, rows: list[int], tokens: torch.Tensor) -> None:
        self.executor.record_tokens(rows, tokens)

    def run(self, phase: str, batch: ForwardBatch, dp_tokens: list[int] | None = None):
        return self.executor.forward(phase, batch, dp_tokens=dp_tokens)["logits"]

    def verify(self, batch: ForwardBatch, dp_tokens: list[int] | None = None):
        out = self.executor.forward("mtp_verify", batch, dp_tokens=dp_tokens)
        return out["logits"], out["hidden"]

    def draft(self, batch: ForwardBatch, hidden: torch.Tensor, dp_tokens: list[int] | None = None):
        out = self.executor.forward("mtp_draft", batch, hidden=hidden, dp_tokens=dp_tokens)
        return out["logits"], out["hidden"]
