"""Pass docstrings are tests: each pass's `Example (...)` block is checked against the IR it describes.

A pass module's docstring holds one or more examples:

    Example (GLM-5.3, tp8, decode):

        %L0.o = linear(%L0.attn) {parallel=row} : [T, 6144] bf16
     -> %L0.o = linear(%L0.attn) {parallel=row, tp=8} : [T, 6144] bf16 @ {attn_tp=P}

The header names the model (GLM-5.3 = models/glm_moe_dsa.yaml, tiny = glm_moe_dsa_tiny.yaml), the
parallel spec, the phase and any options (`moe_a2a=true`, `max_batch=32`, `device=cpu`). Lines
before `->` must match the IR printed just before the pass runs, lines from `->` on the IR just
after it, each in order (FileCheck style: `...` matches anything, the rest literally, a substring
of one printed line; a snippet line starting with `...` continues the one above). The IR is
printed unfolded (`print_graph(g, fold=False)`: one line per op, absolute names, `# L<n>`), so an
example names one layer's ops. Without `->`,
every line is checked after the pass. The "after" lines must not all hold before the pass: the
example shows what the pass did.
"""
import re
import sys
from functools import cache

import pytest
from filecheck import check_lines
from glmc.ir import Graph, print_graph
from glmc.passes import PIPELINE, PassContext

from glmc.config import Options
from glmc.parallel import parse_parallel
from tests.compile_util import FULL, TINY, spec

MODELS = {"GLM-5.3": FULL, "tiny": TINY}
EXAMPLE = re.compile(r"^\s*Example \((?P<args>[^)]*)\):\s*$")


def examples(doc: str) -> list[tuple[str, list[str], list[str]]]:
    """(header args, before lines, after lines) of each Example block of a docstring."""
    out, lines = [], doc.splitlines()
    for i, line in enumerate(lines):
        m = EXAMPLE.match(line)
        if not m:
            continue
        block = []
        for body in lines[i + 1:]:
            if not body.strip():
                if block:
                    break
                continue
            if not body.startswith(" "):
                break
            if body.strip().startswith("...") and block:  # continues the line above (one IR line)
                block[-1] += body.strip()
            else:
                block.append(body.strip())
        split = next((j for j, b in enumerate(block) if b.startswith("-> ")), None)
        before, after = ([], block) if split is None else (block[:split], block[split:])
        out.append((m["args"], before, [a.removeprefix("-> ") for a in after]))
    return out


def _value(text: str):
    return {"true": True, "false": False}.get(text, int(text) if text.isdigit() else text)


@cache
def printed(args: str) -> tuple[str, ...]:
    """The printed IR before every pass and after the last: index i = before PIPELINE[i]."""
    model, parallel, phase, *opts = [a.strip() for a in args.split(",")]
    s = spec(MODELS[model])
    options = Options(**{k: _value(v) for k, v in (o.split("=") for o in opts)})
    ctx = PassContext(s, parse_parallel(parallel, s.config), phase, options)
    graph, out = Graph([]), []
    for p in PIPELINE:
        out.append(print_graph(graph, fold=False))
        graph = p.run(graph, ctx)
    return (*out, print_graph(graph, fold=False))


@pytest.mark.parametrize("index", range(len(PIPELINE)), ids=[p.name for p in PIPELINE])
def test_pass_docstring_examples_hold(index):
    p = PIPELINE[index]
    doc = sys.modules[type(p).__module__].__doc__
    found = examples(doc)
    assert found, f"{p.name}: its docstring has no `Example (model, parallel, phase):` block"
    for args, before, after in found:
        ir = printed(args)
        where = f"{p.name}, Example ({args})"
        assert check_lines(ir[index], before) is None, f"{where}, before: {check_lines(ir[index], before)}"
        assert check_lines(ir[index + 1], after) is None, f"{where}, after: {check_lines(ir[index + 1], after)}"
        assert check_lines(ir[index], after) is not None, f"{where}: the after lines already hold before the pass"
