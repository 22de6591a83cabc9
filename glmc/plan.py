"""The compiled plan: the one hand-off between the compiler and the runtime.

`glmc compile` (or `glmc.api`, compiling on demand) makes a `Plan`; the runtime
(`glmc.runtime.worker.loader.load_runner`) reads nothing else. A plan directory holds:

    <phase>.ir        the phase graph (prefill, decode, mtp_draft, mtp_verify), with its metadata
                      (mesh, CUDA-graph buckets, memory plan, cost, fusions fired) as `#!` lines
    plan.json         model, parallel spec, mesh and world, options, dtypes, config, the spec,
                      how the weights are held (`weights`: which ops' weights are block-FP8)
    kernels/*.py      (cuda target) every Triton kernel the plan can launch, rendered; the runtime
                      imports exactly these files (plan.json maps each to its kernel context)
    launch/<phase>.txt  (written by `glmc compile --device cuda`) what one step launches, in order
                      (`codegen.launch_program`); read by `glmc explain`, not by the runtime
    report.md         `glmc explain` of the plan
    after/NN-<pass>/  with --dump-after: the IR after each pass

`Plan.save(dir)` writes into a temporary directory and renames it into place (a failed save never
leaves a half-written plan); `Plan.load(dir)` reads it back, naming the file at fault.

This module imports the IR and the configuration types only: the runtime may import it.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from glmc import __version__
from glmc.config import MESH_AXES, DTypes, GlmConfig, Mesh, Options
from glmc.ir import Graph, IRError, parse, print_graph, verify


class PlanError(ValueError):
    """A plan directory that cannot be read; the message names the directory and the file."""


@dataclass
class Plan:
    """Everything the runtime needs to run a compiled model on every rank of its mesh."""

    model: str                       # the spec's name ("glm-5.3", "glm-tiny", a checkpoint's dir)
    source: str                      # where the spec came from (YAML file or config.json)
    config: GlmConfig                # hyperparameters, HF names
    dtypes: DTypes                   # storage dtypes the plan assumes
    parallel: str                    # the parallel spec's name ("tp1", "dp2ep2", ...)
    mesh: Mesh                       # the parsed spec: attn_dp, attn_tp, ep, moe_tp (a dict of them: made one)
    options: Options                 # compile options (target device, MoE lowering, buckets)
    graphs: dict[str, Graph]         # phase -> final graph
    kernels: dict[str, str] = field(default_factory=dict)   # kernels/<name>.py -> source
    kernel_contexts: dict[str, str] = field(default_factory=dict)  # name -> repr of its kernel context
    spec: dict = field(default_factory=dict)   # the model spec as data, for tools that recompile
    weight_formats: dict = field(default_factory=dict)  # codegen.weight_formats of the plan
    dumps: dict[str, dict[str, Graph]] = field(default_factory=dict)  # "NN-pass" -> phase -> graph
    directory: Path | None = None    # where `Plan.load` read it from (None: compiled in memory)

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):   # the axis sizes as a dict (the IR's metadata form)
            self.mesh = Mesh(**{a: self.mesh[a] for a in MESH_AXES}, name=self.parallel)
        if self.mesh.name != self.parallel:
            raise PlanError(f"a plan for {self.parallel!r} with the mesh of {self.mesh.name!r}")

    # -- facts the runtime asks for ---------------------------------------------------------
    @property
    def world(self) -> int:
        return self.mesh.world

    @property
    def has_mtp(self) -> bool:
        """Whether the plan runs the MTP layer (then its KV layer and indexer cache exist)."""
        return any(p.startswith("mtp") for p in self.graphs)

    @property
    def target(self) -> str:
        """The codegen target: "cuda" (Triton kernels, CUDA graphs) or "cpu" (the torch target)."""
        return self.options.device

    @property
    def decode_buckets(self) -> list[int]:
        """Decode batch sizes captured as CUDA graphs (empty for the torch target)."""
        return list(self.graphs["decode"].meta.get("cuda_graph_buckets", []))

    @property
    def memory(self) -> dict:
        """The memory plan of the decode phase (weights, KV and indexer bytes per token, ...)."""
        return dict(self.graphs["decode"].meta.get("memory", {}))

    @property
    def groups(self) -> set:
        """The process groups the plan's collectives run over: tuples of mesh axes, `("world",)` for
        all ranks."""
        out = set()
        for g in self.graphs.values():
            for op in g.ops:
                if (grp := op.attr("group")) is not None:
                    out.add(grp)
        return out

    def full_indexer_layers(self) -> set[int]:
        """KV layers with an indexer key cache: the full-indexer layers, and the MTP layer."""
        c = self.config
        full = {i for i, t in enumerate(c.layer_indexer_types()) if t == "full"}
        return full | ({c.num_hidden_layers} if self.has_mtp else set())

    def num_kv_layers(self) -> int:
        """Decoder layers plus the MTP layer when the plan runs it."""
        return self.config.num_hidden_layers + self.has_mtp

    # -- plan.json ----------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "glmc_version": __version__, "model": self.model, "source": self.source,
            "parallel": {"spec": self.parallel, **self.mesh, "world": self.world},
            "options": asdict(self.options), "dtypes": self.dtypes.model_dump(),
            "config": self.config.model_dump(mode="json"), "spec": self.spec,
            "kernels": dict(sorted(self.kernel_contexts.items())), "weights": self.weight_formats,
            "phases": {ph: {"ir": f"{ph}.ir", "num_ops": len(g.ops),
                            **{k: v for k, v in g.meta.items() if k not in ("mesh", "model", "parallel")}}
                       for ph, g in self.graphs.items()},
        }

    # -- directories ----------------------------------------------------------------------------
    def save(self, out_dir: str | Path, files: dict[str, str] | None = None) -> Path:
        """Write the plan (and `files`: relative path -> text, e.g. report.md) atomically."""
        out_dir = Path(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        # a directory of its own, not mkdtemp's: that is mode 0700, this one follows the umask
        tmp = out_dir.parent / f".{out_dir.name}.{os.getpid()}.{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            texts = {f"{ph}.ir": print_graph(g) for ph, g in self.graphs.items()}
            texts |= {f"kernels/{name}.py": src for name, src in self.kernels.items()}
            texts |= {f"after/{d}/{ph}.ir": print_graph(g)
                      for d, by_phase in self.dumps.items() for ph, g in by_phase.items()}
            texts["plan.json"] = json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"
            for rel, text in (texts | (files or {})).items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_text(text)
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out_dir

    @classmethod
    def load(cls, plan_dir: str | Path) -> Plan:
        plan_dir = Path(plan_dir)
        meta_path = plan_dir / "plan.json"
        if not meta_path.exists():
            raise PlanError(f"{plan_dir}: not a plan directory (no plan.json); make one with "
                            "`glmc compile`")
        try:
            meta = json.loads(meta_path.read_text())
            par = meta["parallel"]
            graphs = {ph: _read_graph(plan_dir / info["ir"]) for ph, info in meta["phases"].items()}
            contexts = meta.get("kernels", {})
            kernels = {name: (plan_dir / "kernels" / f"{name}.py").read_text() for name in contexts}
            return cls(model=meta["model"], source=meta["source"],
                       config=GlmConfig.model_validate(meta["config"]),
                       dtypes=DTypes.model_validate(meta["dtypes"]), parallel=par["spec"],
                       mesh=Mesh(**{a: int(par[a]) for a in MESH_AXES}, name=par["spec"]),
                       options=Options(**meta["options"]), graphs=graphs, kernels=kernels,
                       kernel_contexts=dict(contexts), spec=meta.get("spec", {}),
                       weight_formats=meta.get("weights", {}), directory=plan_dir)
        except (KeyError, TypeError, ValueError, OSError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"{meta_path}: not a plan this glmc can read ({type(e).__name__}: "
                            f"{e}); recompile with `glmc compile`") from e


def _read_graph(path: Path) -> Graph:
    """Parse and verify: a hand-edited or stale IR file fails here, naming itself, not mid-run."""
    try:
        graph = parse(path.read_text())
        verify(graph)
        return graph
    except IRError as e:
        raise PlanError(f"{path}: {e}") from e
