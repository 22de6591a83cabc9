"""The mesh is validated data: the parsed parallel spec is the type a plan carries, saves to plan.json
and loads back, and the runtime reads its axes and token split from it."""
import pickle

import pytest

from glmc.compiler import compile_plan
from glmc.config import MESH_AXES, Mesh, Options
from glmc.parallel import parse_parallel
from glmc.plan import Plan
from glmc.spec import load_spec, model_path


def test_a_parsed_spec_is_the_mesh():
    m = parse_parallel("dp4tp2ep8")
    assert isinstance(m, Mesh) and m == Mesh(4, 2, 8, 1, "dp4tp2ep8")
    assert (m.world, m.token_split, m.token_split_size) == (8, True, 2)
    assert dict(m) == m.mesh == {"attn_dp": 4, "attn_tp": 2, "ep": 8, "moe_tp": 1}
    assert list(m) == list(MESH_AXES) and m["ep"] == 8 and m.get("attn_dp") == 4
    assert parse_parallel("tp8").token_split_size == 1 and parse_parallel("dp8ep8").token_split_size == 1
    with pytest.raises(KeyError):
        m["world"]
    assert pickle.loads(pickle.dumps(m)) == m and hash(m) == hash(Mesh(4, 2, 8, 1, "dp4tp2ep8"))


@pytest.mark.parametrize("sizes, message", [
    ((2, 2, 8, 1), "attn_dp 2 x attn_tp 2 = 4 ranks, but ep 8 x moe_tp 1 = 8"),
    ((0, 1, 1, 1), "attn_dp must be an integer >= 1, got 0"),
    ((1, 1.5, 1, 1), "attn_tp must be an integer >= 1, got 1.5"),
])
def test_an_inconsistent_mesh_names_the_numbers(sizes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Mesh(*sizes, name="bad")


def test_the_plan_carries_it_through_plan_json(tmp_path):
    spec = load_spec(model_path("glm_moe_dsa_tiny"))
    par = parse_parallel("tp2ep2", spec.config)
    plan = compile_plan(spec, par, Options(device="cpu"))
    assert isinstance(plan.mesh, Mesh) and plan.mesh == par and plan.world == 2
    assert plan.to_json()["parallel"] == {"spec": "tp2ep2", "attn_dp": 1, "attn_tp": 2, "ep": 2,
                                          "moe_tp": 1, "world": 2}
    back = Plan.load(plan.save(tmp_path / "p"))
    assert isinstance(back.mesh, Mesh) and back.mesh == par and back.parallel == "tp2ep2"
    assert plan.graphs["decode"].meta["mesh"] == par.mesh   # the IR's metadata stays a plain dict
