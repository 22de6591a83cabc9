"""Run the pass pipeline per phase and write plan directories.

`compile_plan(spec, parallel, options)` -> Plan (one final Graph per phase, plus the graph after
each pass when asked); `write_plan(plan, out_dir)` writes `<phase>.ir`, `plan.json`, `report.md`
(and `after/<NN>-<pass>/<phase>.ir` dumps) into a temporary directory and renames it into place,
so a failed compile never leaves a half-written plan.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from glmc import __version__
from glmc.config import Options
from glmc.ir import Graph, IRError, parse, print_graph, verify
from glmc.parallel import Parallel
from glmc.passes import PHASES, PIPELINE, PassContext, PassError
from glmc.spec import ModelSpec


class CompileError(ValueError):
    """A pass failed; the message names it, the passes that ran before it, and the op."""


@dataclass
class Plan:
    spec: ModelSpec
    parallel: Parallel
    options: Options
    graphs: dict[str, Graph]
    dumps: dict[str, dict[str, Graph]] = field(default_factory=dict)   # pass -> phase -> graph


def phases_of(spec: ModelSpec) -> list[str]:
    has_mtp = spec.config.num_nextn_predict_layers > 0 and spec.program.mtp_prologue
    return [p for p in PHASES if has_mtp or not p.startswith("mtp")]


def verify_each_pass() -> bool:
    """Full verification between passes (tests and debug builds: GLMC_VERIFY=1); the final graph
    is always verified."""
    return os.environ.get("GLMC_VERIFY", "") not in ("", "0")


def compile_phase(spec: ModelSpec, parallel: Parallel, phase: str, options: Options,
                  dump=None) -> Graph:
    ctx = PassContext(spec, parallel, phase, options)
    graph, done = Graph([]), []
    check = verify_each_pass()
    for i, p in enumerate(PIPELINE):
        try:
            graph = p.run(graph, ctx)
            if check or i == len(PIPELINE) - 1:
                verify(graph)
        except (IRError, PassError, ValueError) as e:
            before = ", ".join(done) or "none"
            raise CompileError(f"{phase}: pass {p.name} failed (passes before it: {before}): {e}") \
                from e
        done.append(p.name)
        if dump is not None:
            dump(p.name, graph)
    return graph


def compile_plan(spec: ModelSpec, parallel: Parallel, options: Options = Options(),
                 dump_after: list[str] | None = None) -> Plan:
    """All phases; `dump_after` (pass names or "all") keeps the graph after those passes.
    GLMC_DUMP_IR=dir also writes every pass's graph to dir/<NN>-<pass>/<phase>.ir."""
    env_dir = os.environ.get("GLMC_DUMP_IR")
    if env_dir:
        dump_after = ["all"]
    plan = Plan(spec, parallel, options, {})
    for phase in phases_of(spec):
        def dump(name, g, phase=phase):
            if dump_after is not None and ("all" in dump_after or name in dump_after):
                plan.dumps.setdefault(name, {})[phase] = g
        plan.graphs[phase] = compile_phase(spec, parallel, phase, options, dump)
    if env_dir:
        _write_dumps(plan, Path(env_dir))
    return plan


def _write_dumps(plan: Plan, root: Path) -> None:
    for i, name in enumerate(p.name for p in PIPELINE):
        for phase, g in plan.dumps.get(name, {}).items():
            d = root / f"{i:02d}-{name}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{phase}.ir").write_text(print_graph(g))


def plan_json(plan: Plan) -> dict:
    return {
        "glmc_version": __version__, "model": plan.spec.name, "source": plan.spec.source,
        "parallel": {"spec": plan.parallel.name, **plan.parallel.mesh, "world": plan.parallel.world},
        "options": asdict(plan.options), "dtypes": plan.spec.dtypes.model_dump(),
        "config": plan.spec.config.model_dump(mode="json"),
        "spec": plan.spec.model_dump(mode="json"),
        "phases": {ph: {"ir": f"{ph}.ir", "num_ops": len(g.ops),
                        **{k: v for k, v in g.meta.items() if k not in ("mesh", "model", "parallel")}}
                   for ph, g in plan.graphs.items()},
    }


def write_plan(plan: Plan, out_dir: str | Path, report: str = "") -> Path:
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for phase, g in plan.graphs.items():
            (tmp / f"{phase}.ir").write_text(print_graph(g))
        _write_dumps(plan, tmp / "after")
        (tmp / "plan.json").write_text(json.dumps(plan_json(plan), indent=1, sort_keys=True) + "\n")
        (tmp / "report.md").write_text(report)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def load_plan_graphs(plan_dir: str | Path) -> tuple[dict, dict[str, Graph]]:
    """(plan.json, {phase: Graph}) of a plan directory, with clear errors for a bad directory."""
    plan_dir = Path(plan_dir)
    meta_path = plan_dir / "plan.json"
    if not meta_path.exists():
        raise CompileError(f"{plan_dir}: not a plan directory (no plan.json); "
                           "make one with `glmc compile`")
    meta = json.loads(meta_path.read_text())
    graphs = {}
    for phase, info in meta["phases"].items():
        try:
            graphs[phase] = parse((plan_dir / info["ir"]).read_text())
        except IRError as e:
            raise CompileError(f"{plan_dir / info['ir']}: {e}") from e
    return meta, graphs
