"""The packaged models `glmc run --weights NAME` serves by name.

`glmc-small` (the default of `glmc run`): models/small, a trained glm_moe_dsa checkpoint (7.5M
parameters, every feature active, trained on the Python standard library's sources by
tools/train_small.py), so a newcomer sees real text. `glmc-tiny`: the random-weight tiny model the
tests use, written on first use:

`make_tiny_checkpoint(dir)` writes models/glm_moe_dsa_tiny.yaml (the compiler goldens' tiny GLM:
same architecture as GLM-5, MTP layer included) as a HF checkpoint with deterministic random
weights plus the tiny BPE tokenizer and chat template of models/tiny, reusing an up-to-date
directory. Compiler side (it reads the model spec); the runtime gets only the checkpoint.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from glmc.runtime.worker.checkpoint import expected_tensors
from glmc.runtime.worker.loader import progress
from glmc.spec import config_from_hf, load_spec, model_path

TINY_DIR = Path(str(resources.files("glmc.models") / "tiny"))
TINY_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY_SPEC = "glm_moe_dsa_tiny"        # the model: models/glm_moe_dsa_tiny.yaml, as the compiler sees it
TINY_SPECIAL = {"bos_token_id": 2, "pad_token_id": 0}   # ids in models/tiny/tokenizer.json
TINY_SEED = 0
TINY_STAMP = f"glmc tiny weights: seed {TINY_SEED}, init v1\n"  # bump when _tiny_init changes
TINY_NAME = "glmc-tiny"
SMALL_NAME = "glmc-small"
SMALL_DIR = Path(str(resources.files("glmc.models") / "small"))


def default_cache_dir() -> Path:
    """$GLMC_CACHE, else ~/.cache/glmc."""
    return Path(os.environ.get("GLMC_CACHE") or Path.home() / ".cache" / "glmc")


def tiny_hf_config() -> dict:
    """config.json of the tiny default model: the config of models/glm_moe_dsa_tiny.yaml (what the
    compiler goldens use) under HF's names, plus the tokenizer's special ids."""
    c = load_spec(model_path(TINY_SPEC)).config
    cfg = c.model_dump(mode="json", exclude_none=True)
    theta = cfg.pop("rope_theta")
    return {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", **cfg,
            "num_key_value_heads": c.num_attention_heads, "head_dim": c.qk_rope_head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "hidden_act": "silu",
            "attention_bias": False, "dtype": "float32", **TINY_SPECIAL}


def make_tiny_checkpoint(ckpt_dir: str | Path) -> Path:
    """Write the tiny GLM (models/glm_moe_dsa_tiny.yaml, same architecture as GLM-5, MTP layer
    included) as an HF checkpoint with deterministic random weights, plus the tiny tokenizer.
    Reuses an up-to-date directory."""

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_hf_config()
    config_text = json.dumps(config, indent=1) + "\n"
    fresh = all((ckpt_dir / f).exists() and (ckpt_dir / f).read_bytes() == (TINY_DIR / f).read_bytes()
                for f in TINY_FILES) and (ckpt_dir / "config.json").exists() and \
        (ckpt_dir / "config.json").read_text() == config_text
    stamp = ckpt_dir / "glmc_tiny.txt"
    if fresh and stamp.exists() and stamp.read_text() == TINY_STAMP:
        return ckpt_dir
    gen, tensors = torch.Generator().manual_seed(TINY_SEED), {}
    mtp = config["num_nextn_predict_layers"] > 0
    for name, shape in progress(sorted(expected_tensors(config_from_hf(config), mtp=mtp).items()),
                            desc="creating tiny weights", unit="tensor"):
        tensors[name] = _tiny_init(name, shape, gen)
    tmp = ckpt_dir / f"model.safetensors.tmp{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, ckpt_dir / "model.safetensors")  # atomic: concurrent builders agree
    for f in TINY_FILES:
        shutil.copyfile(TINY_DIR / f, ckpt_dir / f)
    (ckpt_dir / "config.json").write_text(config_text)
    stamp.write_text(TINY_STAMP)  # last: a half-written directory is never taken as fresh
    return ckpt_dir


def _tiny_init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Norm weights 1, biases small, embeddings N(0, 1), matrices with std 2/sqrt(fan_in): the
    activations stay O(1) and the logits are peaked enough that greedy decoding has clear winners."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if len(shape) == 1:
        return 0.01 * torch.randn(shape, generator=gen)
    scale = 1.0 if name.endswith("embed_tokens.weight") else 2.0 / math.sqrt(shape[1])
    return scale * torch.randn(shape, generator=gen)
