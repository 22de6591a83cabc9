"""The cost model: parameters, FLOPs, HBM bytes and collective traffic of one op at a point.

`op_cost(op, graph, env)` evaluates an op of a lowered graph with the symbols bound
(`T` tokens per DP rank in the step, `B` requests, `S` context length). Conventions:
- params: elements of the op's weights, `params` over the whole model, `params_local` on one rank.
- flops: 2 x multiply-adds on one rank; MoE assumes balanced routing; attention counts the keys
  a query actually reads (min(S, index_topk); prefill sums over causal positions).
- comm `message_bytes`: the logical tensor the collective reduces or produces (all-reduce: its
  input; all-gather: its output; reduce-scatter: its input); for dispatch/combine the rows sent,
  summed over the group's ranks. `wire_bytes`: what one rank sends (ring algorithms).
- hbm_bytes: what the op reads and writes in one rank's HBM (`hbm_bytes_of`): the weights it reads
  (an embedding only its rows; routed experts only those some token picks, in expectation under
  uniform random routing: `touched_experts`), the KV and indexer-cache rows attention and the
  indexer read (min(S, index_topk) and S keys per decode query) and the cache rows it writes, and
  its IR-typed operands and results. Views (VIEW_KINDS) move nothing; a collective's own traffic
  is its `message_bytes` (0 here; a fused collective + norm counts the norm's tensors). Workspaces
  inside a kernel are a target's business (`codegen/launch_model.py`, `glmc/launches.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

from glmc.ir import Graph, Op
from glmc.ir.types import DTYPE_BYTES
from glmc.target import FP8_BLOCK

COMM_KINDS = {"comm.all_reduce": "all_reduce", "fused.allreduce_add_rms": "all_reduce",
              "comm.all_gather": "all_gather", "comm.reduce_scatter": "reduce_scatter",
              "fused.reduce_scatter_add_rms": "reduce_scatter", "moe.dispatch": "dispatch",
              "moe.combine": "combine", "comm.broadcast": "broadcast"}


@dataclass
class Cost:
    params: int = 0
    params_local: int = 0
    active_params: int = 0
    weight_bytes_local: int = 0
    flops: float = 0.0
    comm: str | None = None
    message_bytes: int = 0
    wire_bytes: float = 0.0
    hbm_bytes: float = 0.0


def _i(x) -> int:
    return int(x)


def params_of(op: Op) -> tuple[int, int, int, str]:
    """(global params, local params, active params per token, weight storage class)."""
    a = op.attr
    tp = _i(a("tp", 1))
    k = op.kind
    if k in ("embed.lookup", "lm.head"):
        n = _i(a("vocab")) * _i(a("hidden"))
        return n, n // tp, (n if k == "lm.head" else 0), "dense16"
    if k in ("linear", "mla.a_proj"):
        n = _i(a("in_features")) * _i(a("out_features"))
        return n, n // tp, n, "weight"
    if k.startswith("attn."):   # kv_b_proj: absorbed MLA's per-head GEMMs run it in bf16 (weight_formats)
        n = _i(a("kv_lora")) * _i(a("heads")) * (_i(a("dn")) + _i(a("dv")))
        return n, n // tp, n, "dense16"
    if k == "mlp.swiglu":
        n = 3 * _i(a("hidden")) * _i(a("inter"))
        return n, n // tp, n, "weight"
    if k == "moe.experts":
        per = 3 * _i(a("hidden")) * _i(a("inter"))
        n = per * _i(a("experts"))
        return n, n // (_i(a("ep", 1)) * _i(a("moe_tp", 1))), per * _i(a("top_k")), "weight"
    if k == "moe.gate":
        n = _i(a("experts")) * (_i(a("hidden")) + 1)
        return n, n, n, "fp32"
    if k in ("norm.rms", "fused.add_rms", "fused.allreduce_add_rms",
             "fused.reduce_scatter_add_rms"):
        n = op.types[0].shape[-1].eval({})
        return n, n, n, "dense16"
    if k == "norm.layer":
        n = 2 * op.types[0].shape[-1].eval({})
        return n, n, n, "dense16"
    if k.startswith("fused.qkv_a_norm_rope_write"):
        n = _i(a("q_lora")) + _i(a("kv_lora")) + 2 * _i(a("index_dim", 0))
        return n, n, n, "dense16"
    return 0, 0, 0, "none"


def _causal_keys(t: int, s: int, k: int) -> int:
    """Keys read by t new queries ending a context of s tokens, each limited to the top k."""
    def upto(n: int) -> int:     # sum of min(k, p) for p = 1..n
        return n * (n + 1) // 2 if n <= k else k * (k + 1) // 2 + (n - k) * k
    return upto(s) - upto(s - t)


# Kinds `flops_of` counts arithmetic for; every other kind is a collective (COMM_KINDS) or FREE:
# data movement, element-wise or bookkeeping whose FLOPs the cost model does not count (their
# bytes are counted by `op_cost`).
FLOP_KINDS = frozenset({"linear", "mla.a_proj", "lm.head", "mlp.swiglu", "moe.gate", "moe.experts",
                        "attn.sparse_mla", "attn.mla_absorbed", "attn.mla_mha", "idx.topk"})
FREE_KINDS = frozenset({"io.input", "embed.lookup", "norm.rms", "norm.layer", "rope.apply",
                        "elt.add", "tensor.slice", "tensor.view", "tensor.concat", "tensor.shard",
                        "tensor.select_last", "mem.kv_write", "mem.index_k_write", "fused.add_rms",
                        "fused.qkv_a_norm_rope_write", "fused.qkv_a_norm_rope_write_index",
                        "moe.topk", "idx.reuse", "comm.reshard", "sample.tokens"})


def flops_of(op: Op, graph: Graph, env: dict) -> float:
    a, k = op.attr, op.kind
    rows = op.types[0].shape[0].eval(env) if op.types and op.types[0].shape else 0
    tp = _i(a("tp", 1))
    if k in ("linear", "mla.a_proj"):
        in_f = _i(a("in_features")) // (tp if a("parallel") == "row" else 1)
        out_f = _i(a("out_features")) // (tp if a("parallel") == "column" else 1)
        return 2.0 * rows * in_f * out_f
    if k == "lm.head":
        return 2.0 * rows * _i(a("hidden")) * _i(a("vocab")) // tp
    if k == "mlp.swiglu":
        return 2.0 * rows * 3 * _i(a("hidden")) * _i(a("inter")) / tp
    if k == "moe.gate":
        return 2.0 * rows * _i(a("hidden")) * _i(a("experts"))
    if k == "moe.experts":
        pairs, _ = moe_pairs(op, graph, env)
        return 2.0 * pairs * 3 * _i(a("hidden")) * _i(a("inter")) / _i(a("moe_tp", 1))
    if k.startswith("attn."):
        return _attn_flops(op, env, rows, tp)
    if k == "idx.topk":
        keys = _causal_keys(rows, env["S"], env["S"]) if rows > 1 and env.get("prefill") else \
            rows * env["S"]
        return 2.0 * keys * _i(a("heads")) * _i(a("head_dim"))
    return 0.0


def _attn_flops(op: Op, env: dict, rows: int, tp: int) -> float:
    a = op.attr
    h = _i(a("heads")) // tp
    dn, dr, dv, c, topk = _i(a("dn")), _i(a("dr")), _i(a("dv")), _i(a("kv_lora")), env["K"]
    if op.kind == "attn.mla_mha":
        keys = _causal_keys(rows, env["S"], topk)
        expand = 2.0 * env["S"] * c * h * (dn + dv)   # kv_b over the request's context
        return expand + 2.0 * keys * h * (dn + dr + dv)
    keys = rows * min(env["S"], topk)
    return 2.0 * rows * h * (dn * c + c * dv) + 2.0 * keys * h * (c + dr + c)


def comm_of(op: Op, graph: Graph, env: dict) -> tuple[str, int, float] | None:
    kind = COMM_KINDS.get(op.kind)
    if kind is None:
        return None
    n = _i(op.attr("size"))
    frac = (n - 1) / n
    src = graph.type_of(op.operands[0]).nbytes(env)
    if kind == "all_reduce":
        return kind, src, 2 * frac * src
    if kind == "reduce_scatter":
        return kind, src, frac * src
    if kind == "all_gather":
        out = op.types[0].nbytes(env)
        return kind, out, frac * out
    if kind == "dispatch":
        sent = sum(t.payload_bytes(env) for t in op.types)   # an FP8 dispatch sends its rows' scales too
        return kind, sent * n, frac * sent
    if kind == "combine":
        return kind, src * n, frac * src
    return kind, src, frac * src


# One-shot peer-memory collectives against NCCL inside CUDA graphs, measured on two H200s
# (2026-11-30): torch's one-shot all-reduce over P2P 6.6 / 7.0 / 9.0 / 15.4 us at
# 12 / 96 / 384 / 1536 KiB, NCCL 13.0 / 12.7 / 14.2 / 22.2 us. Fitted: one-shot = latency + the
# (n - 1) peer messages it reads / P2P_READ_BPS; NCCL = latency + its ring wire bytes / NCCL_BUS_BPS.
P2P_LATENCY_S, P2P_READ_BPS = 6.5e-6, 177e9
NCCL_LATENCY_S, NCCL_BUS_BPS = 12.9e-6, 170e9
P2P_MAX_BYTES = 4 * 2**20   # the largest message a peer-memory channel holds (2 slots per rank)


def p2p_seconds(kind: str, nbytes: float, n: int) -> float:
    """The one-shot kernel's modelled time: each rank reads every peer's rows of its output."""
    read = (n - 1) * nbytes / (1 if kind == "all_reduce" else n)    # an all-gather's message: its output
    return P2P_LATENCY_S + read / P2P_READ_BPS


def nccl_seconds(kind: str, nbytes: float, n: int) -> float:
    """NCCL's modelled time at small messages (ring: all-reduce sends 2 (n-1)/n of the message)."""
    wire = (2 if kind == "all_reduce" else 1) * (n - 1) / n * nbytes
    return NCCL_LATENCY_S + wire / NCCL_BUS_BPS


def runs_p2p(op: Op, message_bytes: float) -> bool:
    """Whether the CUDA target runs `op` with the one-shot peer-memory kernel for a message of
    `message_bytes` (`comm_of`'s convention): select-collective-backend gave it a threshold and the
    message is within it; else NCCL."""
    limit = op.attr("p2p_max_bytes")
    return limit is not None and 0 < message_bytes <= int(limit)


def p2p_max_bytes(kind: str, n: int) -> int:
    """The largest message (bytes) of an all-reduce / reduce-scatter / all-gather over n ranks that the one-shot
    kernel runs faster than NCCL by the models above, at most P2P_MAX_BYTES (16-byte multiple)."""
    lo, hi = 0, P2P_MAX_BYTES
    if p2p_seconds(kind, hi, n) <= nccl_seconds(kind, hi, n):
        return hi
    while hi - lo > 16:          # the one-shot's cost grows faster: one crossing
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if p2p_seconds(kind, mid, n) <= nccl_seconds(kind, mid, n) else (lo, mid)
    return lo // 16 * 16


# Kinds whose results alias their operands or host values: no kernel, no HBM traffic.
VIEW_KINDS = frozenset({"io.input", "tensor.view", "tensor.slice", "tensor.shard", "idx.reuse", "comm.reshard"})
SCALE_BYTES = {"fp8": 4}   # one fp32 scale per token row of an fp8 indexer cache


def touched_experts(local: int, top_k: int, experts: int, tokens: float) -> float:
    """Expected experts among `local` that at least one of `tokens` picks, each token choosing
    top_k of `experts` uniformly at random: local x (1 - (1 - top_k/experts)^tokens)."""
    return local * (1.0 - (1.0 - top_k / experts) ** tokens)


def moe_pairs(op: Op, graph: Graph, env: dict) -> tuple[float, float]:
    """(routed (token, expert) pairs computed on this rank, tokens routed over the EP group) of a
    `moe.experts`, under balanced routing (rows after a dispatch are pairs already)."""
    a = op.attr
    rows = op.types[0].shape[0].eval(env)
    routed_rows = graph.type_of(op.operands[1]).shape[-1].eval(env) == 1
    pairs = rows if routed_rows else rows * _i(a("top_k")) / _i(a("ep", 1))
    return pairs, pairs * _i(a("ep", 1)) / _i(a("top_k"))


def _is_cache(t) -> bool:
    return t is None or (bool(t.shape) and t.shape[0].sym == "S")


def _row_bytes(t, indexer: bool = False) -> int:
    """Bytes of one token row of a cache type (an fp8 indexer row carries its scale)."""
    return t.nbytes({"S": 1}) + (SCALE_BYTES.get(t.dtype, 0) if indexer else 0)


def kv_row_bytes(t, kv_lora: int) -> int:
    """Bytes of one token row of a latent cache type [S, kv_lora + rope]: as the type says, or for
    fp8 FlashMLA's row: kv_lora e4m3 + a fp32 scale per 128 + the rope part in bf16 (656 for GLM-5)."""
    if t.dtype != "fp8":
        return _row_bytes(t)
    rope = t.numel({"S": 1}) - kv_lora
    return kv_lora + 4 * -(-kv_lora // FP8_BLOCK) + 2 * rope


def cache_row_bytes(op: Op, graph: Graph) -> list[tuple[bool, int]]:
    """(indexer cache?, bytes per token row) of each cache a KV-writing op (`mem.kv_write`,
    `mem.index_k_write`, `fused.qkv*`) writes; [] for other ops."""
    k = op.kind
    if not k.startswith(("mem.kv_write", "mem.index_k_write", "fused.qkv")):
        return []
    out = []
    for i, t in enumerate(op.types):
        if t is None or not _is_cache(t):
            continue
        if k == "mem.index_k_write" or (k.endswith("_index") and i == len(op.types) - 1):
            out.append((True, _row_bytes(t, indexer=True)))
        else:
            kv_lora = _i(op.attr("kv_lora")) if k.startswith("fused") else \
                graph.type_of(op.operands[0]).numel({"S": 1, "T": 1})
            out.append((False, kv_row_bytes(t, kv_lora)))
    return out


def _weights_read(op: Op, graph: Graph, env: dict, weight_bytes: dict[str, int]) -> float:
    _, local, _, cls = params_of(op)
    if op.kind == "embed.lookup":
        return op.types[0].shape[0].eval(env) * _i(op.attr("hidden")) * weight_bytes[cls]
    if op.kind == "moe.experts":
        a = op.attr
        experts, ep = _i(a("experts")), _i(a("ep", 1))
        _, tokens = moe_pairs(op, graph, env)
        per_expert = local * weight_bytes[cls] / (experts // ep)
        return touched_experts(experts // ep, _i(a("top_k")), experts, tokens) * per_expert
    return local * weight_bytes.get(cls, 0)


def _cache_bytes(op: Op, graph: Graph, env: dict) -> float:
    """KV / indexer-cache rows read (attention, indexer) or written (the ops that write them)."""
    k = op.kind
    rows = op.types[0].shape[0].eval(env) if op.types[0] is not None and op.types[0].shape else 0
    prefill = rows > 1 and env.get("prefill")
    if k.startswith("attn."):
        keys = _causal_keys(rows, env["S"], env["K"]) if prefill else rows * min(env["S"], env["K"])
        return keys * kv_row_bytes(graph.type_of(op.operands[2]), _i(op.attr("kv_lora")))
    if k == "idx.topk":
        keys = _causal_keys(rows, env["S"], env["S"]) if prefill else rows * env["S"]
        return keys * _row_bytes(graph.type_of(op.operands[2]), indexer=True)
    if k.startswith(("fused.qkv", "mem.")):
        tokens = graph.type_of(op.operands[0]).shape[0].eval(env)
        return tokens * sum(b for _, b in cache_row_bytes(op, graph))
    return 0.0


def hbm_bytes_of(op: Op, graph: Graph, env: dict, weight_bytes: dict[str, int]) -> float:
    """Bytes `op` reads and writes in one rank's HBM at `env` (conventions in the module docstring)."""
    if op.kind in VIEW_KINDS or (op.kind in COMM_KINDS and not op.kind.startswith("fused.")):
        return 0.0
    tensors = [graph.type_of(v) for v in op.operands] + list(op.types)
    if op.kind in COMM_KINDS:   # a fused collective + norm: the norm reads the reduced x and the residual
        tensors = [op.types[0], graph.type_of(op.operands[1])] + list(op.types)
    act = sum(t.nbytes(env) for t in tensors if not _is_cache(t))
    return act + _weights_read(op, graph, env, weight_bytes) + _cache_bytes(op, graph, env)


def op_cost(op: Op, graph: Graph, env: dict, weight_bytes: dict[str, int]) -> Cost:
    p, pl, act, cls = params_of(op)
    c = Cost(params=p, params_local=pl, active_params=act,
             weight_bytes_local=pl * weight_bytes.get(cls, 0), flops=flops_of(op, graph, env),
             hbm_bytes=hbm_bytes_of(op, graph, env, weight_bytes))
    comm = comm_of(op, graph, env)
    if comm:
        c.comm, c.message_bytes, c.wire_bytes = comm
    return c


def weight_bytes_for(dtypes) -> dict[str, int]:
    """Bytes per element for each weight storage class (norms, embeddings stay 16-bit)."""
    act = DTYPE_BYTES[dtypes.activation]
    return {"weight": DTYPE_BYTES[dtypes.weight], "dense16": act, "fp32": 4, "none": 0}
