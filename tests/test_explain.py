"""`glmc explain` reproduces the GLM-5.3 article's figures (and the CLI around it)."""
import json

import onnx
import pytest

from glmc.cli import main
from glmc.compiler import compile_plan
from glmc.diff import diff_text
from glmc.explain import explain_plan
from glmc.parallel import parse_parallel
from glmc.report import render
from tests.compile_util import FULL, graph, spec


@pytest.fixture(scope="module")
def bills():
    s = spec(FULL)
    out = {}
    for par in ("tp8", "tp8ep8", "dp8ep8"):
        plan = compile_plan(s, parse_parallel(par, s.config))
        out[par] = explain_plan(plan, batch=32, context=4096)
    return out


def test_parameters_and_memory(bills):
    d = bills["dp8ep8"]
    assert 743e9 < d["params"]["total"] < 745e9          # ~744B
    assert 39.5e9 < d["params"]["active_per_token"] < 41e9  # ~40B active
    assert d["memory"]["kv_elements_per_token_per_layer"] == 576
    assert d["memory"]["kv_bytes_per_token"] == 656 * 78    # FlashMLA fp8 rows: 51.2 KB/token
    assert (d["memory"]["kv_bytes_per_token_per_layer"], d["memory"]["index_bytes_per_token_per_layer"]) == (656, 132)
    assert d["memory"]["full_indexer_layers"] == 21 and d["memory"]["shared_indexer_layers"] == 57
    assert 105e9 < d["memory"]["weights_bytes_per_rank"] < 115e9   # ~109 GB per rank (EP8)
    # the CUDA target's copies beside the originals (absorbed W_UK / W_UV^T, joined q_a + kv_a rows,
    # the dense and shared MLPs' gate_up): ~5.9 GB on a dp8ep8 rank, whose attention is replicated
    assert 5.5e9 < d["memory"]["weight_copies_bytes_per_rank"] < 6.5e9


def test_step_workspaces(bills):
    """What a step allocates above the held bytes (passes/step_memory.py), per DP rank of dp8ep8 at
    context 4096: a decode step per bucket (up to max_batch, 128 requests, on every DP rank: it is
    per DP rank, as `glmc run --max-running` is), the graphs of all buckets, the largest prefill chunk and
    the indexer's workspace in it: fp32 scores [8192, 4096] and the top-k as int32 KV slots [8192,
    2048] (the positions + 1 come from the step prologue)."""
    m = bills["dp8ep8"]["memory"]
    assert list(m["decode_workspace_bytes"]) == ["1", "2", "4", "8", "12", "16", "24", "32", "48", "64", "96", "128"]
    assert m["graph_bytes"] == m["decode_workspace_bytes"]      # the old name
    pool = m["graph_pool"]
    assert pool["workspaces"] == 2 * 32 * 2**20                 # the warm-up stream + the capture stream
    assert m["graph_pool_bytes"] == pool["outputs"] + pool["inputs"] + pool["workspaces"]
    assert m["prefill_point"] == {"tokens": 8192, "requests": 2, "max_len": 4096}
    assert m["indexer_workspace_bytes"] == 8192 * (4096 * 4 + 2048 * 4)
    # values freed at their last use: a few layers' activations live, not all 78 layers' (held to
    # the step's end, as the executor once did, this chunk needed 679 GB)
    assert 4 * 2**30 < m["prefill_workspace_bytes"] < 24 * 2**30
    assert "prefill step workspace (8192 tokens" in render(bills["dp8ep8"])


def _per_layer(d, phase, layer):
    return {k: v["messages"] for k, v in d["comm"][phase]["per_layer"][str(layer)].items()}


def test_tp8_ledger(bills):
    b = 32 * 6144 * 2
    assert _per_layer(bills["tp8"], "decode", 5) == {"all_reduce": [b, b]}
    step = bills["tp8"]["comm"]["decode"]["per_step"]
    assert step["all_reduce"]["count"] == 157 and step["all_gather"]["count"] == 1


def test_tp8ep8_ledger(bills):
    layer = _per_layer(bills["tp8ep8"], "decode", 5)
    assert layer["reduce_scatter"][-1] == 32 * 6144 * 2
    assert layer["all_gather"][0] == 32 * 6144 * 2


def test_runtime_counts_the_billed_dispatch_message():
    """The targets count a moe.dispatch as its results' payload_bytes over the group, the bill with
    costs.comm_of: the same bytes (an FP8 dispatch's scales included) at any token count."""
    from glmc.passes.costs import comm_of
    g = graph(FULL, "dp8ep8", "decode", moe_a2a=True)
    op = next(o for o in g.ops if o.kind == "moe.dispatch")
    assert op.attr("dtype") == "fp8" and op.types[0].dtype == "fp8"
    for t in (1, 32, 257):
        counted = sum(ty.payload_bytes({"T": t}) for ty in op.types) * int(op.attr("size"))
        assert counted == comm_of(op, g, {"T": t})[1] == 8 * t * 8 * (6144 + 8 + 48 * 4)


def test_dp8ep8_decode_bill_at_batch_32(bills):
    d = bills["dp8ep8"]
    assert _per_layer(d, "decode", 5)["all_gather"][0] == 393216      # 393 KB per DP gather
    assert d["ep_dispatch_bytes_per_token"] == 49152                  # 48 KB per token, fp8
    a2a = d["moe_alternatives"]["a2a"]
    assert a2a["dispatch"]["count"] == 75
    # + routing weights/ids, + each row's fp32 scale per 128 columns (FP8 dispatch)
    assert a2a["dispatch"]["message_bytes"] == 75 * 32 * (49152 + 8 * 8 + 8 * 48 * 4)
    assert a2a["combine"]["message_bytes"] == 75 * 32 * 8 * 6144 * 2
    assert "all_reduce" not in d["comm"]["decode"]["per_step"]         # attention is local


def test_cli_compile_explain_diff_onnx(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["compile", "--model", "glm_moe_dsa_tiny", "--parallel", "tp8ep8", "-o", str(out),
                 "--dump-after", "propagate-sharding,fuse-add-norm"]) == 0
    for name in ("prefill.ir", "decode.ir", "mtp_draft.ir", "mtp_verify.ir", "plan.json", "report.md"):
        assert (out / name).exists(), name
    assert (out / "after" / "02-propagate-sharding" / "decode.ir").exists()
    assert "comm.reshard" in (out / "after" / "02-propagate-sharding" / "decode.ir").read_text()
    capsys.readouterr()
    assert main(["explain", str(out), "--json", "--batch", "8"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["comm"]["decode"]["point"]["T"] == 8 and d["parallel"]["spec"] == "tp8ep8"
    assert main(["explain", str(out)]) == 0
    assert "## Communication: decode" in capsys.readouterr().out
    assert main(["diff", "tp8", "tp8ep8", "--phase", "prefill", "--model", "glm_moe_dsa_tiny"]) == 0
    text = capsys.readouterr().out
    assert "-1 comm.all_reduce (1 -> 0)" in text and "+4 fused.reduce_scatter_add_rms (0 -> 4)" in text
    assert "--- glm-tiny tp8" in text and "+++ glm-tiny tp8ep8" in text
    assert main(["export-onnx", str(out)]) == 0
    model = onnx.load(str(out / "decode.onnx"))
    onnx.checker.check_model(model)
    assert any(n.op_type == "attn.mla_absorbed" and n.domain == "ai.glmc" for n in model.graph.node)


def test_diff_shows_a_lowering_change_once_per_class_of_layers():
    """GLM-5.3 decode under dp2ep2, MoE gather vs all-to-all: a handful of hunks (the metadata, the
    step workspaces among it, then one per class of MoE layers, not one per layer), each naming the
    layers it is in. Layer 3 is a class of its own: its residual norm reads the dense layer 2's
    ffn, the others' read the MoE layer before them's shared and routed outputs."""
    gather, a2a = (graph(FULL, "dp2ep2", "decode", moe_a2a=forced) for forced in (False, True))
    text = diff_text("gather", gather, "a2a", a2a)
    hunks = [line.split(" @@ ")[1] for line in text.splitlines() if line.startswith("@@ ")]
    assert hunks == ["#! cost = {", "#! memory = {", "#! model = glm-5.3", "#! rewrites = {", "layers 3 {",
                     "layers 4..76 step 4 {", "layers 5..77 step 4 {", "layers 6..74 step 4 {", "layers 7..75 step 4 {"]
    assert text.count("\n+  %L.routed.cb = moe.combine(%L.routed, %L.hn) {group=[ep], p2p_max_bytes=4194304, size=2, "
                      "top_k=8}") == 5
    # (the gather form routes on the gathered tokens, the a2a form on its own: 4 router lines a class)
    assert "+75 moe.dispatch (0 -> 75)" in text and len(text.splitlines()) < 160


def test_the_cards_command_compiles_glm53(tmp_path, monkeypatch, capsys):
    """`glmc compile --parallel dp8ep8` (the design card's usage line, no --model) compiles GLM-5.3;
    `glmc diff` of two specs defaults to it too."""
    monkeypatch.setenv("GLMC_VERIFY", "0")
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "--parallel", "dp8ep8"]) == 0
    plan = json.loads((tmp_path / "build" / "glm-5.3-dp8ep8" / "plan.json").read_text())
    assert plan["config"]["num_hidden_layers"] == 78 and plan["config"]["hidden_size"] == 6144
    capsys.readouterr()
    assert main(["diff", "tp8", "dp8ep8"]) == 0
    assert "--- glm-5.3 tp8" in capsys.readouterr().out


def test_compile_moe_routing_flag(tmp_path, monkeypatch):
    """`glmc compile --moe-routing gather` keeps the router's all-gathers that the default (by cost)
    drops from decode steps; the report says which routing each phase got."""
    monkeypatch.setenv("GLMC_VERIFY", "0")
    for routing, out in ((None, tmp_path / "cost"), ("gather", tmp_path / "gather")):
        extra = ["--moe-routing", routing] if routing else []
        assert main(["compile", "--parallel", "tp8ep8", "--model", "glm_moe_dsa_tiny", "-o", str(out), *extra]) == 0
    for name, gathered in (("cost", False), ("gather", True)):
        decode = (tmp_path / name / "decode.ir").read_text()
        assert ("route_ids.ag = comm.all_gather" in decode) == gathered
        assert ("routing gather" if gathered else "routing recompute") in (tmp_path / name / "report.md").read_text()


@pytest.mark.parametrize("argv,msg", [
    (["compile", "--parallel", "tp48", "--model", "glm_moe_dsa"], "attn_tp = 48"),
    (["compile", "--model", "nope.yaml"], "nope.yaml: no such model file"),
    (["compile", "--dump-after", "fuse-everything"], "unknown pass ['fuse-everything']"),
    (["explain", "/nonexistent"], "not a plan directory"),
])
def test_cli_errors(argv, msg, capsys, tmp_path):
    argv = argv + (["-o", str(tmp_path / "p")] if argv[0] == "compile" else [])
    assert main(argv) == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "p").exists()          # nothing half-written


def test_report_cross_checks_the_article(bills):
    from glmc.report import render
    text = render(bills["dp8ep8"])
    assert "Article: GLM-5.3 推理全链路(一)" in text          # the source the figures come from
    assert "| DP all-gather per layer (batch 32) | 393KB | 393,216 B |" in text
    assert "| EP dispatch per token (fp8) | 48KB | 49,152 B |" in text
    assert "83.3 GFLOP | 103.5 GFLOP" in text


def test_fusions_are_listed_with_their_layers(bills):
    from glmc.report import render
    d = bills["tp8"]
    assert d["fused_ops"]["decode"]["fused.qkv_a_norm_rope_write_index"][:4] == [0, 1, 2, 6]
    text = render(d)
    assert "`fused.allreduce_add_rms` x156: layers 0-77, final" in text


def test_glmc_dump_ir_env(tmp_path, monkeypatch):
    from tests.compile_util import plan
    monkeypatch.setenv("GLMC_DUMP_IR", str(tmp_path / "dumps"))
    plan("glm_moe_dsa_tiny", "tp8")
    names = sorted(p.name for p in (tmp_path / "dumps").iterdir())
    assert names[0] == "00-expand-layers" and names[-1] == "14-estimate-cost"
    assert "comm.reshard" in (tmp_path / "dumps" / "02-propagate-sharding" / "decode.ir").read_text()
