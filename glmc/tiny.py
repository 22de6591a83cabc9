"""The packaged models `glmc run --weights NAME` serves by name.

`glmc-small` (the default of `glmc run`): models/small, a trained glm_moe_dsa checkpoint (7.5M
parameters, every feature active, trained on the Python standard library's sources by
tools/train_small.py), so a newcomer sees real text. `glmc-tiny`: the random-weight tiny model the
tests use, written on first use:

`make_tiny_checkpoint(dir)` writes models/glm_moe_dsa_tiny.yaml (the compiler goldens' tiny GLM:
same architecture as GLM-5, MTP layer included) as a HF checkpoint with deterministic random
weights plus the tiny BPE tokenizer and chat template of models/tiny, reusing an up-to-date
directory. Compiler side (it reads the model spec); the runtime gets only the checkpoint.

`glm-5.3-random`: GLM-5.3 at full size (models/glm_moe_dsa.yaml: 78 layers, 256 experts, the MTP
layer; block-FP8 linear weights and FP8 caches, as the FP8 checkpoint ships) as a random checkpoint
directory (`runtime/worker/random_weights`): each rank makes its shard of random weights on its
device at start-up, no 744 GB on disk. It has glmc-small's tokenizer (4096 of the 154880 ids:
the rest decode to nothing): for benchmarks and serving tests at full size, not for reading.
`make_random_glm(dir, layers=)` writes it, with fewer layers where the devices hold fewer.
"""
from __future__ import annotations

import json
import os
import shutil
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from glmc.runtime.worker.checkpoint import expected_tensors
from glmc.runtime.worker.loader import progress
from glmc.runtime.worker.random_weights import init_tensor, make_random_checkpoint
from glmc.spec import config_from_hf, load_spec, model_path

TINY_DIR = Path(str(resources.files("glmc.models") / "tiny"))
TINY_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY_SPEC = "glm_moe_dsa_tiny"        # the model: models/glm_moe_dsa_tiny.yaml, as the compiler sees it
TINY_SPECIAL = {"bos_token_id": 2, "pad_token_id": 0}   # ids in models/tiny/tokenizer.json
TINY_SEED = 0
TINY_STAMP = f"glmc tiny weights: seed {TINY_SEED}, init v1\n"  # bump when init_tensor changes
TINY_NAME = "glmc-tiny"
SMALL_NAME = "glmc-small"
SMALL_DIR = Path(str(resources.files("glmc.models") / "small"))
RANDOM_NAME = "glm-5.3-random"
RANDOM_SPEC = "glm_moe_dsa"           # GLM-5.3's card: models/glm_moe_dsa.yaml
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}   # as GLM-5.3-FP8's config.json


def default_cache_dir() -> Path:
    """$GLMC_CACHE, else ~/.cache/glmc."""
    return Path(os.environ.get("GLMC_CACHE") or Path.home() / ".cache" / "glmc")


def hf_config(model: str, dtype: str, **extra) -> dict:
    """config.json of packaged model `model` (models/<model>.yaml's config under HF's names) for
    weights of `dtype` ("float32", "bfloat16"), with `extra` fields (special ids, quantisation)."""
    c = load_spec(model_path(model)).config
    cfg = c.model_dump(mode="json", exclude_none=True)
    theta = cfg.pop("rope_theta")
    return {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", **cfg,
            "num_key_value_heads": c.num_attention_heads, "head_dim": c.qk_rope_head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "hidden_act": "silu",
            "attention_bias": False, "dtype": dtype, **extra}


def tiny_hf_config() -> dict:
    """config.json of the tiny default model: the config of models/glm_moe_dsa_tiny.yaml (what the
    compiler goldens use) under HF's names, plus the tokenizer's special ids."""
    return hf_config(TINY_SPEC, "float32", **TINY_SPECIAL)


def make_random_glm(ckpt_dir: str | Path, layers: int | None = None, seed: int = 0) -> Path:
    """The random checkpoint directory `glm-5.3-random` (see the module docstring) in `ckpt_dir`;
    `layers` keeps only the first that many decoder layers (the dense ones first, as GLM-5.3's;
    the MTP layer stays)."""
    cfg = hf_config(RANDOM_SPEC, "bfloat16", quantization_config=FP8_QUANTIZATION,
                    bos_token_id=json.loads((SMALL_DIR / "config.json").read_text())["bos_token_id"])
    if layers is not None:
        if not 0 < layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"layers: {layers} is not in 1..{cfg['num_hidden_layers']}")
        cfg["num_hidden_layers"] = layers   # the layer kinds follow from it (first_k_dense_replace, ...)
    return make_random_checkpoint(ckpt_dir, cfg, SMALL_DIR, seed)


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
        tensors[name] = init_tensor(name, shape, gen)
    tmp = ckpt_dir / f"model.safetensors.tmp{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, ckpt_dir / "model.safetensors")  # atomic: concurrent builders agree
    for f in TINY_FILES:
        shutil.copyfile(TINY_DIR / f, ckpt_dir / f)
    (ckpt_dir / "config.json").write_text(config_text)
    stamp.write_text(TINY_STAMP)  # last: a half-written directory is never taken as fresh
    return ckpt_dir
