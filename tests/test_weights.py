"""Checkpoint loading: names/shapes from config, round trips, sharded files, FP8, errors, rank slices."""
import json

import pytest
import torch
from glmc.codegen.fp8_ref import fp8_block_dequant
from glmc.runtime.worker.checkpoint import (
    WeightError,
    detect_mtp,
    expected_tensors,
    load_checkpoint,
)
from safetensors.torch import save_file
from tiny_hf import fp8_quantize, glm_config, make_config, save_tiny

from glmc.spec import config_from_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = save_tiny(path, "grouped", seed=11)
    return path, model


def test_expected_tensors_is_exactly_what_hf_saves(tiny):
    path, model = tiny
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert expected_tensors(glm_config(model.config)) == saved
    # The same from the config.json dict (HF keys), as a server would read it.
    assert expected_tensors(config_from_hf(json.loads((path / "config.json").read_text()))) == saved
    names = set(saved)
    assert "model.layers.1.self_attn.indexer.wk.weight" not in names  # shared layer: no indexer
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.1.mlp.experts.7.up_proj.weight" in names


def test_config_from_hf_derives_hf_fields():
    """GlmConfig reproduces HF's derived per-layer fields from the config.json keys."""
    base = glm_config(make_config("grouped")).model_dump(exclude_none=True)
    base.update(model_type="glm_moe_dsa", indexer_types=None, mlp_layer_types=None, num_hidden_layers=78,
                first_k_dense_replace=3, index_topk_freq=4, index_skip_topk_offset=3)
    c = config_from_hf(base)
    assert sorted(c.full_indexer_layers()) == [0, 1, 2] + list(range(6, 78, 4))
    assert len(c.full_indexer_layers()) == 21 and c.layer_mlp_types()[:4] == ("dense",) * 3 + ("sparse",)
    pattern = config_from_hf({**base, "num_hidden_layers": 3, "index_topk_pattern": "FSF"})
    assert pattern.layer_indexer_types() == ("full", "shared", "full")
    for cfg in (make_config("grouped"), make_config("wide")):
        assert list(glm_config(cfg).layer_indexer_types()) == cfg.indexer_types
        assert list(glm_config(cfg).layer_mlp_types()) == cfg.mlp_layer_types


def test_round_trip_and_sharded_index(tiny, tmp_path):
    path, model = tiny
    state = {k: v for k, v in model.state_dict().items()}
    w = load_checkpoint(path, expected_tensors(glm_config(model.config)))
    kv_b = "model.layers.2.self_attn.kv_b_proj.weight"
    assert torch.equal(w[kv_b], state[kv_b])
    inter = model.config.moe_intermediate_size
    fused = state["model.layers.3.mlp.experts.gate_up_proj"]
    assert torch.equal(w["model.layers.3.mlp.experts.5.up_proj.weight"], fused[5, inter:])
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    sharded = load_checkpoint(tmp_path, expected_tensors(glm_config(model.config)))
    assert sharded.keys() == w.keys() and all(torch.equal(sharded[k], w[k]) for k in w)


def test_mismatches_raise_with_names_and_shapes(tiny):
    path, model = tiny
    exp = expected_tensors(glm_config(model.config))
    missing = dict(exp, **{"model.layers.9.mlp.gate.weight": (8, 64)})
    msg = r"missing tensor model\.layers\.9\.mlp\.gate\.weight: expected shape \(8, 64\), found none"
    with pytest.raises(WeightError, match=msg):
        load_checkpoint(path, missing)
    extra = {k: v for k, v in exp.items() if k != "lm_head.weight"}
    with pytest.raises(WeightError, match=r"unexpected tensor lm_head\.weight: expected none, found shape \(256, 64\)"):
        load_checkpoint(path, extra)
    bad = dict(extra, **{"model.norm.weight": (65,)})  # every problem is reported in one error
    with pytest.raises(WeightError, match=r"2 checkpoint mismatch") as err:
        load_checkpoint(path, bad)
    assert "model.norm.weight: expected shape (65,), found (64,)" in str(err.value)
    assert "unexpected tensor lm_head.weight" in str(err.value)
    # The MTP block is not in an HF checkpoint: asking for it names its tensors.
    with pytest.raises(WeightError, match=r"missing tensor model\.layers\.4\.eh_proj\.weight"):
        load_checkpoint(path, expected_tensors(glm_config(model.config), mtp=True))
    assert detect_mtp(path) == {"mtp": False, "mtp_head": False, "mtp_embed": False}


def test_shard_reads_the_right_slice(tiny):
    path, model = tiny
    exp = expected_tensors(glm_config(model.config))
    full = load_checkpoint(path, exp)
    cols = {"model.layers.0.self_attn.q_b_proj.weight": 0, "model.layers.0.self_attn.o_proj.weight": 1}
    for rank in range(2):
        part = load_checkpoint(path, exp, shard=lambda n: (cols[n], rank, 2) if n in cols else None)
        q_b, o = full["model.layers.0.self_attn.q_b_proj.weight"], full["model.layers.0.self_attn.o_proj.weight"]
        assert torch.equal(part["model.layers.0.self_attn.q_b_proj.weight"], q_b.chunk(2, 0)[rank])
        assert torch.equal(part["model.layers.0.self_attn.o_proj.weight"], o.chunk(2, 1)[rank])
        assert torch.equal(part["model.norm.weight"], full["model.norm.weight"])
    with pytest.raises(WeightError, match="does not split 3 ways"):
        load_checkpoint(path, exp, shard=lambda n: (0, 0, 3) if n == "model.norm.weight" else None)


def test_fp8_checkpoint_dequantises(tiny, tmp_path):
    path, model = tiny
    w = load_checkpoint(path, expected_tensors(glm_config(model.config)))
    keep = ("mlp.gate.weight", "weights_proj.weight", "lm_head.weight", "embed_tokens.weight")
    quant, want = {}, {}
    for name, t in w.items():
        if t.dim() == 2 and not name.endswith(keep):
            q, s = fp8_quantize(t)
            quant |= {name: q, name + "_scale_inv": s}
            want[name] = fp8_block_dequant(q, s)
        else:
            quant[name], want[name] = t, t
    save_file(quant, tmp_path / "model.safetensors")
    got = load_checkpoint(tmp_path, expected_tensors(glm_config(model.config)))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    name = "model.layers.1.self_attn.q_b_proj.weight"
    assert not torch.equal(got[name], w[name]) and torch.allclose(got[name], w[name], rtol=0.07, atol=1e-2)
    # A missing scale is an error, not a silently unscaled weight.
    del quant[name + "_scale_inv"]
    save_file(quant, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match=r"q_b_proj\.weight_scale_inv: expected shape \(1, 1\), found None"):
        load_checkpoint(tmp_path, expected_tensors(glm_config(model.config)))


def test_fp8_shard_slices_across_block_boundaries(tmp_path):
    g = torch.Generator().manual_seed(2)
    big = torch.randn(300, 260, generator=g) * torch.linspace(0.1, 10, 260)  # per-block scales differ
    q, s = fp8_quantize(big)
    assert s.shape == (3, 3)
    save_file({"w": q, "w_scale_inv": s}, tmp_path / "model.safetensors")
    full = fp8_block_dequant(q, s)
    assert torch.equal(load_checkpoint(tmp_path, {"w": (300, 260)})["w"], full)
    for dim, world in ((0, 3), (1, 2), (0, 5)):
        for rank in range(world):
            part = load_checkpoint(tmp_path, {"w": (300, 260)}, shard=lambda n: (dim, rank, world))["w"]
            assert torch.equal(part, full.chunk(world, dim)[rank]), (dim, world, rank)
    bf16 = load_checkpoint(tmp_path, {"w": (300, 260)}, dtype=torch.bfloat16)["w"]
    assert bf16.dtype == torch.bfloat16


def test_mtp_checkpoint_detected_and_loaded(tiny, tmp_path):
    path, model = tiny
    w = load_checkpoint(path, expected_tensors(glm_config(model.config)))
    full = expected_tensors(glm_config(model.config), mtp=True, mtp_head=True)
    extra = {k: torch.randn(s) for k, s in full.items() if k not in w}
    assert "model.layers.4.shared_head.head.weight" in extra and "model.layers.4.self_attn.indexer.wk.weight" in extra
    assert "model.layers.4.mlp.experts.7.down_proj.weight" in extra and "model.layers.4.embed_tokens.weight" not in extra
    save_file({**w, **extra}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    flags = detect_mtp(tmp_path)
    assert flags == {"mtp": True, "mtp_head": True, "mtp_embed": False}
    got = load_checkpoint(tmp_path, expected_tensors(glm_config(model.config), **flags))
    assert torch.equal(got["model.layers.4.eh_proj.weight"], extra["model.layers.4.eh_proj.weight"])


def test_the_router_stays_fp32_in_a_bf16_model(tiny, tmp_path):
    """HF keeps the router's gate weight and correction bias in fp32 whatever the model's dtype
    (`_keep_in_fp32_modules_strict`): a bf16 runner reads them from the checkpoint in fp32, bit for
    bit, so the expert sets are ranked as HF ranks them; the rest is in bf16."""
    from glmc.compiler import compile_plan
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.runtime.worker.loader import load_runner
    from glmc.spec import load_spec
    from safetensors.torch import load_file
    path, _ = tiny
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    saved = load_file(tmp_path / "model.safetensors")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert not torch.equal(saved[bias], saved[bias].bfloat16().float())   # bf16 would round it
    spec = load_spec(tmp_path)
    plan = compile_plan(spec, parse_parallel("tp1", spec.config), Options(device="cuda", max_batch=2))
    weights = load_runner(plan, tmp_path, device="cpu", num_pages=4, max_context=64, max_running=2,
                          capture=False).executor.weights
    for name in (bias, "model.layers.1.mlp.gate.weight"):
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], saved[name].float()), name
    assert weights["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
