"""Tile sweep of the sparse-MLA decode kernel on FP8 and bf16 rows at GLM-5.3 shapes (64 heads, or
--heads: a tp8 rank's 8; latent 512, rope 64, top-k 2048), per token count: which (key_major,
block_h, block_n, warps, stages) is fastest, against the plan's default (`SparseMlaDecodeCtx.make`).

    python -m bench.mla_tiles_sweep --out-dir $OUT [--tokens 1,8,32,128]
    python -m bench.mla_tiles_sweep --out-dir $OUT --focus     # FP8 rows: the two best tiles of the full
        sweep x fp16 dot operands (dot16) x split counts (1x / 2x / 4x mla_num_splits')
    python -m bench.mla_tiles_sweep --out-dir $OUT --dequant --tokens 1,8,32,128 --contexts 1024,2048
        # FP8 rows scaled once per gathered tile (one dot over the latent dim) against the per-group
        # kernel, head- and key-major, 16-64 heads, 1-2 stages; contexts below k select fewer keys
    python -m bench.mla_tiles_sweep --out-dir $OUT --splits --tokens 32,128 --contexts 1024,2048
        # the default tiles at split counts 1 .. 64 against mla_num_splits' (the split partials are
        # [T, H, S, 512] fp32, written by the kernel and read back by mla_combine)
    python -m bench.mla_tiles_sweep --out-dir $OUT --parts --tokens 1,128 --contexts 1024,2048
        # the latent output in v_parts 1/2/4 column parts per head block (a smaller accumulator, fewer
        # spills) x head-major tiles x stages, FP8 rows scaled per tile and bf16; at T < 32 also split counts
    python -m bench.mla_tiles_sweep --out-dir $OUT --tokens 128,8192 --tiles 0:32:64:8:2,1:32:64:8:2:1:1
        # the given tiles (key_major:block_h:block_n:warps:stages[:v_parts[:dot16]]), FP8 rows scaled
        # per tile and bf16 (dot16 applies to FP8 rows only)

Each row records the compiled binary's registers and spills (Triton's n_regs / n_spills).
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="/tmp/mla_tiles_sweep")
    ap.add_argument("--tokens", default="32,128")
    ap.add_argument("--budget", type=float, default=200)
    ap.add_argument("--focus", action="store_true", help="FP8 rows: best tiles x dot16 x split counts")
    ap.add_argument("--dequant", action="store_true", help="FP8 rows: per-tile scaling vs per-group dots")
    ap.add_argument("--parts", action="store_true", help="v_parts 1/2/4 x head-major tiles, FP8 and bf16")
    ap.add_argument("--splits", action="store_true", help="the default tiles x split counts 1 .. 64 (kernel + combine)")
    ap.add_argument("--contexts", default="2048", help="token positions + 1 (2048 and up: all k keys)")
    ap.add_argument("--tiles", default="", help="comma list of key_major:block_h:block_n:warps:stages"
                    "[:v_parts[:dot16]] to measure")
    ap.add_argument("--heads", type=int, default=64, help="query heads (a tp8 rank of GLM-5.3 holds 8)")
    a = ap.parse_args()
    import torch
    import triton.testing as tb
    from glmc.codegen import fp8_ref
    from glmc.codegen import triton_launch as tt
    t_end = time.perf_counter() + a.budget
    H, R, DR, K = a.heads, 512, 64, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_total = 128 * K
    c_kv = torch.randn(rows_total, R, device="cuda", generator=g).to(torch.bfloat16)
    k_pe = torch.randn(rows_total, DR, device="cuda", generator=g).to(torch.bfloat16)
    caches = {"bf16": torch.cat([c_kv, k_pe], 1), "fp8": fp8_ref.kv_fp8_pack(c_kv, k_pe)}
    res = []
    for T, n_ctx in itertools.product([int(x) for x in a.tokens.split(",")],
                                      [int(x) for x in a.contexts.split(",")]):
        q_lat = torch.randn(T, H, R, device="cuda", generator=g).to(torch.bfloat16)
        q_pe = torch.randn(T, H, DR, device="cuda", generator=g).to(torch.bfloat16)
        slots = torch.randint(0, rows_total, (T, K), device="cuda", generator=g, dtype=torch.int32)
        slots[:, min(n_ctx, K):] = -1     # what the select writes for a context of n_ctx keys
        topk = torch.zeros(T, K, dtype=torch.int64, device="cuda")
        rows, pos = torch.arange(T, device="cuda"), torch.full((T,), n_ctx - 1, device="cuda")
        r2t = torch.zeros(T, 1, dtype=torch.int64, device="cuda")
        for kv, cache in caches.items():
            def run(**tiles):
                return tt.sparse_mla_latent(q_lat, q_pe, cache, r2t, rows, pos, topk, 0.07, slots=slots, **tiles)
            want = _reference(q_lat, q_pe, cache, slots, 0.07, R)
            combos = [(None,) * 5]
            if a.tiles:
                for tiles in (_tiles_arg(t, kv == "fp8") for t in a.tiles.split(",")):
                    if tiles not in combos:      # bf16 rows drop dot16: measure each tile once
                        combos.append(tiles)
            elif a.splits:
                combos += [dict(num_splits=ns) for ns in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)]
            elif a.parts:
                combos += [dict(t, **({"dequant": True} if kv == "fp8" else {})) for t in _parts_tiles(T)]
            elif a.dequant and kv == "fp8":
                for dq, km, bh, bn, w, st in _dequant_tiles(T):
                    combos.append(dict(dequant=dq, key_major=km, block_h=bh, block_n=bn, num_warps=w, num_stages=st))
            elif a.dequant:
                combos += [dict(key_major=False, block_h=bh, block_n=32, num_warps=w, num_stages=st)
                           for bh, w, st in ((64, 8, 1), (64, 8, 2), (32, 4, 2))]
            elif a.focus and kv == "fp8":
                from glmc.target import mla_num_splits
                for km, bh, bn, w in ((False, 32, 32, 4), (True, 64, 64, 8)):
                    base = mla_num_splits(T, H, bh, K, bn, torch.cuda.get_device_properties(0).multi_processor_count)
                    for d16, mult in itertools.product((False, True), (1, 2, 4)):
                        combos.append(dict(key_major=km, block_h=bh, block_n=bn, num_warps=w, num_stages=1,
                                           dot16=d16, num_splits=min(64, base * mult)))
            elif kv == "fp8":   # bf16: the default only (the reference)
                combos += [c for c in itertools.product((True, False), (16, 32, 64), (16, 32, 64), (4, 8), (1, 2))
                           if (c[1] == 64) == c[0]]   # key-major: 64-head blocks; head-major: 16 or 32
            for c in combos:
                if time.perf_counter() > t_end:
                    break
                km, bh, bn, w, st = c if isinstance(c, tuple) else (0,) * 5
                tiles = c if isinstance(c, dict) else \
                    {} if km is None else dict(key_major=km, block_h=bh, block_n=bn, num_warps=w, num_stages=st)
                try:
                    got = run(**tiles).float()
                    err = float((got - want).abs().max() / want.abs().max())
                    us = tb.do_bench_cudagraph(lambda: run(**tiles), rep=20, return_mode="median") * 1e3
                except Exception as e:   # out of resources etc.
                    res.append(dict(T=T, ctx=n_ctx, kv=kv, tiles=tiles, error=str(e)[:120]))
                    continue
                res.append(dict(T=T, ctx=n_ctx, kv=kv, tiles=tiles or "default", us=us, err=err,
                                **_binary_stats(T, kv, tiles, q_lat, cache, K)))
            best = sorted((r for r in res if (r["T"], r["ctx"], r["kv"]) == (T, n_ctx, kv) and "us" in r),
                          key=lambda r: r["us"])
            default = next((r for r in best if r["tiles"] == "default"), None)
            errors = [r for r in res if (r["T"], r["ctx"], r["kv"]) == (T, n_ctx, kv) and "error" in r]
            print(f"T={T} ctx={n_ctx} {kv}: default {default['us'] if default else None} us "
                  f"(err {default['err'] if default else None}); best " +
                  "; ".join(f"{r['us']:.1f} {r['tiles']} regs {r.get('n_regs')} spills {r.get('n_spills')}"
                            for r in best[:3]) +
                  (f"; {len(errors)} failed, e.g. {errors[0]['tiles']}: {errors[0]['error']}" if errors else ""),
                  flush=True)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mla_tiles_sweep.json").write_text(json.dumps(res, indent=1))


def _reference(q_lat, q_pe, cache, slots, scale, R):
    """fp32 softmax attention of each token over its selected rows (FP8 rows dequantised): what
    every tile's `err` (max abs error / max abs value) is measured against."""
    import torch
    from glmc.codegen import fp8_ref
    out = torch.zeros(q_lat.shape, dtype=torch.float32, device=q_lat.device)
    for t in range(q_lat.shape[0]):
        sel = slots[t][slots[t] >= 0].long()
        rows = cache[sel]
        c, pe = fp8_ref.kv_fp8_unpack(rows, R) if cache.dtype == torch.uint8 else (rows[:, :R], rows[:, R:])
        c, pe = c.float(), pe.float()
        p = torch.softmax(scale * (q_lat[t].float() @ c.T + q_pe[t].float() @ pe.T), -1)
        out[t] = p @ c
    return out


def _tiles_arg(spec, fp8):
    """key_major:block_h:block_n:warps:stages[:v_parts[:dot16]] -> make()'s keywords (FP8 rows: scaled
    per tile; dot16 1 = fp16 dot operands, which e4m3 converts to exactly)."""
    f = [int(x) for x in spec.split(":")]
    if len(f) not in (5, 6, 7):
        raise SystemExit(f"--tiles {spec!r}: want key_major:block_h:block_n:warps:stages[:v_parts[:dot16]]")
    out = dict(key_major=bool(f[0]), block_h=f[1], block_n=f[2], num_warps=f[3], num_stages=f[4])
    if len(f) > 5:
        out["v_parts"] = f[5]
    if fp8:
        out["dequant"] = True
        if len(f) > 6:
            out["dot16"] = bool(f[6])
    return out


def _parts_tiles(T):
    """Head-major tiles x v_parts to try at T tokens (the accumulator is [block_h, 512 / v_parts]);
    at T < 32 a head block's splits are few programs, so split counts are swept too."""
    shapes = ([(16, 32, 4, 1), (16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2), (64, 32, 8, 2)] if T < 32 else
              [(64, 32, 8, 1), (64, 32, 8, 2), (64, 64, 8, 1), (64, 32, 16, 1), (32, 32, 4, 1), (32, 32, 4, 2),
               (32, 64, 4, 2)])
    out = [dict(key_major=False, block_h=bh, block_n=bn, num_warps=w, num_stages=st, v_parts=vp)
           for vp in (2, 4, 1) for bh, bn, w, st in shapes]
    if T < 32:
        out += [dict(key_major=False, block_h=16, block_n=32, num_warps=4, num_stages=2, v_parts=vp, num_splits=ns)
                for vp in (1, 2, 4) for ns in (4, 8, 16, 32)]
    return out


def _dequant_tiles(T):
    """(dequant, key_major, block_h, block_n, warps, stages) to try at T tokens: the per-group
    kernel's current choices first, then per-tile scaling over the shapes that fit its registers."""
    if T < 32:
        return [(False, False, 16, 32, 4, 2), (True, False, 16, 32, 4, 2), (True, False, 16, 64, 4, 2),
                (True, False, 16, 32, 4, 1), (True, False, 32, 32, 4, 2), (True, False, 64, 32, 8, 2)]
    return [(False, True, 64, 64, 8, 1), (False, False, 32, 32, 4, 1),
            (True, True, 64, 64, 8, 1), (True, True, 64, 32, 8, 1), (True, True, 64, 32, 8, 2),
            (True, True, 64, 64, 8, 2), (True, False, 64, 32, 8, 1), (True, False, 64, 32, 8, 2),
            (True, False, 32, 32, 4, 1), (True, False, 32, 32, 4, 2), (True, False, 64, 64, 8, 2)]


def _binary_stats(T, kv, tiles, q_lat, cache, K):
    """Registers and spills of the sparse_mla_decode binary these tiles compiled to (Triton's
    CompiledKernel fields), {} where this Triton does not expose them."""
    import torch
    from glmc.codegen import triton_launch as tt
    from glmc.codegen.triton_contexts import SparseMlaDecodeCtx
    fp8 = cache.dtype == torch.uint8
    ctx = SparseMlaDecodeCtx.make(q_lat.shape[1], q_lat.shape[2], 64, K, 0.07,
                                  q_lat.dtype if fp8 else cache.dtype, T, kv_fp8=fp8,
                                  **{k: v for k, v in tiles.items() if k != "num_splits"})
    try:
        fn = tt.JIT(ctx)
        kernels = [k for c in fn.device_caches.values() for k in c[0].values()]
        return dict(n_regs=max(k.n_regs for k in kernels), n_spills=max(k.n_spills for k in kernels))
    except Exception:   # noqa: BLE001 - a diagnostic only
        return {}


if __name__ == "__main__":
    main()
