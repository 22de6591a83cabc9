"""The top-k select on rows longer than its chunk: the split byte-radix path of topk_select.py.j2
(five launches, rows over many programs) against torch_ref.topk_lowest_first, under TRITON_INTERPRET
at tiny shapes (k a few, segments of 16-32 scores, rows of several segments).

Semantics checked on every row: the positions of the k largest of the first lens[t] scores,
ascending, -1 padded; exact ties at the k-th score go to the lowest positions; rows with
lens[t] <= k keep every position; short rows (<= chunk) in the same launch take the register path.
"""
from __future__ import annotations

import pytest
import torch

from glmc.codegen import torch_ref as ref
from glmc.codegen import triton_launch as tt


def want_row(scores_row, n, k):
    """The reference answer of one row: ascending positions, -1 padded to k."""
    keep = sorted(ref.topk_lowest_first(scores_row[:n], k).tolist())
    return keep + [-1] * (k - len(keep))


def assert_selects(scores, lens, k, chunk, segment):
    got = tt.topk_select(scores, lens, k, chunk=chunk, segment=segment)
    assert got.shape == (scores.shape[0], k) and got.dtype == torch.int64
    for t in range(scores.shape[0]):
        assert got[t].tolist() == want_row(scores[t], int(lens[t]), k), f"row {t} (lens {int(lens[t])})"


def test_random_rows_over_many_segments():
    """Distinct values; lens from several segments down to below k, and one row on the short path."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 320, generator=g) * 10
    assert_selects(scores, torch.tensor([320, 257, 97, 30, 9]), 12, chunk=32, segment=16)


def test_heavy_ties_and_minus_inf():
    """Few distinct values (every round's threshold bin is crowded), -inf included, so the k-th
    score ties across segments and the ties must go to the lowest positions."""
    g = torch.Generator().manual_seed(1)
    values = torch.tensor([-1.5, -0.25, 0.0, 0.25, 3.0, float("-inf")])
    scores = values[torch.randint(0, 6, (4, 300), generator=g)]
    assert_selects(scores, torch.tensor([300, 211, 64, 40]), 20, chunk=16, segment=16)


def test_all_equal_and_all_minus_inf_rows():
    """Every key of the row is the threshold: the first k positions, in every segment layout."""
    scores = torch.stack([torch.full((200,), 0.5), torch.full((200,), float("-inf")), torch.zeros(200)])
    assert_selects(scores, torch.tensor([200, 150, 77]), 10, chunk=16, segment=32)


def test_values_that_share_their_high_bytes():
    """Keys equal in their top three bytes and differing in the last: the fourth round decides."""
    base = torch.tensor(1.0).view(torch.int32)
    g = torch.Generator().manual_seed(2)
    bits = base + torch.randint(0, 256, (2, 256), generator=g, dtype=torch.int32)
    scores = bits.view(torch.float32) * torch.tensor([[1.0], [-1.0]])   # a positive row and a negative one
    assert_selects(scores, torch.tensor([256, 190]), 16, chunk=16, segment=16)


@pytest.mark.parametrize("k", [24, 40])
def test_chunk_below_k_keeps_short_rows_whole(k):
    """chunk < k (a test-only layout): long-path rows of <= k scores keep every position, -1 padded."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 96, generator=g)
    assert_selects(scores, torch.tensor([96, 40, 17, 3]), k, chunk=16, segment=16)


def test_deterministic_on_ties():
    """Two launches over the same tied row give the same positions."""
    scores = torch.tensor([0.0, 1.0])[torch.randint(0, 2, (2, 160), generator=torch.Generator().manual_seed(4))]
    lens = torch.tensor([160, 130])
    first = tt.topk_select(scores, lens, 8, chunk=16, segment=16)
    assert torch.equal(first, tt.topk_select(scores, lens, 8, chunk=16, segment=16))


@pytest.mark.parametrize("chunk, segment", [(256, None), (32, 16)])   # the register path / the split path
def test_slots_are_the_selected_positions_through_the_table(chunk, segment):
    """slots_of: the select writes req_to_token[rows[t], position] (int32, -1 padded) for the
    positions it selects: what the attention's topk_slots gather gives, on short and long rows."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(4, 200, generator=g)
    lens = torch.tensor([200, 100, 9, 37])
    r2t = torch.randperm(8 * 256, generator=g).view(8, 256)      # int64, as the runtime's table
    rows = torch.tensor([3, 0, 7, 5])
    slots = tt.topk_select(scores, lens, 12, chunk=chunk, segment=segment, slots_of=(r2t, rows))
    pos = tt.topk_select(scores, lens, 12, chunk=chunk, segment=segment)
    assert slots.dtype == torch.int32 and torch.equal(slots, tt.topk_slots(pos, r2t, rows, lens - 1))
