"""Codegen is a stage: `glmc compile --device cuda` writes every Triton kernel the plan can launch to
kernels/*.py, and the runtime runs exactly those files (Triton interpreter on CPU)."""
import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from compile_util import plan as compiled
from glmc.codegen import cuda_target
from glmc.codegen.kernel_set import KERNELS_OF, NO_TRITON, plan_kernels
from glmc.codegen.triton_contexts import RmsNormCtx
from glmc.codegen.triton_render import KernelLibrary, KernelNotInPlan
from glmc.plan import Plan
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.loader import load_runner

from glmc.cli import main as glmc


def test_every_cuda_op_lists_its_kernels():
    """A CUDA implementation either has a kernel list or is marked as launching no Triton kernel."""
    assert set(cuda_target.IMPLS) == set(KERNELS_OF) | NO_TRITON
    assert not set(KERNELS_OF) & NO_TRITON


@pytest.mark.parametrize("parallel,heads,tiles", [
    ("tp1", 64, {(False, 16, "tl.float16"), (False, 64, "tl.bfloat16")}),
    ("tp8", 8, {(False, 16, "tl.float16")})])
def test_glm53_kernel_set_is_small_and_fits_the_rank(parallel, heads, tiles):
    """GLM-5.3 (FP8 weights, FP8 KV): a few dozen kernels, attention specialised to the rank's heads
    (head-major 16-head blocks with fp16 operands; where a rank holds >= 64 heads, 64-head blocks
    with bf16 operands from 4 tokens; FP8 rows scaled per tile); the FP8 experts
    and GEMMs at the rank's widths (A-projection: shared layers q_a | kv_a, full layers q_a | kv_a
    padded to its 128-row scale block | wk, one GEMM each)."""
    kernels = plan_kernels(compiled("glm_moe_dsa", parallel, device="cuda"))
    assert 15 <= len(kernels) <= 80   # 3 FP8 GEMM row classes per weight shape, MoE split forms
    attn = [c for c in kernels.values() if c.template == "sparse_mla_decode"]
    assert {c.num_heads for c in attn} == {heads} and {c.topk for c in attn} == {2048}
    assert {(c.key_major, c.block_h, c.dot_dtype) for c in attn} == tiles
    assert not [c for c in kernels.values() if c.template == "moe_experts"]
    experts = [c for c in kernels.values() if c.template == "moe_experts_fp8"]
    assert {(c.block_m, c.down) for c in experts} == {(m, d) for m in (16, 32, 64) for d in (False, True)}
    tp = 8 if parallel == "tp8" else 1
    assert {c.n_out for c in experts if not c.down} == {2048 // tp}
    gemms = {(c.n, c.k) for c in kernels.values() if c.template == "fp8_block_gemm"}
    assert {(2048 + 576, 6144), (2048 + 640 + 128, 6144), (64 * 256 // tp, 2048), (6144, 64 * 256 // tp),
            (2 * 12288 // tp, 6144), (6144, 12288 // tp)} <= gemms
    assert (128, 6144) not in gemms            # wk joins the full layers' A-projection
    assert [c.vocab for c in kernels.values() if c.template == "sample"] == [154880]
    if parallel == "tp1":                         # the README's count
        readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
        assert f"rendered: {len(kernels)} for GLM-5.3 at tp1" in " ".join(readme.split())


@pytest.mark.parametrize("a2a,routes", [(False, 4), (True, 1)])
def test_expert_kernels_take_routes_per_row_from_the_ids(a2a, routes):
    """Under the a2a lowering the experts get one dispatched row per route (k = 1), as the kernel sees."""
    kernels = plan_kernels(compiled("glm_moe_dsa_tiny", "dp2ep2", device="cuda", moe_a2a=a2a))
    assert {c.top_k for c in kernels.values() if c.template == "moe_experts"} == {routes}


@pytest.fixture(scope="module")
def cuda_plan_dir(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "tiny-cuda"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert glmc(["compile", "--model", str(tiny_ckpt), "--device", "cuda", "-o", str(out)]) == 0
    assert "kernels/ (" in printed.getvalue() and "Triton kernels)" in printed.getvalue()
    return out


def test_compile_writes_the_kernels_with_their_contexts(cuda_plan_dir):
    contexts = json.loads((cuda_plan_dir / "plan.json").read_text())["kernels"]
    files = sorted(p.stem for p in (cuda_plan_dir / "kernels").glob("*.py"))
    assert files == sorted(contexts) and len(files) >= 10
    for name, ctx in contexts.items():
        src = (cuda_plan_dir / "kernels" / f"{name}.py").read_text()
        assert f"# context: {ctx}\n" in src and f"def {ctx.split('Ctx(')[0]}" not in src
        compile(src, name, "exec")
    assert Plan.load(cuda_plan_dir).kernel_contexts == contexts
    report = (cuda_plan_dir / "report.md").read_text()
    assert f"## Triton kernels ({len(contexts)}" in report
    assert all(f"| `{name}.py` | `{ctx}` |" in report for name, ctx in contexts.items())


def _greedy_logits(plan, ckpt):
    """Prefill 9 tokens then decode 1 with the plan on the CPU (CUDA target, Triton interpreter)."""
    runner = load_runner(plan, ckpt, device="cpu", num_pages=2, max_context=64, max_running=1).executor
    r2t = torch.arange(64, 128).view(1, 64)
    prompt = list(range(3, 12))
    out = runner.forward("prefill", ForwardBatch.build("extend", [prompt], [0], [0], r2t))["logits"]
    step = runner.forward("decode", ForwardBatch.build("decode", [[int(out[0].argmax())]], [0], [9], r2t))
    return runner, torch.cat([out[0], step["logits"][0]])


@pytest.mark.usefixtures("one_torch_thread")
def test_runtime_runs_exactly_the_plan_files(cuda_plan_dir, tiny_ckpt):
    """Every kernel the steps launch is imported from the plan directory; an edit to a kernel file
    changes what runs (here: the RMSNorm output scaled by 0.5 changes the logits)."""
    runner, logits = _greedy_logits(Plan.load(cuda_plan_dir), tiny_ckpt)
    used = runner.kernels.loaded()
    assert len(used) >= 8 and all(p.parent == cuda_plan_dir / "kernels" for p in used)
    # (no mla_combine: on the CPU's 2-SM stand-in each step's attention has one split, which the
    # decode kernel writes itself)
    assert {p.stem.rsplit("_", 1)[0] for p in used} >= {"rms_norm", "qkv_norm_rope_write", "indexer_scores",
                                                        "topk_select", "sparse_mla_decode",
                                                        "moe_router", "moe_experts", "argmax"}
    norm = next(p for p in used if p.stem.startswith("rms_norm"))
    src = norm.read_text()
    assert "    y = x * rstd * w\n" in src
    norm.write_text(src.replace("    y = x * rstd * w\n", "    y = x * rstd * w * 0.5\n"))
    try:
        _, edited = _greedy_logits(Plan.load(cuda_plan_dir), tiny_ckpt)
    finally:
        norm.write_text(src)
    assert not torch.allclose(edited, logits, atol=1e-3)


def test_a_kernel_the_plan_lacks_is_an_error(cuda_plan_dir):
    plan = Plan.load(cuda_plan_dir)
    lib = KernelLibrary.from_plan(plan)
    with pytest.raises(KernelNotInPlan, match=r"(?s)has no kernel for RmsNormCtx\(hidden=12345.*glmc compile"):
        lib(RmsNormCtx.make(12345, 1e-6, False))
    with pytest.raises(KernelNotInPlan, match="compiled for device 'cpu'.*--device cuda"):
        KernelLibrary.from_plan(compiled("glm_moe_dsa_tiny", "tp1", device="cpu"))
