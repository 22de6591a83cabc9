"""Run a compiled plan's phase graphs with the torch target, one process per rank.

`PlanExecutor(plan, weights, pool, comm)` binds a `glmc.plan.Plan` to this rank's weights and KV pool;
`forward(phase, batch, ...)` evaluates the phase graph op by op (`codegen.torch_target.IMPLS`)
and returns {"logits", "hidden", "next_ids"} for the batch's requests. Token counts that must
split evenly (TP attention with EP: the residual is split over attn_tp; DP gathers) are padded
with dummy tokens that write their KV to a scratch slot (the pool's last slot, which allocators
must not hand out) and are dropped from the outputs.

Hooks for other targets (backward compatible): `impls` swaps the op table (the CUDA target,
`codegen/cuda_target.py`), `device` puts the step's feeds and KV locations on that device (the torch
target run on a GPU), and `run_ops(graph, step)` is the op loop a subclass can reuse (the GPU runner
calls it inside CUDA-graph capture).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from glmc.codegen.fp8_ref import Fp8Weight
from glmc.codegen.torch_target import IMPLS
from glmc.ir import Graph
from glmc.runtime.worker.comm import Comm
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.kv_cache import KVPool

from glmc.plan import Plan


@dataclass
class Step:
    """What ops see during one forward (fulfils `codegen.context.StepContext`): feeds, batch,
    pool, comm, padded KV locations."""
    ex: "PlanExecutor"
    graph: Graph
    batch: ForwardBatch
    feeds: dict
    loc: torch.Tensor
    routes: dict = field(default_factory=dict)
    memo: dict = field(default_factory=dict)   # (value, what) -> made from the value once, dropped with it

    @property
    def pool(self) -> KVPool:
        return self.ex.pool

    @property
    def comm(self) -> Comm:
        return self.ex.comm

    @property
    def num_experts(self) -> int:
        return self.ex.config.n_routed_experts

    def w(self, name: str) -> torch.Tensor:
        return self.ex.weight(name)

    def tp_rank(self, op) -> int:
        return self.comm.coords.of("moe_tp" if op.attr("parallel") == "shared" else "attn_tp")

    def gate_bias(self, op) -> str:
        return f"model.layers.{op.layer}.mlp.gate.e_score_correction_bias"

    def experts(self, op):
        return self.ex.expert_stacks(op)

    def expert_offset(self, op) -> int:
        ep = int(op.attr("ep", 1))
        return self.comm.coords.of("ep") * (int(op.attr("experts")) // ep) if ep > 1 else 0

    def type_of(self, value: str):
        return self.graph.type_of(value)


def _stack(weights: list):
    """Per-expert weights -> one [E, ...] stack (FP8 ones with their scales)."""
    return Fp8Weight.stack(weights) if isinstance(weights[0], Fp8Weight) else torch.stack(weights)


def rank_expert_names(op, ep_rank: int) -> list[list[str]]:
    """HF names of this rank's experts of a `moe.experts` op, per projection (gate, up, down), in
    expert order: the rows of its [E_rank, ...] stacks."""
    key, ep = op.attr("weight"), int(op.attr("ep", 1))
    per = int(op.attr("experts")) // ep
    first = ep_rank * per if ep > 1 else 0
    return [[f"{key}.{e}.{n}_proj.weight" for e in range(first, first + per)] for n in ("gate", "up", "down")]


def pop_expert_stacks(weights: dict, op, ep_rank: int) -> tuple:
    """(gate, up, down) stacks of this rank's experts, their per-expert entries removed from `weights`
    one projection at a time: each expert weight is then held once (in its stack), and at most one
    projection's experts are held twice while it is stacked."""
    names = rank_expert_names(op, ep_rank)
    missing = [n for n in names[0] if n not in weights]
    if missing:
        raise KeyError(f"{op.attr('weight')}: no expert weights {missing[:2]}... (not in this rank's shard)")
    return tuple(_stack([weights.pop(n) for n in part]) for part in names)


class PlanExecutor:
    def __init__(self, plan: Plan, weights: dict, pool: KVPool, comm: Comm | None = None,
                 impls: dict | None = None, device=None, stacks: dict | None = None):
        self.plan, self.weights, self.pool = plan, weights, pool
        self.graphs, self.config, self.mesh = plan.graphs, plan.config, plan.mesh
        self.impls = IMPLS if impls is None else impls
        self.device = torch.device(device) if device is not None else None
        self.comm = comm or Comm(self.mesh, plan.groups)
        self._stacks: dict = dict(stacks or {})  # fused A-projections, expert stacks

    @property
    def stacks(self) -> dict:
        """The weights held stacked: fused A-projections ({(name, ...): rows of those weights}) and
        each MoE layer's experts ({weight prefix: (gate, up, down)}), as made so far."""
        return self._stacks

    def weight(self, name: str) -> torch.Tensor:
        if isinstance(name, tuple):          # fused A-projection: rows of several weights
            if name not in self._stacks:
                self._stacks[name] = torch.cat([self.weights[n] for n in name], dim=0)
            return self._stacks[name]
        try:
            return self.weights[name]
        except KeyError:
            raise KeyError(f"rank {self.comm.rank} has no weight {name!r} (not in its shard)") from None

    def expert_stacks(self, op):
        """(gate, up, down) [E_rank, ...] stacks of a `moe.experts` op: given (`stacks`: the loader
        stacks every rank's experts at load time), or stacked now from per-expert entries of
        `weights`, which are then dropped (the executor owns `weights`; each expert is held once)."""
        key = op.attr("weight")
        if key not in self._stacks:
            self._stacks[key] = pop_expert_stacks(self.weights, op, self.comm.coords.of("ep"))
        return self._stacks[key]

    def padded_tokens(self, t: int, dp_tokens: list[int] | None) -> int:
        """Tokens after padding: the largest DP rank's count, rounded up to the mesh's token split."""
        t = max(dp_tokens) if dp_tokens else t
        split = self.mesh.token_split_size
        return -(-t // split) * split if t else 0

    def release(self) -> None:
        """Free device state before the process group goes (the torch target holds none)."""

    def run_ops(self, graph: Graph, step, phase: str = "") -> dict:
        """Evaluate every op of `graph` in order with `self.impls`, dropping each value after its
        last use (`Graph.dead_after`: a tensor's storage goes when nothing else holds it, so a
        step's peak is its largest live set, not the sum of its values); -> {value name: result}
        of the values left: the step's outputs (`Graph.step_outputs`)."""
        values = {}
        for op, dead in zip(graph.ops, graph.dead_after()):
            try:
                out = self.impls[op.kind](op, [values[v] for v in op.operands], step)
            except Exception as e:
                raise RuntimeError(f"rank {self.comm.rank}, {phase}: {op.where()}: {e}") from e
            values.update(zip(op.results, out if isinstance(out, tuple) else (out,)))
            del out
            for v in dead:
                del values[v]
            if step.memo:
                for key in [k for k in step.memo if k[0] in dead]:
                    del step.memo[key]
        return values

    @torch.no_grad()
    def forward(self, phase: str, batch: ForwardBatch, hidden: torch.Tensor | None = None,
                dp_tokens: list[int] | None = None) -> dict:
        graph = self.graphs[phase]
        t = batch.num_tokens
        pad = self.padded_tokens(t, dp_tokens) - t
        scratch = torch.full((pad,), self.pool.num_slots - 1, dtype=torch.int64)
        zeros = torch.zeros(pad, dtype=torch.int64)
        feeds = {"input_ids": torch.cat([batch.input_ids, zeros]),
                 "positions": torch.cat([batch.positions, zeros])}
        if hidden is not None:
            feeds["hidden"] = torch.cat([hidden.float(), hidden.new_zeros(pad, hidden.shape[1])])
        loc = torch.cat([batch.out_cache_loc, scratch])
        if self.device is not None:
            feeds, loc = {k: v.to(self.device) for k, v in feeds.items()}, loc.to(self.device)
        values = self.run_ops(graph, Step(self, graph, batch, feeds, loc), phase)
        rows = batch.batch_size if phase == "prefill" else t
        logits, hidden, ids = (values[v] for v in graph.step_outputs())
        return {"logits": logits[:rows], "hidden": hidden[:rows], "next_ids": ids[:rows]}
