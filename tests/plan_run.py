"""Helpers to run compiled plans on tiny HF checkpoints: build batches, run prefill + greedy decode."""
from __future__ import annotations

import torch

from glmc.compiler import compile_plan
from glmc.parallel import parse_parallel
from glmc.passes import Options
from glmc.runtime.comm import Comm
from glmc.runtime.executor import PlanExecutor
from glmc.runtime.forward_batch import ForwardBatch
from glmc.runtime.kv_cache import PAGE_SIZE, KVPool
from glmc.runtime.plan_weights import load_rank_weights
from glmc.spec import load_spec

PAGES_PER_REQ = 2


def build(ckpt_dir, parallel: str = "tp1", moe_a2a=None, groups=None):
    """(executor, spec) for this process's rank of `parallel` over the checkpoint."""
    spec = load_spec(ckpt_dir)
    par = parse_parallel(parallel, spec.config)
    plan = compile_plan(spec, par, Options(device="cpu", moe_a2a=moe_a2a))
    graphs = plan.graphs
    used = {_group(op) for g in graphs.values() for op in g.ops if op.attr("group") is not None}
    comm = Comm(par.mesh, used)
    c = spec.config
    full = {i for i, t in enumerate(c.layer_indexer_types()) if t == "full"}
    pool = KVPool(c.num_hidden_layers + 1, full | {c.num_hidden_layers}, 64, c.kv_lora_rank,
                  c.qk_rope_head_dim, c.index_head_dim)
    weights = load_rank_weights(ckpt_dir, c, list(graphs.values()), comm.coords)
    return PlanExecutor(graphs, c, weights, pool, comm), spec


def _group(op):
    g = op.attr("group")
    return g if isinstance(g, str) else tuple(g)


def table(num_rows: int) -> torch.Tensor:
    """req_to_token: row r on pages 2r+1, 2r+2 (page 0 unused, the last page is the scratch)."""
    pages = torch.arange(num_rows * PAGES_PER_REQ).view(num_rows, PAGES_PER_REQ) + 1
    return (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(num_rows, -1)


def greedy(ex: PlanExecutor, prompts: list[list[int]], steps: int, dp_tokens=None):
    """Prefill all prompts in one batch, then `steps` greedy decode steps.
    -> (prefill logits [B, V], generated tokens [B, steps], per-step comm counts)."""
    r2t = table(len(prompts))
    rows = list(range(len(prompts)))
    batch = ForwardBatch.build("extend", prompts, rows, [0] * len(prompts), r2t)
    out = ex.forward("prefill", batch, dp_tokens=dp_tokens and dp_tokens[0])
    first = out["logits"]
    seqs = [list(p) for p in prompts]
    tokens, counts = [], [ex.comm.reset()]
    nxt = out["logits"].argmax(-1).tolist()
    for i in range(steps):
        tokens.append(nxt)
        for s, t in zip(seqs, nxt):
            s.append(t)
        batch = ForwardBatch.build("decode", [[s[-1]] for s in seqs], rows,
                                   [len(s) - 1 for s in seqs], r2t)
        out = ex.forward("decode", batch, dp_tokens=dp_tokens and dp_tokens[1])
        counts.append(ex.comm.reset())
        nxt = out["logits"].argmax(-1).tolist()
    return first, torch.tensor(tokens).T if tokens else torch.zeros(len(prompts), 0), counts


def dp_split(prompts, dp: int) -> list[list[int]]:
    """Request indices per DP rank (round robin), as the scheduler balances them."""
    return [list(range(r, len(prompts), dp)) for r in range(dp)]


def rank_worker(rank, world, ckpt, parallel, moe_a2a, prompts, steps, out_dir, die_rank=None):
    """One rank: run its DP share of the prompts; save logits, tokens and comm counts."""
    import os
    from glmc.parallel import parse_parallel as pp
    if die_rank == rank:
        os._exit(3)
    ex, spec = build(ckpt, parallel, moe_a2a)
    par = pp(parallel, spec.config)
    share = dp_split(prompts, par.attn_dp)
    mine = [prompts[i] for i in share[ex.comm.coords.of("attn_dp")]]
    dp_tokens = ([sum(len(prompts[i]) for i in s) for s in share], [len(s) for s in share])
    if mine:
        logits, tokens, counts = greedy(ex, mine, steps, dp_tokens)
    else:
        logits, tokens, counts = idle_steps(ex, steps, dp_tokens)
    torch.save({"logits": logits, "tokens": tokens, "counts": counts,
                "index": share[ex.comm.coords.of("attn_dp")]}, f"{out_dir}/rank{rank}.pt")


def idle_steps(ex, steps, dp_tokens):
    """A DP rank with no requests still runs every step (IDLE batches), or collectives hang."""
    idle = ForwardBatch.idle(table(1))
    ex.forward("prefill", idle, dp_tokens=dp_tokens[0])
    counts = [ex.comm.reset()]
    for _ in range(steps):
        ex.forward("decode", idle, dp_tokens=dp_tokens[1])
        counts.append(ex.comm.reset())
    return torch.zeros(0), torch.zeros(0, steps, dtype=torch.long), counts
