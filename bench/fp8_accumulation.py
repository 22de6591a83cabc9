"""How the FP8 GEMM's tensor-core accumulation sets its error and its speed, per promotion interval.

`fp8_block_gemm` sums each 128-wide K block in one FP8 dot; `promote` (Triton's
`max_num_imprecise_acc`, `triton_render.FP8_DOT_PROMOTE`) is how many of those products the tensor
core may sum before its result joins an fp32 register. For each GLM-5.3 GEMM shape at prefill and
MTP-verify row counts and each promote (128 = Triton's Hopper default for this dot; 64; 32 = one
wgmma; 0 = mma.sync on operands converted to fp16), against the exact product of the same FP8
operands (fp64, on the device):

- `out_of_bound`: the fraction of bf16 outputs farther from it than op_compare's bound (one bf16 ulp
  + 2^-14 of the row's RMS: what `bench.fp8_op_check` holds each FP8 GEMM to);
- `fp32_rel_err`: the fp32 result's relative error (the accumulation alone, before bf16 rounding);
- `acc_bits`: -log2 of the worst fp32 error in units of the sum of |terms| (|x| @ |W|^T, both
  dequantised): the bits the accumulation kept in its worst element, what op_compare's FP8 bound
  (`FP8_ACC_REL`) must stay below;
- `us`: median time of the launch (do_bench, L2 flushed), and its ratio to promote 128.

    python -m bench.fp8_accumulation [--rows 2048,64] [--out fp8_accumulation.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from bench import common

SHAPES = {   # GLM-5.3 tp1 FP8 GEMMs: (N, K)
    "a_proj": (2624, 6144), "q_b": (16384, 2048), "o_proj": (6144, 16384),
    "shared gate_up": (4096, 6144), "dense gate_up": (24576, 6144),
}
PROMOTES = (128, 64, 32, 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="2048,64")
    ap.add_argument("--out")
    a = ap.parse_args()
    import triton.testing as tb
    from glmc.codegen import fp8_ref
    from glmc.codegen import triton_fp8 as tf
    from glmc.runtime.worker.op_compare import bound
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for m in [int(r) for r in a.rows.split(",")]:
        for name, (n, k) in SHAPES.items():
            wq, ws = fp8_ref.quantize_weight_blocks(torch.randn(n, k, device=dev, generator=g) * k ** -0.5)
            xq, xs = tf.quantize_tokens(torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16))
            exact, terms = common.fp8_exact(xq, xs, wq, ws)
            base = None
            for promote in PROMOTES:
                got = tf.fp8_block_gemm(xq, xs, wq, ws, torch.bfloat16, promote=promote)
                got32 = tf.fp8_block_gemm(xq, xs, wq, ws, torch.float32, promote=promote)
                err = (got.double() - exact).abs()
                oob = float((err > bound(exact.float(), torch.bfloat16).double()).double().mean())
                rel32 = float((got32.double() - exact).norm() / exact.norm())
                worst = float(((got32.double() - exact).abs() / terms.clamp_min(1e-300)).max())
                us = 1e3 * tb.do_bench(lambda: tf.fp8_block_gemm(xq, xs, wq, ws, torch.bfloat16, promote=promote),
                                       warmup=10, rep=50, return_mode="median")
                base = base or us
                row = {"rows": m, "gemm": name, "n": n, "k": k, "promote": promote, "out_of_bound": oob,
                       "fp32_rel_err": rel32,
                       "acc_bits": round(-math.log2(worst), 2) if worst else None, "us": round(us, 2), "vs_promote_128": round(us / base, 3),
                       "tflops": round(2 * m * n * k / us / 1e6, 1)}
                print(json.dumps(row), flush=True)
                rows_out.append(row)
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "commit": os.environ.get("GLMC_COMMIT", "unknown"), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "rows": rows_out}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
