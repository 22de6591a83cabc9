"""plan-memory: what one rank holds — weights, KV + indexer cache per token, workspaces, graphs.

Assumes: a lowered, sharded graph with buckets. Guarantees: `meta.memory` with
`weights_bytes` (this phase's graph, one rank, each weight once, as the loader holds it: block-FP8
weights at 1 byte plus a fp32 scale per 128 x 128 block, the indexer's weights_proj inside the FP8
A-projection in the compute dtype, expert weights once in their [E, ...] stacks),
`weight_copies_bytes` (CUDA target: the re-laid-out weights its op table keeps beside the originals,
`_copies`), `kv_bytes_per_token` (c_kv | k_pe per layer, all
layers; an fp8 row is FlashMLA's: e4m3 latent + a fp32 scale per 128 + bf16 k_pe, `costs.kv_row_bytes`),
`index_bytes_per_token` (indexer keys + fp8 scale, full layers only), the layer counts,
and, for the CUDA target, what one step allocates above that (`step_memory`: every op's allocations
replayed in execution order, each value freed after its last use as the executor drops it, 512-byte
blocks, an H200's 132 SMs, a runner of `workspace_context` = 4096 tokens of context):
`workspace_bytes` {bucket: peak} of one eager step (decode, MTP phases; prefill: {chunk: peak} at
its largest chunk, `Options.chunked_prefill` tokens ending at that context; it replaces the earlier
per-layer estimate `graph_bytes`), `indexer_workspace_bytes` (the indexer's fp32 scores, scaled weights and
top-k buffers at the phase's largest step) and (decode) `graph_pool_bytes` (what capturing every
bucket keeps allocated: the graphs' outputs and static inputs, a cuBLAS workspace per stream;
`step_memory.graph_pool`). `glmc explain` recomputes them at its own context.
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
from glmc.target import FP8_BLOCK, H200_SMS, fp8_gemm_rows, fp8_row_groups

from .base import Pass, PassContext
from .costs import cache_row_bytes, params_of, weight_bytes_for
from .step_arena import Target
from .step_memory import graph_pool, step_memory

WORKSPACE_CONTEXT = 4096   # the runner's max_context the plan's workspace numbers assume
BLOCK_BYTES = 512          # the CUDA caching allocator's block: every allocation rounds up to it


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


def _joined_rows(rows: list[int]) -> list[int]:
    """Rows of each weight the CUDA target copies when it joins consecutive FP8 parts into one GEMM
    (`glmc.target.fp8_row_groups`: groups of more than one part, a ragged part padded with zero rows)."""
    return [n for g, (n, _) in zip(fp8_row_groups(rows), fp8_gemm_rows(rows)) if len(g) > 1]


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
        return held, sum(_matrix_bytes(n, cols, True, 1) for n in _joined_rows(fp8_rows))
    if k == "mlp.swiglu":
        inter, hidden = int(a("inter")) // tp, int(a("hidden"))
        one = _matrix_bytes(inter, hidden, fp8, elem)
        copies = (2 * one if not fp8 else sum(_matrix_bytes(n, hidden, True, 1) for n in _joined_rows([inter, inter]))) \
            if cuda else 0
        return 2 * one + _matrix_bytes(hidden, inter, fp8, elem), copies
    if k == "moe.experts":
        experts = int(a("experts")) // int(a("ep", 1))
        inter, hidden = int(a("inter")) // int(a("moe_tp", 1)), int(a("hidden"))
        return experts * (2 * _matrix_bytes(inter, hidden, fp8, elem) + _matrix_bytes(hidden, inter, fp8, elem)), 0
    _, local, _, cls = params_of(op)
    held = local * weight_bytes_for(dtypes)[cls]
    return held, held if cuda and k.startswith("attn.") else 0


def target_of(dtypes, tokens: int, requests: int, max_len: int, num_sms: int = H200_SMS) -> Target:
    """The CUDA target's step at `tokens` x `requests`, indexer scores `max_len` wide, for a plan's dtypes."""
    return Target(4 if dtypes.activation == "fp32" else 2, dtypes.weight == "fp8", dtypes.kv_cache == "fp8",
                  tokens, requests, max_len, num_sms)


def prefill_point(chunk: int, context: int) -> dict:
    """The largest prefill step within `context`: one chunk of `chunk` tokens, whose indexer scores
    `context` positions: one request's chunk ending at `context`, or (context < chunk) chunk /
    context requests of `context` tokens (the last one cut by the chunk)."""
    return {"tokens": chunk, "requests": max(1, -(-chunk // max(1, context))), "max_len": context}


def indexer_workspace(step) -> int:
    """The indexer's own allocations at a step: the largest idx.topk peak above its start."""
    return max((peak - start for op, start, peak, _ in step.regions if op.kind == "idx.topk"), default=0)


def phase_workspaces(graph: Graph, phase: str, dtypes, cfg, chunk: int, context: int,
                     num_sms: int = H200_SMS, rounding: int = BLOCK_BYTES) -> dict:
    """`workspace_bytes`, `indexer_workspace_bytes` and (decode) `graph_pool_bytes` of one phase
    graph of the CUDA target (module docstring); -> also `steps` {key: StepMemory}, `targets`."""
    buckets = graph.meta.get("cuda_graph_buckets") or []
    if phase == "prefill":
        pt = prefill_point(chunk, context)
        targets = {pt["tokens"]: target_of(dtypes, pt["tokens"], pt["requests"], pt["max_len"], num_sms)}
        mode = "prefill"
    else:
        targets = {b: target_of(dtypes, b, b, context, num_sms) for b in buckets}
        mode = "eager"
    steps = {k: step_memory(graph, t, cfg, mode, rounding) for k, t in targets.items()}
    out = {"workspace_bytes": {str(k): m.peak for k, m in steps.items()},
           "indexer_workspace_bytes": indexer_workspace(steps[max(steps)]) if steps else 0,
           "steps": steps, "targets": targets}
    if phase == "decode":
        out["graph_pool"] = graph_pool(steps, targets, rounding)
    return out


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
        memory = {
            "weights_bytes": weights, "weight_copies_bytes": copies,
            "kv_bytes_per_token": kv_tok, "kv_layers": len(kv),
            "index_bytes_per_token": idx_tok, "index_layers": len(idx),
        }
        if cuda:
            memory.update(self._workspaces(graph, ctx))
        return graph.with_ops(graph.ops, memory=memory)

    @staticmethod
    def _workspaces(graph: Graph, ctx: PassContext) -> dict:
        w = phase_workspaces(graph, ctx.phase, ctx.spec.dtypes, ctx.spec.config, ctx.options.chunked_prefill,
                             WORKSPACE_CONTEXT)
        out = {"workspace_bytes": w["workspace_bytes"], "indexer_workspace_bytes": w["indexer_workspace_bytes"],
               "workspace_context": WORKSPACE_CONTEXT}
        if "graph_pool" in w:
            out["graph_pool_bytes"] = w["graph_pool"]["allocated"]
        return out
