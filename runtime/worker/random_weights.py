"""Random weights made where they are used: a model with no checkpoint on disk.

GLM-5.3 at full size is 744B parameters (~744 GB in FP8): benchmarks and `glmc run` on a random
full-size model cannot write it out first, nor hold another rank's experts. `RandomWeights` is a
read-only mapping of every HF tensor name of a config (the MTP layer's too when the config has one)
to a tensor made when it is looked up, in fp32 on the mapping's device, from a generator seeded by
(seed, name): the same values on every rank and every call on one kind of device (CPU and CUDA
generators make different numbers from one seed). The loader cuts each
rank's shard out of it one tensor at a time (`shards.cut_rank_weights`) and converts it to the
plan's format at once (block-FP8 for the plan's FP8 weights), so a rank holds only its shard, and
plans of every parallel spec compute the same function of the same weights.

A *random checkpoint directory* is a checkpoint directory without tensors: config.json, the
tokenizer files and `glmc_random.json` ({"seed": N}); `load_runner` given one makes its weights
(`RandomWeights.in_dir`). `make_random_checkpoint` writes one.

Initialisation (`init_tensor`, also glmc-tiny's): norm weights 1, other vectors N(0, 0.01^2),
embeddings N(0, 1), matrices N(0, (2 / sqrt(fan_in))^2): activations stay O(1) through the layers
and the logits are peaked enough that greedy decoding has clear winners.
"""
from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from glmc.runtime.worker.checkpoint import expected_tensors

MARKER = "glmc_random.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One weight of `shape` (fp32, on the generator's device) by the module's rule."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=gen.device)
    if len(shape) == 1:
        return 0.01 * torch.randn(shape, generator=gen, device=gen.device)
    scale = 1.0 if name.endswith("embed_tokens.weight") else 2.0 / math.sqrt(shape[1])
    return scale * torch.randn(shape, generator=gen, device=gen.device)


class RandomWeights(Mapping):
    """HF tensor name -> full fp32 tensor on `device`, made on lookup (see the module docstring)."""

    def __init__(self, config, seed: int = 0, device: str | torch.device = "cpu"):
        self.config, self.seed, self.device = config, int(seed), torch.device(device)
        self.shapes = expected_tensors(config, mtp=config.num_nextn_predict_layers > 0)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        # 32 bits: the CPU generator (mt19937) ignores the rest of a seed
        gen = torch.Generator(self.device).manual_seed(zlib.crc32(name.encode(), self.seed & 0xFFFFFFFF))
        return init_tensor(name, shape, gen)

    def __contains__(self, name) -> bool:   # Mapping's would make the tensor to find out
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def on(self, device: str | torch.device) -> RandomWeights:
        """The same weights, made on `device`."""
        return RandomWeights(self.config, self.seed, device)

    @classmethod
    def in_dir(cls, ckpt_dir, config, device: str | torch.device = "cpu") -> RandomWeights | None:
        """The weights of random checkpoint directory `ckpt_dir` whose config.json is `config` (the
        plan's: the runtime does not parse model configs), or None for any other path."""
        marker = Path(ckpt_dir) / MARKER
        if not marker.is_file():
            return None
        try:
            seed = json.loads(marker.read_text())["seed"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{marker}: expected {{\"seed\": <integer>}} ({e})") from None
        if not isinstance(seed, int):
            raise ValueError(f"{marker}: field seed: expected an integer, got {seed!r}")
        return cls(config, seed, device)


def make_random_checkpoint(ckpt_dir: str | Path, hf_config: dict, tokenizer_dir: str | Path,
                           seed: int = 0) -> Path:
    """Write a random checkpoint directory: `hf_config` as config.json, the tokenizer files of
    `tokenizer_dir`, the marker with `seed`. Rewrites only what differs; the marker goes last, so
    a half-written directory is never taken for a finished one."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    files = {"config.json": json.dumps(hf_config, indent=1) + "\n",
             **{f: (Path(tokenizer_dir) / f).read_text() for f in TOKENIZER_FILES},
             MARKER: json.dumps({"seed": int(seed)}) + "\n"}
    for name, text in files.items():
        path = ckpt_dir / name
        if not path.exists() or path.read_text() != text:
            tmp = path.with_name(f"{name}.tmp{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, path)
    return ckpt_dir
