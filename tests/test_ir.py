"""IR: dims, text round-trip (folded layers, values), parser errors, verifier."""
import json
import re
from pathlib import Path

import pytest
from glmc.ir import Graph, IRError, Op, parse, print_graph, verify
from glmc.ir.text_values import format_value, read_value
from glmc.ir.types import Dim, Placement, TensorType, parse_dim

from tests.compile_util import FULL, TINY, graph

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("text", ["T", "T*8", "T/8", "T*3/2", "6144", "B", "S"])
def test_dim_round_trip(text):
    assert str(parse_dim(text)) == text


def test_dim_eval_pads_fractional_tokens():
    assert Dim.of("T/8").eval({"T": 3}) == 1
    assert Dim.of("T*8").eval({"T": 4}) == 32


def test_placement_text_and_errors():
    p = Placement.of({"ep": "P", "attn_dp": "S(0)", "attn_tp": "R"})
    assert str(p) == "{attn_dp=S(0), ep=P}"
    with pytest.raises(ValueError, match="unknown mesh axis 'tp'"):
        Placement.of({"tp": "P"})
    with pytest.raises(ValueError, match="bad placement"):
        Placement.of({"ep": "Q"})


PHASES = ("prefill", "decode", "mtp_draft", "mtp_verify")
ROUND_TRIP = [(TINY, par, ph) for par in ("tp1", "tp8ep8", "dp8ep8", "dp2tp2ep4") for ph in PHASES] + \
             [(FULL, par, ph) for par in ("tp1", "tp8", "dp8ep8") for ph in PHASES]


@pytest.mark.parametrize("model,par,phase", ROUND_TRIP)
def test_text_round_trip(model, par, phase):
    """Folded or not, the text is the graph: ops (order, names, attributes, layers) and metadata."""
    g = graph(model, par, phase)
    for fold in (True, False):
        text = print_graph(g, fold=fold)
        assert parse(text) == g
        assert print_graph(parse(text), fold=fold) == text


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.ir")), ids=lambda p: p.name)
def test_every_golden_round_trips(path):
    text = path.read_text()
    g = parse(text)
    assert print_graph(g) == text
    assert parse(print_graph(g, fold=False)) == g


def test_identical_layers_print_once_with_their_layers():
    """GLM-5.3 tp8 decode: 78 layers in 7 classes; names and weights relative to the layer."""
    text = print_graph(graph(FULL, "tp8", "decode"))
    assert re.findall(r"^layers (.*) \{$", text, re.MULTILINE) == [
        "0", "1, 2", "3", "4..76 step 4", "5..77 step 4", "6..74 step 4", "7..75 step 4"]
    block = text[text.index("layers 5..77 step 4 {"):]
    assert "  %L.attn = attn.mla_absorbed(%L.q_nope, %L.q_pe_a, %L.kv, %L-3.topk, %positions) {" in block
    assert "weight=.self_attn.o_proj.weight}" in block
    assert "model.layers." not in text and "  # L" not in text
    assert len(text.splitlines()) < len(print_graph(graph(FULL, "tp8", "decode"), fold=False).splitlines()) / 6


def _layered(layers, names=None):
    """A chain of norms, one op per entry of `layers`."""
    names = names or [f"L{n}.y{i}" for i, n in enumerate(layers)]
    ops, prev = [Op.make("io.input", "x", attrs={"dtype": "fp32", "shape": ("T", 4), "name": "x"})], "x"
    for name, n in zip(names, layers):
        ops.append(Op.make("norm.rms", name, [prev], {"eps": 1e-5, "weight": f"model.layers.{n}.w"}, n))
        prev = name
    return Graph(ops)


@pytest.mark.parametrize("g,folded", [
    (_layered([0, 1, 2, 3]), True),
    (_layered([1, 0]), False),                       # layers out of order: cannot fold
    (_layered([0, 1, 0]), False),                    # a layer in two pieces
    (_layered([0, 1], names=["L.y", "L1.y"]), False),  # a name that already reads as relative
])
def test_folding_is_exact_or_not_done(g, folded):
    text = print_graph(g)
    assert ("layers " in text) == folded and ("# L" in text) != folded
    assert parse(text) == g


def test_values_print_short_and_read_back():
    cases = [None, True, -3, 1e-05, float("inf"), "fp8", ".mlp.experts", "glm-5.3", "true", "inf", "a b", "",
             [0, 1, 2, 6, 10, 14, 18], [1, 2, 4, 8, 12, 16, 24], [5, 1, 2, 3], [3, 3, 3], [[0, 1], ["x", 2.5]],
             {"3": 2, "4": 2, "5": 2, "7": 6, "step": 3, "q/kv norm": 1}, {}, []]
    for value in cases:
        back = read_value(format_value(value))
        assert json.dumps(back, sort_keys=True) == json.dumps(value, sort_keys=True), format_value(value)
    assert format_value([0, 1, 2, 6, 10, 14, 18]) == "[0..2, 6..18 step 4]"
    assert format_value({"3": 2, "4": 2, "5": 2, "q/kv": 1}) == '{3..5: 2, "q/kv": 1}'
    assert format_value([1, 2, 4, 8]) == "[1, 2, 4, 8]"      # a range only where it is shorter


def test_wide_metadata_breaks_one_entry_per_line():
    g = graph(FULL, "dp8ep8", "decode")
    text = print_graph(g)
    assert "#!   full_layers: [0..2, 6..74 step 4],\n#!   shared_from: {\n#!     3..5: 2,\n" in text
    assert max(len(line) for line in text.splitlines() if line.startswith("#!")) <= 120


@pytest.mark.parametrize("text,msg", [
    ("# glmc ir v1\n", "line 1: IR written as v1; this glmc reads v2: recompile"),
    ("layers 0 {\n%x = io.input() {dtype=fp32, name=x, shape=[T]} : [T] fp32\n", "ends inside a layers block"),
    ("#! a = {b: [1,\n", "ends inside metadata 'a'"),
    ("layers 0 {\n%x = io.input() {dtype=fp32, name=x, shape=[T]} : [T] fp32\n}\n" * 2, "layer 0 is in two blocks"),
])
def test_parser_errors_say_what_and_where(text, msg):
    with pytest.raises(IRError, match=re.escape(msg)):
        parse(text)


def test_parser_names_the_line():
    text = print_graph(graph(TINY, "tp1", "decode")).splitlines()
    n = next(i for i, line in enumerate(text) if line.startswith("%"))
    text[n] = text[n].replace("(", "<", 1)
    with pytest.raises(IRError, match=f"line {n + 1}: not an op line"):
        parse("\n".join(text))


def test_graph_rejects_undefined_operand():
    with pytest.raises(IRError, match="operand %nope is not defined"):
        Graph([Op.make("norm.rms", "y", ["nope"], {"eps": 1e-5})])


def test_verifier_catches_wrong_type_and_names_layer_and_op():
    g = graph(TINY, "tp1", "decode")
    ops = list(g.ops)
    i = next(i for i, op in enumerate(ops) if op.kind == "linear" and op.layer == 2)
    bad = ops[i].with_types([TensorType.of(["T", 7], "fp32")], ops[i].placements)
    ops[i] = bad
    with pytest.raises(IRError, match=r"layer 2, op linear -> %L2\.\w+: .* has type \[T, 7\] fp32"):
        verify(g.with_ops(ops))


def test_verifier_catches_placement_on_unit_axis():
    g = graph(TINY, "tp1", "decode")
    ops = list(g.ops)
    ops[-1] = ops[-1].with_types(ops[-1].types, [Placement.of({"ep": "P"})])
    with pytest.raises(IRError, match="axis 'ep' of size 1"):
        verify(g.with_ops(ops))


def test_repr_is_the_printer():
    g = graph(TINY, "tp1", "mtp_draft")
    assert repr(g) == print_graph(g)


@pytest.mark.parametrize("par,phase", [("tp1", "prefill"), ("tp8ep8", "decode"), ("dp8ep8", "mtp_verify")])
def test_dead_after_drops_each_value_once_after_its_last_use(par, phase):
    """Graph.dead_after (what the executor frees): every value but the step's outputs exactly once,
    at its last reader (or its producer when nothing reads it), never before a later reader."""
    g = graph(TINY, par, phase)
    dead = g.dead_after()
    where = {v: i for i, vs in enumerate(dead) for v in vs}
    assert sum(map(len, dead)) == len(where)                       # once each
    values = {r for op in g.ops for r in op.results}
    assert set(where) == values - set(g.step_outputs())
    for i, op in enumerate(g.ops):
        for v in op.operands:
            assert v in g.step_outputs() or where[v] >= i, (op.where(), v)
        for r in op.results:
            assert r in g.step_outputs() or where[r] >= i
    for v, i in where.items():
        readers = [j for j, op in enumerate(g.ops) if v in op.operands]
        assert i == max(readers, default=i), v


def test_a_fragment_without_a_head_drops_nothing():
    g = graph(TINY, "tp1", "decode")
    part = Graph(g.ops[:5])
    assert part.dead_after() == [()] * 5
