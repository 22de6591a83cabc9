"""Helpers for compiler tests: compile packaged models by name, print IR."""
from functools import lru_cache

from glmc.ir import print_graph

from glmc.cli import _model_path
from glmc.compiler import compile_phase, compile_plan
from glmc.config import Options
from glmc.parallel import parse_parallel
from glmc.spec import load_spec

TINY, FULL = "glm_moe_dsa_tiny", "glm_moe_dsa"


@lru_cache(maxsize=None)
def spec(name: str = TINY):
    return load_spec(_model_path(name))


@lru_cache(maxsize=None)
def graph(name: str, parallel: str, phase: str, **opts):
    s = spec(name)
    return compile_phase(s, parse_parallel(parallel, s.config), phase, Options(**opts))


def ir(name: str, parallel: str, phase: str, **opts) -> str:
    """The compiled graph printed unfolded: one line per op, absolute names, `# L<n>`."""
    return print_graph(graph(name, parallel, phase, **opts), fold=False)


def plan(name: str, parallel: str, **opts):
    s = spec(name)
    return compile_plan(s, parse_parallel(parallel, s.config), Options(**opts))
