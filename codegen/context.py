"""The step context: what an op implementation may read during one forward.

Both targets' op tables are `IMPLS[kind](op, args, ctx) -> tensor | tuple`, where `args` are the
operand values and `ctx` is the step's context. The runtime's executors fulfil these contracts
(`runtime/worker/executor.py::Step` for `StepContext`, `runtime/worker/cuda_executor.py::GpuStep`
for `CudaStepContext`); codegen never imports the runtime, so the contracts live here.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from glmc.ir import Op
from glmc.ir.types import TensorType


class PagedCache(Protocol):
    """The paged KV pool as ops read and write it (`runtime/worker/kv_cache.py::KVPool`)."""

    def write_kv(self, layer: int, loc: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store each token's latent row and RoPE'd key at its slot."""

    def write_index_k(self, layer: int, loc: torch.Tensor, k: torch.Tensor) -> None:
        """Store each token's indexer key at its slot."""

    def c_kv(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The latent rows [L, kv_lora] at `slots`."""

    def k_pe(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The RoPE'd shared keys [L, rope_dim] at `slots`."""

    def index_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The indexer keys [L, index_dim] at `slots`."""


class StepBatch(Protocol):
    """One step's requests as ops read them (`runtime/worker/forward_batch.py::ForwardBatch`)."""

    positions: torch.Tensor          # [T] position of each token
    seq_lens: torch.Tensor           # [B] keys each request has after the step
    req_pool_indices: torch.Tensor   # [B] each request's row of req_to_token
    req_to_token: torch.Tensor       # [rows, max_context] KV slot of every position

    def token_ranges(self) -> list[tuple[int, int, int]]:
        """(request, first token, end token) of each request's tokens in the step."""


class StepContext(Protocol):
    """One forward of one rank, as the torch target sees it (host or device tensors)."""

    graph: Any                       # the phase's Graph (ops, users of a value)
    feeds: dict[str, torch.Tensor]   # graph inputs by name: input_ids, positions (padded)
    loc: torch.Tensor                # [T] KV slot of every token (padding: the scratch slot)
    batch: Any                       # the step's ForwardBatch (lengths, req_to_token)
    routes: dict                     # moe.dispatch -> moe.combine bookkeeping of this step
    pool: Any                        # the KV pool: kv[layer], index_k[layer], c_kv(), k_pe()
    comm: Any                        # counted collectives over the plan's groups (runtime Comm)
    num_experts: int                 # routed experts of the model

    def w(self, name: str | tuple[str, ...]) -> torch.Tensor:
        """This rank's weight (a tuple of names: their rows stacked, made once)."""

    def tp_rank(self, op: Op) -> int:
        """This rank's index on the axis `op` is tensor-parallel over (moe_tp or attn_tp)."""

    def gate_bias(self, op: Op) -> str:
        """The router's correction-bias weight name for `op`'s layer."""

    def experts(self, op: Op) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's expert stacks (gate [E, I, H], up [E, I, H], down [E, H, I])."""

    def expert_offset(self, op: Op) -> int:
        """Global id of this rank's first expert."""

    def type_of(self, value: str) -> TensorType:
        """The plan's type of an IR value (dtype, symbolic shape)."""


class CudaStepContext(StepContext, Protocol):
    """What the CUDA target adds: device index tensors instead of host loops, so that every op is
    capture-safe (no host sync, sizes from shapes)."""

    rows: torch.Tensor               # [T] req_to_token row of each token (padding: a spare row)
    pad_slot: int                    # the KV slot of padding tokens (loc[t] == pad_slot: t is padding)
    dp_loc: torch.Tensor | None      # attention DP: [attn_dp x T], pad_slot at every DP rank's padding
    pos: torch.Tensor                # [T] position of each token
    lens: torch.Tensor               # [T] pos + 1: the keys each token attends to
    r2t: torch.Tensor                # the device req_to_token table
    max_len: int                     # static workspace width, >= every seq_len of the step
    last_rows: torch.Tensor | None   # prefill: each request's last token
    token_runs: bool                 # eager prefill, >= 64 tokens per request on average: run lengths
                                     # that let a request's consecutive tokens share key tiles
    moe_tiles: dict                  # MoE kernel tile overrides (benchmarks sweep them)
    kernels: Any                     # the plan's KernelLibrary: `kernels(ctx)` -> @triton.jit function
    memo: dict                       # (value, what): made from an IR value once per step, dropped with it

    def derived(self, key: Any, make: Callable[[], Any]) -> Any:
        """A per-runner cache of weights re-laid out once (absorbed W_UK / W_UV, fused gate_up)."""
