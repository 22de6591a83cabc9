"""Which slice of which checkpoint tensor a rank needs, read off the plan's ops.

`rank_shards(graph, coords)` -> {HF name: (dim, index, parts) | None}: column-parallel weights and
vocab-parallel tables split dim 0 over attn_tp, row-parallel ones dim 1; the dense MLP and shared
expert split over attn_tp / moe_tp when the plan gives them `tp`; a rank holds only its experts
(ep), each split on the intermediate dim over moe_tp. `load_rank_weights` reads exactly that.
"""
from __future__ import annotations

import torch
from glmc.runtime.worker.checkpoint import detect_mtp, expected_tensors, load_checkpoint
from glmc.runtime.worker.comm import Coords

Shard = "tuple[int, int, int] | None"


def _tp_rank(op, coords: Coords) -> int:
    return coords.of("moe_tp" if op.attr("parallel") == "shared" else "attn_tp")


def _op_shards(op, coords: Coords) -> dict:
    a, tp = op.attr, int(op.attr("tp", 1))
    r = _tp_rank(op, coords)
    split = lambda dim: (dim, r, tp) if tp > 1 else None  # noqa: E731
    k = op.kind
    if k in ("embed.lookup", "lm.head", "linear") or k.startswith("attn."):
        return {a("weight"): split(1 if a("parallel") == "row" else 0)}
    if k == "mlp.swiglu":
        p = a("weight")
        return {f"{p}.gate_proj.weight": split(0), f"{p}.up_proj.weight": split(0),
                f"{p}.down_proj.weight": split(1)}
    if k == "moe.experts":
        return _expert_shards(op, coords)
    if k == "moe.gate":
        return {a("weight"): None, a("bias"): None}
    names = []
    for key in ("weight", "bias", "index_weight"):
        v = a(key)
        names += list(v) if isinstance(v, tuple) else [v] if v else []
    return {n: None for n in names}


def _expert_shards(op, coords: Coords) -> dict:
    ep, mtp = int(op.attr("ep", 1)), int(op.attr("moe_tp", 1))
    per = int(op.attr("experts")) // ep
    first = coords.of("ep") * per if ep > 1 else 0
    r = coords.of("moe_tp")
    out = {}
    for e in range(first, first + per):
        p = f"{op.attr('weight')}.{e}"
        out[f"{p}.gate_proj.weight"] = (0, r, mtp) if mtp > 1 else None
        out[f"{p}.up_proj.weight"] = (0, r, mtp) if mtp > 1 else None
        out[f"{p}.down_proj.weight"] = (1, r, mtp) if mtp > 1 else None
    return out


def rank_shards(graphs, coords: Coords) -> dict:
    out: dict = {}
    for g in graphs:
        for op in g.ops:
            out.update(_op_shards(op, coords))
    return out


def load_rank_weights(ckpt_dir, plan, coords: Coords, dtype: torch.dtype = torch.float32,
                      keep_fp8=frozenset()) -> dict:
    """This rank's weights for the plan's phase graphs, read from a HF checkpoint directory in
    `dtype` (FP8 dequantised on the way, except the names in `keep_fp8`: `Fp8Weight`s)."""
    shards = rank_shards(plan.graphs.values(), coords)
    expected = expected_tensors(plan.config, **detect_mtp(ckpt_dir))
    needed = {n for n in shards if n in expected}
    return load_checkpoint(ckpt_dir, expected, shard=lambda n: shards.get(n), dtype=dtype,
                           only=needed, keep_fp8=keep_fp8)


def iter_rank_weights(weights, shards: dict):
    """(name, this rank's slice) of each full HF-named tensor of `weights` the rank needs (`shards`:
    `rank_shards`'), one at a time: a mapping that makes its tensors on lookup
    (`random_weights.RandomWeights`) then never has more than one full tensor alive. A slice is a
    copy, so it holds no full tensor's storage."""
    for name, spec in shards.items():
        if name not in weights:
            continue
        w = weights[name]
        if spec is not None:
            dim, index, parts = spec
            w = w.chunk(parts, dim=dim)[index].clone()
        yield name, w


def cut_rank_weights(weights, plan, coords: Coords) -> dict[str, torch.Tensor]:
    """This rank's slices of full HF-named tensors held in memory (random weights of a benchmark)."""
    return dict(iter_rank_weights(weights, rank_shards(plan.graphs.values(), coords)))


def cut_rank_stacks(stacks: dict, plan, coords: Coords) -> dict:
    """This rank's part of expert stacks {weight prefix: (gate [E, I, H], up [E, I, H], down
    [E, H, I])} held whole in memory: its experts (ep), each cut on the intermediate dim (moe_tp)."""
    out = {}
    for op in (op for g in plan.graphs.values() for op in g.ops if op.kind == "moe.experts"):
        key = op.attr("weight")
        if key not in stacks or key in out:
            continue
        ep, mtp = int(op.attr("ep", 1)), int(op.attr("moe_tp", 1))
        per = int(op.attr("experts")) // ep
        first = coords.of("ep") * per if ep > 1 else 0
        r = coords.of("moe_tp")
        gate, up, down = (w[first:first + per] for w in stacks[key])
        if mtp > 1:
            gate, up = gate.chunk(mtp, dim=1)[r], up.chunk(mtp, dim=1)[r]
            down = down.chunk(mtp, dim=2)[r]
        out[key] = (gate, up, down)
    return out
