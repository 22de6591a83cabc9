"""The configuration types every stage reads: the model's hyperparameters (`GlmConfig`, HF
`config.json` names), storage dtypes (`DTypes`), the user's compile options (`Options`) and the
parallel mesh (`Mesh`).

The compiler fills them (`glmc.spec` parses YAML / config.json into them; the CLI builds
`Options`), a `glmc.plan.Plan` carries them, and the runtime reads them from the plan: this module
imports nothing of the compiler, so the runtime may import it.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Frozen = ConfigDict(frozen=True, extra="forbid")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """transformers' yarn `get_mscale`: 0.1 * mscale * ln(factor) + 1, or 1 when factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RopeScaling(BaseModel):
    """A yarn RoPE (HF `rope_scaling` / `rope_parameters`, HF names; DeepSeek-V3.x checkpoints).

    Yarn changes three things, each computed as transformers computes it: the frequencies
    (`codegen/torch_ref.rope_inv_freq`: interpolation and extrapolation blended over the
    beta_fast..beta_slow correction range), a factor on cos/sin (`attention_factor`), and the
    softmax scale (times mscale(factor, mscale_all_dim)^2, `GlmConfig.softmax_scale`). Other rope
    types are refused (`rope_type` accepts only "yarn"; a plain RoPE is `rope_scaling: null`).
    """
    model_config = Frozen
    rope_type: Literal["yarn"]
    factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)
    beta_fast: float | None = None          # None or 0: 32, as transformers (`or 32`)
    beta_slow: float | None = None          # None or 0: 1
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None   # None: from factor, mscale, mscale_all_dim
    truncate: bool = True

    def resolved_attention_factor(self) -> float:
        """The factor on cos/sin: given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)
        when both are set, else mscale(factor) (transformers' `_compute_yarn_parameters`)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim))
        return yarn_mscale(self.factor)

    def ir_attr(self) -> tuple:
        """What a rope op needs, as the IR's `scaling` attribute: (name, value) pairs."""
        return (("type", "yarn"), ("factor", float(self.factor)),
                ("original_max_position_embeddings", self.original_max_position_embeddings),
                ("beta_fast", float(self.beta_fast or 32)), ("beta_slow", float(self.beta_slow or 1)),
                ("truncate", self.truncate), ("attention_factor", self.resolved_attention_factor()))


class GlmConfig(BaseModel):
    """Hyperparameters, named as in HF `config.json` (glm_moe_dsa / deepseek_v32)."""
    model_config = Frozen
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    q_lora_rank: int = Field(gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    n_routed_experts: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    n_shared_experts: int = Field(ge=0)
    n_group: int = Field(default=1, gt=0)
    topk_group: int = Field(default=1, gt=0)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = Field(default=0, ge=0)
    index_topk: int = Field(gt=0)
    index_n_heads: int = Field(gt=0)
    index_head_dim: int = Field(gt=0)
    index_topk_freq: int = Field(default=1, gt=0)
    index_skip_topk_offset: int = Field(default=2, ge=0)
    index_topk_pattern: str | None = None
    indexer_types: tuple[Literal["full", "shared"], ...] | None = None
    indexer_rope_interleave: bool = True  # indexer RoPE pairs: GLM interleaved, DeepSeek-V3.2 half-split
    mlp_layer_types: tuple[Literal["dense", "sparse"], ...] | None = None
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    max_position_embeddings: int = Field(default=4096, gt=0)
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = Field(default=0, ge=0)
    eos_token_id: int | tuple[int, ...] | None = None
    rope_scaling: RopeScaling | None = None  # yarn (DeepSeek-V3.2); None: plain RoPE

    @model_validator(mode="after")
    def _cross_check(self):
        n = self.num_hidden_layers
        if self.indexer_types is not None and len(self.indexer_types) != n:
            raise ValueError(f"indexer_types has {len(self.indexer_types)} entries, "
                             f"num_hidden_layers is {n}")
        if self.mlp_layer_types is not None and len(self.mlp_layer_types) != n:
            raise ValueError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries, "
                             f"num_hidden_layers is {n}")
        if self.index_topk_pattern is not None and len(self.index_topk_pattern) != n:
            raise ValueError(f"index_topk_pattern has {len(self.index_topk_pattern)} letters, "
                             f"num_hidden_layers is {n}")
        if self.layer_indexer_types()[0] != "full":
            raise ValueError("indexer_types: layer 0 must be 'full' (shared layers reuse the "
                             "previous full layer's top-k)")
        if self.first_k_dense_replace > n:
            raise ValueError(f"first_k_dense_replace {self.first_k_dense_replace} > "
                             f"num_hidden_layers {n}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts {self.n_routed_experts} is not divisible by "
                             f"n_group {self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group {self.topk_group} > n_group {self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} > topk_group "
                             f"{self.topk_group} x experts per group {per_group}")
        if self.n_group > 1 and per_group < 2:
            raise ValueError(f"n_group {self.n_group} leaves {per_group} expert per group; "
                             "group scores sum the top-2")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and <= "
                             f"index_head_dim {self.index_head_dim}")
        return self

    def layer_indexer_types(self) -> tuple[str, ...]:
        """Per layer "full"/"shared": indexer_types, else index_topk_pattern, else freq/offset."""
        if self.indexer_types is not None:
            return self.indexer_types
        if self.index_topk_pattern is not None:
            return tuple("full" if c.upper() == "F" else "shared" for c in self.index_topk_pattern)
        off, freq = self.index_skip_topk_offset, self.index_topk_freq
        return tuple("full" if max(i - off + 1, 0) % freq == 0 else "shared"
                     for i in range(self.num_hidden_layers))

    def full_indexer_layers(self) -> frozenset[int]:
        """Decoder layers with their own indexer (weights, key cache, top-k)."""
        return frozenset(i for i, t in enumerate(self.layer_indexer_types()) if t == "full")

    def layer_mlp_types(self) -> tuple[str, ...]:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types
        return tuple("dense" if i < self.first_k_dense_replace else "sparse"
                     for i in range(self.num_hidden_layers))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """(dn + dr)^-0.5, times mscale(factor, mscale_all_dim)^2 for yarn RoPE with mscale_all_dim
        (DeepSeek-V3.x), in transformers' order of float operations; GLM-5: 1/16."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def rope_scaling_attr(self) -> tuple | None:
        """The rope ops' `scaling` attribute (None: plain RoPE, no attribute)."""
        return None if self.rope_scaling is None else self.rope_scaling.ir_attr()


DType = Literal["fp32", "bf16", "fp16", "fp8"]


class DTypes(BaseModel):
    """Storage dtypes: activations, linear weights, KV cache, indexer cache."""
    model_config = Frozen
    activation: DType = "bf16"
    weight: DType = "bf16"
    kv_cache: DType = "bf16"
    index_cache: DType = "bf16"



MESH_AXES = ("attn_dp", "attn_tp", "ep", "moe_tp")


@dataclass(frozen=True)
class Mesh(Mapping):
    """A parallel spec, parsed (`glmc.parallel.parse_parallel`): the world factored twice, attention
    as attn_dp x attn_tp and MoE as ep x moe_tp. The compiler places ops over it, a `Plan` carries
    it (plan.json's `parallel`) and the runtime reads it from there. As a mapping it is axis ->
    size (`mesh["ep"]`, over `MESH_AXES`)."""

    attn_dp: int
    attn_tp: int
    ep: int
    moe_tp: int
    name: str   # the spec as written: "tp8", "dp8ep8", ...

    def __post_init__(self):
        for axis in MESH_AXES:
            if isinstance(self[axis], bool) or not isinstance(self[axis], int) or self[axis] < 1:
                raise ValueError(f"mesh {self.name!r}: {axis} must be an integer >= 1, got {self[axis]!r}")
        if self.attn_dp * self.attn_tp != self.ep * self.moe_tp:
            raise ValueError(f"mesh {self.name!r}: attn_dp {self.attn_dp} x attn_tp {self.attn_tp} = "
                             f"{self.attn_dp * self.attn_tp} ranks, but ep {self.ep} x moe_tp {self.moe_tp} = "
                             f"{self.ep * self.moe_tp}")

    @property
    def world(self) -> int:
        return self.attn_dp * self.attn_tp

    @property
    def token_split(self) -> bool:
        """Whether the residual stream is split over attn_tp ranks (TP attention with EP MoE)."""
        return self.attn_tp > 1 and self.ep > 1

    @property
    def token_split_size(self) -> int:
        """How many ranks a step's tokens are split over between attention and the MoE: attn_tp
        with EP MoE, else 1 (batch sizes the runtime captures are multiples of it)."""
        return self.attn_tp if self.ep > 1 else 1

    @property
    def mesh(self) -> dict[str, int]:
        """Axis -> size as a plain dict (the IR's `mesh` metadata)."""
        return dict(self)

    def __getitem__(self, axis: str) -> int:
        if axis not in MESH_AXES:
            raise KeyError(axis)
        return getattr(self, axis)

    def __iter__(self) -> Iterator[str]:
        return iter(MESH_AXES)

    def __len__(self) -> int:
        return len(MESH_AXES)


@dataclass(frozen=True)
class Options:
    """User choices that passes honour: `moe_a2a` True/False forces a MoE lowering (None: cost);
    `moe_routing` "gather" / "recompute" the gather form's routing (None: cost; passes/lower_moe.py)."""
    moe_a2a: bool | None = None
    moe_routing: str | None = None
    topk_broadcast: bool = False
    device: str = "cuda"
    p2p_collectives: bool = True   # small all-reduces / reduce-scatters over peer memory (cuda)
    mtp_draft_tokens: int = 6
    decode_batch: int = 32
    max_batch: int = 128
    chunked_prefill: int = 8192
