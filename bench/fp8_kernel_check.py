"""Each FP8 kernel on the GPU against codegen/fp8_ref.py (the torch reference, on the host), at the
CI test shapes and at GLM-5.3 shapes; prints one JSON line per case and a verdict.

    python -m bench.fp8_kernel_check [--out fp8_kernels.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def rel(got, want) -> float:
    return float((got.float().cpu() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


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
        want = fp8_ref.fp8_gemm(xq, xs, wq, ws)
        e = rel(got, want)
        rows.append({"case": f"block_gemm m{m} n{n} k{k} bn{bn}", "rel_err": e, "pass": e < 1e-4})
        gq, gs = tf.quantize_tokens(x.to(dev))
        e2 = rel(tf.fp8_block_gemm(gq, gs, wq.to(dev), ws.to(dev), torch.float32), want)
        rows.append({"case": f"quant+gemm m{m} n{n} k{k}", "rel_err": e2, "pass": e2 < 1e-4})
    for T, E, top_k, hidden, inter, offset in [(5, 4, 2, 160, 96, 0), (3, 3, 2, 128, 256, 2),
                                               (32, 16, 8, 6144, 2048, 0), (256, 32, 8, 1024, 512, 0)]:
        ws = [fp8_ref.Fp8Weight.quantize(torch.randn(E, *shape, generator=g) * shape[1] ** -0.5)
              for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
        x = torch.randn(T, hidden, generator=g)
        ids = torch.randint(0, E + offset, (T, top_k), generator=g)
        w = torch.rand(T, top_k, generator=g)
        got = moe_experts_fp8(x.to(dev), ids.to(dev), w.to(dev), *(q.to(dev) for q in ws), expert_offset=offset)
        want = fp8_ref.moe_experts_fp8(x, ids, w, *ws, expert_offset=offset)
        e = rel(got, want)
        rows.append({"case": f"moe_experts_fp8 T{T} E{E} k{top_k} h{hidden} i{inter} off{offset}", "rel_err": e,
                     "pass": e < 1e-3})
    for r in rows:
        print(json.dumps(r), flush=True)
    ok = all(r["pass"] for r in rows)
    print(f"FP8 KERNEL CHECK: {'PASS' if ok else 'FAIL'} ({sum(r['pass'] for r in rows)}/{len(rows)})")
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
