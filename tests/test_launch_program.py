"""The CUDA plan's launch program (`codegen/launch_program.py`) is what a step launches.

- The program traced on the meta device (no data, nothing launched) equals, launch by launch and
  in order, what a real step of the same plan launches on the CPU (Triton interpreted), recorded by
  the same recorder: decode and prefill, an fp32 plan, a block-FP8 plan and lone ranks of tp2ep2
  and dp2ep2 (`LoneComm`; their MoE is the gather lowering: a lone rank cannot run an all-to-all on
  data, so the a2a lowering is traced only on the meta device). A real step starts with host-side work outside every op (its requests' rows into the
  device table, the step's index vectors), which a CUDA graph leaves outside the graph.
- GLM-5.3 at its real shapes: per MoE layer at one decode request, a plan with bf16 weights launches
  19 and 22 kernels; the card's block-FP8 plan launches more (its GEMMs are quantise + FP8 GEMM +
  split reduction). A sampled trace (one layer per class) makes the same launches per op as the
  whole program, and `glmc.predict` prices each of them.
- The text form folds identical layers and reads back the counts; `glmc compile --device cuda`
  writes it and `glmc explain` reports it.
"""
from collections import Counter

import pytest
from tiny_hf import save_tiny, save_tiny_fp8

from glmc.api import Model
from glmc.launches import launch_programs, meta_executor
from glmc.cli import main
from glmc.codegen.launch_program import Recorder, counts, split, trace
from glmc.compiler import compile_plan
from glmc.config import Options
from glmc.parallel import parse_parallel
from glmc.run_config import RunConfig
from glmc.runtime.worker.comm import LoneComm
from glmc.runtime.worker.loader import load_runner
from glmc.spec import load_spec

RUN = RunConfig(num_pages=9, max_context=128, max_running=4)   # 4 requests x 2 pages, + the scratch page
PROMPTS = [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 10, 1]]


def canonical(launches) -> list[tuple]:
    """The launches with their buffers numbered by first use among them (which launches share a
    storage, not where it was allocated)."""
    ids: dict[int, int] = {}
    out = []
    for x in launches:
        args = tuple((ids.setdefault(b, len(ids)), dtype, shape) for b, dtype, shape in x.args)
        out.append((x.kind, x.name, x.grid, args, x.op, x.op_kind, x.layer, x.group, x.nbytes))
    return out


def real_steps(plan, ckpt, comm=None) -> dict:
    """A prefill of PROMPTS then one decode step, run on the CPU after a warm-up and recorded."""
    ex = load_runner(plan, ckpt, RUN, device="cpu", capture=False, comm=comm).executor
    names = {v: k for k, v in plan.kernel_contexts.items()}
    model = Model(ex, None, max_requests=4, pages_per_request=2)
    model.decode(model.prefill(PROMPTS).argmax(-1).tolist())   # warm: what the runner makes once (as capture warms)
    with Recorder(names).watching(ex) as pre:
        logits = model.prefill(PROMPTS)
    with Recorder(names).watching(ex) as dec:
        model.decode(logits.argmax(-1).tolist())
    tokens = ex.padded_tokens(sum(map(len, PROMPTS)), None)
    return {"prefill": pre.program("prefill", tokens), "decode": dec.program("decode", len(PROMPTS))}


def assert_same(real, traced):
    cut = len(real.launches) - len(traced.launches)
    assert cut >= 0 and not traced.untraced
    head = real.launches[:cut]
    assert all(x.op is None and x.kind == "torch" for x in head), [x.line() for x in head if x.op or x.kind != "torch"]
    assert canonical(real.launches[cut:]) == canonical(traced.launches)


def plan_of(ckpt, parallel="tp1"):
    spec = load_spec(ckpt)
    return compile_plan(spec, parse_parallel(parallel, spec.config), Options(device="cuda", max_batch=4))


@pytest.fixture(scope="module")
def fp32_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp32")
    save_tiny(path, "grouped", seed=3)
    return path


@pytest.mark.parametrize("kind", ["fp32", "fp8", "tp2ep2 rank 1", "dp2ep2 rank 1"])
def test_the_traced_program_is_what_a_real_step_launches(kind, fp32_ckpt, tmp_path, one_torch_thread):
    if kind == "fp8":
        save_tiny_fp8(tmp_path, "grouped", seed=3)
        ckpt = tmp_path
    else:
        ckpt = fp32_ckpt
    parallel, rank = (kind.split()[0], 1) if "rank" in kind else ("tp1", 0)
    plan = plan_of(ckpt, parallel)
    real = real_steps(plan, ckpt, LoneComm(plan.mesh, rank) if rank else None)
    meta = meta_executor(plan, rank, RUN)
    longest = max(map(len, PROMPTS))
    traced = {"prefill": trace(meta, "prefill", real["prefill"].tokens, num_sms=2, requests=len(PROMPTS),
                               max_len=longest),
              "decode": trace(meta, "decode", meta.padded_tokens(len(PROMPTS), None), num_sms=2)}
    for phase in ("prefill", "decode"):
        assert_same(real[phase], traced[phase])
    kinds = Counter(x.kind for p in traced.values() for x in p.launches)
    assert kinds["triton"] and kinds["gemm"] and (kinds["collective"] > 0) == (parallel != "tp1")
    if kind == "fp8":
        assert any(x.name.startswith("fp8_block_gemm") for x in traced["decode"].launches)
    buffers = traced["decode"].buffers
    assert all(0 <= b.first <= b.last < len(traced["decode"].launches) for b in buffers)


def glm53(weight: str):
    from compile_util import spec
    s = spec("glm_moe_dsa")
    s = s.model_copy(update={"dtypes": s.dtypes.model_copy(update={"weight": weight})})
    return compile_plan(s, parse_parallel("tp1", s.config), Options(device="cuda"))


def test_glm53_decode_launches_per_moe_layer():
    """One decode request, context 4096 (the top-k select in one pass). Layer 4 is an MoE layer
    reading layer 3's top-k, layer 6 an MoE layer with its own indexer."""
    run = RunConfig(max_context=4096)
    bf16 = glm53("bf16")
    per_layer = trace(meta_executor(bf16, 0, run), "decode", 1).per_layer()
    assert (per_layer[4], per_layer[6]) == (19, 22)
    # The card's block-FP8 weights: 26 and 31. An FP8 linear is its input's quantisation (unless the
    # norm before it quantised), the FP8 GEMM and its split-K reduction (3 launches: q_b, o_proj;
    # the A-projection 2 and its unquantised weights_proj's gemv 1), the shared expert 4 (gate/up
    # GEMM, its reduction with SwiGLU and quantisation, down GEMM, its reduction) and the routed
    # experts 5 (align, gate/up, SwiGLU reduction, down, combine); and the indexer's wq_b 3 more.
    fp8 = glm53("fp8")
    prog = trace(meta_executor(fp8, 0, run), "decode", 1)
    per_layer = prog.per_layer()
    assert (per_layer[4], per_layer[6]) == (26, 31)
    kinds = Counter(x.op_kind for x in prog.launches if x.layer == 4)
    assert (kinds["linear"], kinds["mlp.swiglu"], kinds["moe.experts"]) == (6, 4, 5)
    # the text folds the 78 layers into a few classes and reads back every layer's count
    text = prog.text()
    assert text.count("\nlayers ") <= 6
    assert counts(text)["layers"] == {n: {k: c for k, c in Counter(x.kind for x in prog.launches if x.layer == n).items()}
                                      for n in range(fp8.config.num_hidden_layers)}


def signature(program) -> dict:
    return {op: Counter((x.kind, x.name, x.grid) for x in made) for op, made in program.op_launches().items()}


@pytest.mark.parametrize("parallel", ["tp1", "tp8ep8", "dp8ep8"])
def test_a_sampled_trace_makes_the_whole_programs_launches(parallel):
    """`trace(sample=True)` runs one layer per class of identical layers and stands in for the
    others: per op, per layer and outside the layers it launches what the whole program launches
    (GLM-5.3 with block-FP8 weights, decode at 1 and 32 requests, an MTP verify and draft step and
    a prefill chunk), in a fraction of the ops."""
    from compile_util import spec
    s = spec("glm_moe_dsa")
    plan = compile_plan(s, parse_parallel(parallel, s.config), Options(device="cuda"))
    ex = meta_executor(plan, 0, RunConfig(max_context=4096))
    for phase, tokens in (("decode", 1), ("decode", 32), ("mtp_verify", 4), ("mtp_draft", 8), ("prefill", 512)):
        whole = trace(ex, phase, tokens)
        sampled = trace(ex, phase, tokens, warm=False, sample=True)
        assert signature(sampled) == signature(whole), (phase, tokens)
        assert sampled.per_layer() == whole.per_layer()
        assert [x.line() for x in sampled.step_launches()] == [x.line() for x in whole.step_launches()]
        if phase != "mtp_draft":     # one layer: nothing to leave out
            assert len(sampled.launches) < len(whole.launches) / 5
    with pytest.raises(ValueError, match="sampled trace has no text form"):
        sampled.text()


def test_the_predictor_prices_the_program():
    """`glmc.predict` counts the launches of the plan's program: a block-FP8 GLM-5.3 step at one
    request makes its quantisations and split-K reductions (2118 launches on tp1), which the
    prediction counts one by one (on dp8ep8 its small collectives are the one-shot kernel's,
    priced as that); the MoE rows of 32 requests per dp8ep8 rank (2048 routed rows, 64 per local
    expert) are sorted by the moe_align kernel, no torch op; past its 4096 rows (128 requests), by
    torch's."""
    from compile_util import spec

    from glmc.calibration import load
    from glmc.launches import LaunchCounts
    from glmc.predict import predict_step
    cal = load("bench/results/calibration_nvidia-h200-x2_2026-11-30.json")
    s = spec("glm_moe_dsa")
    for parallel, tokens in (("tp1", 1), ("dp8ep8", 1), ("dp8ep8", 32), ("dp8ep8", 128)):
        plan = compile_plan(s, parse_parallel(parallel, s.config), Options(device="cuda"))
        prog = LaunchCounts(plan)("decode", tokens, 4096)
        env = {"T": tokens, "B": tokens, "S": 4096, "K": s.config.index_topk}
        p = predict_step(plan.graphs["decode"], env, plan.dtypes, cal, plan.world, prog)
        made = Counter(x.kind for x in prog.launches) + Counter(
            x.kind for same, layer in prog.aliases.values() for x in prog.op_launches().get(same, ()))
        assert p["torch_ops"] == made["torch"]
        if parallel == "tp1":
            assert p["kernels"] == made["triton"] + made["gemm"] and made["collective"] == 0
            assert p["kernels"] + p["torch_ops"] == 2118
        elif tokens == 128:
            assert p["by_kind"]["moe.experts"]["torch_ops"] >= 36 * 75
        else:
            assert p["by_kind"]["moe.experts"]["torch_ops"] == 0
            assert sum(x.name.startswith("moe_align") for x in prog.op_launches()["L3.routed"]) == 1


def test_text_round_trips_and_compile_writes_it(fp32_ckpt, tmp_path, capsys):
    plan = plan_of(fp32_ckpt)
    programs = launch_programs(plan, RUN)
    assert [p.tokens for p in programs["decode"]] == [1, 4] and len(programs["prefill"]) == 1
    for progs in programs.values():
        text = "".join(p.text() for p in progs)
        by_tokens = split(text)
        for p in progs:
            c = counts(by_tokens[p.tokens])
            assert c["step"] == dict(Counter(x.kind for x in p.launches))
            assert {n: sum(k.values()) for n, k in c["layers"].items()} == \
                {n: v for n, v in p.per_layer().items() if n is not None}
    out = tmp_path / "plan"
    assert main(["compile", "--model", str(fp32_ckpt), "--parallel", "tp1", "--device", "cuda", "-o", str(out)]) == 0
    assert sorted(p.name for p in (out / "launch").iterdir()) == ["decode.txt", "prefill.txt"]
    capsys.readouterr()
    assert main(["explain", str(out)]) == 0
    report = capsys.readouterr().out
    assert "## Launches" in report and "| decode | 1 |" in report


def test_a_lone_ranks_all_to_all_and_an_op_that_needs_data():
    """On the meta device a lone rank's MoE all-to-all stands in by its shape (the a2a lowering
    traces whole); an op that cannot run without data is listed as not traced, with its reason,
    and so are the ops fed by its stand-in results, never guessed."""
    from compile_util import plan as compiled
    plan = compiled("glm_moe_dsa_tiny", "dp2ep2", device="cuda", moe_a2a=True)
    ex = meta_executor(plan, 1, RUN)
    prog = trace(ex, "prefill", 16)
    assert not prog.untraced
    assert {x.name for x in prog.launches if x.kind == "collective"} >= {"dispatch", "combine"}

    def needs_data(op, args, ctx):
        raise RuntimeError("a host sync on data")
    ex.impls = dict(ex.impls, **{"moe.topk": needs_data})
    text = trace(ex, "decode", 2).text()
    assert "# not traced: moe.topk (layers 1..3): RuntimeError: a host sync on data" in text
    assert "# not traced: moe.dispatch (layers 1..3): its operands come from an op not traced" in text
