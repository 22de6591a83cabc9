"""The Plan: what `glmc compile` writes is what the runtime reads, and the one KV-pool sizer."""
import json

import pytest
from compile_util import plan as compiled
from glmc.ir import print_graph
from glmc.plan import Plan, PlanError
from glmc.runtime.worker.kv_cache import KVPool


@pytest.mark.parametrize("parallel,opts", [("tp1", {"device": "cpu"}),
                                           ("dp2ep2", {"device": "cuda", "moe_a2a": True})])
def test_save_load_round_trip(tmp_path, parallel, opts):
    plan = compiled("glm_moe_dsa_tiny", parallel, **opts)
    plan.save(tmp_path / "p", {"report.md": "hello\n"})
    back = Plan.load(tmp_path / "p")
    assert (back.model, back.parallel, back.mesh, back.world) == \
        (plan.model, plan.parallel, plan.mesh, plan.world)
    assert back.config == plan.config and back.dtypes == plan.dtypes
    assert back.options == plan.options and back.target == opts["device"]
    assert {ph: print_graph(g) for ph, g in back.graphs.items()} == \
        {ph: print_graph(g) for ph, g in plan.graphs.items()}
    assert back.groups == plan.groups and back.decode_buckets == plan.decode_buckets
    assert (tmp_path / "p" / "report.md").read_text() == "hello\n"


def test_load_names_the_file_at_fault(tmp_path):
    with pytest.raises(PlanError, match="no plan.json"):
        Plan.load(tmp_path)
    compiled("glm_moe_dsa_tiny", "tp1").save(tmp_path / "p")
    meta = json.loads((tmp_path / "p" / "plan.json").read_text())
    del meta["config"]["hidden_size"]
    (tmp_path / "p" / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(PlanError, match="(?s)plan.json.*hidden_size"):
        Plan.load(tmp_path / "p")
    compiled("glm_moe_dsa_tiny", "tp1").save(tmp_path / "q")
    (tmp_path / "q" / "decode.ir").write_text("# glmc ir v2\n%x = no.such_op() : [T] i64 @ R\n")
    with pytest.raises(PlanError, match="decode.ir.*no.such_op"):
        Plan.load(tmp_path / "q")
    (tmp_path / "q" / "decode.ir").write_text("# glmc ir v1\n")    # an older glmc's text form
    with pytest.raises(PlanError, match="decode.ir: line 1: IR written as v1; this glmc reads v2: recompile"):
        Plan.load(tmp_path / "q")


def test_a_failed_save_leaves_the_old_plan(tmp_path):
    plan = compiled("glm_moe_dsa_tiny", "tp1")
    plan.save(tmp_path / "p")
    before = (tmp_path / "p" / "decode.ir").read_text()
    with pytest.raises(TypeError):
        plan.save(tmp_path / "p", {"report.md": object()})   # not text: the write fails midway
    assert (tmp_path / "p" / "decode.ir").read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p"]      # no temporary directory left


def test_kv_pool_has_the_mtp_layer_exactly_when_the_plan_runs_mtp():
    plan = compiled("glm_moe_dsa_tiny", "tp1")
    c = plan.config
    assert plan.has_mtp and c.num_nextn_predict_layers == 1
    pool = KVPool.for_plan(plan, 4)
    assert pool.num_layers == c.num_hidden_layers + 1
    assert c.num_hidden_layers in pool.full_layers       # the MTP layer runs its own indexer
    no_mtp = Plan(**{**plan.__dict__, "graphs": {p: g for p, g in plan.graphs.items()
                                                 if not p.startswith("mtp")}})
    pool = KVPool.for_plan(no_mtp, 4)
    assert pool.num_layers == c.num_hidden_layers and c.num_hidden_layers not in pool.full_layers
    full = {i for i, t in enumerate(c.layer_indexer_types()) if t == "full"}
    assert pool.full_layers == full
