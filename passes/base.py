"""Pass infrastructure: a named pass with a docstring contract, and the context passes read.

A pass is an object with `name` (kebab-case) and `run(graph, ctx) -> graph`; it never mutates its
input (ops are frozen; it returns a new Graph).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from glmc.ir import Graph

from glmc.config import Options
from glmc.parallel import Parallel
from glmc.spec import ModelSpec

PHASES = ("prefill", "decode", "mtp_draft", "mtp_verify")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class PassContext:
    spec: ModelSpec
    parallel: Parallel
    phase: str
    options: Options = field(default_factory=Options)


class Pass(ABC):
    """`run` assumes what the docstring says and guarantees what it says; the verifier checks."""
    name: str = ""

    @abstractmethod
    def run(self, graph: Graph, ctx: PassContext) -> Graph: ...


class PassError(ValueError):
    """A pass failed; the message names the pass, the passes before it, the layer and the op."""
