"""The shape of the code: imports follow the pipeline, and no two modules import each other.

    ir  ->  passes  ->  compiler (glmc.spec, glmc.parallel, glmc.compiler, explain, ...)  ->  Plan
                                  codegen  ->  runtime (worker <- engine <- serving)
    glmc.cli, glmc.api, glmc.tiny: the front door, may import anything (they compile on demand)

The import graph is read with `ast` from every module of the package, imports inside functions
included (a lazy import is still a dependency), and so are `if TYPE_CHECKING:` blocks: a
type-only import is still an arrow between modules (a module that needs another's type for its
annotations states what it reads as a Protocol instead). `glmc.config` and `glmc.plan` are the
shared vocabulary every stage may read, `glmc.run_config` the run settings every stage from
the command line to the engine reads, and `glmc.target` the CUDA target's description (device
constants, tile tables, launch rules) that passes and codegen both read.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"glmc": "glmc", "ir": "glmc.ir", "passes": "glmc.passes", "codegen": "glmc.codegen",
           "runtime": "glmc.runtime", "models": "glmc.models"}
FRONT_DOOR = ("glmc.cli", "glmc.api", "glmc.tiny")
COMPILER = ("glmc.passes", "glmc.spec", "glmc.parallel", "glmc.compiler", "glmc.explain",
            "glmc.report", "glmc.diff", "glmc.onnx_export", "glmc.article", "glmc.predict", "glmc.calibration")
# (importer prefix, forbidden prefixes, why)
FORBIDDEN = [
    ("glmc.runtime", COMPILER + FRONT_DOOR, "the runtime reads a Plan; it never compiles"),
    ("glmc.codegen", ("glmc.runtime",) + COMPILER + FRONT_DOOR, "codegen renders kernels; it runs nothing"),
    ("glmc.ir", ("glmc.passes", "glmc.codegen", "glmc.runtime", "glmc.spec", "glmc.compiler") + FRONT_DOOR,
     "the IR is the bottom layer"),
    ("glmc.passes", ("glmc.codegen", "glmc.runtime", "glmc.compiler") + FRONT_DOOR,
     "passes transform graphs; the pipeline runs them"),
    ("glmc.config", ("glmc.",), "the config types import nothing of glmc"),
    ("glmc.run_config", ("glmc.",), "the run settings import nothing of glmc"),
    ("glmc.target", ("glmc.passes", "glmc.codegen", "glmc.runtime", "glmc.models") + COMPILER + FRONT_DOOR,
     "the target description sits below passes and codegen: the IR's types only"),
    ("glmc.plan", ("glmc.passes", "glmc.spec", "glmc.compiler", "glmc.codegen", "glmc.runtime") + FRONT_DOOR,
     "the Plan is data: the IR and the config types only"),
    ("glmc.runtime.worker", ("glmc.runtime.engine", "glmc.runtime.serving"), "a worker knows no requests"),
    ("glmc.runtime.engine", ("glmc.runtime.serving",), "the engine knows no HTTP"),
]
ALLOWED_IN_CONFIG = ("glmc.config",)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts).replace("glmc.glmc", "glmc")


def modules() -> dict[str, Path]:
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            out[module_name(path)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """glmc modules `name` imports (resolving relative imports and `from pkg import module`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def _under(name: str, prefix: str) -> bool:
    return name == prefix.rstrip(".") or name.startswith(prefix if prefix.endswith(".") else prefix + ".")


def test_imports_follow_the_pipeline(graph):
    bad = []
    for importer, forbidden, why in FORBIDDEN:
        for mod, deps in graph.items():
            if not _under(mod, importer):
                continue
            for dep in sorted(deps):
                if any(_under(dep, f) for f in forbidden) and not dep.startswith(ALLOWED_IN_CONFIG):
                    bad.append(f"{mod} imports {dep} ({why})")
    assert not bad, "imports against the pipeline:\n  " + "\n  ".join(bad)


def test_no_import_cycles(graph):
    """Tarjan's strongly connected components over module -> imported module; a package's
    __init__ re-exporting its own modules is not a cycle of two modules."""
    edges = {m: {d for d in deps if not _under(m, d) or m == d} for m, deps in graph.items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_target_description_is_pure_python():
    """glmc.target imports no torch, so the compiler side may read it."""
    tree = ast.parse((ROOT / "glmc" / "target.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names <= {"__future__", "glmc"}, names


def test_the_checker_sees_a_violation(tmp_path):
    """The walker is not blind: a runtime module importing the compiler is found."""
    fake = tmp_path / "runtime" / "worker" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from glmc.compiler import compile_plan\n")
    found = imports_of("glmc.runtime.worker.bad", fake, {"glmc.compiler"})
    assert found == {"glmc.compiler"}
    typed = tmp_path / "codegen" / "typed.py"       # a type-only import is an arrow too
    typed.parent.mkdir(parents=True)
    typed.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from glmc.runtime.worker.kv_cache import KVPool\n")
    assert "glmc.runtime.worker.kv_cache" in imports_of("glmc.codegen.typed", typed, {"glmc.runtime.worker.kv_cache"})


# -- every op kind is accounted for at every stage ------------------------------------------------
SPECS = [("glm_moe_dsa_tiny", p, o) for p, o in
         [("tp1", {}), ("tp2", {}), ("tp2ep2", {}), ("dp2ep2", {"moe_a2a": True}),
          ("dp2ep2", {"moe_a2a": False}), ("tp2", {"topk_broadcast": True}), ("tp1", {"device": "cpu"})]]


@pytest.fixture(scope="module")
def final_kinds() -> set[str]:
    """Op kinds in the final graphs of the tiny model's plans over several specs."""
    from compile_util import plan
    return {op.kind for name, par, opts in SPECS for g in plan(name, par, **opts).graphs.values()
            for op in g.ops}


def test_every_op_has_a_sharding_rule():
    from glmc.ir import REGISTRY
    from glmc.passes.sharding_rules import DEFAULT_RULE_KINDS, PLACED_BY_PASS, RULES
    from glmc.passes import PASS_NAMES
    missing = set(REGISTRY) - set(RULES) - DEFAULT_RULE_KINDS - set(PLACED_BY_PASS)
    assert not missing, f"op kinds with no sharding rule and no pass placing them: {sorted(missing)}"
    assert not (set(RULES) | DEFAULT_RULE_KINDS) & set(PLACED_BY_PASS)
    for kind, pass_name in PLACED_BY_PASS.items():   # the named pass really makes the op
        assert pass_name in PASS_NAMES
        source = (ROOT / "passes" / f"{pass_name.replace('-', '_')}.py").read_text()
        assert kind in source, f"{kind}: pass {pass_name} does not name it"


def test_ops_before_sharding_have_rules():
    """What propagate-sharding sees (the program after expansion) is covered by its rules."""
    from compile_util import spec
    from glmc.compiler import compile_phase
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.passes.sharding_rules import DEFAULT_RULE_KINDS, RULES
    seen = set()

    def dump(name, graph):
        if name == "infer-shapes":
            seen.update(op.kind for op in graph.ops)
    s = spec()
    for phase in ("prefill", "decode", "mtp_draft"):
        compile_phase(s, parse_parallel("tp2ep2", s.config), phase, Options(), dump)
    assert seen and seen <= set(RULES) | DEFAULT_RULE_KINDS, sorted(seen - set(RULES) - DEFAULT_RULE_KINDS)


def test_every_op_has_a_cost():
    from glmc.ir import REGISTRY
    from glmc.passes.costs import COMM_KINDS, FLOP_KINDS, FREE_KINDS, flops_of
    missing = set(REGISTRY) - FLOP_KINDS - set(COMM_KINDS) - FREE_KINDS
    assert not missing, f"op kinds the cost model does not account for: {sorted(missing)}"
    from compile_util import plan
    g = plan("glm_moe_dsa", "tp8ep8").graphs["decode"]
    env = {"T": 32, "B": 32, "S": 4096, "K": 2048}
    zero = sorted({op.kind for op in g.ops if op.kind in FLOP_KINDS and not flops_of(op, g, env) > 0})
    assert not zero, f"FLOP_KINDS that flops_of counts as 0: {zero}"


def test_every_executed_op_has_torch_and_cuda_implementations(final_kinds):
    from glmc.codegen import cuda_target, torch_target
    from glmc.ir import REGISTRY
    assert not final_kinds & set(torch_target.NOT_EXECUTED), "a final plan holds a lowered-away op"
    executed = set(REGISTRY) - set(torch_target.NOT_EXECUTED)
    assert executed <= set(torch_target.IMPLS), sorted(executed - set(torch_target.IMPLS))
    overridden = {k for k, fn in cuda_target.IMPLS.items() if torch_target.IMPLS.get(k) is not fn}
    assert not overridden & cuda_target.FROM_TORCH_TARGET
    missing = executed - overridden - cuda_target.FROM_TORCH_TARGET - cuda_target.CPU_ONLY
    assert not missing, f"op kinds the CUDA target neither implements nor reuses: {sorted(missing)}"
    assert final_kinds <= executed


def test_every_executed_op_exports_to_onnx(final_kinds):
    from compile_util import plan
    from glmc.onnx_export import DOMAIN, to_onnx
    kinds = set()
    for name, par, opts in SPECS:
        for phase, g in plan(name, par, **opts).graphs.items():
            model = to_onnx(g, f"{par}_{phase}")     # checked by onnx.checker inside
            kinds |= {(n.domain, n.op_type) for n in model.graph.node}
    assert {k for d, k in kinds if d == DOMAIN} == final_kinds - {"io.input"}


def test_the_executors_step_fulfils_the_codegen_contract():
    """Every member an op implementation may use (codegen/context.py) exists on the runtime's
    step objects: the torch target's `Step`, the CUDA target's `GpuStep`."""
    import dataclasses
    import typing

    from glmc.codegen.context import CudaStepContext, StepContext
    from glmc.runtime.worker.cuda_executor import GpuStep
    from glmc.runtime.worker.executor import Step

    def members(proto):
        names = set(typing.get_type_hints(proto)) if hasattr(proto, "__annotations__") else set()
        names |= {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
        for base in proto.__mro__[1:]:
            if base not in (typing.Protocol, typing.Generic, object):
                names |= members(base)
        return names

    for step, proto in ((Step, StepContext), (GpuStep, CudaStepContext)):
        have = {f.name for f in dataclasses.fields(step)} | set(dir(step))
        missing = members(proto) - have
        assert not missing, f"{step.__name__} lacks {sorted(missing)} of {proto.__name__}"


ADAPTERS = {"token_rows"}   # the one ForwardBatch -> tensors adapter, for tests and benchmarks


def test_kernel_wrappers_take_tensors():
    """The Triton launch wrappers take tensors (and a kernel library), never the runtime's
    ForwardBatch or KV pool: no parameter named batch or pool in codegen/triton_*.py."""
    bad = []
    for path in sorted((ROOT / "codegen").glob("triton_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name not in ADAPTERS:
                names = {a.arg for a in node.args.args + node.args.kwonlyargs}
                if names & {"batch", "pool"}:
                    bad.append(f"{path.name}::{node.name}")
    assert not bad, f"kernel wrappers taking a ForwardBatch or KV pool: {bad}"
