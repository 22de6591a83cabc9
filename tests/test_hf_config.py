"""Never silently wrong: every config.json key glmc reads is honoured, or refused with its name and value.

The walk: each GlmConfig field (HF names) is changed in a tiny config.json and must change what glmc
builds (the IR of every phase, or the checkpoint's tensor list), be refused, or be one of the few
fields that only the server reads (named below with their reader). Keys that do not touch a forward
pass (`HF_INERT`) must change nothing; keys glmc implements for one value (`HF_REQUIRED`) and unknown
keys are refused; every key transformers' own configs write has a status.
"""
import json

import pytest
from glmc.ir import print_graph
from glmc.runtime.worker.checkpoint import expected_tensors
from glmc.runtime.worker.model_runner import context_limit
from tiny_hf import YARN, make_config
from transformers import DeepseekV32Config, GlmMoeDsaConfig

from glmc.compiler import compile_plan
from glmc.config import GlmConfig, Options
from glmc.parallel import parse_parallel
from glmc.spec import HF_INERT, HF_REQUIRED, SpecError, hf_key_status, load_spec

# Per GlmConfig field: a change to the base config.json (the field, plus what must move with it).
CHANGES = {
    "vocab_size": {"vocab_size": 320},
    "hidden_size": {"hidden_size": 96},
    "intermediate_size": {"intermediate_size": 64},
    "moe_intermediate_size": {"moe_intermediate_size": 48},
    "num_hidden_layers": {"num_hidden_layers": 3},
    "num_attention_heads": {"num_attention_heads": 4, "num_key_value_heads": 4},
    "q_lora_rank": {"q_lora_rank": 16},
    "kv_lora_rank": {"kv_lora_rank": 16},
    "qk_nope_head_dim": {"qk_nope_head_dim": 8, "qk_head_dim": 16},
    "qk_rope_head_dim": {"qk_rope_head_dim": 4, "qk_head_dim": 20},
    "v_head_dim": {"v_head_dim": 8},
    "n_routed_experts": {"n_routed_experts": 16},
    "num_experts_per_tok": {"num_experts_per_tok": 3},
    "n_shared_experts": {"n_shared_experts": 2},
    "n_group": {"n_group": 2},
    "topk_group": {"topk_group": 1},
    "norm_topk_prob": {"norm_topk_prob": False},
    "routed_scaling_factor": {"routed_scaling_factor": 1.0},
    "first_k_dense_replace": {"first_k_dense_replace": 2},
    "index_topk": {"index_topk": 4},
    "index_n_heads": {"index_n_heads": 8},
    "index_head_dim": {"index_head_dim": 32},
    "index_topk_freq": {"index_topk_freq": 1},
    "index_skip_topk_offset": {"index_skip_topk_offset": 3},
    "index_topk_pattern": {"index_topk_pattern": "FSFF"},  # the base schedule is F F S F
    "indexer_types": {"indexer_types": ["full", "shared", "shared", "full"]},
    "indexer_rope_interleave": {"indexer_rope_interleave": False},
    "mlp_layer_types": {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]},
    "rms_norm_eps": {"rms_norm_eps": 1e-6},
    "rope_theta": {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
    "rope_scaling": {"rope_parameters": YARN},
    "num_nextn_predict_layers": {"num_nextn_predict_layers": 1},
    "tie_word_embeddings": {"tie_word_embeddings": True},
    "max_position_embeddings": {"max_position_embeddings": 256},
    "eos_token_id": {"eos_token_id": [1, 2]},
}
# Fields only the server reads, and where: they limit or stop generation, never change a logit.
SERVER_ONLY = {
    "max_position_embeddings": lambda c: context_limit(c.max_position_embeddings, 1000, None),
    "eos_token_id": lambda c: c.eos_token_id,  # stop ids: runtime/engine/tokenizer.py reads config.json
}


def base_config() -> dict:
    """The tiny GLM's config.json with the per-layer schedules left to their rules (freq 2, offset 2)."""
    raw = make_config("grouped").to_dict()
    for k in ("indexer_types", "mlp_layer_types"):
        raw.pop(k)
    return {**raw, "index_topk_freq": 2, "index_skip_topk_offset": 2}


def load(tmp_path, raw: dict):
    """The spec of a checkpoint directory holding `raw` as config.json (one name: the IR shows it)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(raw))
    return load_spec(ckpt)


def built(spec) -> tuple:
    """What glmc builds from a spec: the IR of every phase and the checkpoint's tensors."""
    plan = compile_plan(spec, parse_parallel("tp1", spec.config), Options(device="cpu"))
    c = spec.config
    return ({ph: print_graph(g) for ph, g in plan.graphs.items()},
            expected_tensors(c, mtp=c.num_nextn_predict_layers > 0))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    spec = load(tmp_path_factory.mktemp("base"), base_config())
    return spec, built(spec)


def test_the_walk_covers_every_field():
    assert set(CHANGES) == set(GlmConfig.model_fields)


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_each_field_is_honoured_or_refused(field, base, tmp_path, monkeypatch):
    monkeypatch.setenv("GLMC_VERIFY", "0")
    spec0, built0 = base
    try:
        spec = load(tmp_path, {**base_config(), **CHANGES[field]})
    except SpecError as e:
        value = next(iter(CHANGES[field].values()))
        assert field in str(e) and str(value).lower() in str(e).lower(), str(e)
        return
    assert getattr(spec.config, field) != getattr(spec0.config, field)
    if field in SERVER_ONLY:
        assert SERVER_ONLY[field](spec.config) != SERVER_ONLY[field](spec0.config)
        assert built(spec) == built0
    else:
        assert built(spec) != built0, f"{field} changed but nothing glmc builds did"


@pytest.mark.parametrize("key,value", [
    ("architectures", ["Other"]), ("transformers_version", "0.0"), ("initializer_range", 1.0),
    ("attention_dropout", 0.5), ("use_cache", False), ("head_dim", 99), ("bos_token_id", 7),
    ("output_router_logits", True), ("chunk_size_feed_forward", 4), ("ep_size", 8),
    ("auto_map", {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}),
])
def test_inert_keys_change_nothing(key, value, base, tmp_path, monkeypatch):
    monkeypatch.setenv("GLMC_VERIFY", "0")
    assert key in HF_INERT
    spec = load(tmp_path, {**base_config(), key: value})
    assert spec.config == base[0].config and built(spec) == base[1]


@pytest.mark.parametrize("key,value", [
    ("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu"), ("scoring_func", "softmax"),
    ("topk_method", "greedy"), ("moe_layer_freq", 2), ("rope_interleave", False), ("use_qk_norm", True),
    ("partial_rotary_factor", 0.5), ("num_key_value_heads", 1), ("num_experts", 4), ("qk_head_dim", 30),
    ("pretraining_tp", 2),
])
def test_required_values_are_refused_otherwise(key, value, tmp_path):
    assert key in HF_REQUIRED
    with pytest.raises(SpecError, match=rf"field {key}: {value!r} is not supported"):
        load(tmp_path, {**base_config(), key: value})


@pytest.mark.parametrize("raw,message", [
    ({"sliding_window": 128}, r"field sliding_window: 128 is an unknown config.json key"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     r"field rope_scaling.rope_type: Input should be 'yarn' \(got 'linear'\)"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, r"\(got 'dynamic'\)"),
    ({"rope_parameters": {**YARN, "low_freq_factor": 1.0}}, r"field rope_scaling.low_freq_factor: Extra inputs"),
    ({"rope_parameters": {"rope_type": "default", "factor": 2.0}}, r"field rope_parameters: plain RoPE"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, r"\(got 'llama3'\)"),
    ({"tie_word_embeddings": True}, r"tie_word_embeddings true is not supported"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, r"quantization_config.quant_method: 'gptq'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
     r"quantization_config.weight_block_size: \[64, 64\] is not supported"),
])
def test_rope_types_and_unknown_keys_are_refused_by_name(raw, message, tmp_path):
    with pytest.raises(SpecError, match=message):
        load(tmp_path, {**base_config(), **raw})


@pytest.mark.parametrize("cls", [GlmMoeDsaConfig, DeepseekV32Config])
def test_every_key_transformers_writes_has_a_status(cls):
    for key in cls().to_dict():
        assert hf_key_status(key) != "refused", key
