"""The torch target with an FP8 plan's activation quantisation: the plan-level oracle of the FP8 kernels.

An FP8 plan's CUDA target (`cuda_target`, `triton_fp8`, `triton_moe.moe_experts_fp8`) multiplies
block-FP8 weights by activations quantised per token per 128 columns. The torch target holds the same
weights dequantised in fp32 (`runtime/worker/loader.py`), so the two differ by the activations'
quantisation, which compounds through a random model's layers and routing. `IMPLS` here is the torch
target with that quantisation applied where the CUDA target applies it (`fp8_ref.quantize_token_groups`,
then dequantised: the same values in fp32), so a plan run through it agrees with the CUDA target up to
fp32 summation order:

- linear-type ops: x quantised once for every FP8 weight part; unquantised parts (the indexer's
  weights_proj in the A-projection) see x as it is;
- SwiGLU MLPs: x before gate/up, silu(g) * u before down;
- routed experts: as `fp8_ref.moe_experts_fp8` (h rounded to the activation dtype, then quantised).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from glmc.codegen import torch_target
from glmc.codegen.context import StepContext
from glmc.codegen.fp8_ref import quantize_token_groups
from glmc.codegen.weight_formats import is_fp8_name

IMPLS: dict = dict(torch_target.IMPLS)


impl = torch_target.registry(IMPLS)


def fake_quant(x):
    """x's per-token, per-128-column FP8 values, in fp32."""
    q, s = quantize_token_groups(x.float())
    return q.float() * s.repeat_interleave(128, 1)[:, :x.shape[1]]


@impl("linear", "mla.a_proj")
def _linear(op, args, ctx: StepContext):
    x = args[0].float()
    name = op.attr("weight")
    names = name if isinstance(name, tuple) else (name,)
    xq = fake_quant(x)
    return torch.cat([(xq if is_fp8_name(n) else x) @ ctx.w(n).float().T for n in names], dim=1)


@impl("mlp.swiglu")
def _swiglu(op, args, ctx: StepContext):
    p = op.attr("weight")
    gate, up, down = (ctx.w(f"{p}.{n}_proj.weight").float() for n in ("gate", "up", "down"))
    xq = fake_quant(args[0])
    return fake_quant(F.silu(xq @ gate.T) * (xq @ up.T)) @ down.T


@impl("moe.experts")
def _experts(op, args, ctx: StepContext):
    x, weights, ids = args
    gate, up, down = ctx.experts(op)
    offset, E = ctx.expert_offset(op), gate.shape[0]
    xq = fake_quant(x)
    T, k = ids.shape
    routed = torch.zeros(T * k, down.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1) - offset
    for e in range(E):
        rows = (flat == e).nonzero().flatten()
        if rows.numel():
            xe = xq[rows // k]
            h = F.silu(xe @ gate[e].float().T) * (xe @ up[e].float().T)
            routed[rows] = fake_quant(h) @ down[e].float().T * weights.reshape(-1)[rows, None].float()
    return routed.view(T, k, -1).sum(1)
