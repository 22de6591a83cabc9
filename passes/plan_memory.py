"""plan-memory: what one rank holds — weights, KV + indexer cache per token, workspaces, graphs.

Assumes: a lowered, sharded graph with buckets. Guarantees: `meta.memory` with
`weights_bytes` (this phase's graph, one rank, each weight once, as the loader holds it: block-FP8
weights at 1 byte plus a fp32 scale per 128 x 128 block, the indexer's weights_proj inside the FP8
A-projection in the compute dtype, expert weights once in their [E, ...] stacks),
`weight_copies_bytes` (CUDA target: the re-laid-out weights its op table keeps beside the originals,
`_copies`), `kv_bytes_per_token` (c_kv | k_pe per layer, all
layers; an fp8 row is FlashMLA's: e4m3 latent + a fp32 scale per 128 + bf16 k_pe, `costs.kv_row_bytes`),
`index_bytes_per_token` (indexer keys + fp8 scale, full layers only), the layer counts,
`indexer_workspace_bytes` (fp32 score tiles + running top-k for the largest step) and
`graph_bytes` per bucket (the largest per-layer activation set at that batch, plus logits).
GLM-5.3: 656 bytes of fp8 KV per token on each of 78 layers (512 + 4 x 4 + 64 x 2), 128 + 4 on each
of 21 indexer layers:

Example (GLM-5.3, tp1, decode):

 -> #! memory = {
    #!   index_bytes_per_token: 2772,
    #!   index_layers: 21,
    #!   kv_bytes_per_token: 51168,
    #!   kv_layers: 78,
"""
from __future__ import annotations

from glmc.ir import Graph, Op
from glmc.ir.types import DTYPE_BYTES

from .base import Pass, PassContext
from .costs import cache_row_bytes, params_of, weight_bytes_for

TILE_KEYS = 4096
FP8_BLOCK = 128   # codegen.fp8_ref.BLOCK: one fp32 scale per 128 x 128 block


def _matrix_bytes(rows: int, cols: int, fp8: bool, elem: int) -> int:
    """A [rows, cols] weight as held: e4m3 + fp32 block scales, or `elem` bytes per element."""
    if fp8:
        return rows * cols + 4 * -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)
    return rows * cols * elem


def _a_proj_rows(op: Op, cfg) -> list[tuple[int, bool]] | None:
    """(rows, FP8-able) of each part of the A-projection in its weight order, from the config
    (None if they do not add up to out_features): the indexer's weights_proj is never FP8
    (`codegen.weight_formats.UNQUANTISED`)."""
    rows = {"q_a_proj.weight": (cfg.q_lora_rank, True),
            "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, True),
            "indexer.wk.weight": (cfg.index_head_dim, True),
            "indexer.weights_proj.weight": (cfg.index_n_heads, False)}
    parts = [next((v for k, v in rows.items() if n.endswith(k)), None) for n in op.attr("weight")]
    if None in parts or sum(r for r, _ in parts) != int(op.attr("out_features")):
        return None
    return parts


def _joined_rows(rows: list[int]) -> int:
    """Rows the CUDA target copies when it joins consecutive FP8 parts into one GEMM weight: parts
    join while each one before the last of a run ends on a 128-row block (`fp8_ref.fp8_row_groups`)."""
    copied, run = 0, []
    for r in rows + [None]:
        if r is not None and run and run[-1] % FP8_BLOCK == 0:
            run.append(r)
            continue
        copied += sum(run) if len(run) > 1 else 0
        run = [] if r is None else [r]
    return copied


def op_weight_bytes(op: Op, cfg, dtypes, cuda: bool) -> tuple[int, int]:
    """(bytes of the op's weights on one rank, bytes of the copies the CUDA target keeps beside
    them: absorbed MLA's W_UK / W_UV^T of kv_b_proj, the fused gate_up of a dense MLP and the joined
    A-projection (bf16: one concatenation; FP8: the parts joined on 128-row blocks))."""
    fp8, k, a = dtypes.weight == "fp8", op.kind, op.attr
    elem, act = DTYPE_BYTES[dtypes.weight], DTYPE_BYTES[dtypes.activation]
    tp = int(a("tp", 1))
    if k == "linear":
        rows, cols = int(a("out_features")), int(a("in_features"))
        rows, cols = (rows, cols // tp) if a("parallel") == "row" else (rows // tp, cols)
        return _matrix_bytes(rows, cols, fp8, elem), 0
    if k == "mla.a_proj" and isinstance(a("weight"), tuple) and _a_proj_rows(op, cfg):
        parts, cols = _a_proj_rows(op, cfg), int(a("in_features"))
        held = sum(_matrix_bytes(r, cols, fp8 and q, act if fp8 and not q else elem) for r, q in parts)
        if not cuda:
            return held, 0
        if not fp8:
            return held, held
        fp8_rows = [r for r, q in parts if q]
        joined = _joined_rows(fp8_rows)
        return held, _matrix_bytes(joined, cols, True, 1) if joined else 0
    if k == "mlp.swiglu":
        inter, hidden = int(a("inter")) // tp, int(a("hidden"))
        one = _matrix_bytes(inter, hidden, fp8, elem)
        copies = 2 * one if cuda and (not fp8 or inter % FP8_BLOCK == 0) else 0
        return 2 * one + _matrix_bytes(hidden, inter, fp8, elem), copies
    if k == "moe.experts":
        experts = int(a("experts")) // int(a("ep", 1))
        inter, hidden = int(a("inter")) // int(a("moe_tp", 1)), int(a("hidden"))
        return experts * (2 * _matrix_bytes(inter, hidden, fp8, elem) + _matrix_bytes(hidden, inter, fp8, elem)), 0
    _, local, _, cls = params_of(op)
    held = local * weight_bytes_for(dtypes)[cls]
    return held, held if cuda and k.startswith("attn.") else 0


def _rows(graph: Graph, ctx: PassContext) -> int:
    buckets = graph.meta.get("cuda_graph_buckets") or [ctx.options.chunked_prefill]
    return max(buckets)


def _layer_activation_bytes(graph: Graph, env: dict) -> int:
    per_layer: dict = {}
    for op in graph.ops:
        for t in op.types:
            if t is not None and t.shape and t.shape[0].sym in ("T", "B"):
                per_layer[op.layer] = per_layer.get(op.layer, 0) + t.nbytes(env)
    return max(per_layer.values(), default=0)


class PlanMemory(Pass):
    name = "plan-memory"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        cuda, weights, copies, seen = ctx.options.device == "cuda", 0, 0, set()
        for op in graph.ops:
            key = (op.kind, op.attr("weight"))
            if op.attr("weight") is not None and key in seen:   # a weight two ops read is held once
                continue
            seen.add(key)
            held, copied = op_weight_bytes(op, ctx.spec.config, ctx.spec.dtypes, cuda)
            weights, copies = weights + held, copies + copied
        rows = [row for op in graph.ops for row in cache_row_bytes(op, graph)]
        kv = [b for index, b in rows if not index]
        idx = [b for index, b in rows if index]
        kv_tok, idx_tok = sum(kv), sum(idx)
        cfg = ctx.spec.config
        memory = {
            "weights_bytes": weights, "weight_copies_bytes": copies,
            "kv_bytes_per_token": kv_tok, "kv_layers": len(kv),
            "index_bytes_per_token": idx_tok, "index_layers": len(idx),
            # scores are produced in tiles of TILE_KEYS keys and merged into a running top-k
            "indexer_workspace_bytes": _rows(graph, ctx) * (TILE_KEYS + 2 * cfg.index_topk) * 4
            if idx else 0,
            "graph_bytes": {str(b): _layer_activation_bytes(graph, {"T": b, "B": b, "S": 1})
                            + b * cfg.vocab_size * 4
                            for b in graph.meta.get("cuda_graph_buckets", [])},
        }
        return graph.with_ops(graph.ops, memory=memory)
