"""glmc IR: typed ops with symbolic dims and placements, a graph, its text form and verifier."""
from . import dialect, fused_and_comm  # noqa: F401  (registers the op kinds)
from .graph import Graph
from .ops import REGISTRY, IRError, Op
from .parser import parse
from .printer import print_graph
from .types import Dim, Placement, TensorType
from .verify import verify

__all__ = ["Graph", "Op", "IRError", "REGISTRY", "parse", "print_graph", "Dim", "Placement",
           "TensorType", "verify"]
