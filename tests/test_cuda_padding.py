"""Padding rows on the CUDA target (CPU, Triton interpreted): a decode step run past its batch, as a
graph bucket runs it (padding rows: token 0 at the scratch KV slot), gives the real rows the logits
of the unpadded step, and its MoE runs no expert for the padding rows: their routed output is 0
(`cuda_target.padding_rows` -> `triton_moe.align_rows(pad=)`)."""

import pytest
import torch
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.loader import load_runner

from glmc.api import plan_for

from bench import common  # op_calls: every op call of a step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_padding_rows_run_no_expert(tiny_ckpt):
    plan = plan_for(tiny_ckpt, device="cuda", max_running=4)
    runner = load_runner(plan, tiny_ckpt, device="cpu", num_pages=16, max_running=4, capture=False).executor
    pages = torch.arange(12).view(4, 3) + 1
    table = (pages[:, :, None] * 64 + torch.arange(64)).reshape(4, -1)
    prompts = [[(7 * i + j) % 300 + 5 for j in range(n)] for i, n in enumerate((20, 33, 9))]
    runner.forward("prefill", ForwardBatch.build("extend", prompts, [0, 1, 2], [0, 0, 0], table))
    step = ForwardBatch.build("decode", [[5], [6], [7]], [0, 1, 2], [len(p) for p in prompts], table)

    def run(size):
        vectors = runner.host_vectors(step, size).to(runner.r2t.device)
        calls = common.op_calls(runner, lambda: out.update(runner.run_tokens("decode", vectors)))
        return out.pop("logits"), calls
    out = {}
    want, _ = run(3)
    got, calls = run(8)                          # 5 padding rows, as the 8-bucket runs 3 requests
    torch.testing.assert_close(got[:3], want, rtol=1e-4, atol=1e-4)
    moe = [(op, args, rt, fn) for op, args, rt, fn in calls if op.kind == "moe.experts"]
    assert moe
    for op, args, rt, fn in moe:
        assert rt.pad_slot == runner.scratch and (rt.loc[3:] == runner.scratch).all()
        routed = fn(op, args, rt)
        assert routed.shape[0] == 8 and (routed[3:] == 0).all() and routed[:3].abs().sum() > 0


def test_attention_dp_padding_rows_run_no_expert(tiny_ckpt):
    """dp2ep2, the MoE's rows all-gathered over attention DP: DP rank 1 holds one token of the two
    every rank pads to; its padding row runs no expert. Rank 0 alone (`LoneComm`: the gather brings
    copies of its own rows), so row 3, a copy of row 1, is padding in one step and not in the other."""
    from glmc.compiler import compile_plan
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.runtime.worker.comm import LoneComm
    from glmc.spec import load_spec
    spec = load_spec(tiny_ckpt)
    plan = compile_plan(spec, parse_parallel("dp2ep2", spec.config), Options(device="cuda", max_batch=4, moe_a2a=False))
    runner = load_runner(plan, tiny_ckpt, device="cpu", num_pages=16, max_running=4, capture=False,
                         comm=LoneComm(plan.mesh, rank=0)).executor
    assert runner.dp_rows == 2
    pages = torch.arange(12).view(4, 3) + 1
    table = (pages[:, :, None] * 64 + torch.arange(64)).reshape(4, -1)
    prompts = [[(5 * i + j) % 300 + 5 for j in range(n)] for i, n in enumerate((17, 26))]
    runner.forward("prefill", ForwardBatch.build("extend", prompts, [0, 1], [0, 0], table), dp_tokens=[43, 43])
    step = ForwardBatch.build("decode", [[100], [200]], [0, 1], [len(p) for p in prompts], table)

    def routed(dp_tokens):
        """[(the MoE's dp_loc, its routed output)] of every MoE layer of one decode step."""
        calls = common.op_calls(runner, lambda: runner.forward("decode", step, dp_tokens=dp_tokens))
        return [(rt.dp_loc.tolist(), fn(op, args, rt)) for op, args, rt, fn in calls if op.kind == "moe.experts"]
    full, padded = routed([2, 2]), routed([2, 1])
    assert len(full) == len(padded) >= 2
    for (loc, f), (pad_loc, p) in zip(full, padded):
        assert loc == [0, 0, 0, 0] and pad_loc == [0, 0, 0, runner.scratch]
        assert torch.equal(f[2:], f[:2])                      # rank 1's rows: copies of rank 0's
        assert torch.equal(p[:3], f[:3]) and (p[3] == 0).all()
    assert any(f[1].abs().sum() > 0 for _, f in full)        # row 1 reaches this rank's experts somewhere
