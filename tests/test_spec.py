"""Model spec and parallel spec validation: errors name the file, the field and the numbers."""
import json

import pytest
import yaml

from glmc.cli import _model_path
from glmc.parallel import ParallelError, parse_parallel
from glmc.spec import SpecError, load_spec
from tests.compile_util import FULL, TINY, spec


def test_glm53_hyperparameters_and_indexer_layers():
    c = spec(FULL).config
    types = c.layer_indexer_types()
    full = [i for i, t in enumerate(types) if t == "full"]
    assert len(full) == 21 and full[:5] == [0, 1, 2, 6, 10] and full[-1] == 74
    assert c.layer_mlp_types()[:4] == ("dense", "dense", "dense", "sparse")
    assert c.qk_head_dim == 256


def test_tiny_is_same_architecture_with_sparse_attention_at_32_tokens():
    c = spec(TINY).config
    assert c.index_topk < 32 and "shared" in c.layer_indexer_types() and c.n_group > 1
    assert spec(TINY).program == spec(FULL).program


def _write(tmp_path, mutate):
    data = yaml.safe_load(open(_model_path(TINY)).read())
    data["program"] = "glm_moe_dsa"
    mutate(data)
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("mutate,field,reason", [
    (lambda d: d["config"].pop("hidden_size"), "config.hidden_size", "Field required"),
    (lambda d: d["config"].update(num_attention_heads="many"), "config.num_attention_heads",
     "valid integer"),
    (lambda d: d["config"].update(indexer_types=["full", "shared"]), "config",
     "indexer_types has 2 entries, num_hidden_layers is 4"),
    (lambda d: d["config"].update(indexer_types=["shared", "full", "full", "full"]), "config",
     "layer 0 must be 'full'"),
    (lambda d: d["config"].update(topk_group=3), "config", "topk_group 3 > n_group 2"),
    (lambda d: d.update(colour="blue"), "colour", "Extra inputs are not permitted"),
    (lambda d: d["dtypes"].update(kv_cache="int3"), "dtypes.kv_cache", "Input should be"),
])
def test_bad_model_file_names_file_field_reason(tmp_path, mutate, field, reason):
    p = _write(tmp_path, mutate)
    with pytest.raises(SpecError) as e:
        load_spec(p)
    msg = str(e.value)
    assert str(p) in msg and f"field {field}" in msg and reason in msg


def test_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("name: [unclosed")
    with pytest.raises(SpecError, match="broken.yaml: not valid YAML"):
        load_spec(p)
    with pytest.raises(SpecError, match="no such model file"):
        load_spec(tmp_path / "missing.yaml")


def test_hf_checkpoint_dir(tmp_path):
    from transformers import GlmMoeDsaConfig
    d = GlmMoeDsaConfig().to_dict()
    d["rope_parameters"] = {"rope_theta": 8e6, "rope_type": "default"}
    (tmp_path / "config.json").write_text(json.dumps(d))
    s = load_spec(tmp_path)
    assert s.config.hidden_size == 6144 and s.config.rope_theta == 8e6
    assert s.program == spec(FULL).program
    d["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(SpecError, match="field model_type: 'llama'"):
        load_spec(tmp_path)


@pytest.mark.parametrize("text,mesh", [
    ("tp1", (1, 1, 1, 1)), ("tp8", (1, 8, 1, 8)), ("tp8ep8", (1, 8, 8, 1)),
    ("dp8ep8", (8, 1, 8, 1)), ("dp4tp2ep8", (4, 2, 8, 1)), ("tp8ep4", (1, 8, 4, 2)),
    ("dp16ep16", (16, 1, 16, 1)), ("dp32ep32", (32, 1, 32, 1)), ("dp2tp2ep4", (2, 2, 4, 1)),
])
def test_parallel_specs(text, mesh):
    p = parse_parallel(text, spec(FULL).config)
    assert (p.attn_dp, p.attn_tp, p.ep, p.moe_tp) == mesh


@pytest.mark.parametrize("text,msg", [
    ("tp48", "num_attention_heads = 64 is not divisible by attn_tp = 48"),
    ("dp8ep3", "ep 3 does not divide world 8"),
    ("dp512ep512", "n_routed_experts = 256 is not divisible by ep = 512"),
    ("ep8", "use tp{N}"), ("dp8", "use tp{N}"), ("pp2", "use tp{N}"),
])
def test_parallel_errors_show_numbers(text, msg):
    with pytest.raises(ParallelError, match=msg.replace("{", r"\{").replace("}", r"\}")):
        parse_parallel(text, spec(FULL).config)


def test_deepseek_v32_config_compiles(tmp_path):
    """A DeepSeek-V3.2 config.json (same code path, other shapes, yarn RoPE) compiles for dp8ep8."""
    from glmc.compiler import compile_plan
    cfg = dict(model_type="deepseek_v32", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
               moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
               q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
               n_group=8, topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5,
               index_topk=2048, index_n_heads=64, index_head_dim=128, rope_theta=10000,
               num_nextn_predict_layers=1, architectures=["DeepseekV32ForCausalLM"],
               rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096},
               quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = load_spec(tmp_path)
    assert s.config.layer_indexer_types().count("full") == 61 and s.dtypes.weight == "fp8"
    plan = compile_plan(s, parse_parallel("dp8ep8", s.config))
    attn = next(op for op in plan.graphs["decode"].ops if op.kind == "attn.mla_absorbed")
    mscale = 0.1 * 1.0 * __import__("math").log(40) + 1.0
    assert abs(attn.attr("scale") - 192 ** -0.5 * mscale ** 2) < 1e-12
    assert not any(op.kind == "idx.reuse" for op in plan.graphs["decode"].ops)


def test_full_model_compiles_all_phases_quickly(monkeypatch):
    """The user's compile (the verifier on the final graph only) of all 4 phases takes < 5 s."""
    import time
    monkeypatch.setenv("GLMC_VERIFY", "0")
    from glmc.compiler import compile_plan
    s = spec(FULL)
    t = time.perf_counter()
    plan = compile_plan(s, parse_parallel("dp8ep8", s.config))
    assert len(plan.graphs) == 4
    assert time.perf_counter() - t < 5.0
