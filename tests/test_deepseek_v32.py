"""DeepSeek-V3.2 (`deepseek_v32`) checkpoints against transformers' DeepseekV32ForCausalLM.

What differs from GLM-5 and must be exact: the indexer's RoPE rotates the two halves of its rope dims
(rotate_half), not interleaved pairs; every layer has its own indexer; and yarn RoPE changes the
frequencies, scales cos/sin by its attention factor and the softmax scale by mscale^2. The tiny
checkpoint (tests/tiny_hf.py "dsv32") has all of it, with sparse attention active: every prompt is
longer than index_topk (12). Checked: the reference model, the compiled plan on the torch target (tp1
and tp2ep2 as gloo processes), and the CUDA target's Triton kernels run by the interpreter.
"""
import pytest
import torch
from glmc.ir import parse, print_graph
from glmc.runtime.worker.checkpoint import expected_tensors, load_checkpoint
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.launch import spawn
from glmc.runtime.worker.reference_model import ReferenceModel
from tiny_hf import save_tiny
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_ds

from glmc.spec import load_spec
from tests.plan_run import build, greedy, rank_worker
from tests.test_reference_model import hf_logits, prompts, reference

ATOL = 1e-4


@pytest.fixture(scope="module")
def dsv32(tmp_path_factory):
    """(checkpoint dir, the HF oracle) of the tiny DeepSeek-V3.2 with yarn RoPE."""
    path = tmp_path_factory.mktemp("dsv32")
    return path, save_tiny(path, "dsv32", seed=7)


def test_config_and_ir_say_yarn_and_the_indexer_layout(dsv32):
    path, model = dsv32
    c = load_spec(path).config
    assert c.indexer_rope_interleave is False and c.rope_scaling.rope_type == "yarn"
    assert len(c.full_indexer_layers()) == c.num_hidden_layers
    assert c.softmax_scale == hf_ds.DeepseekV32Attention(model.config, 0).scaling
    graph = build(path).executor.graphs["prefill"]
    text = print_graph(graph, fold=False)
    yarn = "scaling=[[type, yarn], [factor, 8.0], [original_max_position_embeddings, 64], [beta_fast, 32.0], " \
           "[beta_slow, 1.0], [truncate, true], [attention_factor, "
    assert f"%L1.iq = rope.apply(%L1.iq_h, %positions) {{dims=8, interleaved=false, {yarn}" in text
    assert f"%L1.q_pe = rope.apply(%L1.q_pe_a, %positions) {{dims=8, interleaved=true, {yarn}" in text
    fused = next(line for line in text.splitlines() if "fused.qkv_a_norm_rope_write_index(%L1.a" in line)
    assert "index_interleaved=false" in fused and " interleaved=true" in fused and yarn in fused
    assert parse(print_graph(graph)) == graph == parse(text)  # the scaling attribute round-trips


def test_reference_model_matches_transformers(dsv32):
    path, model = dsv32
    c = load_spec(path).config
    weights = load_checkpoint(path, expected_tensors(c))
    ps = prompts(c.vocab_size, [23, 40, 31])
    ref, r2t = reference(model, weights, 3)
    batch = ForwardBatch.build("extend", ps, [2, 0, 1], [0, 0, 0], r2t)
    want = torch.cat([hf_logits(model, p) for p in ps])
    assert (ref.forward(batch, return_all_logits=True) - want).abs().max() < ATOL
    # Each of the three matters here: the indexer's layout, yarn, and sparse attention.
    for wrong in ({"indexer_rope_interleave": True}, {"rope_scaling": None}, {"index_topk": 4096}):
        other = ReferenceModel(c.model_copy(update=wrong), weights, ref.pool)
        assert (other.forward(batch, return_all_logits=True) - want).abs().max() > 1e-2, wrong


def test_plan_tp1_matches_transformers_prefill_and_greedy_decode(dsv32):
    path, model = dsv32
    m = build(path)
    ps = prompts(m.spec.config.vocab_size, [26, 26], seed=1)
    logits, tokens, _ = greedy(m, ps, 24)
    for b, p in enumerate(ps):
        assert (logits[b] - hf_logits(model, p)[-1]).abs().max() < ATOL
    want = model.generate(torch.tensor(ps), max_new_tokens=24, do_sample=False, min_new_tokens=24)[:, 26:]
    assert torch.equal(tokens, want)


def test_plan_tp2ep2_as_gloo_processes_equals_tp1(dsv32, tmp_path):
    path, _ = dsv32
    ps = prompts(256, [21, 30, 17], seed=4)
    logits, tokens, _ = greedy(build(path), ps, 4)
    spawn(rank_worker, 2, str(path), "tp2ep2", None, ps, 4, str(tmp_path))
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert (res["logits"] - logits[res["index"]]).abs().max() < 1e-5
        assert torch.equal(res["tokens"], tokens[res["index"]])


def test_triton_kernels_match_transformers(dsv32):
    """The CUDA target's op table (the fused q/kv norm + RoPE + cache write with the indexer's
    half-split keys, indexer scores and top-k, sparse MLA, the last two turning their queries by
    the yarn RoPE as they load them) on the CPU interpreter."""
    from glmc.api import plan_for
    from glmc.runtime.worker.loader import load_runner
    path, model = dsv32
    plan = plan_for(path, device="cuda", max_running=1)      # the CUDA target, run on the CPU
    text = print_graph(plan.graphs["prefill"], fold=False)
    assert "rope.apply" not in text and "rope_interleaved=false, rope_scaling=[[type, yarn]" in text
    assert parse(text) == plan.graphs["prefill"]              # the readers' rope_* attributes round-trip
    runner = load_runner(plan, path, device="cpu", num_pages=2, max_context=64, max_running=1).executor
    (p,) = prompts(plan.config.vocab_size, [17], seed=2)
    r2t = torch.arange(64, 128).view(1, 64)
    out = runner.forward("prefill", ForwardBatch.build("extend", [p], [0], [0], r2t))["logits"]
    want = hf_logits(model, p + [int(out[0].argmax())])
    assert (out[0] - want[-2]).abs().max() < ATOL
    step = runner.forward("decode", ForwardBatch.build("decode", [[int(out[0].argmax())]], [0], [17], r2t))
    assert (step["logits"][0] - want[-1]).abs().max() < ATOL
