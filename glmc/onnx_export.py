"""`glmc export-onnx`: each phase's IR as an ONNX graph for standard viewers (Netron).

Ops become nodes in the custom domain `ai.glmc` (op_type = the IR kind), values carry their
symbolic shapes (`T`, `T*8`, ...) and element types; attributes and placements are node
attributes. The result passes `onnx.checker.check_model`; it is for reading, not running.
"""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from glmc.ir import Graph
from glmc.plan import Plan

DOMAIN = "ai.glmc"
ELEM = {"fp32": TensorProto.FLOAT, "bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16,
        "fp8": TensorProto.FLOAT8E4M3FN, "i64": TensorProto.INT64, "i32": TensorProto.INT32}


def _value_info(name: str, t) -> onnx.ValueInfoProto:
    dims = [d.eval({}) if d.sym is None else str(d) for d in t.shape]
    return helper.make_tensor_value_info(name, ELEM[t.dtype], dims)


def _attr(v):
    if isinstance(v, tuple):
        return ", ".join(map(str, v))
    return v


def to_onnx(graph: Graph, name: str) -> onnx.ModelProto:
    nodes, infos = [], []
    inputs = []
    for i, op in enumerate(graph.ops):
        for r, t in zip(op.results, op.types):
            (inputs if op.kind == "io.input" else infos).append(_value_info(r, t))
        if op.kind == "io.input":
            continue
        attrs = {k: _attr(v) for k, v in op.attrs}
        attrs["placement"] = ", ".join(str(p) for p in op.placements)
        if op.layer is not None:
            attrs["layer"] = op.layer
        nodes.append(helper.make_node(op.kind, list(op.operands), list(op.results),
                                      name=f"n{i}_{op.results[0]}", domain=DOMAIN, **attrs))
    outputs = [i for i in infos if i.name in _sinks(graph)]
    g = helper.make_graph(nodes, name, inputs, outputs, value_info=infos)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid(DOMAIN, 1)],
                              producer_name="glmc")
    onnx.checker.check_model(model)
    return model


def _sinks(graph: Graph) -> set[str]:
    used = {v for op in graph.ops for v in op.operands}
    return {r for op in graph.ops for r in op.results if r not in used}


def export(plan_dir: str, out_dir: str | None = None) -> list[Path]:
    plan = Plan.load(plan_dir)
    out = Path(out_dir or plan_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for phase, g in plan.graphs.items():
        path = out / f"{phase}.onnx"
        onnx.save(to_onnx(g, f"{plan.model}_{phase}"), str(path))
        paths.append(path)
    return paths
