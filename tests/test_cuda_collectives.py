"""The CUDA target's capture-safe MoE exchange computes what the torch target's exchange does.

The a2a lowering on the GPU sends fixed T*k-slot buffers (no counts exchanged, no host sync, so it
can be captured in a CUDA graph); the torch target sends exactly the routed rows. Run both over real
gloo processes on a real dp2ep2 plan's `moe.dispatch` / `moe.combine` ops, with a stand-in for the
experts in between (each received row scaled by its routing weight, zero for empty slots), and
compare the tokens' outputs and the collectives counted. With FP8 experts (`--quantize fp8`, a CUDA
plan: the exchange over peer memory, routed rows only) the CUDA target dispatches x quantised (e4m3
rows + fp32 scales per 128 columns, as the experts kernel would quantise it); the torch target,
given x already rounded that way, must agree.
"""
import pytest
import torch
from compile_util import plan as compiled
from glmc.codegen.triton_render import JIT
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
    step.kernels = JIT                        # the CUDA target's kernels (interpreted), unchecked
    dispatch = next(op for op in graph.ops if op.kind == "moe.dispatch")
    combine = next(op for op in graph.ops if op.kind == "moe.combine")
    rx, rw, rids = impls["moe.dispatch"](dispatch, [x, w, ids], step)
    if rx.dtype == torch.float8_e4m3fn:          # FP8 dispatch: the rows' scales ride beside them
        scales, _ = step.routes[dispatch.results[0] + ".scales"]
        rx = rx.float() * scales.repeat_interleave(128, 1)[:, :rx.shape[1]]
    first = comm.coords.of("ep") * (plan.config.n_routed_experts // plan.mesh["ep"])
    mine = (rids >= first) & (rids < first + plan.config.n_routed_experts // plan.mesh["ep"])
    y = torch.where(mine, rx.float() * rw.float() * (1 + rids.float()), 0.0)   # "experts"
    out = impls["moe.combine"](combine, [y, x], step)
    return out, comm.reset()


def _rank(rank, world, out_dir, fp8=False):
    from glmc.codegen import cuda_target, fp8_ref, torch_target
    from glmc.compiler import compile_plan
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.spec import quantized
    from tests.compile_util import TINY, spec
    if fp8:
        s = quantized(spec(TINY), "fp8")
        plan = compile_plan(s, parse_parallel("dp2ep2", s.config), Options(device="cuda", moe_a2a=True))
    else:
        plan = compiled("glm_moe_dsa_tiny", "dp2ep2", moe_a2a=True, device="cpu")
    c = plan.config
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, c.hidden_size, generator=g)
    x_torch = x
    if fp8:                                       # what the FP8 dispatch delivers: x rounded per 128
        q, sc = fp8_ref.quantize_token_groups(x)
        x_torch = q.float() * sc.repeat_interleave(128, 1)[:, :x.shape[1]]
    ids = torch.stack([torch.randperm(c.n_routed_experts, generator=g)[:c.num_experts_per_tok]
                       for _ in range(T)])
    w = torch.rand(T, c.num_experts_per_tok, generator=g)
    got = {"torch": _exchange(torch_target.IMPLS, plan, x_torch, w, ids),
           "cuda": _exchange(cuda_target.IMPLS, plan, x, w, ids),
           "dtype": next(op for op in plan.graphs["decode"].ops if op.kind == "moe.dispatch").attr("dtype")}
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


def _rank_fp8(rank, world, out_dir):
    _rank(rank, world, out_dir, fp8=True)


@pytest.mark.usefixtures("one_torch_thread")
def test_fp8_dispatch_sends_the_experts_quantised_rows(tmp_path):
    spawn(_rank_fp8, 2, str(tmp_path), backend="gloo")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        (want, want_counts), (out, counts) = got["torch"], got["cuda"]
        assert got["dtype"] == "fp8"
        assert torch.allclose(out.float(), want.float(), rtol=1e-5, atol=1e-5)
        assert all(counts[k].pop("p2p") == counts[k]["count"] for k in ("dispatch", "combine")), counts
        assert counts == want_counts
