"""`LoneComm`: one rank of a multi-GPU plan run by itself (its shard, its work, collectives that keep
shapes and move nothing), the basis of `python -m bench.mtp_gpu_check --parts rank`."""
import pytest
import torch
from glmc.compiler import compile_plan
from glmc.config import Options
from glmc.parallel import parse_parallel
from glmc.passes.estimate_cost import bill
from glmc.runtime.worker.comm import LoneComm
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.loader import load_runner
from glmc.spec import load_spec
from safetensors.torch import load_file
from tiny_hf import save_tiny

MESH = {"attn_dp": 1, "attn_tp": 4, "ep": 4, "moe_tp": 1}


def test_collectives_keep_shapes_and_move_nothing():
    c = LoneComm(MESH, rank=2, peer=lambda part, x: x + 10 * part)
    x = torch.arange(8.0).view(4, 2)
    assert torch.equal(c.all_reduce(x, ("attn_tp",)), x)
    assert torch.equal(c.reduce_scatter(x, ("attn_tp",)), x[2:3])
    gathered = c.all_gather(x[:1], ("attn_tp",))
    assert gathered.shape == (4, 2)
    assert torch.equal(gathered, torch.cat([x[:1] + 0, x[:1] + 10, x[:1], x[:1] + 30]))   # own part: x
    assert c.all_gather(x, ("attn_tp",), dim=1).shape == (4, 8)
    assert torch.equal(c.broadcast(x, ("attn_tp",)), x)
    counts = c.reset()
    assert {k: v["count"] for k, v in counts.items()} == {"all_reduce": 1, "reduce_scatter": 1, "all_gather": 2,
                                                           "broadcast": 1}
    assert counts["all_gather"]["message_bytes"] == (8 + 32) * 4
    assert c.peer_channel(("attn_tp",), "reduce", 64, 8, "cpu") is None
    with pytest.raises(NotImplementedError, match="dispatch is an all-to-all"):
        c.all_to_all([x], ("ep",), "dispatch", 64)
    with pytest.raises(ValueError, match="rank 4 is not one of the mesh's 4 ranks"):
        LoneComm(MESH, rank=4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("lone")
    save_tiny(path, "grouped", seed=5)
    return path


def test_a_lone_rank_holds_its_shard_and_runs_the_plans_collectives(ckpt):
    """tp2ep2's rank 1 alone: its experts are the second half, and each decode step runs exactly the
    collectives (count and bytes) `glmc explain` bills a rank of the real two-process run."""
    spec = load_spec(ckpt)
    plan = compile_plan(spec, parse_parallel("tp2ep2", spec.config), Options(device="cpu"))
    comm = LoneComm(plan.mesh, rank=1)
    ex = load_runner(plan, ckpt, comm=comm, num_pages=9).executor
    hf = load_file(ckpt / "model.safetensors")
    op = next(op for op in plan.graphs["decode"].ops if op.kind == "moe.experts")
    gate, _, down = ex.expert_stacks(op)
    E = spec.config.n_routed_experts
    assert gate.shape[0] == E // 2
    for i, e in enumerate(range(E // 2, E)):
        assert torch.equal(gate[i], hf[f"{op.attr('weight')}.{e}.gate_proj.weight"])
        assert torch.equal(down[i], hf[f"{op.attr('weight')}.{e}.down_proj.weight"])

    pages = torch.arange(8).view(4, 2) + 1
    table = (pages[:, :, None] * 64 + torch.arange(64)).reshape(4, -1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 14, 5)]
    ex.forward("prefill", ForwardBatch.build("extend", prompts, [0, 1, 2], [0, 0, 0], table))
    comm.reset()
    t = ex.padded_tokens(3, None)
    want = bill(plan.graphs["decode"], {"T": t, "B": t, "S": 64, "K": spec.config.index_topk}, spec.dtypes)["comm"]
    want = {k: {"count": v["count"], "message_bytes": v["message_bytes"]} for k, v in want.items()}
    for step in range(2):
        out = ex.forward("decode", ForwardBatch.build("decode", [[1], [2], [3]], [0, 1, 2],
                                                      [len(p) + step for p in prompts], table))
        assert out["logits"].shape == (3, spec.config.vocab_size) and out["logits"].isfinite().all()
        assert comm.reset() == want


def test_a_lone_rank_refuses_moe_all_to_all(ckpt):
    spec = load_spec(ckpt)
    plan = compile_plan(spec, parse_parallel("dp2ep2", spec.config), Options(device="cpu", moe_a2a=True))
    ex = load_runner(plan, ckpt, comm=LoneComm(plan.mesh, rank=0), num_pages=9).executor
    table = ((torch.arange(2) + 1)[:, None] * 64 + torch.arange(64)).reshape(1, -1)
    with pytest.raises(RuntimeError, match="dispatch is an all-to-all"):
        ex.forward("prefill", ForwardBatch.build("extend", [[1, 2, 3]], [0], [0], table))


def test_a_lone_fp8_rank_runs_its_fused_reductions_through_the_nccl_path(tmp_path):
    """Every collective of a lone rank takes the CUDA target's NCCL path (no peer memory), as the
    messages above the one-shot threshold do on GPUs: a reduction fused with add + RMS norm then runs
    the add + RMS norm kernel, which the plan's kernel set holds (FP8: its quantising form too), and
    its rows keep the activations' dtype (the torch target's norm returned fp32 there)."""
    from bench import common
    from tiny_hf import save_tiny_fp8
    save_tiny_fp8(tmp_path, "grouped", seed=3, v_head_dim=64, intermediate_size=256, moe_intermediate_size=256)
    spec = load_spec(tmp_path)
    plan = compile_plan(spec, parse_parallel("tp2ep2", spec.config), Options(device="cuda", max_batch=4))
    ex = load_runner(plan, tmp_path, device="cpu", comm=LoneComm(plan.mesh, rank=0), num_pages=9,
                     max_running=4, capture=False).executor
    pages = torch.arange(8).view(4, 2) + 1
    table = (pages[:, :, None] * 64 + torch.arange(64)).reshape(4, -1)
    prompts = [[7, 8, 9, 10, 11], [12, 13, 14]]
    ex.forward("prefill", ForwardBatch.build("extend", prompts, [0, 1], [0, 0], table))
    step = ForwardBatch.build("decode", [[1], [2]], [0, 1], [5, 3], table)
    out = {}
    calls = common.op_calls(ex, lambda: out.update(ex.forward("decode", step)))
    assert out["logits"].isfinite().all()
    fused = [(op, args, rt, fn) for op, args, rt, fn in calls if op.kind == "fused.reduce_scatter_add_rms"]
    assert fused
    for op, args, rt, fn in fused:
        rt.memo.pop((op.results[0], "fp8_tokens"), None)
        normed, residual = fn(op, args, rt)
        assert normed.dtype == residual.dtype == args[0].dtype
        assert (op.results[0], "fp8_tokens") in rt.memo       # quantised for its FP8 readers, in the kernel
