"""The kernels of a CUDA-target plan: every Triton kernel context its ops can ask for, rendered.

`plan_kernels(plan)` walks each phase's ops and lists, per op kind (`KERNELS_OF`), the contexts the
CUDA target's launch wrappers (`cuda_target` -> `triton_launch`, `triton_moe`) build for any step
the runtime can run. That set is small and known at compile time because a kernel's source depends
only on the model's shapes, the compute dtype and a few tile classes; the batch, the context length
and the GPU choose grids and split counts at launch:

- sparse MLA decode: the head-major tile for < 32 tokens and, with >= 64 heads on the rank, the
  wide one (>= 32 tokens); its split-K combine: one per power-of-two split bound (<= MAX_SPLITS);
- MoE experts: gate/up and down at each row-block class (16, 32, 64 rows);
- an unquantised SwiGLU's activation between its cuBLAS GEMMs (`silu_mul`);
- the router's fp32 GEMV (and an FP8 A-projection's unquantised weights_proj) at decode sizes: one
  `gemv` per row class (1, 4, 16 rows); above them the router's `narrow_gemm` (its split count a
  launch argument) and the split reduction;
- top-k select: one pass width (TOPK_CHUNK); at the full vocabulary the split greedy argmax (the
  IR's `sample.tokens`) and the engine's per-request sampler;
- FP8 weights (a plan whose `dtypes.weight` is fp8, `weight_formats`): per linear-type op the token
  quantiser at its input width and the block-scaled GEMM per joined FP8 part (`cuda_target.fp8_parts`)
  at each row class (`Fp8BlockGemmCtx.variants`: decode and wider tiles, and the split-K reduction;
  the split count is a launch argument); the routed experts' FP8 grouped GEMMs instead of the bf16 ones. A bf16 plan
  carries none of them.
- peer-memory collectives: the one-shot all-reduce / reduce-scatter (+ add + RMSNorm) / all-gather
  of each collective that select-collective-backend gave a `p2p_max_bytes` (larger messages: NCCL);
- FP8 KV (a plan whose `dtypes.kv_cache` is fp8, `kv_fp8`): the KV-write, indexer-scores and sparse
  MLA kernels in their FP8-cache variants (quantise / dequantise in registers) instead of the plain
  ones; the indexer cache follows `dtypes.index_cache`.

`render_kernels(plan)` names them `<template>_<n>` and renders each: `glmc compile --device cuda`
writes them to `kernels/<name>.py` with their contexts in plan.json, and the runtime runs exactly
those files (`triton_render.KernelLibrary.from_plan`: a context missing from the plan is an error,
so a drift between this table and the wrappers fails loudly, in the tests that run plans).
"""
from __future__ import annotations

import torch
from glmc.codegen import torch_ref as ref
from glmc.codegen import triton_contexts as tc
from glmc.codegen.triton_fp8 import Fp8BlockGemmCtx, Fp8QuantTokensCtx, Fp8SplitReduceCtx
from glmc.codegen.triton_moe import MoeExpertsCtx, MoeExpertsFp8Ctx
from glmc.codegen.weight_formats import FP8_KINDS, is_fp8_name, op_weight_names
from glmc.codegen.triton_render import render
from glmc.ir import Graph, Op
from glmc.ir.types import fp8_row_bytes
from glmc.target import TOPK_CHUNK, fp8_gemm_rows


def compute_dtype(dtypes) -> torch.dtype:
    """Weights, activations and KV in the CUDA target: fp32 for an fp32 plan, else bf16 (the router
    stays fp32 either way)."""
    return torch.float32 if dtypes.activation == "fp32" else torch.bfloat16


def kv_fp8(dtypes) -> tuple[bool, bool]:
    """(latent cache FP8, indexer cache FP8) on the CUDA target: the plan's dtypes say so."""
    return dtypes.kv_cache == "fp8", dtypes.index_cache == "fp8"


def _dims(graph: Graph, value: str) -> list[int]:
    """The static dims of a value's type (the token dim `T` and other symbols dropped)."""
    return [int(d.coeff) for d in graph.type_of(value).shape if d.sym is None]


# norms that add a residual first (the fused collectives' add + RMS norm after NCCL included)
RESIDUAL_NORMS = ("fused.add_rms", "fused.allreduce_add_rms", "fused.reduce_scatter_add_rms")


def _rms(op, graph, dtype, kv=(False, False)):
    return [tc.RmsNormCtx.make(_dims(graph, op.results[0])[-1], op.attr("eps"), op.kind in RESIDUAL_NORMS,
                               has_addend=len(op.operands) == 3)]


def _rope(op, graph, dtype, kv=(False, False)):
    *heads, dim = _dims(graph, op.operands[0])
    return [tc.RopeCtx.make(heads[0] if heads else 1, dim, int(op.attr("dims")), op.attr("interleaved", True),
                         ref.rope_attention_factor(op.attr("scaling")))]


def _qkv(op, graph, dtype, kv=(False, False)):
    index = op.kind.endswith("_index")
    return [tc.QkvNormRopeWriteCtx.make(
        int(op.attr("q_lora")), int(op.attr("kv_lora")), int(op.attr("rope_dim")), op.attr("eps"),
        op.attr("interleaved", True), int(op.attr("index_dim")) if index else 0,
        op.attr("index_eps") if index else 1e-6, op.attr("index_interleaved", True) if index else True,
        ref.rope_attention_factor(op.attr("scaling")), kv[0], kv[1])]


def _topk(op, graph, dtype, kv=(False, False)):
    heads, dim = _dims(graph, op.operands[0])
    scale, rope = ref.index_head_scale(op), tc.QueryRope.of(op)
    return [tc.IndexerScoresCtx.make(heads, dim, dtype, fp8=kv[1], w_scale=scale, rope=rope),
            tc.IndexerScoresCtx.make_tiled(heads, dim, dtype, fp8=kv[1], w_scale=scale, rope=rope),
            tc.TopkSelectCtx.make(int(op.attr("k")), chunk=TOPK_CHUNK)]


def _attn(op, graph, dtype, kv=(False, False)):
    heads = int(op.attr("heads")) // int(op.attr("tp", 1))
    kv_lora = int(op.attr("kv_lora"))
    topk = _dims(graph, op.operands[3])[-1] if len(op.operands) > 3 else None
    return (tc.SparseMlaDecodeCtx.variants(heads, kv_lora, int(op.attr("dr")), topk, op.attr("scale"), dtype, kv[0],
                                           tc.QueryRope.of(op)) + tc.MlaCombineCtx.variants(heads, kv_lora))


def _router(op, graph, dtype, kv=(False, False)):
    return [tc.MoeRouterCtx.make(_dims(graph, op.operands[0])[-1], int(op.attr("n_group")), int(op.attr("topk_group")),
                              int(op.attr("top_k")), op.attr("norm_topk_prob"), op.attr("scale"))]


def _experts(op, graph, dtype, kv=(False, False)):
    """Routes per row from the ids operand: top_k, or 1 after an a2a dispatch (one row per route)."""
    inter = int(op.attr("inter")) // int(op.attr("moe_tp", 1))
    return MoeExpertsCtx.variants(int(op.attr("hidden")), inter, _dims(graph, op.operands[2])[-1], dtype)


def _gate(op, graph, dtype, kv=(False, False)):
    """The fp32 router GEMV at decode sizes, above them the narrow GEMM and its split reduction."""
    k = int(op.attr("hidden"))
    return tc.GemvCtx.variants(k) + [tc.NarrowGemmCtx.make(int(op.attr("experts")), k, torch.float32),
                                     Fp8SplitReduceCtx.make()]


def _swiglu(op, graph, dtype, kv=(False, False)):
    """Unquantised weights: the activation between the two cuBLAS GEMMs (FP8: `_fp8_swiglu`)."""
    return [tc.SiluMulCtx.make(int(op.attr("inter")) // int(op.attr("tp", 1)))]


def _sample(op, graph, dtype, kv=(False, False)):
    vocab = _dims(graph, op.operands[0])[-1]
    return [tc.SampleCtx.make(vocab), tc.ArgmaxCtx.make(vocab)]


def _p2p(op, graph, dtype, kv=(False, False)):
    """The one-shot peer-memory collective where select-collective-backend allowed it (else NCCL);
    an FP8 dispatch also quantises x."""
    n, width = int(op.attr("size")), _dims(graph, op.operands[0])[-1]
    fp8 = op.kind == "moe.dispatch" and op.attr("dtype") == "fp8"
    if op.attr("p2p_max_bytes") is None:
        return [Fp8QuantTokensCtx.make(width)] if fp8 else []
    if fp8:   # e4m3 x + its scales per 128, weight, id
        return [Fp8QuantTokensCtx.make(width),
                tc.P2pAllReduceCtx.make(n, fp8_row_bytes(width) + 8, None, False, True, False, True)]
    if op.kind == "moe.dispatch":   # one byte row per slot: x's bytes (compute dtype, or fp32 from a torch op), weight, id
        return [tc.P2pAllReduceCtx.make(n, width * b + 8, None, False, True, False, True)
                for b in sorted({dtype.itemsize, 4})]
    if op.kind == "moe.combine":
        return [tc.P2pAllReduceCtx.make(n, width, None, False, True, False, True)]
    fused, scatter = op.kind.startswith("fused."), "reduce_scatter" in op.kind
    return [tc.P2pAllReduceCtx.make(int(op.attr("size")), _dims(graph, op.operands[0])[-1],
                                    op.attr("eps") if fused else None, fused, scatter, op.kind == "comm.all_gather")]


def _fused_reduce(op, graph, dtype, kv=(False, False)):
    """A reduction fused with add + RMS norm: the one-shot kernel where the plan allows it, and the
    add + RMS norm kernel after NCCL for the messages above that (`cuda_target._reduce`)."""
    return _p2p(op, graph, dtype, kv) + _rms(op, graph, dtype, kv)


# op kind -> the kernel contexts its CUDA implementation can launch
KERNELS_OF = {
    "norm.rms": _rms, "fused.add_rms": _rms, "rope.apply": _rope,
    "fused.qkv_a_norm_rope_write": _qkv, "fused.qkv_a_norm_rope_write_index": _qkv,
    "idx.topk": _topk, "attn.mla_absorbed": _attn, "attn.sparse_mla": _attn, "attn.mla_mha": _attn,
    "moe.gate": _gate, "moe.topk": _router, "moe.experts": _experts, "sample.tokens": _sample, "mlp.swiglu": _swiglu,
    "comm.all_reduce": _p2p, "comm.reduce_scatter": _p2p, "fused.allreduce_add_rms": _fused_reduce,
    "fused.reduce_scatter_add_rms": _fused_reduce, "comm.all_gather": _p2p, "moe.dispatch": _p2p, "moe.combine": _p2p,
}
# CUDA implementations that launch no Triton kernel (cuBLAS, torch ops, NCCL)
NO_TRITON = frozenset({
    "io.input", "elt.add", "tensor.slice", "tensor.view", "tensor.concat", "tensor.shard", "tensor.select_last",
    "mem.kv_write", "mem.index_k_write", "comm.broadcast", "embed.lookup", "norm.layer",
    "linear", "mla.a_proj", "lm.head",
})


def _fp8_gemms(k: int, rows: list) -> list:
    """x [T, k] times row parts (their row counts; None for an unquantised part): the quantiser,
    one GEMM per joined run of FP8 parts, as `cuda_target.fp8_parts` joins them, and the decode
    GEMV of the unquantised parts."""
    out, run = [Fp8QuantTokensCtx.make(k)], []
    if None in rows:
        out += tc.GemvCtx.variants(k)
    for r in rows + [None]:
        if r is not None:
            run.append(r)
            continue
        for n, pad in fp8_gemm_rows(run):
            out += Fp8BlockGemmCtx.variants(n, k, gapped=pad > 0)
        run = []
    return out


def _a_proj_rows(name: str, config) -> int:
    """Rows of one A-projection part (`mla.a_proj`'s weight tuple) in the checkpoint."""
    c = config
    rows = {"q_a_proj.weight": c.q_lora_rank, "kv_a_proj_with_mqa.weight": c.kv_lora_rank + c.qk_rope_head_dim,
            "indexer.wk.weight": c.index_head_dim, "indexer.weights_proj.weight": c.index_n_heads}
    return next(r for suffix, r in rows.items() if name.endswith(suffix))


def _fp8_linear(op, graph, dtype, config):
    if op.kind == "mla.a_proj":
        names = op_weight_names(op)
        return _fp8_gemms(_dims(graph, op.operands[0])[-1],
                          [_a_proj_rows(n, config) if is_fp8_name(n) else None for n in names])
    return _fp8_gemms(_dims(graph, op.operands[0])[-1], [_dims(graph, op.results[0])[-1]])


def _fp8_swiglu(op, graph, dtype, config):
    """gate/up (joined or apart), their split reduction with SwiGLU + quantisation, down (its input
    comes quantised: no quantiser at the intermediate width)."""
    hidden, inter = int(op.attr("hidden")), int(op.attr("inter")) // int(op.attr("tp", 1))
    # the gate/up GEMMs store fp32 partials, a padded gate's zero columns included: never gapped
    gate_up = [c for n, _ in fp8_gemm_rows([inter, inter]) for c in Fp8BlockGemmCtx.variants(n, hidden)]
    return ([Fp8QuantTokensCtx.make(hidden)] + gate_up + [Fp8SplitReduceCtx.make(inter, dtype)]
            + _fp8_gemms(inter, [hidden])[1:])


def _fp8_experts(op, graph, dtype, config):
    inter = int(op.attr("inter")) // int(op.attr("moe_tp", 1))
    hidden = int(op.attr("hidden"))
    return [Fp8QuantTokensCtx.make(hidden)] + MoeExpertsFp8Ctx.variants(hidden, inter,
                                                                         _dims(graph, op.operands[2])[-1], dtype)


def _fp8_rms(op, graph, dtype, config):
    """A norm whose output an FP8 GEMM reads quantises it too up to NORM_QUANT_ROWS rows, above
    them the plain norm runs (`cuda_target._norm_quantises`)."""
    value = op.results[0]
    quant = any(u.operands[0] == value and u.kind in FP8_KINDS and any(map(is_fp8_name, op_weight_names(u)))
                for u in graph.users(value))
    forms = (True, False) if quant else (False,)
    return [tc.RmsNormCtx.make(_dims(graph, value)[-1], op.attr("eps"), op.kind in RESIDUAL_NORMS, q,
                               len(op.operands) == 3) for q in forms]


def _fp8_fused_reduce(op, graph, dtype, config):
    """`_fused_reduce` where the norm's readers are FP8 GEMMs: its norm in `_fp8_rms`' forms."""
    return _p2p(op, graph, dtype) + _fp8_rms(op, graph, dtype, config)


# op kind -> its kernel contexts when the plan stores its weights FP8 (`weight_formats.FP8_KINDS`)
FP8_KERNELS_OF = {"linear": _fp8_linear, "mla.a_proj": _fp8_linear, "mlp.swiglu": _fp8_swiglu,
                  "moe.experts": _fp8_experts, "norm.rms": _fp8_rms, "fused.add_rms": _fp8_rms,
                  "fused.allreduce_add_rms": _fp8_fused_reduce, "fused.reduce_scatter_add_rms": _fp8_fused_reduce}


def op_kernels(op: Op, graph: Graph, dtype: torch.dtype, fp8_config=None, kv=(False, False)) -> list:
    """The kernel contexts `op`'s CUDA implementation may launch; `fp8_config` (the plan's config
    when its weights are FP8) selects the FP8 kernels of the ops in FP8_KERNELS_OF, `kv`
    (`kv_fp8`) the FP8-cache variants of the attention kernels."""
    if fp8_config is not None and op.kind in FP8_KERNELS_OF:
        return FP8_KERNELS_OF[op.kind](op, graph, dtype, fp8_config)
    if op.kind in NO_TRITON:
        return []
    if op.kind not in KERNELS_OF:
        raise ValueError(f"{op.where()}: the CUDA target has no kernel list for {op.kind!r}")
    return KERNELS_OF[op.kind](op, graph, dtype, kv)


def plan_kernels(plan) -> dict[str, object]:
    """{name: context} of every kernel the plan's CUDA target can launch, named `<template>_<n>`
    in order of first use (phase by phase, op by op)."""
    dtype = compute_dtype(plan.dtypes)
    fp8_config = plan.config if plan.dtypes.weight == "fp8" else None
    seen: dict = {tc.StepInputsCtx.make(): None}     # the executor's prologue of every step
    for graph in plan.graphs.values():
        for op in graph.ops:
            for ctx in op_kernels(op, graph, dtype, fp8_config, kv_fp8(plan.dtypes)):
                seen.setdefault(ctx, None)
    counts: dict[str, int] = {}
    out = {}
    for ctx in seen:
        n = counts[ctx.template] = counts.get(ctx.template, -1) + 1
        out[f"{ctx.template}_{n}"] = ctx
    return out


def render_kernels(plan) -> None:
    """Fill `plan.kernels` (name -> source) and `plan.kernel_contexts` (name -> repr of the context)."""
    kernels = plan_kernels(plan)
    plan.kernels = {name: render(ctx.template, ctx) for name, ctx in kernels.items()}
    plan.kernel_contexts = {name: repr(ctx) for name, ctx in kernels.items()}
