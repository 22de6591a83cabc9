"""Pass infrastructure: a named pass with a docstring contract, and the context passes read.

A pass is an object with `name` (kebab-case) and `run(graph, ctx) -> graph`; it never mutates its
input (ops are frozen; it returns a new Graph).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from glmc.ir import Graph
from glmc.parallel import Parallel
from glmc.spec import ModelSpec

PHASES = ("prefill", "decode", "mtp_draft", "mtp_verify")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Options:
    """User choices that passes honour: `moe_a2a` True/False forces a MoE lowering (None: cost)."""
    moe_a2a: bool | None = None
    topk_broadcast: bool = False
    device: str = "cuda"
    mtp_draft_tokens: int = 6
    decode_batch: int = 32
    max_batch: int = 128
    chunked_prefill: int = 8192


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
