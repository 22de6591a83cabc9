"""Helpers to run compiled plans on tiny HF checkpoints (over `glmc.api`) in one or many ranks."""
from __future__ import annotations

import os

import torch

from glmc.api import Model, load


def build(ckpt_dir, parallel: str = "tp1", moe_a2a=None) -> Model:
    return load(ckpt_dir, parallel, moe_a2a)


def greedy(m: Model, prompts: list[list[int]], steps: int, dp_tokens=None):
    """Prefill, then `steps` greedy decode steps.
    -> (prefill logits [B, V], generated tokens [B, steps], comm counts of each step)."""
    logits = m.prefill(prompts, dp_tokens and dp_tokens[0])
    first, tokens, counts = logits, [], [m.executor.comm.reset()]
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        tokens.append(nxt)
        logits = m.decode(nxt, dp_tokens and dp_tokens[1])
        counts.append(m.executor.comm.reset())
    generated = torch.tensor(tokens, dtype=torch.long).reshape(steps, len(prompts)).T
    return first, generated, counts


def dp_split(prompts, dp: int) -> list[list[int]]:
    """Request indices per DP rank (round robin), as the scheduler balances them."""
    return [list(range(r, len(prompts), dp)) for r in range(dp)]


def rank_worker(rank, world, ckpt, parallel, moe_a2a, prompts, steps, out_dir, die_rank=None):
    """One rank: run its DP share of the prompts (idle batches if none); save the results."""
    if die_rank == rank:
        os._exit(3)
    m = build(ckpt, parallel, moe_a2a)
    share = dp_split(prompts, m.executor.mesh["attn_dp"])
    index = share[m.executor.comm.coords.of("attn_dp")]
    dp_tokens = ([sum(len(prompts[i]) for i in s) for s in share], [len(s) for s in share])
    logits, tokens, counts = greedy(m, [prompts[i] for i in index], steps, dp_tokens)
    torch.save({"logits": logits, "tokens": tokens, "counts": counts, "index": index},
               f"{out_dir}/rank{rank}.pt")
