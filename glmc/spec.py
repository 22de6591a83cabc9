"""The model spec: GLM-5.x hyperparameters (HF `config.json` names), dtypes and the op program.

`load_spec(path)` reads a YAML model file or a Hugging Face checkpoint directory (its
`config.json`, with the op program of the packaged `glm_moe_dsa.yaml`). Every error names the file,
the field and the reason (`SpecError`).

`config_from_hf` never guesses: every config.json key is a GlmConfig field or otherwise honoured
(`HF_HONOURED`: RoPE, model_type, dtypes), known not to change a forward pass (`HF_INERT`), or
implemented for one value only (`HF_REQUIRED`); other values and unknown keys are refused.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from glmc.config import DType, DTypes, Frozen, GlmConfig  # noqa: F401  (the spec is made of them)


class SpecError(ValueError):
    """A model spec that cannot be used; the message names the file and the field."""


class Statement(BaseModel):
    """One op of the program: `out = op(args) {attrs}`, kept only where every `when` tag holds."""
    model_config = Frozen
    op: str
    out: str | tuple[str, ...]
    args: tuple[str, ...] = ()
    when: tuple[str, ...] = ()
    attrs: dict = Field(default_factory=dict)


class Program(BaseModel):
    """The op program: prologue + layer (x78) + epilogue; MTP: mtp_prologue + layer + mtp_epilogue."""
    model_config = Frozen
    prologue: tuple[Statement, ...]
    layer: tuple[Statement, ...]
    epilogue: tuple[Statement, ...]
    mtp_prologue: tuple[Statement, ...] = ()
    mtp_epilogue: tuple[Statement, ...] = ()


class ModelSpec(BaseModel):
    """A whole model file."""
    model_config = Frozen
    name: str
    config: GlmConfig
    dtypes: DTypes = DTypes()
    program: Program
    source: str = ""

    @model_validator(mode="after")
    def _program_supports_config(self):
        # The op program's lm.head ops read lm_head.weight; a tied checkpoint ships none.
        if self.config.tie_word_embeddings:
            raise ValueError("config.tie_word_embeddings true is not supported: the op program's "
                             "lm.head reads lm_head.weight (GLM-5 and DeepSeek-V3.2 untie it)")
        return self


def _fail(path: str, e: ValidationError) -> SpecError:
    lines = [f"{path}: invalid model spec"]
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        got = err.get("input")
        shown = f" (got {got!r})" if isinstance(got, str | int | float | bool) else ""
        lines.append(f"  field {field}: {err['msg']}{shown}")
    return SpecError("\n".join(lines))


def _packaged_program(path: Path, name: str) -> dict:
    """`program: glm_moe_dsa` reuses the op program of a packaged model file."""
    ref = resources.files("glmc.models").joinpath(f"{name}.yaml")
    if not ref.is_file():
        raise SpecError(f"{path}: field program: no packaged model {name!r}")
    return yaml.safe_load(ref.read_text())["program"]


def default_program() -> dict:
    return _packaged_program(Path("glm_moe_dsa"), "glm_moe_dsa")


def load_spec(path: str | Path) -> ModelSpec:
    """Load a YAML model file or a HF checkpoint directory (config.json)."""
    path = Path(path)
    if path.is_dir():
        return _from_hf_dir(path)
    if not path.exists():
        raise SpecError(f"{path}: no such model file or checkpoint directory")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping with name, config, program")
    if isinstance(data.get("program"), str):
        data["program"] = _packaged_program(path, data["program"])
    try:
        return ModelSpec(**data, source=str(path))
    except ValidationError as e:
        raise _fail(str(path), e) from None


HF_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")
# The indexer's RoPE pairs when config.json does not say (`indexer_rope_interleave`): transformers'
# GlmMoeDsaIndexer rotates interleaved pairs, DeepseekV32Indexer the two halves (rotate_half).
INDEXER_ROPE_INTERLEAVE = {"glm_moe_dsa": True, "deepseek_v32": False}


def _from_hf_dir(path: Path) -> ModelSpec:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise SpecError(f"{path}: directory has no config.json")
    raw = json.loads(cfg_path.read_text())
    try:
        return ModelSpec(name=path.name, config=config_from_hf(raw, str(cfg_path)),
                         dtypes=_hf_dtypes(raw, str(cfg_path)), program=default_program(), source=str(path))
    except ValidationError as e:
        raise _fail(str(cfg_path), e) from None


# config.json keys that do not change a forward pass: metadata, training, generation, caching.
HF_INERT = frozenset({
    "architectures", "transformers_version", "_name_or_path", "id2label", "label2id",
    "problem_type", "return_dict", "output_hidden_states", "output_attentions", "use_cache",
    "output_router_logits", "initializer_range", "attention_dropout", "router_aux_loss_coef",
    "aux_loss_alpha", "seq_aux", "bos_token_id", "pad_token_id", "tokenizer_class",
    "auto_map",                 # remote-code class names
    "chunk_size_feed_forward",  # HF may chunk the FFN over tokens: same values
    "is_encoder_decoder",       # a decoder-only class ignores it
    "ep_size",                  # DeepSeek's deployment hint; glmc's parallel spec decides
    "head_dim",                 # HF overwrites it with qk_rope_head_dim
    "layer_types",              # HF's cache dispatch ("indexed_attention" on every layer)
})
# config.json keys honoured besides GlmConfig's fields: the RoPE (`_rope_fields`), the indexer
# layout's default (model_type), storage dtypes and FP8 blocks (`_hf_dtypes`, the loader).
HF_HONOURED = frozenset({
    "rope_theta", "rope_parameters", "rope_scaling", "original_max_position_embeddings", "model_type",
    "dtype", "torch_dtype", "quantization_config",
})
# config.json keys glmc implements for one value only: (does the value fit?, what glmc implements).
HF_REQUIRED = {
    "attention_bias": (lambda v, raw: v is False, "false (no q/kv/o projection bias)"),
    "mlp_bias": (lambda v, raw: v is False, "false (no MLP bias)"),
    "hidden_act": (lambda v, raw: v == "silu", '"silu" (SwiGLU experts and MLPs)'),
    "scoring_func": (lambda v, raw: v == "sigmoid", '"sigmoid" (router scores)'),
    "topk_method": (lambda v, raw: v == "noaux_tc", '"noaux_tc" (bias-corrected group top-k)'),
    "moe_layer_freq": (lambda v, raw: v == 1, "1 (every layer after first_k_dense_replace is MoE)"),
    "rope_interleave": (lambda v, raw: v is True, "true (MLA RoPE on interleaved pairs)"),
    "use_qk_norm": (lambda v, raw: v is False, "false (no per-head q/k norm)"),
    "partial_rotary_factor": (lambda v, raw: v == 1, "1 (RoPE on all qk_rope_head_dim dims)"),
    "pretraining_tp": (lambda v, raw: v == 1, "1 (unsplit projections)"),
    "num_key_value_heads": (lambda v, raw: v == raw.get("num_attention_heads"),
                            "num_attention_heads (MLA: one latent per token, every head reads it)"),
    "num_experts": (lambda v, raw: v == raw.get("n_routed_experts"), "n_routed_experts"),
    "qk_head_dim": (lambda v, raw: v == (raw.get("qk_nope_head_dim") or 0) + (raw.get("qk_rope_head_dim") or 0),
                    "qk_nope_head_dim + qk_rope_head_dim"),
}


def hf_key_status(key: str) -> str:
    """How glmc treats a config.json key: honoured, inert, required (one value) or refused."""
    if key in GlmConfig.model_fields or key in HF_HONOURED:
        return "honoured"
    if key in HF_INERT:
        return "inert"
    return "required" if key in HF_REQUIRED else "refused"


def _refusals(raw: dict) -> list[str]:
    """One line per config.json key glmc would not reproduce exactly."""
    out = []
    for key, value in sorted(raw.items()):
        if value is None or key in GlmConfig.model_fields or key in HF_HONOURED or key in HF_INERT:
            continue
        if key in HF_REQUIRED:
            fits, implemented = HF_REQUIRED[key]
            if not fits(value, raw):
                out.append(f"field {key}: {value!r} is not supported; glmc implements {implemented}")
        else:
            out.append(f"field {key}: {value!r} is an unknown config.json key; glmc refuses to guess "
                       "whether it changes the numerics (remove it if it does not)")
    return out


def _rope_fields(raw: dict, where: str) -> dict:
    """rope_theta and rope_scaling as transformers resolves them: the rope dict (the older
    `rope_scaling` wins over `rope_parameters`, as in transformers) first, then top-level keys; a
    plain RoPE has no scaling."""
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    rope_type = rope.pop("rope_type", None) or rope.pop("type", "default")
    rope.pop("type", None)
    out = {}
    theta = rope.pop("rope_theta", None) or raw.get("rope_theta")
    if theta is not None:
        out["rope_theta"] = theta
    if rope.get("partial_rotary_factor", 1) == 1:
        rope.pop("partial_rotary_factor", None)
    if rope_type == "default":
        if rope:  # e.g. a factor without a type: say so rather than drop it
            raise SpecError(f"{where}: field rope_parameters: plain RoPE (rope_type 'default') with "
                            f"{rope}: glmc does not know what these keys would change")
        return out
    if rope_type == "yarn":
        if raw.get("original_max_position_embeddings") is not None:  # transformers gives it priority
            rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
        if rope.get("factor") is None and rope["original_max_position_embeddings"]:
            rope["factor"] = raw.get("max_position_embeddings", 0) / rope["original_max_position_embeddings"]
    out["rope_scaling"] = {"rope_type": rope_type, **rope}
    return out


def config_from_hf(raw: dict, where: str = "config.json") -> GlmConfig:
    """A transformers config.json (glm_moe_dsa or deepseek_v32) as a GlmConfig: every key is honoured,
    inert (`HF_INERT`), or refused with its name and value (`HF_REQUIRED`, unknown keys)."""
    model_type = raw.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise SpecError(f"{where}: field model_type: {model_type!r} is not one of {HF_MODEL_TYPES}")
    refused = _refusals(raw)
    if refused:
        raise SpecError("\n  ".join([f"{where}: config.json glmc cannot reproduce exactly"] + refused))
    fields = {k: v for k, v in raw.items() if k in GlmConfig.model_fields and v is not None}
    fields.setdefault("indexer_rope_interleave", INDEXER_ROPE_INTERLEAVE[model_type])
    fields.pop("rope_theta", None)
    fields.pop("rope_scaling", None)
    fields.update(_rope_fields(raw, where))
    try:
        return GlmConfig(**fields)
    except ValidationError as e:
        raise _fail(where, e) from None


def _hf_dtypes(raw: dict, where: str = "config.json") -> DTypes:
    """Storage dtypes: fp32 checkpoints compute in fp32; block-FP8 ones (128 x 128 blocks: weights
    "fp8", `codegen.weight_formats`) or plain ones in bf16 (an fp32 FP8 checkpoint, as tests make,
    computes in fp32 on FP8 weights). Other quantisations are refused."""
    quant = raw.get("quantization_config") or {}
    method = quant.get("quant_method", "fp8" if quant.get("fmt") == "e4m3" else None)
    if quant and method != "fp8":
        raise SpecError(f"{where}: field quantization_config.quant_method: {method!r} is not supported; "
                        "glmc loads unquantised or block-FP8 (quant_method fp8) checkpoints")
    if quant and list(quant.get("weight_block_size") or [128, 128]) != [128, 128]:
        raise SpecError(f"{where}: field quantization_config.weight_block_size: "
                        f"{quant['weight_block_size']!r} is not supported; glmc's FP8 blocks are [128, 128]")
    if (raw.get("dtype") or raw.get("torch_dtype")) == "float32":
        return DTypes(activation="fp32", weight="fp8" if quant else "fp32", kv_cache="fp32",
                      index_cache="fp32")
    return DTypes(activation="bf16", weight="fp8" if quant else "bf16", kv_cache="fp8",
                  index_cache="fp8")


QUANTIZE = ("fp8",)


def quantized(spec: ModelSpec, quantize: str | None) -> ModelSpec:
    """The spec with its linear weights stored as `quantize` ("fp8": e4m3 with 128 x 128 block
    scales, quantised on load where the checkpoint is unquantised); None leaves it as it is."""
    if quantize is None or spec.dtypes.weight == quantize:
        return spec
    if quantize not in QUANTIZE:
        raise SpecError(f"--quantize {quantize!r}: glmc quantises to {', '.join(QUANTIZE)}")
    return spec.model_copy(update={"dtypes": spec.dtypes.model_copy(update={"weight": quantize})})


KV_DTYPES = ("fp8", "bf16")


def kv_dtyped(spec: ModelSpec, kv_dtype: str | None) -> ModelSpec:
    """The spec with its KV and indexer caches stored as `kv_dtype`: "fp8" (FlashMLA's 656-byte
    latent rows and 132-byte indexer keys on the CUDA target) or "bf16" (unquantised, in the
    activation dtype: bf16, or fp32 for an fp32 checkpoint); None leaves the spec's (a bf16 or
    FP8 HF checkpoint: fp8, as GLM-5.3's card; an fp32 one: fp32)."""
    if kv_dtype is None:
        return spec
    if kv_dtype not in KV_DTYPES:
        raise SpecError(f"--kv-dtype {kv_dtype!r}: glmc stores the KV cache as {', '.join(KV_DTYPES)}")
    dtype = "fp8" if kv_dtype == "fp8" else spec.dtypes.activation
    return spec.model_copy(update={"dtypes": spec.dtypes.model_copy(update={"kv_cache": dtype, "index_cache": dtype})})


def model_path(name: str) -> str:
    """A model file or checkpoint dir as given, else the packaged model of that name
    (`glm_moe_dsa`, `glm_moe_dsa_tiny`: models/<name>.yaml)."""
    if Path(name).exists():
        return name
    ref = resources.files("glmc.models").joinpath(f"{name}.yaml")
    return str(ref) if ref.is_file() else name
