"""Which weights a plan stores block-FP8: the one statement the kernel set, plan.json, `glmc explain`
and the loader all read.

A plan whose `dtypes.weight` is "fp8" keeps the weights of the ops in `FP8_KINDS` as float8_e4m3fn
with a fp32 scale per 128 x 128 block (`fp8_ref.Fp8Weight`), as GLM-5 / DeepSeek-V3 FP8 checkpoints
ship them: the dense linears (q_b_proj, o_proj, the indexer's wq_b, MTP's eh_proj), the A-projection
(q_a, kv_a, the indexer's wk), the dense and shared-expert MLPs and the routed experts. Everything
else is in the compute dtype (bf16; fp32 for fp32 plans) or fp32:

- embedding, lm_head, norms: bf16, as the checkpoint ships them;
- the indexer's weights_proj: bf16 (unquantised in the checkpoint; its output is used in fp32);
- kv_b_proj: dequantised to bf16 at load, since absorbed MLA multiplies per head by W_UK and W_UV
  (batched GEMMs whose 192- and 256-row head slices do not fall on 128-row scale blocks), as SGLang does;
- the router (mlp.gate, its bias): fp32.

The loader conforms to this: FP8 tensors of these weights stay FP8, unquantised ones are quantised
on load (`--quantize fp8` compiles a bf16 checkpoint's plan with fp8 weights), and FP8 tensors of
any other weight are dequantised. The torch target holds the same values dequantised in fp32.
"""
from __future__ import annotations

from glmc.ir import Op
from glmc.target import FP8_KINDS, UNQUANTISED

FORMAT = "fp8_e4m3, fp32 scale per 128x128 block"


def op_weight_names(op: Op) -> list[str]:
    """HF names of the weights of an op in FP8_KINDS (every expert for moe.experts), in the order
    the op's implementation concatenates their rows."""
    w = op.attr("weight")
    if op.kind == "mlp.swiglu":
        return [f"{w}.{p}_proj.weight" for p in ("gate", "up", "down")]
    if op.kind == "moe.experts":
        return [f"{w}.{e}.{p}_proj.weight" for e in range(int(op.attr("experts"))) for p in ("gate", "up", "down")]
    return list(w) if isinstance(w, tuple) else [w]


def is_fp8_name(name: str) -> bool:
    """Whether a weight of an FP8 op is itself FP8 (not one of `UNQUANTISED`)."""
    return not name.endswith(UNQUANTISED)


def fp8_weights(plan) -> frozenset[str]:
    """Every weight name the plan stores FP8 (empty unless `plan.dtypes.weight` is fp8)."""
    if plan.dtypes.weight != "fp8":
        return frozenset()
    return frozenset(n for g in plan.graphs.values() for op in g.ops if op.kind in FP8_KINDS
                     for n in op_weight_names(op) if is_fp8_name(n))


def weight_formats(plan) -> dict:
    """plan.json's and `glmc explain`'s statement of how the runtime holds the weights."""
    compute = "fp32" if plan.dtypes.activation == "fp32" else "bf16"
    if plan.dtypes.weight != "fp8":
        return {"linear_weights": plan.dtypes.weight, "fp8_ops": [], "compute": compute}
    held = FORMAT if plan.target == "cuda" else f"{FORMAT}, held dequantised in fp32 (torch target)"
    return {"linear_weights": held, "fp8_ops": list(FP8_KINDS), "fp8_tensors": len(fp8_weights(plan)),
            "not_fp8": ["embed, lm_head, norms: " + compute, "indexer.weights_proj: " + compute,
                        "kv_b_proj (attn.*): " + compute + ", dequantised at load", "mlp.gate: fp32"],
            "compute": compute}
