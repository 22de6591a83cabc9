"""Padding rows on the CUDA target (CPU, Triton interpreted): a decode step run past its batch, as a
graph bucket runs it (padding rows: token 0 at the scratch KV slot), gives the real rows the logits
of the unpadded step, and its MoE runs no expert for the padding rows: their routed output is 0
(`cuda_target._padding` -> `triton_moe.align_rows(pad=)`)."""
import sys
from pathlib import Path

import pytest
import torch
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.loader import load_runner

from glmc.api import plan_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import decode_bench as db  # noqa: E402  (op_calls: every op call of a step)

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
        vectors = runner._host_vectors(step, size).to(runner.r2t.device)
        calls = db.op_calls(runner, lambda: out.update(runner._body("decode", *vectors)))
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
