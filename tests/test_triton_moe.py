"""The Triton MoE experts (codegen/triton_moe.py) against torch_ref.moe_experts, under the interpreter.

Tiny ragged shapes (hidden and intermediate not multiples of the tiles), skewed routing (some experts
empty, one crowded past a block), EP offsets (rows of other ranks' experts dropped), and HF's fused
gate_up layout as strided views. Outputs are allocated poisoned so an unwritten element fails.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CI has no GPU

import pytest
import torch
from glmc.codegen import torch_ref as ref
from glmc.codegen import triton_moe as tm

_EMPTY = torch.empty


def _poisoned_empty(*args, **kwargs):
    t = _EMPTY(*args, **kwargs)
    return t.fill_(float("nan") if t.is_floating_point() else -777)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
    torch.manual_seed(0)


def _routing(T, k, num_experts, skew=False):
    """Distinct expert ids per token; with skew, expert 1 is in every row (a crowded expert)."""
    ids = torch.stack([torch.randperm(num_experts)[:k] for _ in range(T)])
    if skew:
        ids[:, 0] = torch.where((ids[:, 1:] == 1).any(1), ids[:, 0], 1)
    w = torch.rand(T, k) + 0.1
    return w, ids


def _stacks(E, inter, hidden, fused=False):
    if fused:  # HF layout: gate_up [E, 2I, H]; gate and up are strided views of it
        gate_up = torch.randn(E, 2 * inter, hidden) / hidden ** 0.5
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
    else:
        gate, up = torch.randn(E, inter, hidden) / hidden ** 0.5, torch.randn(E, inter, hidden) / hidden ** 0.5
    return gate, up, torch.randn(E, hidden, inter) / inter ** 0.5


@pytest.mark.parametrize("T,k,E,skew,fused", [(1, 2, 8, False, False), (7, 3, 8, True, True),
                                                (20, 2, 6, True, False)])
def test_moe_experts_matches_reference(T, k, E, skew, fused):
    hidden, inter = 48, 40
    x = torch.randn(T, hidden)
    w, ids = _routing(T, k, E, skew)
    gate, up, down = _stacks(E, inter, hidden, fused)
    got = tm.moe_experts(x, ids, w, gate, up, down, tiles={"gate_up": {"block_k": 32}})
    want = ref.moe_experts(x, ids, w, gate, up, down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_moe_experts_ep_offset_drops_other_ranks_rows():
    T, k, hidden, inter = 9, 2, 32, 24
    x = torch.randn(T, hidden)
    w, ids = _routing(T, k, 8)
    gate, up, down = _stacks(4, inter, hidden)  # this rank holds experts 4..7
    got = tm.moe_experts(x, ids, w, gate, up, down, expert_offset=4)
    want = ref.moe_experts(x, ids, w, gate, up, down, expert_offset=4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_align_rows_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [3, 0]])
    rows, block_expert = tm.align_rows(ids, 4, 2)
    nb = tm.num_blocks_bound(6, 4, 2)
    assert rows.shape == (nb * 2,) and block_expert.shape == (nb,)
    # expert 0: rows 1, 5; expert 1: row 3 + pad; expert 3: rows 0, 2, 4 + pad; then unused blocks
    assert rows.tolist()[:8] == [1, 5, 3, 6, 0, 2, 4, 6]
    assert block_expert.tolist() == [0, 1, 3, 3] + [-1] * (nb - 4)


def test_generated_source_is_specialised():
    from glmc.codegen.triton_target import render
    ctx = tm.MoeExpertsCtx.make(True, 2048, 6144, 8, torch.bfloat16, 16)
    src = render("moe_experts", ctx)
    assert "for k0 in range(0, 2048, 128)" in src and "n < 6144" in src and "row // 8" not in src
    assert "tl.bfloat16" in src and "w2_ptr" not in src
    up = render("moe_experts", tm.MoeExpertsCtx.make(False, 6144, 2048, 8, torch.bfloat16, 16))
    assert "row // 8" in up and "acc2" in up and "route_w_ptr" not in up
