"""Every parallel spec as real gloo processes reproduces tp1: logits, greedy tokens, and the
collectives executed equal `glmc explain`'s bill."""
import pytest
import torch
from glmc.passes.estimate_cost import bill
from glmc.runtime.worker.launch import RankFailed, spawn
from tiny_hf import save_tiny

from tests.plan_run import build, greedy, rank_worker

STEPS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_tiny(path, "grouped", seed=5)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (21, 30, 17, 26)]
    logits, tokens, _ = greedy(build(path), prompts, STEPS)
    return path, prompts, logits, tokens


def run(setup, tmp_path, parallel, world, moe_a2a=None, prompts=None):
    path, all_prompts, _, _ = setup
    prompts = prompts or all_prompts
    spawn(rank_worker, world, str(path), parallel, moe_a2a, prompts, STEPS, str(tmp_path))
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def check_same_as_tp1(setup, results, prompts=None):
    _, all_prompts, logits, tokens = setup
    for res in results:
        for row, i in enumerate(res["index"]):
            assert (res["logits"][row] - logits[i]).abs().max() < 1e-5, i
            assert torch.equal(res["tokens"][row], tokens[i]), i


@pytest.mark.parametrize("parallel,world,a2a", [
    ("tp2", 2, None), ("tp2ep2", 2, False), ("tp2ep2", 2, True), ("dp2ep2", 2, False),
    ("dp2ep2", 2, True), ("dp4ep4", 4, False), ("dp4ep4", 4, True), ("dp2tp2ep4", 4, False),
    ("dp2tp2ep4", 4, True),
])
def test_parallel_equals_tp1(setup, tmp_path, parallel, world, a2a):
    check_same_as_tp1(setup, run(setup, tmp_path, parallel, world, a2a))


def test_idle_dp_rank_still_steps(setup, tmp_path):
    path, prompts, logits, tokens = setup
    results = run(setup, tmp_path, "dp2ep2", 2, True, prompts=prompts[:1])
    assert results[1]["index"] == [] and len(results[1]["counts"]) == STEPS + 1
    res = results[0]
    assert (res["logits"][0] - logits[0]).abs().max() < 1e-5


def test_dead_rank_fails_clearly(setup, tmp_path):
    path, prompts, _, _ = setup
    with pytest.raises(RankFailed, match="rank 1 died"):
        spawn(rank_worker, 2, str(path), "dp2ep2", None, prompts, 1, str(tmp_path), 1,
              timeout_s=30)


@pytest.mark.parametrize("parallel,world,a2a", [("tp2", 2, None), ("dp2ep2", 2, True),
                                                ("dp2tp2ep4", 4, False)])
def test_collectives_executed_equal_the_bill(setup, tmp_path, parallel, world, a2a):
    """Per decode step, every rank ran exactly the plan's collectives with the predicted sizes."""
    path, prompts, _, _ = setup
    results = run(setup, tmp_path, parallel, world, a2a)
    m = build(path, parallel, a2a)
    ex, spec = m.executor, m.spec
    dp = ex.mesh["attn_dp"]
    t = ex.padded_tokens(0, [len(range(r, len(prompts), dp)) for r in range(dp)])
    want = bill(ex.graphs["decode"], {"T": t, "B": t, "S": 64, "K": spec.config.index_topk},
                spec.dtypes)["comm"]
    want = {k: {"count": v["count"], "message_bytes": v["message_bytes"]} for k, v in want.items()}
    assert want, "this spec should communicate"
    for res in results:
        for step in res["counts"][1:]:
            assert step == want
