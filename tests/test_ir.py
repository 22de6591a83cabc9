"""IR: dims, text round-trip, parser errors, verifier."""
import pytest
from glmc.ir import Graph, IRError, Op, parse, print_graph, verify
from glmc.ir.types import Dim, Placement, TensorType, parse_dim

from tests.compile_util import FULL, TINY, graph


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


@pytest.mark.parametrize("model,par", [(TINY, "tp1"), (TINY, "tp8ep8"), (TINY, "dp8ep8"),
                                       (TINY, "dp2tp2ep4"), (FULL, "dp8ep8")])
@pytest.mark.parametrize("phase", ["prefill", "decode", "mtp_draft", "mtp_verify"])
def test_text_round_trip(model, par, phase):
    g = graph(model, par, phase)
    text = print_graph(g)
    g2 = parse(text)
    assert g2 == g
    assert print_graph(g2) == text


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
