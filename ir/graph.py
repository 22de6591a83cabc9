"""`Graph`: an immutable, topologically ordered list of ops plus graph-level metadata.

networkx is the storage for def-use edges (users, topological order); passes never touch it,
they read `ops`, `producer`, `users` and build a new Graph.
"""
from __future__ import annotations

import json
from typing import Iterable

import networkx as nx

from .ops import IRError, Op
from .printer import print_graph


class Graph:
    """Ops in a stable topological order (ties broken by construction order) and `meta`."""

    def __init__(self, ops: Iterable[Op], meta: dict | None = None):
        ops = list(ops)
        self.meta = dict(meta or {})
        self._outputs: tuple | None = None
        self._dead: list | None = None
        self._producer: dict[str, Op] = {}
        g = nx.DiGraph()
        for i, op in enumerate(ops):
            g.add_node(i)
            for r in op.results:
                if r in self._producer:
                    raise IRError(f"{op.where()}: value %{r} defined twice")
                self._producer[r] = op
        self.ops: list[Op] = ops if self._in_order(ops) else self._sorted(ops)
        self._users: dict[str, list[Op]] = {r: [] for r in self._producer}
        for op in self.ops:
            for v in op.operands:
                self._users[v].append(op)

    def _in_order(self, ops: list[Op]) -> bool:
        seen: set[str] = set()
        for op in ops:
            for v in op.operands:
                if v not in self._producer:
                    raise IRError(f"{op.where()}: operand %{v} is not defined")
                if v not in seen:
                    return False
            seen.update(op.results)
        return True

    def _sorted(self, ops: list[Op]) -> list[Op]:
        """Topological order, ties broken by construction order (stable text, stable diffs)."""
        g = nx.DiGraph()
        g.add_nodes_from(range(len(ops)))
        index = {id(op): i for i, op in enumerate(ops)}
        for i, op in enumerate(ops):
            for v in op.operands:
                g.add_edge(index[id(self._producer[v])], i)
        if not nx.is_directed_acyclic_graph(g):
            raise IRError("graph has a cycle")
        return [ops[i] for i in nx.lexicographical_topological_sort(g)]

    def producer(self, value: str) -> Op:
        return self._producer[value]

    def users(self, value: str) -> list[Op]:
        return self._users[value]

    def type_of(self, value: str):
        op = self._producer[value]
        return op.types[op.results.index(value)]

    def placement_of(self, value: str):
        op = self._producer[value]
        return op.placements[op.results.index(value)]

    def with_ops(self, ops: Iterable[Op], **meta) -> "Graph":
        return Graph(ops, {**self.meta, **meta})

    def step_outputs(self) -> tuple[str, str, str]:
        """(logits, final hidden states, sampled ids): the values a phase graph's step returns (the
        operand of `sample.tokens`, the operand of `lm.head`, the last op's result)."""
        if self._outputs is None:
            head = next(op for op in self.ops if op.kind == "lm.head")
            sample = next(op for op in self.ops if op.kind == "sample.tokens")
            self._outputs = (sample.operands[0], head.operands[0], self.ops[-1].results[0])
        return self._outputs

    def dead_after(self) -> list[tuple[str, ...]]:
        """Per op, in order: the values whose last use is that op (its operands read for the last
        time, its results nobody reads), never `step_outputs`: what an executor that frees values at
        their last use drops after running it. A graph without a head (a fragment) drops nothing."""
        if self._dead is None:
            dead: list[list[str]] = [[] for _ in self.ops]
            if {"lm.head", "sample.tokens"} <= {op.kind for op in self.ops}:
                last = {r: i for i, op in enumerate(self.ops) for r in op.results}
                for i, op in enumerate(self.ops):
                    last.update((v, i) for v in op.operands)
                keep = set(self.step_outputs())
                for v, i in last.items():
                    if v not in keep:
                        dead[i].append(v)
            self._dead = [tuple(sorted(d)) for d in dead]
        return self._dead

    def count(self, prefix: str) -> int:
        return sum(op.kind.startswith(prefix) for op in self.ops)

    def __repr__(self) -> str:
        return print_graph(self)

    def __eq__(self, other) -> bool:
        return isinstance(other, Graph) and self.ops == other.ops and _as_json(self.meta) == _as_json(other.meta)


def _as_json(meta: dict) -> dict:
    """Metadata as JSON holds it (keys strings, tuples lists): what the text form keeps."""
    return json.loads(json.dumps(meta))
