"""The model spec: GLM-5.x hyperparameters (HF `config.json` names), dtypes and the op program.

`load_spec(path)` reads a YAML model file or a Hugging Face checkpoint directory (its
`config.json`, with the op program of the packaged `glm_moe_dsa.yaml`). Every error names the file,
the field and the reason (`SpecError`).
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError

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


def _fail(path: str, e: ValidationError) -> SpecError:
    lines = [f"{path}: invalid model spec"]
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  field {field}: {err['msg']}")
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


def _from_hf_dir(path: Path) -> ModelSpec:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise SpecError(f"{path}: directory has no config.json")
    raw = json.loads(cfg_path.read_text())
    if raw.get("model_type") not in HF_MODEL_TYPES:
        raise SpecError(f"{cfg_path}: field model_type: {raw.get('model_type')!r} is not one of "
                        f"{HF_MODEL_TYPES}")
    return ModelSpec(name=path.name, config=config_from_hf(raw, str(cfg_path)),
                     dtypes=_hf_dtypes(raw), program=default_program(), source=str(path))


def config_from_hf(raw: dict, where: str = "config.json") -> GlmConfig:
    """Keep the HF keys glmc knows (others: architectures, dtype, ... are not model shape)."""
    known = {k: v for k, v in raw.items() if k in GlmConfig.model_fields and v is not None}
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if "rope_theta" not in known and "rope_theta" in rope:
        known["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        known["rope_scaling"] = rope
    try:
        return GlmConfig(**known)
    except ValidationError as e:
        raise _fail(where, e) from None


def _hf_dtypes(raw: dict) -> DTypes:
    if (raw.get("dtype") or raw.get("torch_dtype")) == "float32":
        return DTypes(activation="fp32", weight="fp32", kv_cache="fp32", index_cache="fp32")
    quant = raw.get("quantization_config") or {}
    fp8 = quant.get("quant_method") == "fp8" or quant.get("fmt") == "e4m3"
    return DTypes(activation="bf16", weight="fp8" if fp8 else "bf16", kv_cache="fp8",
                  index_cache="fp8")


def model_path(name: str) -> str:
    """A model file or checkpoint dir as given, else the packaged model of that name
    (`glm_moe_dsa`, `glm_moe_dsa_tiny`: models/<name>.yaml)."""
    if Path(name).exists():
        return name
    ref = resources.files("glmc.models").joinpath(f"{name}.yaml")
    return str(ref) if ref.is_file() else name
