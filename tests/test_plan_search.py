"""`glmc plan`: a fixed calibration gives a fixed ranking, dropped candidates carry their reason,
bad arguments get a clear error, the chart is SVG with one dot per priced row, and `--explain` sets
SGLang's recipes against the pick with the rows' own numbers."""
import json
import xml.etree.ElementTree as ET

import pytest

from glmc.calibration import load
from glmc.cli import main
from glmc.compiler import compile_plan
from glmc.config import Options
from glmc.launches import LaunchCounts
from glmc.parallel import parse_parallel
from glmc.plan_report import explain_recipes, render_explain, render_svg, render_table
from glmc.plan_search import PlanSearchError, StepPricer, parse_slo, parse_workload, search, specs_for
from glmc.predict import predict_step
from glmc.spec import load_spec, model_path

CALIBRATION = "bench/results/calibration_nvidia-h200-x2_2026-11-30.json"


@pytest.fixture(scope="module")
def tiny():
    return load_spec(model_path("glm_moe_dsa_tiny"))


@pytest.fixture(scope="module")
def result(tiny):
    # 0.1 GB per GPU: the tiny model's weights fit, 64 requests of 640 tokens do not on every spec
    return search(tiny, load(CALIBRATION), 2, parse_workload("in=512,out=128"), concurrency=(1, 8, 64),
                  slo={"tpot_ms": 0.33}, gpu_memory=(10**8, "test"))


def test_fixed_calibration_gives_fixed_ranking(result):
    front = [(r["candidate"], r["concurrency"]) for r in result["pareto"]]
    assert front == GOLDEN_FRONT
    assert (result["best"]["candidate"], result["best"]["concurrency"]) == GOLDEN_BEST
    assert result["best"]["tpot_ms"] <= 0.33


@pytest.mark.parametrize("parallel,phase,p2p", [("dp2ep2", "decode", True), ("tp2", "decode", True),
                                                ("tp2ep2", "mtp_draft", True), ("tp2", "decode", False),
                                                ("dp2ep2", "decode", False)])
def test_step_pricer_equals_the_predictor(tiny, parallel, phase, p2p):
    """Priced once per layer, and --no-p2p priced on the p2p plan's graph: both as the predictor
    prices the plan compiled for them, with its launch program."""
    par = parse_parallel(parallel, tiny.config)
    compiled = compile_plan(tiny, par, Options(p2p_collectives=p2p))
    graph, launches = compiled.graphs[phase], LaunchCounts(compiled)
    cal = load(CALIBRATION)
    mine = compile_plan(tiny, par, Options())
    counts = LaunchCounts(mine)
    pricer = StepPricer(mine.graphs[phase], tiny.dtypes, cal, 2, lambda t, s: counts(phase, t, s))
    pricer = pricer if p2p else pricer.nccl()
    if phase == "decode":
        assert len(pricer.groups(counts(phase, 1, 640))) < len(graph.ops) / 2   # layers priced once
    for t, s in ((1, 640), (24, 640), (512, 512)):
        env = {"T": t, "B": t, "S": s, "K": tiny.config.index_topk}
        want = predict_step(graph, env, tiny.dtypes, cal, 2, launches(phase, t, s))["step_s"]
        assert pricer.step_seconds(env) == pytest.approx(want, rel=1e-12)


def test_pareto_rows_are_not_dominated(result):
    for a in result["pareto"]:
        assert not any(b["tok_s_per_gpu"] > a["tok_s_per_gpu"] and b["tok_s_per_user"] > a["tok_s_per_user"]
                       for b in result["rows"])


def test_infeasible_candidates_carry_their_reason(result):
    dropped = [d for d in result["dropped"] if d["candidate"].endswith("c=64")]
    assert dropped, "0.1 GB per GPU must drop some 64-request candidates"
    assert all("per GPU >" in d["reason"] and "KV" in d["reason"] and " requests x 640 tokens)" in d["reason"]
               for d in dropped)
    assert "tp2 moe=auto kv=fp8 mtp=3 c=64" in [d["candidate"] for d in dropped]   # the MTP layer's bytes
    priced = {(r["candidate"], r["concurrency"]) for r in result["rows"]}
    assert ("tp2 moe=auto kv=fp8 mtp=0", 64) in priced
    assert not any((d["candidate"].rsplit(" c=", 1)[0], 64) in priced for d in dropped)


def test_prefill_chunk_sets_the_ttft_steps(tiny):
    def first(chunk):
        r = search(tiny, load(CALIBRATION), 2, parse_workload("in=512,out=128"), concurrency=(1,), drafts=(0,),
                   kv_dtypes=("fp8",), only=["tp2"], prefill_chunk=chunk)
        return r["rows"][0]["ttft_ms"], r["assumptions"]
    (whole, _), (chunked, said) = first(None), first(128)
    assert chunked > whole   # four steps of 128 tokens pay four times the per-step floor
    assert any("ceil(in / 128) decode-graph steps" in a and "--max-batch-tokens 128" in a for a in said)


def test_invalid_specs_carry_their_reason():
    valid, dropped = specs_for(6, load_spec(model_path("glm_moe_dsa")).config)
    assert "tp6" not in valid
    assert {"candidate": "tp6", "reason": "parallel spec 'tp6': num_attention_heads = 64 is not divisible by "
            "attn_tp = 6"} in dropped


@pytest.mark.parametrize("text", ["in=8k,out=1", "in=1", "out=1,in=0", "in=1,out=2,x=3", "8192/1024"])
def test_bad_workload_gets_a_clear_error(text):
    with pytest.raises(PlanSearchError, match=r"--workload .*expected in=<prompt tokens>,out=<output tokens>"):
        parse_workload(text)


def test_bad_workload_on_the_command_line(capsys):
    assert main(["plan", "--gpus", "2", "--workload", "in=8k,out=1"]) == 2
    assert "glmc plan: error: --workload 'in=8k,out=1': expected in=" in capsys.readouterr().err


def test_bad_slo():
    assert parse_slo("tpot_ms=20,ttft_ms=2000") == {"tpot_ms": 20.0, "ttft_ms": 2000.0}
    with pytest.raises(PlanSearchError, match="--slo 'tpot=20'"):
        parse_slo("tpot=20")


def test_outputs_say_their_assumptions(result):
    text = render_table(result)
    assert "Pareto front" in text and "TTFT: no prefill prediction exists" in text
    assert "GPU memory 0.1 GB (test)" in text and "glmc-small's measured" in text
    svg = ET.fromstring(render_svg(result))
    dots = svg.findall("{http://www.w3.org/2000/svg}circle")
    assert len(dots) == len(result["rows"]) + len(result["pareto"])


GOLDEN_FRONT = [("dp2ep2 moe=gather kv=fp8 mtp=1", 1), ("dp2ep2 moe=gather kv=fp8 mtp=0", 8),
                ("dp2ep2 moe=gather kv=fp8 mtp=0", 64)]
GOLDEN_BEST = ("dp2ep2 moe=gather kv=fp8 mtp=0", 64)


def test_plan_command_writes_the_search_and_compiles_the_best(tmp_path, capsys):
    args = ["plan", "--model", "glm_moe_dsa_tiny", "--gpus", "2", "--workload", "in=512,out=128",
            "--concurrency", "1,8", "--kv-dtype", "fp8", "--gpu-memory-gb", "0.1", "-o", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "plan_search.json").read_text())
    assert result["best"]["parallel"] == "dp2ep2" and result["best"]["kv_dtype"] == "fp8"
    assert "GPU memory 0.1 GB (--gpu-memory-gb)" in out
    ET.parse(tmp_path / "pareto.svg")
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["parallel"]["spec"] == "dp2ep2"
    assert f"glmc run {tmp_path / 'plan'} --device cuda" in out and "--max-batch-tokens 8192" in out


def test_step_terms_sum_to_the_step(result):
    for r in result["rows"]:
        assert sum(r["step_terms_ms"].values()) == pytest.approx(r["step_ms"], rel=1e-9)


def test_explain_sets_both_recipes_against_the_pick(tmp_path, capsys):
    args = ["plan", "--model", "glm_moe_dsa_tiny", "--gpus", "2", "--workload", "in=512,out=128",
            "--concurrency", "1,8", "--kv-dtype", "fp8", "--specs", "tp2,dp2ep2", "--no-compile", "--explain",
            "-o", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "plan_search.json").read_text())
    latency, throughput = result["explain"]["recipes"]
    assert (latency["candidate"], latency["concurrency"]) == ("tp2 moe=auto kv=fp8 mtp=3", 1)
    assert (throughput["candidate"], throughput["concurrency"]) == ("dp2ep2 moe=a2a kv=fp8 mtp=0", 8)
    for e, measure in ((latency, "tok_s_per_user"), (throughput, "tok_s_per_gpu")):
        at = [r for r in result["rows"] if r["concurrency"] == e["concurrency"]]
        assert e["recipe_row"] in at and e["glmc_row"] in at and not e["same"]
        assert e["glmc_row"][measure] == max(r[measure] for r in at) > e["recipe_row"][measure]
        assert e["recipe_row"]["candidate"].split(" nccl")[0] == e["candidate"]
        for side, key in (("recipe_row", "recipe_ms"), ("glmc_row", "glmc_ms")):
            row = e[side]
            assert sum(t[key] for t in e["terms"]) == pytest.approx(row["tpot_ms"], rel=1e-9)
            assert all(t[key] == row["step_terms_ms"][t["term"]] / row["accept_length"] for t in e["terms"])
        own, pick = e["recipe_row"], e["glmc_row"]
        for label, key, fmt in (("TPOT ms", "tpot_ms", "{:.3f}"), ("tok/s per GPU", "tok_s_per_gpu", "{:.1f}"),
                                ("tok/s per user", "tok_s_per_user", "{:.1f}"), ("step ms", "step_ms", "{:.3f}")):
            assert f"{label:<44} {fmt.format(own[key]):>12} {fmt.format(pick[key]):>12}" in out
        top = e["terms"][0]
        assert f"{top['recipe_ms']:>12.3f} {top['glmc_ms']:>12.3f} {top['difference_ms']:>+12.3f}" in out
        assert e["summary"] in out and f"the biggest difference is {top['label']}" in e["summary"]
    assert out.index("latency (SGLang's latency recipe: TP2") < out.index("throughput (SGLang's throughput recipe")


def test_explain_says_when_the_pick_is_the_recipe(tiny):
    result = search(tiny, load(CALIBRATION), 2, parse_workload("in=512,out=128"), concurrency=(1,), drafts=(3,),
                    kv_dtypes=("fp8",), only=["tp2"])
    latency = explain_recipes(result)["recipes"][0]
    assert latency["same"] and latency["terms"] == []
    assert latency["summary"].startswith("latency: glmc's pick is the recipe's own candidate, tp2 moe=auto kv=fp8 "
                                         "mtp=3")
    assert latency["summary"] in render_explain(explain_recipes(result))


def test_explain_names_the_recipes_drop_reason(tiny):
    """At 80 MB per GPU nothing fits 64 requests: the throughput recipe is compared at the largest
    concurrency that fits, and its own drop at 64 is said with the search's reason."""
    result = search(tiny, load(CALIBRATION), 2, parse_workload("in=512,out=128"), concurrency=(1, 64),
                    kv_dtypes=("fp8",), gpu_memory=(80 * 10**6, "test"))
    throughput = explain_recipes(result)["recipes"][1]
    reason = next(d["reason"] for d in result["dropped"] if d["candidate"] == "dp2ep2 moe=a2a kv=fp8 mtp=0 c=64")
    assert throughput["concurrency"] == 1
    assert throughput["note"] == ("no candidate fits at concurrency 64, compared at 1; the recipe's "
                                  f"dp2ep2 moe=a2a kv=fp8 mtp=0 c=64: {reason}")
    assert "needs" in reason and "per GPU >" in reason


def test_speculative_rows_carry_the_measured_host_time(result):
    """A row with drafts pays the speculative cycle's measured host work; plain rows do not, and the
    numbers are the recorded run's (a served cycle's wall time minus its graph replays)."""
    from pathlib import Path

    from glmc.predict import SPEC_HOST_MS, SPEC_HOST_SOURCE, spec_host_ms
    runs = json.loads((Path(__file__).resolve().parents[1] / SPEC_HOST_SOURCE).read_text())["small"]["runs"]
    for n, measured in SPEC_HOST_MS.items():
        got = [runs[f"N={n}"][c]["cycle_ms"] - runs[f"N={n}"][c]["replays"]["cycle_ms"] for c in ("c1", "c16")]
        assert measured == pytest.approx(tuple(got), abs=5e-4)
    assert spec_host_ms(0, 64) == 0 and spec_host_ms(3, 16) == SPEC_HOST_MS[3][1]
    for r in result["rows"]:
        want = spec_host_ms(r["mtp_drafts"], r["concurrency"])
        assert r["step_terms_ms"]["spec_host"] == pytest.approx(want) and (want > 0) == (r["mtp_drafts"] > 0)
