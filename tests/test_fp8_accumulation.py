"""FP8 dots accumulate in fp32 beyond one 128-wide K block, checked in the compiler's own output.

Hopper's FP8 tensor-core MMA (wgmma) keeps only about 14 bits of its running sum, and Triton's default
on sm_90 leaves a whole dot to it (`max_num_imprecise_acc` = 2**30). The op checks bound that
accumulation over one 128-wide K block (`op_compare.FP8_ACC_REL`, measured by
bench/fp8_accumulation.py), with every sum across blocks in fp32; a wider dot, or a promotion
interval past 128, would put errors outside that bound that the interpreter (which sums in fp32)
cannot show. So every FP8 kernel GLM-5.3's CUDA plan holds is compiled here for sm_90 (Triton
compiles for a GPU it does not have; the interpreter is switched off in that process), and each
warp-group dot must span K <= 128 and promote within it; the prefill row class must use wgmma at
all (else this checks nothing).
"""
import json
import os
import re
import subprocess
import sys

K_BLOCK = 128   # the FP8 scale block: the accumulation op_compare.FP8_ACC_REL bounds

_INT_POINTERS = {"sorted_rows_ptr", "block_expert_ptr"}
_FP8_POINTERS = {"xq_ptr", "wq_ptr", "aq_ptr", "w2q_ptr"}


def _signature(fn) -> dict:
    def kind(name):
        if not name.endswith("_ptr"):
            return "i32"
        return "*fp8e4nv" if name in _FP8_POINTERS else "*i32" if name in _INT_POINTERS else "*fp32"
    return {name: kind(name) for name in fn.arg_names}


def _compile_fp8_kernels() -> list[dict]:
    """Every distinct FP8-dot kernel form of GLM-5.3's tp1 CUDA plan, compiled for sm_90: its
    context and the dot ops of its TTGIR."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from glmc.codegen.kernel_set import plan_kernels
    from glmc.codegen.triton_render import JIT
    from glmc.compiler import compile_plan
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.spec import load_spec, model_path

    spec = load_spec(model_path("glm_moe_dsa"))
    plan = compile_plan(spec, parse_parallel("tp1", spec.config), Options(device="cuda"))
    forms = {}
    for ctx in plan_kernels(plan).values():
        if hasattr(ctx, "promote"):   # one per tile form: N and K do not change the dot's lowering
            form = tuple(v for k, v in vars(ctx).items() if k not in ("n", "k", "k_blocks", "n_tiles", "n_in", "n_out"))
            forms.setdefault((type(ctx).__name__,) + form, ctx)
    out = []
    for ctx in forms.values():
        fn = JIT(ctx)
        ttgir = triton.compile(ASTSource(fn=fn, signature=_signature(fn), constexprs={}),
                               target=GPUTarget("cuda", 90, 32)).asm["ttgir"]
        dots = [line.strip() for line in ttgir.splitlines() if re.search(r"= (tt\.dot|ttng\.warp_group_dot) ", line)]
        out.append({"ctx": repr(ctx), "block_m": ctx.block_m, "dots": dots})
    return out


def test_fp8_dots_promote_to_fp32_on_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    kernels = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(kernels) >= 8, kernels     # block GEMM (plain, gapped) and the experts' stages
    wgmma = 0
    for k in kernels:
        assert k["dots"], f"no dot compiled in {k['ctx']}"
        for dot in k["dots"]:
            if "warp_group_dot" in dot:
                wgmma += 1
                acc = re.search(r"maxNumImpreciseAcc = (\d+)", dot)
                assert acc and int(acc.group(1)) <= K_BLOCK, f"{k['ctx']}: {dot}"
                a_k = re.search(r"memdesc<\d+x(\d+)xf8E4M3FN", dot)
                assert a_k and int(a_k.group(1)) <= K_BLOCK, f"{k['ctx']}: a dot wider than a K block: {dot}"
            else:   # mma.sync (tiles under 64 rows): fp32 accumulation in the MMA itself
                assert k["block_m"] < 64, f"{k['ctx']}: a 64-row tile left wgmma: {dot}"
    assert wgmma >= 3, "the prefill tiles compiled without wgmma: this test no longer checks its accumulation"


if __name__ == "__main__":
    print(json.dumps(_compile_fp8_kernels()))
