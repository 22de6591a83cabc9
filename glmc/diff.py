"""`glmc diff A B`: a readable IR diff of two plans (or two parallel specs of one model) and a
summary of collectives and fusions added or removed."""
from __future__ import annotations

import difflib
import re
from collections import Counter
from pathlib import Path

from glmc.ir import Graph, print_graph
from glmc.passes.rewrite import FUSIONS

_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@$")
COLLECTIVE_PREFIXES = ("comm.", "moe.dispatch", "moe.combine", "fused.allreduce", "fused.reduce_scatter")


def _graphs(arg: str, model: str | None, phase: str) -> tuple[str, Graph]:
    if (Path(arg) / "plan.json").exists():
        from glmc.plan import Plan
        graphs = Plan.load(arg).graphs
        if phase not in graphs:
            raise ValueError(f"{arg}: plan has no phase {phase!r} (has {sorted(graphs)})")
        return arg, graphs[phase]
    from glmc.compiler import compile_phase
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.spec import load_spec, model_path
    if Path(arg).exists():
        raise ValueError(f"{arg}: not a plan directory (no plan.json)")
    spec = load_spec(model_path(model or "glm_moe_dsa_tiny"))
    return f"{spec.name} {arg}", compile_phase(spec, parse_parallel(arg, spec.config), phase, Options())


def summary(a: Graph, b: Graph) -> list[str]:
    """Collective ops and fusion rewrites whose counts differ, as `+n kind` / `-n kind` lines."""
    def coll(g):
        return Counter(op.kind for op in g.ops if op.kind.startswith(COLLECTIVE_PREFIXES))
    lines = []
    for title, ca, cb in (("collectives", coll(a), coll(b)),
                          ("fusions", _fusions(a), _fusions(b))):
        rows = [f"  {'+' if cb[k] > ca[k] else '-'}{abs(cb[k] - ca[k])} {k} ({ca[k]} -> {cb[k]})"
                for k in sorted(set(ca) | set(cb)) if ca[k] != cb[k]]
        lines += [f"{title}:"] + (rows or ["  (same)"])
    return lines


def _fusions(g: Graph) -> Counter:
    return Counter({k: v for k, v in g.meta.get("rewrites", {}).items() if k in FUSIONS})


def diff_text(name_a: str, a: Graph, name_b: str, b: Graph) -> str:
    """The summary, then a unified diff of the printed (folded) IR: a change to one lowering shows
    once per class of identical layers, each hunk header naming the `layers` block (or metadata entry)
    the hunk starts in, as `git diff` names the function (`@@ -120,9 +121,7 @@ layers 3..75 step 4 {`)."""
    text_a = print_graph(a).splitlines()
    body = difflib.unified_diff(text_a, print_graph(b).splitlines(), name_a, name_b, lineterm="", n=1)
    return "\n".join([*summary(a, b), "", *_name_hunks(body, _headers(text_a))]) + "\n"


def _headers(lines: list[str]) -> list[str]:
    """For each line, the line naming where it is: the header of its `layers ... {` block or the
    first line of its `#! key = ...` metadata entry ("" for ops outside blocks)."""
    out, head = [], ""
    for line in lines:
        if line.startswith("layers ") or (line.startswith("#! ") and not line.startswith(("#!  ", "#! }"))):
            head = line
        elif line.startswith("%"):      # an op outside blocks (ops inside are indented)
            head = ""
        out.append(head)
        head = "" if line == "}" else head
    return out


def _name_hunks(body, header_at: list[str]):
    """Unified-diff lines, each hunk header followed by the header of the line the hunk starts at."""
    for line in body:
        m = _HUNK.match(line)
        start = int(m[1]) if m else 0
        yield f"{line} {header_at[start - 1]}".rstrip() if m and start > 0 else line


def diff_main(a: str, b: str, model: str | None, phase: str) -> int:
    name_a, ga = _graphs(a, model, phase)
    name_b, gb = _graphs(b, model, phase)
    print(diff_text(name_a, ga, name_b, gb), end="")
    return 0
