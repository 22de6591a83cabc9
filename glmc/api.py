"""The Python API: compile a model, load this rank's weights, run prefill / decode on token ids.

    from glmc.api import load
    m = load("path/to/hf_checkpoint")               # compiles for tp1 on the torch target
    logits = m.prefill([[1, 2, 3], [4, 5]])           # [2, vocab]: each request's last position
    logits = m.decode([7, 8])                         # one new token per request -> [2, vocab]
    m.generate_greedy([[1, 2, 3]], 8)                 # -> [[8 token ids]]

Requests get fixed KV rows (row r owns pages r*pages_per_request+1 ...); the pool's last page is
the executor's scratch page. Under a multi-rank spec, call `load` in every rank's process (see
`glmc.runtime.worker.launch.spawn`); `dp_tokens` then lists every DP rank's token count.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glmc.compiler import compile_plan
from glmc.config import Options
from glmc.parallel import parse_parallel
from glmc.runtime.worker.comm import Comm
from glmc.runtime.worker.executor import PlanExecutor
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.kv_cache import PAGE_SIZE, KVPool
from glmc.runtime.worker.shards import load_rank_weights
from glmc.spec import load_spec


def _group(op):
    g = op.attr("group")
    return g if isinstance(g, str) else tuple(g)


@dataclass
class Model:
    """A compiled plan bound to this rank's weights and a KV pool, with simple request rows."""
    executor: PlanExecutor
    spec: object
    max_requests: int
    pages_per_request: int
    seqs: list = field(default_factory=list)

    @property
    def req_to_token(self) -> torch.Tensor:
        pages = torch.arange(self.max_requests * self.pages_per_request).view(
            self.max_requests, self.pages_per_request) + 1
        return (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(self.max_requests, -1)

    def prefill(self, prompts: list[list[int]], dp_tokens=None) -> torch.Tensor:
        """Start new requests (replacing any earlier ones); logits of each prompt's last token."""
        if len(prompts) > self.max_requests:
            raise ValueError(f"{len(prompts)} prompts, max_requests is {self.max_requests}")
        self.seqs = [list(p) for p in prompts]
        batch = ForwardBatch.build("extend", prompts, list(range(len(prompts))), [0] * len(prompts),
                                   self.req_to_token) if prompts else ForwardBatch.idle(self.req_to_token)
        return self.executor.forward("prefill", batch, dp_tokens=dp_tokens)["logits"]

    def decode(self, tokens: list[int], dp_tokens=None) -> torch.Tensor:
        """Append one token to every running request; logits for the next one."""
        if len(tokens) != len(self.seqs):
            raise ValueError(f"{len(tokens)} tokens for {len(self.seqs)} running requests")
        for s, t in zip(self.seqs, tokens):
            s.append(t)
        if not self.seqs:
            return self.executor.forward("decode", ForwardBatch.idle(self.req_to_token),
                                         dp_tokens=dp_tokens)["logits"]
        batch = ForwardBatch.build("decode", [[s[-1]] for s in self.seqs], list(range(len(self.seqs))),
                                   [len(s) - 1 for s in self.seqs], self.req_to_token)
        return self.executor.forward("decode", batch, dp_tokens=dp_tokens)["logits"]

    def generate_greedy(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        out = [[] for _ in prompts]
        logits = self.prefill(prompts)
        for i in range(steps):
            nxt = logits.argmax(-1).tolist()
            for o, t in zip(out, nxt):
                o.append(t)
            if i + 1 < steps:
                logits = self.decode(nxt)
        return out


def load(ckpt_dir, parallel: str = "tp1", moe_a2a=None, max_requests: int = 8,
         pages_per_request: int = 2) -> Model:
    """Compile the checkpoint's model for `parallel` and load this rank's shard of the weights."""
    spec = load_spec(ckpt_dir)
    par = parse_parallel(parallel, spec.config)
    graphs = compile_plan(spec, par, Options(device="cpu", moe_a2a=moe_a2a)).graphs
    comm = Comm(par.mesh, {_group(op) for g in graphs.values() for op in g.ops
                           if op.attr("group") is not None})
    c = spec.config
    full = {i for i, t in enumerate(c.layer_indexer_types()) if t == "full"}
    pool = KVPool(c.num_hidden_layers + 1, full | {c.num_hidden_layers},
                  max_requests * pages_per_request + 2, c.kv_lora_rank, c.qk_rope_head_dim,
                  c.index_head_dim)
    weights = load_rank_weights(ckpt_dir, c, list(graphs.values()), comm.coords)
    return Model(PlanExecutor(graphs, c, weights, pool, comm), spec, max_requests, pages_per_request)
