"""Checkpoint loading: HF glm_moe_dsa safetensors (bf16/fp32 or block-FP8) into a name -> tensor dict.

`expected_tensors(config)` is the single statement of what a GLM-5 checkpoint contains (names as HF
saves them, full shapes) for a `glmc.config.GlmConfig` (the one config type; `glmc.spec` fills it
from config.json). `load_checkpoint` checks a checkpoint against it BEFORE reading any data - every
missing, unexpected or mis-shaped tensor is reported at once in a `WeightError` - then reads only
this rank's slice of each tensor (`safe_open(...).get_slice`) and dequantises FP8 blocks on the way,
except for the names asked to stay FP8 (`keep_fp8`), which come back as `Fp8Weight` (e4m3 + their
scale blocks, the shard cut 128-aligned).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from glmc.codegen.fp8_ref import Fp8Weight, fp8_block_dequant
from safetensors import safe_open

from glmc.config import GlmConfig
from glmc.target import FP8_BLOCK

SCALE_SUFFIX = "_scale_inv"
ShardFn = Callable[[str], "tuple[int, int, int] | None"]


class WeightError(ValueError):
    """A checkpoint does not match the tensors the model expects; the message names each tensor."""


def _layer_tensors(c: GlmConfig, p: str, full: bool, sparse: bool) -> dict[str, tuple[int, ...]]:
    """Tensors of one decoder block under prefix p ('model.layers.L.')."""
    h, nh = c.hidden_size, c.num_attention_heads
    t = {
        f"{p}input_layernorm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,),
        f"{p}self_attn.q_a_proj.weight": (c.q_lora_rank, h),
        f"{p}self_attn.q_a_layernorm.weight": (c.q_lora_rank,),
        f"{p}self_attn.q_b_proj.weight": (nh * c.qk_head_dim, c.q_lora_rank),
        f"{p}self_attn.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, h),
        f"{p}self_attn.kv_a_layernorm.weight": (c.kv_lora_rank,),
        f"{p}self_attn.kv_b_proj.weight": (nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        f"{p}self_attn.o_proj.weight": (h, nh * c.v_head_dim),
    }
    if full:
        q = f"{p}self_attn.indexer."
        t |= {f"{q}wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
              f"{q}wk.weight": (c.index_head_dim, h), f"{q}k_norm.weight": (c.index_head_dim,),
              f"{q}k_norm.bias": (c.index_head_dim,), f"{q}weights_proj.weight": (c.index_n_heads, h)}
    if not sparse:
        return t | _mlp(f"{p}mlp.", h, c.intermediate_size)
    t |= {f"{p}mlp.gate.weight": (c.n_routed_experts, h), f"{p}mlp.gate.e_score_correction_bias": (c.n_routed_experts,)}
    for e in range(c.n_routed_experts):
        t |= _mlp(f"{p}mlp.experts.{e}.", h, c.moe_intermediate_size)
    return t | _mlp(f"{p}mlp.shared_experts.", h, c.moe_intermediate_size * c.n_shared_experts)


def _mlp(p, h, inter):
    return {f"{p}gate_proj.weight": (inter, h), f"{p}up_proj.weight": (inter, h), f"{p}down_proj.weight": (h, inter)}


def expected_tensors(c: GlmConfig, mtp=False, mtp_head=False, mtp_embed=False) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name -> full shape. mtp adds the MTP block at layer num_hidden_layers (full
    indexer, MoE, enorm/hnorm/eh_proj/shared_head.norm); mtp_head / mtp_embed add its own
    shared_head.head / embed_tokens copies, which some checkpoints ship (see `detect_mtp`)."""
    h, n = c.hidden_size, c.num_hidden_layers
    t = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = (c.vocab_size, h)
    kinds = zip(c.layer_indexer_types(), c.layer_mlp_types())
    for i, (indexer, mlp) in enumerate(kinds):
        t |= _layer_tensors(c, f"model.layers.{i}.", indexer == "full", mlp == "sparse")
    if mtp:
        p = f"model.layers.{n}."
        t |= _layer_tensors(c, p, True, True)
        t |= {f"{p}enorm.weight": (h,), f"{p}hnorm.weight": (h,), f"{p}eh_proj.weight": (h, 2 * h),
              f"{p}shared_head.norm.weight": (h,)}
        if mtp_head:
            t[f"{p}shared_head.head.weight"] = (c.vocab_size, h)
        if mtp_embed:
            t[f"{p}embed_tokens.weight"] = (c.vocab_size, h)
    return t


def _files(ckpt_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index json if sharded."""
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: ckpt_dir / f for name, f in weight_map.items()}
    single = ckpt_dir / "model.safetensors"
    if not single.exists():
        raise WeightError(f"{ckpt_dir}: neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def _found_shapes(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype string), read from headers only."""
    found = {}
    for path in sorted(set(files.values())):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                found[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return found


def detect_mtp(ckpt_dir) -> dict[str, bool]:
    """Which optional MTP groups a checkpoint ships, as keyword arguments for `expected_tensors`."""
    names = set(_files(Path(ckpt_dir)))
    cfg = json.loads((Path(ckpt_dir) / "config.json").read_text())
    p = f"model.layers.{cfg['num_hidden_layers']}."
    return {"mtp": f"{p}eh_proj.weight" in names, "mtp_head": f"{p}shared_head.head.weight" in names,
            "mtp_embed": f"{p}embed_tokens.weight" in names}


def _check(expected, found, shard: ShardFn | None) -> None:
    errors = []
    for name, shape in expected.items():
        if name not in found:
            errors.append(f"missing tensor {name}: expected shape {tuple(shape)}, found none")
        elif found[name][0] != tuple(shape):
            errors.append(f"tensor {name}: expected shape {tuple(shape)}, found {found[name][0]}")
        elif found[name][1] == "F8_E4M3":
            blocks = tuple(math.ceil(s / FP8_BLOCK) for s in shape)
            got = found.get(name + SCALE_SUFFIX, (None,))[0]
            if got != blocks:
                errors.append(f"tensor {name + SCALE_SUFFIX}: expected shape {blocks}, found {got}")
        spec = shard(name) if shard and name in found else None
        if spec and shape[spec[0]] % spec[2]:
            errors.append(f"tensor {name}: dim {spec[0]} of {tuple(shape)} does not split {spec[2]} ways")
    for name in sorted(set(found) - set(expected)):
        if not (name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in expected):
            errors.append(f"unexpected tensor {name}: expected none, found shape {found[name][0]}")
    if errors:
        raise WeightError(f"{len(errors)} checkpoint mismatch(es):\n  " + "\n  ".join(errors))


def _read(f, scale_f, name, shape, dtype_str, spec) -> torch.Tensor:
    """Read this rank's slice of one tensor, dequantising FP8 blocks that cover it."""
    dim, rank, world = spec if spec else (0, 0, 1)
    n = shape[dim] // world
    lo, hi = rank * n, (rank + 1) * n
    index = tuple(slice(lo, hi) if d == dim else slice(None) for d in range(len(shape)))
    part = f.get_slice(name)[index]
    if dtype_str != "F8_E4M3":
        return part.float()
    # Read only the scale blocks that overlap [lo, hi), expand them and cut out our rows/cols.
    b0, b1 = lo // FP8_BLOCK, (hi - 1) // FP8_BLOCK + 1
    sidx = tuple(slice(b0, b1) if d == dim else slice(None) for d in range(len(shape)))
    scale = scale_f.get_slice(name + SCALE_SUFFIX)[sidx].float()
    s = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    s = s.narrow(dim, lo - b0 * FP8_BLOCK, n)
    return part.float() * s[: part.shape[0], : part.shape[1]]


def _read_fp8(f, scale_f, name, shape, spec) -> Fp8Weight:
    """This rank's slice of an FP8 tensor kept FP8, with the scale blocks that cover it. The cut
    must start on a 128 block (or lie inside one), so that the slice's blocks are the checkpoint's."""
    dim, rank, world = spec if spec else (0, 0, 1)
    n = shape[dim] // world
    lo, hi = rank * n, (rank + 1) * n
    b0, b1 = lo // FP8_BLOCK, (hi - 1) // FP8_BLOCK + 1
    if lo % FP8_BLOCK and b1 - b0 > 1:
        raise WeightError(f"tensor {name} {tuple(shape)}: rank {rank} of {world} holds [{lo}, {hi}) of dim {dim}, "
                          f"which starts inside a {FP8_BLOCK}-block and spans {b1 - b0}: an FP8 shard must be "
                          f"{FP8_BLOCK}-aligned ({shape[dim]} / {world} = {n} is not a multiple of {FP8_BLOCK})")
    index = tuple(slice(lo, hi) if d == dim else slice(None) for d in range(len(shape)))
    sidx = tuple(slice(b0, b1) if d == dim else slice(None) for d in range(len(shape)))
    return Fp8Weight(f.get_slice(name)[index], scale_f.get_slice(name + SCALE_SUFFIX)[sidx].float())


# Weights HF keeps in fp32 whatever the model's dtype (`_keep_in_fp32_modules_strict`: the router's
# gate and its correction bias, which decide the expert sets): loaded in fp32 always.
FP32_WEIGHTS = ("mlp.gate.weight", "e_score_correction_bias")


def weight_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint tensor is held in for a model computing in `dtype` (`FP32_WEIGHTS`)."""
    return torch.float32 if name.endswith(FP32_WEIGHTS) else dtype


def load_checkpoint(ckpt_dir, expected: dict[str, tuple[int, ...]], shard: ShardFn | None = None,
                    dtype: torch.dtype = torch.float32, only=None, keep_fp8=frozenset()
                    ) -> dict[str, "torch.Tensor | Fp8Weight"]:
    """Load exactly `expected` (HF name -> FULL shape); shard(name) -> (dim, rank, world) | None
    picks the slice this rank reads; `only` (a set of names) limits what is read to what this rank
    needs (e.g. its own experts) while the whole checkpoint is still checked.
    FP8 (float8_e4m3fn + <name>_scale_inv) comes back dequantised, or as `Fp8Weight` for the
    names in `keep_fp8`; floating tensors in `dtype`, `FP32_WEIGHTS` in fp32."""
    ckpt_dir = Path(ckpt_dir)
    files = _files(ckpt_dir)
    found = _found_shapes(files)
    _check(expected, found, shard)
    out, handles = {}, {}

    def handle(path):  # one open file per shard, not per tensor
        if path not in handles:
            handles[path] = safe_open(path, "pt")
        return handles[path]

    for name, shape in expected.items():
        if only is not None and name not in only:
            continue
        fp8 = found[name][1] == "F8_E4M3"
        scale_f = handle(files[name + SCALE_SUFFIX]) if fp8 else None
        spec = shard(name) if shard else None
        if fp8 and name in keep_fp8:
            out[name] = _read_fp8(handle(files[name]), scale_f, name, tuple(shape), spec)
            continue
        out[name] = _read(handle(files[name]), scale_f, name, tuple(shape), found[name][1], spec).to(
            weight_dtype(name, dtype))
    return out


__all__ = ["FP32_WEIGHTS", "WeightError", "expected_tensors", "detect_mtp", "load_checkpoint", "fp8_block_dequant",
           "weight_dtype"]
