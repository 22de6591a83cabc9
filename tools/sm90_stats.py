"""What a glmc kernel compiles to on Hopper, from a host without a GPU: Triton compiles the rendered
kernel for sm_90a and the ptxas that Triton ships assembles it; -> registers per thread, spilled
bytes, shared memory, and the tensor-core instructions (wgmma: Hopper's warp-group MMA; mma.sync:
the Ampere-style one Triton falls back to, e.g. below 64 rows per warp group). Screens tile choices
before they cost device time: a tile that spills hundreds of bytes or falls back to mma.sync is
rarely worth a GPU run.

    python tools/sm90_stats.py mla --tokens 128 [--kv fp8] [--tiles 0:64:64:8:2,1:64:128:8:1]
        # sparse_mla_decode at GLM-5.3 shapes; tiles key_major:block_h:block_n:warps:stages[:v_parts]
        # (default: SparseMlaDecodeCtx.make's choice for that many tokens)
    python tools/sm90_stats.py indexer [--kv fp8] [--tiles 64:256:8:3,128:128:8:2]
        # the prefill indexer's token-block kernel; tiles block_m:block_n:warps:stages

Integer arguments are compiled as the runtime sees GLM-5.3's (strides divisible by 16: Triton
specialises them at launch, and without that a gathered row is not loaded asynchronously, so the
numbers would describe a kernel that never runs). Measured on the GPU it may still differ: these
are the compiler's facts, not timings.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


# pointer arguments' element types (the rest of the *_ptr arguments are fp32 workspaces)
MLA_PTRS = {"q_lat_ptr": "bf16", "q_pe_ptr": "bf16", "kv_pe_ptr": "bf16", "req_to_token_ptr": "i64",
            "tok_row_ptr": "i64", "pos_ptr": "i64", "slots_ptr": "i32"}
INDEXER_PTRS = {"q_ptr": "bf16", "w_ptr": "bf16", "req_to_token_ptr": "i64", "tok_row_ptr": "i64",
                "pos_ptr": "i64"}
SCALARS_NOT_DIV16 = {"num_tokens", "width"}   # run-time counts, not strides


def ptxas() -> str:
    """The ptxas Triton ships that takes its PTX (Triton 3.9 writes PTX 9.x: its ptxas-blackwell)."""
    import triton
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).exists():
            return str(bin_dir / name)
    raise FileNotFoundError(f"no ptxas under {bin_dir}")


def stats(ctx, pointer_types: dict, num_stages: int | None = None) -> dict:
    """Compile ctx's kernel for sm_90a; -> {regs, spill_stores, spill_loads, shared, wgmma, mma_sync}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from glmc.codegen import triton_render as tr
    module = tr.load_kernel(tr.JIT.path(ctx))
    fn = next(v for v in vars(module).values() if isinstance(v, triton.runtime.jit.JITFunction))
    params = list(inspect.signature(fn.fn).parameters)
    constexprs = {p for p, v in inspect.signature(fn.fn).parameters.items()
                  if "constexpr" in str(v.annotation)}
    if constexprs:
        raise ValueError(f"{ctx.template}: constexpr arguments {sorted(constexprs)} need values; not supported")
    signature = {p: ("*" + pointer_types.get(p, "fp32")) if p.endswith("_ptr") else "i32" for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p not in SCALARS_NOT_DIV16}
    kernel = triton.compile(ASTSource(fn, signature=signature, attrs=attrs), target=GPUTarget("cuda", 90, 128),
                            options={"num_warps": ctx.num_warps, "num_stages": num_stages or ctx.num_stages})
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        Path(src).write_text(ptx)
        out = subprocess.run([ptxas(), "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
    if out.returncode or not regs:
        raise RuntimeError(f"ptxas failed on {ctx.template}: {out.stderr[-500:]}")
    return {"regs": int(regs.group(1)), "spill_stores": int(spill.group(1)) if spill else 0,
            "spill_loads": int(spill.group(2)) if spill else 0, "shared": kernel.metadata.shared,
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)), "mma_sync": len(re.findall(r"mma\.sync", ptx))}


MLA_TILES = ("key_major", "block_h", "block_n", "num_warps", "num_stages", "v_parts")
INDEXER_TILES = ("block_m", "block_n", "num_warps", "num_stages")


def kernel_rows(name: str, make, fields: tuple, tiles: list[str], pointer_types: dict, shown=(), **row) -> list[dict]:
    """The default context (`make()`) and one per tile ("a:b:..." over `fields`, `make(**fields)`),
    each with its compiled stats; `shown`: context fields reported beside `fields`."""
    configs = [{}] + [dict(zip(fields, map(int, t.split(":")))) for t in tiles]
    rows = []
    for cfg in configs:
        ctx = make(**cfg)
        tile = {k: getattr(ctx, k) for k in fields + tuple(shown)}
        rows.append({"kernel": name, **row, "tiles": tile, "default": not cfg, **stats(ctx, pointer_types)})
    return rows


def mla_rows(tokens: int, kv: str, tiles: list[str]) -> list[dict]:
    import torch

    from glmc.codegen.triton_contexts import SparseMlaDecodeCtx
    fp8 = kv == "fp8"

    def make(key_major=None, **cfg):
        return SparseMlaDecodeCtx.make(64, 512, 64, 2048, 1 / 16, torch.bfloat16, tokens, kv_fp8=fp8,
                                       key_major=None if key_major is None else bool(key_major), **cfg)
    return kernel_rows("sparse_mla_decode", make, MLA_TILES, tiles, dict(MLA_PTRS, kv_ptr="u8" if fp8 else "bf16"),
                       tokens=tokens, kv=kv)


def indexer_rows(kv: str, tiles: list[str]) -> list[dict]:
    import torch

    from glmc.codegen.triton_contexts import IndexerScoresCtx
    fp8 = kv == "fp8"

    def make(**cfg):
        return IndexerScoresCtx.make_tiled(32, 128, torch.bfloat16, fp8=fp8, w_scale=32 ** -0.5, **cfg)
    return kernel_rows("indexer_scores (token blocks)", make, INDEXER_TILES, tiles,
                       dict(INDEXER_PTRS, k_cache_ptr="u8" if fp8 else "bf16"), kv=kv)


def main(argv=None) -> int:
    os.environ.pop("TRITON_INTERPRET", None)     # compiling for the GPU: the interpreter has no binaries
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton 3.9's default, without its warning
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=("mla", "indexer"))
    ap.add_argument("--tokens", type=int, default=128, help="mla: tokens of the step (the kernel's token class)")
    ap.add_argument("--kv", choices=("bf16", "fp8"), default="bf16", help="KV / indexer-key cache format")
    ap.add_argument("--tiles", default="", help="comma list of tiles (module doc); the default is always included")
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of the table")
    a = ap.parse_args(argv)
    tiles = [t for t in a.tiles.split(",") if t]
    rows = mla_rows(a.tokens, a.kv, tiles) if a.kernel == "mla" else indexer_rows(a.kv, tiles)
    for r in rows:
        if a.json:
            print(json.dumps(r))
        else:
            print(f"{str(r['tiles']):100s} regs {r['regs']:3d}  spills {r['spill_stores']:5d} B  shared "
                  f"{r['shared'] // 1024:4d} KiB  wgmma {r['wgmma']:3d}  mma.sync {r['mma_sync']:3d}"
                  + ("  (default)" if r["default"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
