"""The small kernels between the GEMMs of a decode step, alone (CUDA-graph replays, us, median):

    python -m bench.glue_micro --out-dir $OUT --commit <sha>

- MoE row alignment (`triton_moe.align_rows`): the moe_align kernel at each rows-per-program x warps,
  launched directly, against the torch ops, top-8 of 256 experts, 8 .. 4096 routed rows (8192: the
  torch ops only, past ALIGN_ROWS), and over 32 local experts (a dp8ep8 rank: row blocks of 32 and 64);
- the decode GEMVs (`triton_launch.gemv`): the router's fp32 [256, 6144] and weights_proj's bf16
  [32, 6144] at 1, 4, 16, 32 rows, each tile (columns per program x K step x warps) against cuBLAS;
- past the gemv's rows (`triton_launch.narrow_gemm`, into a column slice): the same two weights at
  32, 128, 4096 rows (tiles x stages x split floors swept) against what cuBLAS took there (the router's cast + fp32 GEMM; weights_proj's
  bf16 GEMM + copy into the A-projection's columns), with its relative error to an fp64 product;
- the greedy sampler of `sample.tokens`: the split argmax (`sample_greedy`) against the one-program
  sampler at temperature 0 (`sample`), vocab 154880, B = 1, 32, 128;
- the top-k select of a short row (`topk_select`, k 2048, the plan's 8192-score pass): rows of 1025
  (a copy: n <= k) and 4000 / 8000 scores (32 counting passes) at 4 .. 32 warps, B = 1, 32.
Writes glue_micro_<date>.json. Measures; changes nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from bench import common


def us(fn):
    return round(common.bench_ms(fn) * 1e3, 2)


def narrow_tiles(M: int, n: int) -> list:
    """(block_m, block_n, block_k, warps, stages) of narrow_gemm to try at M rows of n columns."""
    bms = [b for b in (16, 32, 64) if b <= max(16, M)] if M <= 64 else [64, 128]
    bns = [b for b in (32, 64) if b <= max(32, n)]
    return [(bm, bn, bk, w, st) for bm in bms for bn in bns for bk in (32, 64, 128) for w in (4,) for st in (2, 3)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--parts", default="align,gemv,argmax,topk", help="comma-separated: align, gemv, narrow, argmax, topk")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    import torch
    from glmc.codegen import triton_moe as tm
    from glmc.codegen import triton_launch as tt
    from glmc.codegen.triton_fp8 import even_splits
    from glmc.codegen.launch_model import TOPK_CHUNK
    from glmc.codegen.triton_render import JIT
    dev = "cuda"
    res = {"info": {"device": torch.cuda.get_device_name(), "commit": args.commit,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__}}
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    # (routed rows, local experts): top-8 of 256 experts on one rank, and a dp8ep8 rank's 32 experts
    # (its gathered rows: 64 a request per rank), whose row block grows with the rows (block_m_for)
    for n, E in ([(8, 256), (64, 256), (256, 256), (1024, 256), (2048, 256), (4096, 256), (8192, 256),
                  (512, 32), (1024, 32), (2048, 32), (4096, 32)] if "align" in parts else ()):
        ids = torch.stack([torch.randperm(256, device=dev, generator=g)[:8] for _ in range(n // 8)])
        bm = tm.block_m_for(n, E)
        r = {"rows": n, "experts": E, "block_m": bm, "torch_us": us(lambda: tm.align_rows(ids, E, bm))}
        want = tm.align_rows(ids, E, bm)
        for chunk in (16, 32, 64) if n <= tm.ALIGN_ROWS else ():
            for warps in (4, 8):
                ctx = tm.MoeAlignCtx.make(chunk, warps, num_rows=n)
                nb = tm.num_blocks_bound(n, E, bm)
                sr = torch.full((nb * bm,), -7, dtype=torch.int32, device=dev)
                be = torch.full((nb,), -7, dtype=torch.int32, device=dev)
                k = JIT(ctx)

                def run():
                    k[ctx.grid(n)](ids, sr, be, n, nb, E, 0, ids, -1, 8, bm, False, num_warps=warps)
                run()
                ok = torch.equal(sr, want[0]) and torch.equal(be, want[1])
                r[f"kernel_c{chunk}_w{warps}_us"] = us(run) if ok else "WRONG"
        rows.append(r)
        print("align", r, flush=True)
    res["align"] = rows
    rows = []
    # the decode GEMVs: the router (fp32 [256, 6144]) and weights_proj (bf16 [32, 6144]) against cuBLAS
    for M in (1, 4, 16, 32) if "gemv" in parts else ():
        x = torch.randn(M, 6144, device=dev, generator=g).to(torch.bfloat16)
        for name, w in (("router", torch.randn(256, 6144, device=dev, generator=g)),
                        ("weights_proj", torch.randn(32, 6144, device=dev, generator=g).to(torch.bfloat16))):
            want = x.double() @ w.double().T
            r = {"rows": M, "weight": name, "cublas_us": us(lambda: x.float() @ w.T if w.dtype == torch.float32
                                                             else (x @ w.T).float()),
                 "default": str(tt.GemvCtx.make(6144, M)), "default_us": us(lambda: tt.gemv(x, w, out_dtype=torch.float32))}
            for bn in (1, 2, 4, 8):
                for bk in (64, 128, 256):
                    for warps in (2, 4, 8):
                        ctx = tt.GemvCtx(6144, tt.GemvCtx.make(6144, M).block_m, bn, bk, warps)
                        y = torch.empty(M, w.shape[0], device=dev)
                        k = JIT(ctx)

                        def run():
                            k[(-(-w.shape[0] // bn),)](x, x.stride(0), w, y, y.stride(0), M, w.shape[0], num_warps=warps)
                        run()
                        ok = (y.double() - want).abs().max().item() < 1e-2
                        r[f"n{bn}_k{bk}_w{warps}_us"] = us(run) if ok else "WRONG"
            rows.append(r)
            best = min((v, k) for k, v in r.items() if k.endswith("_us") and isinstance(v, float) and k[0] == "n")
            print("gemv", {k: r[k] for k in ("rows", "weight", "cublas_us", "default", "default_us")}, "best", best,
                  flush=True)
    res["gemv"] = rows
    rows = []
    # past the gemv's rows: narrow_gemm (x read as it is, K split, the partials reduced) against cuBLAS
    # as the CUDA target ran it (the router: x.float() then an fp32 GEMM; weights_proj: a bf16 GEMM into a
    # temporary copied into the A-projection's columns)
    for M in (32, 128, 4096) if "narrow" in parts else ():
        x = torch.randn(M, 6144, device=dev, generator=g).to(torch.bfloat16)
        for name, w in (("router", torch.randn(256, 6144, device=dev, generator=g)),
                        ("weights_proj", torch.randn(32, 6144, device=dev, generator=g).to(torch.bfloat16))):
            want = x.double() @ w.double().T
            wide = torch.empty(M, 2816, dtype=torch.float32 if name == "router" else torch.bfloat16, device=dev)
            cols = wide[:, 2816 - w.shape[0]:]
            old = (lambda: x.float() @ w.T) if name == "router" else (lambda: cols.copy_(x @ w.T))
            y = tt.narrow_gemm(x, w, out=cols)
            err = float((y.double() - want).abs().max() / want.abs().max())
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            r = {"rows": M, "weight": name, "cublas_us": us(old), "narrow_us": us(lambda: tt.narrow_gemm(x, w, out=cols)),
                 "splits": tt.narrow_splits(M, w.shape[0], 6144, sms), "rel_err": err}
            for bm, bn, bk, warps, stages in narrow_tiles(M, w.shape[0]):
                ctx = dataclasses.replace(tt.NarrowGemmCtx.make(w.shape[0], 6144, w.dtype), block_m=bm, block_n=bn,
                                          block_k=bk, k_blocks=-(-6144 // bk), n_tiles=-(-w.shape[0] // bn),
                                          num_warps=warps, num_stages=stages)
                tiles = -(-M // bm) * ctx.n_tiles
                for min_blocks in (2, 8):   # the split count narrow_splits' rule gives at this split floor
                    splits = even_splits(ctx.k_blocks, max(1, min(-(-sms // tiles), ctx.k_blocks // min_blocks, 64)))

                    def run():
                        tt.narrow_gemm(x, w, out=cols, splits=splits, ctx=ctx)
                    try:
                        run()
                        ok = float((cols.double() - want).abs().max() / want.abs().max()) < 1e-2
                        r[f"m{bm}_n{bn}_k{bk}_w{warps}_s{stages}_b{min_blocks}({splits})_us"] = us(run) if ok else "WRONG"
                    except Exception as e:   # out of resources: recorded
                        r[f"m{bm}_n{bn}_k{bk}_w{warps}_s{stages}_b{min_blocks}"] = str(e)[:80]
            best = sorted((v, k) for k, v in r.items() if k.startswith("m") and isinstance(v, float))[:4]
            rows.append(r)
            print("narrow", {k: r[k] for k in ("rows", "weight", "cublas_us", "narrow_us", "splits", "rel_err")},
                  "best", best, flush=True)
    res["narrow"] = rows
    rows = []
    for B in (1, 32, 128) if "argmax" in parts else ():
        x = torch.randn(B, 154880, device=dev, generator=g)
        z = torch.zeros(B, device=dev)
        old = lambda: tt.sample(x, z, z.long(), z + 1.0, z, z.long(), z.long())  # noqa: E731
        r = {"batch": B, "one_program_us": us(old), "split_us": us(lambda: tt.sample_greedy(x)),
             "same": bool(torch.equal(old(), tt.sample_greedy(x))), "torch_argmax_us": us(lambda: x.argmax(-1))}
        rows.append(r)
        print("argmax", r, flush=True)
    res["argmax"] = rows
    rows = []
    for n in (1025, 4000, 8000) if "topk" in parts else ():
        for B in (1, 32):
            scores = torch.randn(B, n + 63, device=dev, generator=g)
            lens = torch.full((B,), n, device=dev, dtype=torch.int64)
            r = {"n": n, "batch": B}
            want = tt.topk_select(scores, lens, 2048, TOPK_CHUNK)
            for warps in (4, 8, 16, 32):
                got = tt.topk_select(scores, lens, 2048, TOPK_CHUNK, num_warps=warps)
                r[f"w{warps}_us"] = us(lambda: tt.topk_select(scores, lens, 2048, TOPK_CHUNK, num_warps=warps)) \
                    if torch.equal(got, want) else "WRONG"
            rows.append(r)
            print("topk", r, flush=True)
    res["topk_short"] = rows
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"glue_micro_{time.strftime('%Y-%m-%d')}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
