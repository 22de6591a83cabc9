"""Folded layers: decoder layers written relative to their index, so identical layers print once.

    layers 3..75 step 4 {
      %L.hn, %L.h = fused.add_rms(%L.o, %L-1.x_out) {eps=1e-05, weight=.post_attention_layernorm.weight} : ...
      %L.attn = attn.mla_absorbed(%L.q_nope, %L.q_pe, %L.kv, %L-1.topk) {...} : ...
    }

Inside a block, for each layer l of its set: a value `%L.q` is `%L<l>.q`, `%L-1.x_out` is
`%L<l-1>.x_out` (any signed offset), other names are themselves; a string attribute starting with
`.` is `model.layers.<l>` + it (weight names relative to the layer); every op is in layer l.
Consecutive blocks expand together, layer by layer in increasing order, so a block holds a layer
class (the layers whose relative ops are identical), not only a contiguous range: the indexer
pattern of GLM-5.3 (a full layer, then three layers reading its top-k at offsets -1, -2, -3)
makes classes such as 3, 7, ..., 75. Folding is exact: every op comes back as it was, in order.
"""
from __future__ import annotations

import re
from dataclasses import replace
from itertools import groupby

from .ops import Op

_ABS_NAME = re.compile(r"^L(0|[1-9][0-9]*)\.")   # canonical numbers only: L3, not L03
_REL_NAME = re.compile(r"^L([+-][0-9]+)?\.")
_WEIGHTS = "model.layers."


def _rewrite(op: Op, name, string, layer: int | None) -> Op:
    """`op` with `name` applied to its values, `string` to its string attributes, in `layer`."""
    return replace(op, results=tuple(map(name, op.results)), operands=tuple(map(name, op.operands)),
                   attrs=tuple((k, _map_strings(v, string)) for k, v in op.attrs), layer=layer)


def _map_strings(value, fn):
    if isinstance(value, tuple):
        return tuple(_map_strings(v, fn) for v in value)
    return fn(value) if isinstance(value, str) else value


def _strings(value) -> list[str]:
    if isinstance(value, tuple):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def _relative(op: Op) -> Op | None:
    """`op` written relative to its layer (layer None), or None if some name or string of it
    would read as relative already (`%L.x`, `.w`) and so cannot fold."""
    layer = op.layer
    names = op.results + op.operands
    if any(_REL_NAME.match(n) for n in names) or \
            any(s.startswith(".") for _, v in op.attrs for s in _strings(v)):
        return None
    weights = f"{_WEIGHTS}{layer}."

    def name(n: str) -> str:
        m = _ABS_NAME.match(n)
        if not m:
            return n
        off = int(m[1]) - layer
        return (f"L{off:+d}." if off else "L.") + n[m.end():]

    def string(s: str) -> str:
        return s[len(weights) - 1:] if s.startswith(weights) else s
    return _rewrite(op, name, string, None)


def absolute(op: Op, layer: int) -> Op:
    """The inverse of folding: a block's op for `layer`."""
    if op.layer is not None:
        raise ValueError(f"an op inside a layers block has its own layer (# L{op.layer})")

    def name(n: str) -> str:
        m = _REL_NAME.match(n)
        return f"L{layer + int(m[1] or 0)}." + n[m.end():] if m else n

    def string(s: str) -> str:
        return f"{_WEIGHTS}{layer}{s}" if s.startswith(".") else s
    return _rewrite(op, name, string, layer)


def fold(ops: list[Op]) -> list[tuple[list[int], list[Op]]] | None:
    """Ops that all have a layer -> [(layers, relative ops)], one entry per class of identical
    layers, in order of first layer; None if they cannot fold (a layer's ops not contiguous, or
    layers not increasing, or a name that would read as relative)."""
    classes: dict[tuple[Op, ...], list[int]] = {}
    last = -1
    for layer, seg in groupby(ops, key=lambda op: op.layer):
        body = tuple(_relative(op) for op in seg)
        if layer <= last or None in body:
            return None
        classes.setdefault(body, []).append(layer)
        last = layer
    return [(layers, list(body)) for body, layers in classes.items()]


def unfold(blocks: list[tuple[list[int], list[Op]]]) -> list[Op]:
    """The inverse of `fold`: consecutive blocks -> ops, layer by layer."""
    body_of: dict[int, list[Op]] = {}
    for layers, body in blocks:
        for layer in layers:
            if layer in body_of:
                raise ValueError(f"layer {layer} is in two blocks")
            body_of[layer] = body
    return [absolute(op, layer) for layer in sorted(body_of) for op in body_of[layer]]
