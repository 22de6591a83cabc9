"""Local rewrites as pattern tables: `[(name, fn)]`, `fn(op, graph)` returns a Rewrite or None.

A Rewrite replaces the anchor op with `new` ops, deletes the ops producing `dead` values, and
renames the other ops' uses (`rename`, old value -> new value). Rules run in table order on each op; the first
that applies wins. The graph is rebuilt (and re-sorted) once at the end.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from glmc.ir import Graph, Op


@dataclass
class Rewrite:
    new: list[Op]
    dead: set[str] = field(default_factory=set)
    rename: dict[str, str] = field(default_factory=dict)


Rule = Callable[[Op, Graph], "Rewrite | None"]

# rewrite names that are fusions (reported as such by explain and diff)
FUSIONS = ("allreduce/reduce-scatter+add+rmsnorm", "add+rmsnorm", "q/kv norm+rope+kv write",
           "q rope+indexer/attention")


def apply_patterns(graph: Graph, rules: list[tuple[str, Rule]], **meta) -> Graph:
    out: list[Op] = []
    new_ids: set[int] = set()
    dead: set[str] = set()
    rename: dict[str, str] = {}
    fired: dict[str, int] = {}
    for op in graph.ops:
        if set(op.results) & dead:
            continue
        for name, rule in rules:
            rw = rule(op, graph)
            if rw is not None:
                out.extend(rw.new)
                new_ids |= {id(o) for o in rw.new}
                dead |= rw.dead
                rename.update(rw.rename)
                fired[name] = fired.get(name, 0) + 1
                break
        else:
            out.append(op)
    # the producers of dead values go, unless they are a rewrite's own replacement ops
    out = [o for o in out if id(o) in new_ids or not set(o.results) & dead]
    # renames redirect the other ops' uses, not the replacement ops' own operands
    out = [o if id(o) in new_ids or not rename.keys() & set(o.operands)
           else replace(o, operands=tuple(rename.get(v, v) for v in o.operands)) for o in out]
    counts = dict(graph.meta.get("rewrites", {}))
    counts.update({k: counts.get(k, 0) + v for k, v in fired.items()})
    return graph.with_ops(out, rewrites=counts, **meta)


def single_use(graph: Graph, value: str) -> bool:
    return len(graph.users(value)) == 1


def producer_if(graph: Graph, value: str, kind: str) -> Op | None:
    op = graph.producer(value)
    return op if op.kind == kind else None
