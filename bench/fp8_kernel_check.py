"""Each FP8 kernel on the GPU against codegen/fp8_ref.py (the torch reference, on the host), at the
CI test shapes and at GLM-5.3 shapes; prints one JSON line per case and a verdict.

The block GEMM's fp32 result is held per element to its tensor core's accumulation bound
(`op_compare.FP8_ACC_REL` of the sum of |terms|: Hopper's FP8 MMA keeps ~14 bits of a 128-wide K
block's sum) plus fp32 summation order; the FP8 experts to op_compare's SwiGLU bound (an FP8 code
of h next to a rounding boundary may land one step either way). `out_of_bound` counts the rest.

    python -m bench.fp8_kernel_check [--out fp8_kernels.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench import common


def rel(got, want) -> float:
    return float((got.float().cpu() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def gemm_row(case, got, xq, xs, wq, ws) -> dict:
    """The GEMM's fp32 result against the exact product of its FP8 operands, per element."""
    from glmc.runtime.worker.op_compare import FP8_ACC_REL
    exact, terms = common.fp8_exact(xq, xs, wq, ws, got.device)
    err = (got.double() - exact).abs()
    bound = FP8_ACC_REL * terms + 2.0 ** -20 * exact.abs()
    oob = int((err > bound).sum())
    return {"case": case, "rel_err": float(err.norm() / exact.norm()), "out_of_bound": oob, "pass": oob == 0}


def experts_row(case, got, x, ids, w, stacks, offset) -> dict:
    """The FP8 experts against op_compare's SwiGLU bound, from the exact products of x's quantisation."""
    from glmc.codegen import fp8_ref
    from glmc.runtime.worker.op_compare import OpRow, mlp_check
    xq, xs = fp8_ref.quantize_token_groups(x)
    gate, up, down = (s.dequant(torch.float32) for s in stacks)
    flat, wf, k = ids.reshape(-1) - offset, w.reshape(-1), ids.shape[1]
    parts = [(sel // k, gate[e], up[e], down[e], wf[sel]) for e in range(gate.shape[0])
             if (sel := (flat == e).nonzero().flatten()).numel()]
    row = OpRow(op=case, kind="moe.experts", layer=None, result="y", dtype="float32", numel=got.numel())
    mlp_check(row, got.cpu(), xq, xs, x.dtype, parts, torch.device("cpu"))
    return {"case": case, "out_of_bound": row.fp8_out_of_bound, "flip_rows": row.flip_rows,
            "pass": row.fp8_out_of_bound == 0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    from glmc.codegen import fp8_ref
    from glmc.codegen import triton_fp8 as tf
    from glmc.codegen.triton_moe import moe_experts_fp8
    dev, rows = "cuda", []
    g = torch.Generator().manual_seed(0)

    x = torch.randn(7, 300, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    q, s = tf.quantize_tokens(x.to(dev))
    wq_, ws_ = fp8_ref.quantize_token_groups(x)
    same_bytes = torch.equal(q.cpu().view(torch.uint8), wq_.view(torch.uint8))
    rows.append({"case": "quant_tokens 7x300", "bytes_equal": same_bytes,
                 "scales_equal": torch.equal(s.cpu(), ws_), "pass": None})
    rows[-1]["pass"] = rows[-1]["bytes_equal"] and rows[-1]["scales_equal"]
    for m, n, k, bn in [(5, 160, 300, 32), (20, 96, 256, 64), (1, 256, 128, 128), (1, 2048, 6144, None),
                        (32, 2048, 6144, None), (128, 24576, 2048, None), (512, 6144, 16384, None)]:
        w = torch.randn(n, k, generator=g) * 0.05
        wq, ws = fp8_ref.quantize_weight_blocks(w)
        x = torch.randn(m, k, generator=g)
        xq, xs = fp8_ref.quantize_token_groups(x)
        kw = {"block_n": bn} if bn else {}
        got = tf.fp8_block_gemm(xq.to(dev), xs.to(dev), wq.to(dev), ws.to(dev), torch.float32, **kw)
        rows.append(gemm_row(f"block_gemm m{m} n{n} k{k} bn{bn}", got, xq, xs, wq, ws))
        gq, gs = tf.quantize_tokens(x.to(dev))
        got = tf.fp8_block_gemm(gq, gs, wq.to(dev), ws.to(dev), torch.float32)
        rows.append(gemm_row(f"quant+gemm m{m} n{n} k{k}", got, gq, gs, wq, ws))
    for T, E, top_k, hidden, inter, offset in [(5, 4, 2, 160, 96, 0), (3, 3, 2, 128, 256, 2),
                                               (32, 16, 8, 6144, 2048, 0), (256, 32, 8, 1024, 512, 0)]:
        ws = [fp8_ref.Fp8Weight.quantize(torch.randn(E, *shape, generator=g) * shape[1] ** -0.5)
              for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
        x = torch.randn(T, hidden, generator=g)
        ids = torch.randint(0, E + offset, (T, top_k), generator=g)
        w = torch.rand(T, top_k, generator=g)
        got = moe_experts_fp8(x.to(dev), ids.to(dev), w.to(dev), *(q.to(dev) for q in ws), expert_offset=offset)
        want = fp8_ref.moe_experts_fp8(x, ids, w, *ws, expert_offset=offset)
        case = f"moe_experts_fp8 T{T} E{E} k{top_k} h{hidden} i{inter} off{offset}"
        rows.append({**experts_row(case, got, x, ids, w, ws, offset), "rel_err": rel(got, want)})
    for r in rows:
        print(json.dumps(r), flush=True)
    ok = all(r["pass"] for r in rows)
    print(f"FP8 KERNEL CHECK: {'PASS' if ok else 'FAIL'} ({sum(r['pass'] for r in rows)}/{len(rows)})")
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
