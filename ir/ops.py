"""Ops: one frozen dataclass for every op, a registry of op kinds that infer and verify types.

Kinds are dotted (`attn.sparse_mla`, `comm.all_reduce`). Attributes are sorted tuples of
(name, value) with immutable values (int, float, bool, str, tuples). An op's result types and
placements are stored on it; `None` means "not inferred yet" (before shape inference / sharding).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from .types import Dim, Placement, TensorType

AttrValue = int | float | bool | str | tuple


def freeze(value):
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


@dataclass(frozen=True)
class Op:
    """One IR operation: `%r0, %r1 = kind(%a, %b) {attrs} : type @ placement, ...  # L<layer>`."""
    kind: str
    results: tuple[str, ...]
    operands: tuple[str, ...] = ()
    attrs: tuple[tuple[str, AttrValue], ...] = ()
    types: tuple[TensorType | None, ...] = ()
    placements: tuple[Placement | None, ...] = ()
    layer: int | None = None

    @staticmethod
    def make(kind, results, operands=(), attrs=None, layer=None, types=None, placements=None) -> "Op":
        results = (results,) if isinstance(results, str) else tuple(results)
        attrs = tuple(sorted((k, freeze(v)) for k, v in (attrs or {}).items()))
        types = tuple(types) if types else (None,) * len(results)
        placements = tuple(placements) if placements else (None,) * len(results)
        return Op(kind, results, tuple(operands), attrs, types, placements, layer)

    def attr(self, name: str, default=None):
        for k, v in self.attrs:
            if k == name:
                return v
        return default

    def with_attrs(self, **updates) -> "Op":
        merged = dict(self.attrs)
        merged.update({k: freeze(v) for k, v in updates.items()})
        return replace(self, attrs=tuple(sorted(merged.items())))

    def with_types(self, types, placements=None) -> "Op":
        return replace(self, types=tuple(types),
                       placements=tuple(placements) if placements is not None else self.placements)

    @property
    def result(self) -> str:
        return self.results[0]

    def where(self) -> str:
        """Provenance for error messages: the layer and the op."""
        loc = f"layer {self.layer}, " if self.layer is not None else ""
        return f"{loc}op {self.kind} -> %{self.results[0]}"


InferFn = Callable[[Op, list[TensorType]], list[TensorType]]


@dataclass(frozen=True)
class OpDef:
    """A registered op kind: how many operands/results and how result types follow from operands."""
    kind: str
    num_operands: int | None        # None: variadic
    num_results: int
    infer: InferFn
    doc: str = ""
    required_attrs: tuple[str, ...] = field(default=())


REGISTRY: dict[str, OpDef] = {}


class IRError(ValueError):
    """An ill-formed op or graph; the message names the op (and layer)."""


def register(kind: str, operands: int | None, results: int = 1, attrs: tuple[str, ...] = ()):
    def deco(fn: InferFn) -> InferFn:
        REGISTRY[kind] = OpDef(kind, operands, results, fn, (fn.__doc__ or "").strip(), attrs)
        return fn
    return deco


def opdef(kind: str) -> OpDef:
    if kind not in REGISTRY:
        raise IRError(f"unknown op kind {kind!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[kind]


def infer_types(op: Op, operand_types: list[TensorType]) -> list[TensorType]:
    d = opdef(op.kind)
    if d.num_operands is not None and len(op.operands) != d.num_operands:
        raise IRError(f"{op.where()}: expects {d.num_operands} operands, got {len(op.operands)}")
    missing = [a for a in d.required_attrs if op.attr(a) is None]
    if missing:
        raise IRError(f"{op.where()}: missing attribute(s) {missing}")
    try:
        out = d.infer(op, operand_types)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise IRError(f"{op.where()}: {e}") from e
    if len(out) != len(op.results):
        raise IRError(f"{op.where()}: {len(op.results)} results named, kind gives {len(out)}")
    return out


def dims(*values) -> tuple[Dim, ...]:
    return tuple(Dim.of(v) for v in values)
