"""Tiny random glm_moe_dsa and deepseek_v32 checkpoints for tests; the HF model built here is the
numerical oracle.

HF initialises weights with std 0.02, which leaves logits nearly tied and attention nearly uniform, so
top-k and routing bugs would hide. `randomize_` re-draws every weight at unit-variance scale (norm
weights around 1, non-zero LayerNorm bias and router bias) so sparse attention, group-limited routing
and greedy decoding are all decisive. Everything is deterministic given the seed.

16 indexer heads: an index score is an exact tie (every head ReLU'd to 0) with probability ~2^-16 per
key. glmc breaks exact top-k ties by the lowest position; HF's torch.topk breaks them arbitrarily, so
HF parity tests need configs without ties (tests that force ties compare glmc's implementations).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import (
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
)

# Shapes small enough for 2 CPU cores; index_topk below the prompt lengths used in tests so DSA is active.
BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=4, topk_group=2, first_k_dense_replace=1, index_topk=8, index_n_heads=16, index_head_dim=16,
    indexer_types=["full", "shared", "full", "shared"], routed_scaling_factor=2.5, rms_norm_eps=1e-5,
    max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
)
# Named variants: "grouped" = n_group 4 / topk_group 2, FSFS indexers; "wide" = 4 heads, 3 layers,
# ungrouped routing, indexer schedule from HF's freq/offset rule (F F S), index_topk 16.
CONFIGS = {
    "grouped": {},
    "wide": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
                 n_group=1, topk_group=1, index_topk=16, indexer_types=None,
                 index_topk_freq=2, index_skip_topk_offset=2, first_k_dense_replace=2, vocab_size=320,
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}


def glm_config(hf_config):
    """The `glmc.config.GlmConfig` glmc reads from this HF config (as its config.json dict)."""
    from glmc.spec import config_from_hf
    return config_from_hf(hf_config.to_dict())


# DeepSeek-V3.2 (`deepseek_v32`): every layer has an indexer, whose RoPE rotates halves (rotate_half),
# and yarn RoPE as its checkpoints ship it (factor 8 over 64 original positions; mscale_all_dim 0.8
# makes the cos/sin attention factor and the softmax mscale both differ from 1).
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
DSV32 = dict(indexer_types=None, rope_parameters=YARN, index_topk=12)


def make_config(name: str = "grouped", **overrides):
    """A GlmMoeDsaConfig from BASE + CONFIGS[name] + overrides (HF derives the rest); name "dsv32"
    (BASE + DSV32 + overrides) gives a DeepseekV32Config."""
    kw = {**BASE, **(DSV32 if name == "dsv32" else CONFIGS[name]), **overrides}
    if kw.get("indexer_types") is None:
        kw.pop("indexer_types", None)
    return DeepseekV32Config(**kw) if name == "dsv32" else GlmMoeDsaConfig(**kw)


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw every parameter and the router bias at decisive scales (see module doc)."""
    g = torch.Generator().manual_seed(seed)
    for name, t in sorted(list(module.named_parameters()) + list(module.named_buffers())):
        if "inv_freq" in name:
            continue
        noise = torch.randn(t.shape, generator=g)
        if name.endswith("e_score_correction_bias") or name.endswith("k_norm.bias"):
            t.copy_(0.2 * noise)
        elif t.dim() == 1:  # RMSNorm / LayerNorm weights
            t.copy_(1.0 + 0.2 * noise)
        elif name.endswith("embed_tokens.weight"):
            t.copy_(noise)
        else:  # [.., out, in] linear weights, fused experts included
            t.copy_(noise / math.sqrt(t.shape[-1]))
    return module


def build_hf(config, seed: int = 0):
    """A randomised fp32 HF model (GlmMoeDsa or DeepseekV32 ForCausalLM, by the config) in eval mode."""
    torch.manual_seed(seed)
    cls = DeepseekV32ForCausalLM if isinstance(config, DeepseekV32Config) else GlmMoeDsaForCausalLM
    return randomize_(cls(config), seed).float().eval()


@torch.no_grad()
def shrink_latents_(model: GlmMoeDsaForCausalLM, factor: float = 1e-3) -> None:
    """Scale q_a_proj and the c_kv rows of kv_a_proj so the latents' variance (~1e-6) is comparable
    to the RMSNorm eps: a wrong q_a/kv_a layernorm eps then moves logits by O(1), not O(1e-6)."""
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_a_proj.weight.mul_(factor)
        attn.kv_a_proj_with_mqa.weight[: attn.kv_lora_rank].mul_(factor)


def save_tiny(path: Path, name: str = "grouped", seed: int = 0, max_shard_size=None, tweak=None, **overrides):
    """Build, randomise (then `tweak(model)` if given) and save_pretrained a tiny model; returns it."""
    model = build_hf(make_config(name, **overrides), seed)
    if tweak is not None:
        tweak(model)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return model


def per_expert(prefix: str, fused_gate_up: torch.Tensor, fused_down: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF's in-memory fused experts -> the per-expert names HF saves (gate rows first, then up)."""
    out, inter = {}, fused_down.shape[-1]
    for e in range(fused_gate_up.shape[0]):
        out[f"{prefix}{e}.gate_proj.weight"] = fused_gate_up[e, :inter].clone()
        out[f"{prefix}{e}.up_proj.weight"] = fused_gate_up[e, inter:].clone()
        out[f"{prefix}{e}.down_proj.weight"] = fused_down[e].clone()
    return out


def checkpoint_names(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """state_dict of an HF module under `prefix`, with fused experts split to checkpoint names."""
    sd, out = module.state_dict(), {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj"):
            out |= per_expert(prefix + k[: -len("gate_up_proj")], v, sd[k[: -len("gate_up_proj")] + "down_proj"])
        elif not k.endswith("experts.down_proj") and "inv_freq" not in k:
            out[prefix + k] = v.clone()
    return out


def fp8_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled float8_e4m3fn: S = amax(block) / 448, Wq = W / S (DeepSeek's recipe)."""
    rows, cols = w.shape
    nb_r, nb_c = -(-rows // block), -(-cols // block)
    padded = torch.zeros(nb_r * block, nb_c * block)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(nb_r, block, nb_c, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view(nb_r * block, nb_c * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


FP8_UNQUANTISED = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "weights_proj.weight")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def save_tiny_fp8(path: Path, name: str = "grouped", seed: int = 0, **overrides):
    """`save_tiny`, then its linear weights rewritten block-FP8 as GLM-5 FP8 checkpoints ship them
    (e4m3 + `weight_scale_inv`; embed, lm_head, router, indexer weights_proj and norms unquantised) and
    `quantization_config` added (config dtype unchanged: fp32 compute on FP8 weights). Returns the model."""
    import json
    from safetensors.torch import load_file, save_file
    model = save_tiny(path, name, seed, **overrides)
    out = {}
    for n, t in load_file(path / "model.safetensors").items():
        if t.dim() == 2 and not n.endswith(FP8_UNQUANTISED):
            out[n], out[n + "_scale_inv"] = fp8_quantize(t)
        else:
            out[n] = t
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": FP8_CONFIG}))
    return model
