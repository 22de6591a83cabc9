"""The CUDA target's capture-safe MoE exchange computes what the torch target's exchange does.

The a2a lowering on the GPU sends fixed T*k-slot buffers (no counts exchanged, no host sync, so it
can be captured in a CUDA graph); the torch target sends exactly the routed rows. Run both over real
gloo processes on a real dp2ep2 plan's `moe.dispatch` / `moe.combine` ops, with a stand-in for the
experts in between (each received row scaled by its routing weight, zero for empty slots), and
compare the tokens' outputs and the collectives counted.
"""
import pytest
import torch
from compile_util import plan as compiled
from glmc.runtime.worker.launch import spawn

T = 5


def _exchange(impls, plan, x, w, ids):
    from glmc.runtime.worker.comm import Comm
    from glmc.runtime.worker.executor import PlanExecutor, Step
    from glmc.runtime.worker.forward_batch import ForwardBatch
    from glmc.runtime.worker.kv_cache import KVPool

    comm = Comm(plan.mesh, plan.groups)
    ex = PlanExecutor(plan, {}, KVPool.for_plan(plan, 2), comm)
    graph = plan.graphs["decode"]
    step = Step(ex, graph, ForwardBatch.idle(), {}, torch.empty(0, dtype=torch.int64))
    dispatch = next(op for op in graph.ops if op.kind == "moe.dispatch")
    combine = next(op for op in graph.ops if op.kind == "moe.combine")
    rx, rw, rids = impls["moe.dispatch"](dispatch, [x, w, ids], step)
    first = comm.coords.of("ep") * (plan.config.n_routed_experts // plan.mesh["ep"])
    mine = (rids >= first) & (rids < first + plan.config.n_routed_experts // plan.mesh["ep"])
    y = torch.where(mine, rx.float() * rw.float() * (1 + rids.float()), 0.0)   # "experts"
    out = impls["moe.combine"](combine, [y, x], step)
    return out, comm.reset()


def _rank(rank, world, out_dir):
    from glmc.codegen import cuda_target, torch_target
    plan = compiled("glm_moe_dsa_tiny", "dp2ep2", moe_a2a=True, device="cpu")
    c = plan.config
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, c.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(c.n_routed_experts, generator=g)[:c.num_experts_per_tok]
                       for _ in range(T)])
    w = torch.rand(T, c.num_experts_per_tok, generator=g)
    got = {name: _exchange(impls.IMPLS, plan, x, w, ids)
           for name, impls in (("torch", torch_target), ("cuda", cuda_target))}
    torch.save(got, f"{out_dir}/rank{rank}.pt")


@pytest.mark.usefixtures("one_torch_thread")
def test_fixed_capacity_exchange_equals_the_routed_exchange(tmp_path):
    spawn(_rank, 2, str(tmp_path), backend="gloo")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        (want, want_counts), (out, counts) = got["torch"], got["cuda"]
        assert out.shape == want.shape == (T, want.shape[1])
        assert torch.allclose(out.float(), want.float(), rtol=1e-6, atol=1e-6)
        assert counts == want_counts and set(counts) == {"dispatch", "combine"}
