"""Serving a compiled plan over several ranks: one process per rank, rank 0 in charge.

`serve_model(cfg)` serves in this process when the plan has one rank, else starts one process per
rank (`runtime/worker/launch.py`, gloo on CPU, NCCL on GPU). Rank 0 hosts the HTTP server, tokenizer and
scheduler; its runner, `DistRunner`, sends every step's batches to all ranks over a gloo control
group (`broadcast_object_list`), runs its own share, and collects the logits of the other
attention-DP ranks (`gather_object`). The other ranks loop in `follow()`: receive, run, send logits.

Life of one step under dp2ep2: the engine on rank 0 schedules DP rank 0 and DP rank 1 separately
(each has its own pages and req_to_token rows), builds two `ForwardBatch`es (an idle one for a rank
with nothing to do), and `DistRunner.forward_dp` broadcasts (phase, batches) with each batch's
req_to_token cut to its own rows. Every rank runs the same phase graph on its DP rank's batch with
`dp_tokens` = every DP rank's token count, so padding and collectives line up; rank 1 sends its
logits back for rank 0 to sample. A `None` message ends the loop.

Speculative decoding: `verify_dp` and `draft_dp` send the MTP phases the same way (every rank
steps every draft step, idle DP ranks too), a draft step with the hidden states rank 0 holds for
each DP rank (with attention TP the followers' own copies are the same replicated values; shipping
them keeps every rank's draft input identical); with attention DP the first rank of each DP rank
sends its logits and hidden states back.

Processes, the HTTP server on rank 0 and shutdown live in `runtime/serving/launch.py`.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.model_runner import ModelRunner, PlanRunner


class DistRunner(ModelRunner):
    """Rank 0's `ModelRunner`: every step goes to all ranks; each DP rank's logits come back."""

    def __init__(self, local: PlanRunner, group):
        mesh = local.executor.mesh
        self.local, self.group = local, group
        self.num_dp, self.attn_tp = mesh.attn_dp, mesh.attn_tp
        self.vocab_size, self.num_pages = local.vocab_size, local.num_pages
        self.max_context = local.max_context
        self.kernels = local.kernels   # rank 0 samples every DP rank's logits on its own device
        self.supports_speculative = local.runs_mtp

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.forward_dp([batch])[0]

    def forward_dp(self, batches: list[ForwardBatch]) -> list[torch.Tensor]:
        phase = PlanRunner.phase_of(batches)
        _send(self.group, (phase, [compact(b) for b in batches]))
        logits = _run(self.local, phase, batches)
        if self.num_dp == 1:  # the lm_head all-gather left the full logits on every TP rank
            return [logits]
        got = [None] * dist.get_world_size()
        dist.gather_object(logits.cpu(), got, dst=0, group=self.group)  # gloo moves host objects
        return [logits if d == 0 else got[d * self.attn_tp].to(logits.device) for d in range(self.num_dp)]

    def verify(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.verify_dp([batch])[0]

    def draft(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.draft_dp([batch], [hidden])[0]

    def verify_dp(self, batches: list[ForwardBatch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._mtp_dp("mtp_verify", batches, None)

    def draft_dp(self, batches: list[ForwardBatch], hiddens: list[torch.Tensor]
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._mtp_dp("mtp_draft", batches, [h.cpu() for h in hiddens])

    def _mtp_dp(self, phase: str, batches: list[ForwardBatch], hiddens) -> list[tuple]:
        _send(self.group, (phase, [compact(b) for b in batches], hiddens))
        out = _run_mtp(self.local, phase, batches, hiddens)
        if self.num_dp == 1:
            return [out]
        got = [None] * dist.get_world_size()
        dist.gather_object(tuple(t.cpu() for t in out), got, dst=0, group=self.group)
        return [out if d == 0 else tuple(t.to(out[0].device) for t in got[d * self.attn_tp])
                for d in range(self.num_dp)]

    def close(self) -> None:
        """Tell the other ranks to exit (call once, after the last step)."""
        _send(self.group, None)


def follow(local: PlanRunner, group) -> None:
    """A rank other than 0: run every step rank 0 sends, until it sends None."""
    first_of_dp = local.executor.comm.coords.of("attn_tp") == 0
    dp_rank = local.executor.comm.coords.of("attn_dp")
    mirror = RowMirror()
    while (msg := _recv(group)) is not None:
        phase, batches, *hiddens = msg
        batches[dp_rank] = mirror.apply(batches[dp_rank])
        if phase.startswith("mtp"):
            out = _run_mtp(local, phase, batches, hiddens[0])
            if len(batches) > 1:
                dist.gather_object(tuple(t.cpu() for t in out) if first_of_dp else None, None,
                                   dst=0, group=group)
            continue
        logits = _run(local, phase, batches)
        if len(batches) > 1:
            mine = logits.cpu() if first_of_dp else None  # gloo moves host objects
            dist.gather_object(mine, None, dst=0, group=group)


def compact(batch: ForwardBatch) -> ForwardBatch:
    """What travels to the other ranks: `batch` with req_to_token cut to its own rows, in batch
    order (row i = request i), up to its longest sequence; `RowMirror.apply` undoes the cut."""
    if batch.batch_size == 0:
        return ForwardBatch.idle()
    width = int(batch.seq_lens.max())
    on_device = {k: None if getattr(batch, k) is None else getattr(batch, k).cpu()
                 for k in ("device_ids", "device_positions", "device_loc")}
    return dataclasses.replace(   # gloo moves host objects: device tensors travel as host ones
        batch, req_to_token=batch.req_to_token[batch.req_pool_indices, :width].clone(), **on_device)


class RowMirror:
    """A following rank's copy of rank 0's req_to_token, row for row. Requests keep their real row
    on every rank, so a runner that keeps rows on the device between steps (the CUDA target's
    table, written at prefill, extended by each decode step) finds the same request in the same
    row on every rank, whatever else joins or leaves the batch."""

    def __init__(self):
        self.table = torch.zeros((0, 0), dtype=torch.int64)

    def apply(self, shipped: ForwardBatch) -> ForwardBatch:
        if shipped.batch_size == 0:
            return ForwardBatch.idle(self.table)
        rows, cut = shipped.req_pool_indices, shipped.req_to_token
        need = (max(self.table.shape[0], int(rows.max()) + 1), max(self.table.shape[1], cut.shape[1]))
        if need != tuple(self.table.shape):
            grown = torch.zeros(need, dtype=torch.int64)
            grown[: self.table.shape[0], : self.table.shape[1]] = self.table
            self.table = grown
        self.table[rows, : cut.shape[1]] = cut
        return dataclasses.replace(shipped, req_to_token=self.table)


def _run(local: PlanRunner, phase: str, batches: list[ForwardBatch]) -> torch.Tensor:
    dp_rank = local.executor.comm.coords.of("attn_dp")
    dp_tokens = [b.num_tokens for b in batches] if len(batches) > 1 else None
    return local.run(phase, batches[dp_rank], dp_tokens)


def _run_mtp(local: PlanRunner, phase: str, batches: list[ForwardBatch], hiddens) -> tuple:
    """This rank's share of an MTP phase step: (logits, hidden) of its DP rank's batch."""
    dp_rank = local.executor.comm.coords.of("attn_dp")
    dp_tokens = [b.num_tokens for b in batches] if len(batches) > 1 else None
    if phase == "mtp_verify":
        return local.verify(batches[dp_rank], dp_tokens)
    return local.draft(batches[dp_rank], hiddens[dp_rank], dp_tokens)


def _send(group, msg) -> None:
    dist.broadcast_object_list([msg], src=0, group=group)


def _recv(group):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
