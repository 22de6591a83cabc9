"""Run the pass pipeline per phase; the result is a `glmc.plan.Plan`.

`compile_plan(spec, parallel, options)` -> Plan (one final Graph per phase, plus the graph after
each pass when asked, and for the cuda target every Triton kernel it can launch, rendered by
`codegen.kernel_set`); `Plan.save(dir)` writes it (atomically). A failing pass raises
`CompileError` naming itself, the passes before it, and the op.
"""
from __future__ import annotations

import os
from pathlib import Path

from glmc.codegen.kernel_set import render_kernels
from glmc.codegen.weight_formats import weight_formats
from glmc.config import Options
from glmc.ir import Graph, IRError, print_graph, verify
from glmc.parallel import Parallel
from glmc.passes import PHASES, PIPELINE, PassContext, PassError
from glmc.plan import Plan
from glmc.spec import ModelSpec


class CompileError(ValueError):
    """A pass failed; the message names it, the passes that ran before it, and the op."""


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
                 dump_after: list[str] | None = None, phases: tuple[str, ...] | None = None) -> Plan:
    """All phases (`phases`: only those of the model's that it names, for a caller that runs no
    other: plan search traces decode and MTP steps, never a prefill); `dump_after` (pass names or "all") keeps the graph after those passes
    (`plan.dumps`, written under after/ by `Plan.save`). GLMC_DUMP_IR=dir also writes every
    pass's graph to dir/<NN>-<pass>/<phase>.ir."""
    env_dir = os.environ.get("GLMC_DUMP_IR")
    if env_dir:
        dump_after = ["all"]
    plan = Plan(model=spec.name, source=spec.source, config=spec.config, dtypes=spec.dtypes,
                parallel=parallel.name, mesh=parallel.mesh, options=options, graphs={},
                spec=spec.model_dump(mode="json"))
    names = {p.name: f"{i:02d}-{p.name}" for i, p in enumerate(PIPELINE)}
    for phase in (p for p in phases_of(spec) if phases is None or p in phases):
        def dump(name, g, phase=phase):
            if dump_after is not None and ("all" in dump_after or name in dump_after):
                plan.dumps.setdefault(names[name], {})[phase] = g
        plan.graphs[phase] = compile_phase(spec, parallel, phase, options, dump)
    plan.weight_formats = weight_formats(plan)   # how the runtime holds the weights (block-FP8 or not)
    if plan.target == "cuda":
        render_kernels(plan)   # codegen: the Triton kernels the plan can launch, rendered
    if env_dir:
        for d, by_phase in plan.dumps.items():
            for phase, g in by_phase.items():
                (Path(env_dir) / d).mkdir(parents=True, exist_ok=True)
                (Path(env_dir) / d / f"{phase}.ir").write_text(print_graph(g))
    return plan
