"""Request data never takes a Triton kernel outside its buffers.

The kernels that index memory with request data (the req_to_token table's rows and positions, the
KV slots in it and in a top-k, a token's out_cache_loc, expert ids) mask or clamp every such index:

| kernel | index | out of range |
|---|---|---|
| step_inputs | rows, pos | no last token read (0), no table cell written |
| qkv_norm_rope_write | out_cache_loc | no KV or indexer row written |
| indexer_scores | rows, pos, table slots | -inf: no key read |
| topk_select | lens, rows (slots form) | lens clamped to [0, width]; -1 slots |
| sparse_mla_decode (+ mla_combine) | top-k slots; rows, pos, table slots | no key read; a token without keys gets 0 |
| moe_align, moe_combine | expert ids | compared in 64 bits: the route is not this rank's |

The others index only with what a kernel computed from shapes (the expert stages' sorted rows, the
sampler's vocabulary) or, for sparse_mla_prefill, with the compact key lists its wrapper gathers in
torch (`triton_prefill.prefill_keys`, bench and tests only: torch's indexing raises past the table
or pool, and wraps a negative index as Python does): bounded by construction.

The interpreter does not check addresses (it reads raw memory), so `Accesses` does: every lane a
kernel loads, stores or updates atomically with its mask on must lie inside one of its launch's
tensor arguments (the view, not the storage behind it); a lane outside is recorded and not made.
On top, buffers are views into larger tensors with a sentinel (NaN, 0xFF bytes, -3) around them, so
a stray read would show in the outputs and a stray write in the border. Each test runs a kernel
with out-of-range values (negative, past the table, past the pool, past 32 bits) mixed with valid
ones and checks the valid tokens' results against a clean run and the others against the rule above.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CI has no GPU

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from glmc.codegen import triton_launch as tt
from glmc.codegen import triton_moe as tm
from glmc.runtime.worker.kv_cache import KVPool

R, DR, DI, HI = 32, 8, 16, 4   # kv_lora, rope dim, indexer head dim, indexer heads (tiny GLM)
GUARD = 2                       # sentinel rows around each buffer
BIG = 2 ** 40                   # an index past 32 bits


def extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, end byte) of the elements a view can address."""
    lo = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)
    return t.data_ptr() + lo * t.element_size(), t.data_ptr() + (hi + 1) * t.element_size()


class Accesses:
    """Every memory lane the interpreter runs, checked against the launch's tensor arguments."""

    def __init__(self):
        self.kernel, self.extents, self.stray = None, [], []

    def launch(self, kernel: str, args) -> None:
        self.kernel = kernel
        self.extents = [extent(a) for a in args if isinstance(a, torch.Tensor) and a.numel()]

    def allowed(self, op: str, ptrs, mask) -> np.ndarray:
        """The lanes of `mask` inside an argument; the others are recorded as (kernel, op, lanes)."""
        addr = np.asarray(ptrs.data).astype(np.int64)
        size = interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize
        on = np.broadcast_to(np.asarray(mask.data).astype(bool), addr.shape)
        inside = np.zeros(addr.shape, dtype=bool)
        for lo, hi in self.extents:
            inside |= (addr >= lo) & (addr + size <= hi)
        if (on & ~inside).any():
            self.stray.append((self.kernel, op, int((on & ~inside).sum())))
        return on & inside


@pytest.fixture
def accesses(monkeypatch):
    """Installs `Accesses` on the interpreter for one test."""
    acc = Accesses()
    builder = interpreter.interpreter_builder
    init_args, load, store, rmw = (interpreter.GridExecutor._init_args_hst, builder.create_masked_load,
                                   builder.create_masked_store, builder.create_atomic_rmw)

    def init(self, args_dev, kwargs):
        args, kw = init_args(self, args_dev, kwargs)
        acc.launch(self.fn.__name__, [*args, *kw.values()])
        return args, kw

    def mask_of(op, ptrs, mask):
        return interpreter.TensorHandle(acc.allowed(op, ptrs, mask), tl.int1)

    monkeypatch.setattr(interpreter.GridExecutor, "_init_args_hst", init)
    monkeypatch.setattr(builder, "create_masked_load", lambda ptrs, mask, other, *a: load(
        ptrs, mask_of("load", ptrs, mask), other, *a))
    monkeypatch.setattr(builder, "create_masked_store", lambda ptrs, value, mask, *a: store(
        ptrs, value, mask_of("store", ptrs, mask), *a))
    monkeypatch.setattr(builder, "create_atomic_rmw", lambda op, ptr, val, mask, *a: rmw(
        op, ptr, val, mask_of("atomic", ptr, mask), *a))
    return acc


def guarded(t: torch.Tensor):
    """(outer, inner): a copy of t (inner) inside a tensor with GUARD sentinel rows before and after."""
    fill = float("nan") if t.is_floating_point() else 255 if t.dtype == torch.uint8 else -3
    outer = torch.full((t.shape[0] + 2 * GUARD, *t.shape[1:]), fill, dtype=t.dtype)
    outer[GUARD:-GUARD] = t
    return outer, outer[GUARD:-GUARD]


def border(outer: torch.Tensor) -> torch.Tensor:
    return torch.cat([outer[:GUARD], outer[-GUARD:]])


def same_border(outer, before) -> bool:
    return torch.equal(border(outer).view(torch.uint8), border(before).view(torch.uint8))


@triton.jit
def _gather_kernel(x_ptr, idx_ptr, out_ptr, n, MASKED: tl.constexpr):
    i = tl.arange(0, 8)
    j = tl.load(idx_ptr + i)
    keep = (j >= 0) & (j < n) if MASKED else i >= 0
    tl.store(out_ptr + i, tl.load(x_ptr + j, mask=keep, other=-1.0))


def test_a_read_past_a_view_is_caught(accesses):
    """The check itself: an unmasked gather 1 past its view (still inside the tensor behind it, so
    neither the process nor torch would notice) is caught and not made; the masked one is clean."""
    _, x = guarded(torch.arange(8, dtype=torch.float32))
    idx, out = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8]), torch.zeros(8)
    _gather_kernel[(1,)](x, idx, out, 8, MASKED=False)
    assert accesses.stray == [("_gather_kernel", "load", 1)]
    accesses.stray.clear()
    _gather_kernel[(1,)](x, idx, out, 8, MASKED=True)
    assert not accesses.stray and out.tolist() == [0, 1, 2, 3, 4, 5, 6, -1]


def test_step_inputs(accesses):
    """Rows outside [0, rows) read no last token and write no cell; positions outside [0, width)
    write none."""
    outer, r2t = guarded(torch.full((4, 16), -5, dtype=torch.int64))
    _, last = guarded(torch.arange(100, 104))
    rows, pos = torch.tensor([0, 3, -1, 4, 2, 1]), torch.tensor([0, 15, 3, 2, -1, 16])
    before = outer.clone()
    out, lens = tt.step_inputs(torch.full((6,), -1), last, rows, pos, torch.arange(10, 16), r2t)
    assert not accesses.stray, accesses.stray
    assert out.tolist() == [100, 103, 0, 0, 102, 101] and torch.equal(lens, pos + 1)
    want = before.clone()
    want[GUARD + 0, 0], want[GUARD + 3, 15] = 10, 11
    assert torch.equal(outer, want)


def _pool(kv_format):
    pool = KVPool(2, {0}, num_pages=2, kv_lora_rank=R, qk_rope_head_dim=DR, index_head_dim=DI, kv_format=kv_format)
    loc = torch.arange(pool.num_slots)
    pool.write_kv(0, loc, torch.randn(pool.num_slots, R), torch.randn(pool.num_slots, DR))
    pool.write_index_k(0, loc, torch.randn(pool.num_slots, DI))
    return pool


@pytest.mark.parametrize("kv_format", ["native", "fp8"])
def test_qkv_write_drops_slots_outside_the_pool(accesses, kv_format):
    """loc = -1, the pool's size and 2^40 write nothing; the valid slots are written as in a clean
    run; c_q is every token's."""
    torch.manual_seed(0)
    pool = _pool(kv_format)
    (kv_o, kv), (ik_o, ik) = guarded(pool.kv[0]), guarded(pool.index_k[0])
    q_a, kv_a, k = torch.randn(5, 40), torch.randn(5, R + DR), torch.randn(5, DI)
    w = dict(q_norm_w=torch.randn(40), kv_norm_w=torch.randn(R), k_norm_w=torch.randn(DI), k_norm_b=torch.randn(DI))
    pos = torch.tensor([3, 4, 0, 9, 10])
    loc = torch.tensor([5, -1, pool.num_slots, BIG, 70])
    clean_kv, clean_ik = kv.clone(), ik.clone()
    want = tt.qkv_norm_rope_write(q_a[[0, 4]], kv_a[[0, 4]], pos[[0, 4]], loc[[0, 4]], clean_kv, eps=1e-6,
                                  theta=1e4, index_k=k[[0, 4]], index_cache=clean_ik, **w)
    before_kv, before_ik = kv_o.clone(), ik_o.clone()
    c_q = tt.qkv_norm_rope_write(q_a, kv_a, pos, loc, kv, eps=1e-6, theta=1e4, index_k=k, index_cache=ik, **w)
    assert not accesses.stray, accesses.stray
    assert torch.equal(c_q[[0, 4]], want) and not c_q.isnan().any()
    assert torch.equal(kv.view(torch.uint8), clean_kv.view(torch.uint8))
    assert torch.equal(ik.view(torch.uint8), clean_ik.view(torch.uint8))
    assert same_border(kv_o, before_kv) and same_border(ik_o, before_ik)


def _table(rows, width, num_slots, gen):
    """A req_to_token table of distinct slots."""
    return torch.randperm(num_slots, generator=gen)[:rows * width].view(rows, width)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("kv_format", ["native", "fp8"])
def test_indexer_scores_read_no_key_out_of_range(accesses, kv_format, tiled):
    """A row outside the table scores -inf everywhere; a position past the table's width scores as
    its last column; table slots -1, past the pool and past 32 bits score -inf; the rest as clean."""
    gen = torch.Generator().manual_seed(1)
    pool = _pool(kv_format)
    n, W = pool.num_slots, 24
    _, cache = guarded(pool.index_k[0])
    clean = _table(4, W, n, gen)
    _, dirty = guarded(clean)
    dirty[2, [1, 3, 4]] = torch.tensor([-1, n + 5, BIG])
    q, w = torch.randn(6, HI, DI, generator=gen), torch.randn(6, HI, generator=gen)
    rows, pos = torch.tensor([0, 0, 1, -1, 4, 2]), torch.tensor([2, 20, W + 10, 5, 3, 5])
    got = tt.indexer_scores(q, w, cache, dirty, rows, pos, W, block_n=16, tiled=tiled)
    assert not accesses.stray, accesses.stray
    want = tt.indexer_scores(q, w, cache, clean, rows.clamp(0, 3), pos.clamp(max=W - 1), W, block_n=16)
    want[[3, 4]] = float("-inf")
    want[5, [1, 3, 4]] = float("-inf")
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [32, 128])   # rows split over segments (5 launches) / one program a row
def test_topk_select_clamps_lengths_and_table_reads(accesses, chunk):
    """lens past the workspace counts as its width, a negative one as 0; the slots form gives -1 for
    a row outside the table and for positions past its (narrower) width."""
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(4, 96, generator=gen)
    lens = torch.tensor([96 + 50, -4, 10, 96])
    got = tt.topk_select(scores, lens, 12, chunk=chunk, segment=32)
    want = tt.topk_select(scores, lens.clamp(0, 96), 12, chunk=chunk, segment=32)
    assert torch.equal(got, want) and bool((got[1] == -1).all())
    _, r2t = guarded(_table(3, 80, 1000, gen))
    rows = torch.tensor([0, 2, -1, 5])
    slots = tt.topk_select(scores, lens, 12, chunk=chunk, segment=32, slots_of=(r2t, rows))
    assert not accesses.stray, accesses.stray
    ok = (want >= 0) & (want < 80) & ((rows >= 0) & (rows < 3))[:, None]
    expect = torch.where(ok, r2t[rows.clamp(0, 2)[:, None], want.clamp(0, 79)], -1)
    assert torch.equal(slots.long(), expect) and bool((want[0] >= 80).any())


def _attend(q_lat, q_pe, c_kv, k_pe, keys, scale):
    """fp32 softmax attention of one token's heads over rows `keys` (0 without keys)."""
    if not keys:
        return torch.zeros_like(q_lat)
    k = torch.tensor(keys)
    p = torch.softmax(scale * (q_lat @ c_kv[k].T + q_pe @ k_pe[k].T), -1)
    return p @ c_kv[k]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("kv_format", ["native", "fp8"])
def test_sparse_mla_reads_no_key_out_of_range(accesses, kv_format, splits):
    """Top-k slots -1, -7, past the pool and past 32 bits are no keys (a token with none gets 0);
    densely, a row outside the table has no keys, a position past its width sees every column, and
    table slots out of range are skipped."""
    gen = torch.Generator().manual_seed(3)
    pool = _pool(kv_format)
    n, T, H, W = pool.num_slots, 4, 4, 24
    _, kv = guarded(pool.kv[0])
    c_kv, k_pe = pool.c_kv(0, torch.arange(n)), pool.k_pe(0, torch.arange(n))
    q_lat, q_pe = torch.randn(T, H, R, generator=gen), torch.randn(T, H, DR, generator=gen)
    big = 2 ** 31 - 1   # top-k slots are int32
    slots = torch.tensor([[3, 9, -1, n, 40, big, 7, -7], [-1, n + 1, -2, big, -1, -1, -1, -1],
                          list(range(8)), [11, 12, 13, -1, -1, -1, -1, -1]])
    pos = torch.tensor([30, 30, 30, 30])
    got = tt.sparse_mla_latent(q_lat, q_pe, kv, torch.zeros(1, 1, dtype=torch.int64), torch.zeros(T).long(), pos,
                               slots, 0.1, slots=slots.to(torch.int32), num_splits=splits, block_n=4, block_h=4)
    for t in range(T):
        keys = [s for s in slots[t].tolist() if 0 <= s < n]
        torch.testing.assert_close(got[t], _attend(q_lat[t], q_pe[t], c_kv, k_pe, keys, 0.1), rtol=1e-4, atol=1e-4)
    table = _table(3, W, n, gen)
    table[0, [2, 5]] = torch.tensor([-1, n + 3])
    _, r2t = guarded(table)
    rows, pos = torch.tensor([0, -1, 3, 1]), torch.tensor([10, 5, 5, W + 20])
    got = tt.sparse_mla_latent(q_lat, q_pe, kv, r2t, rows, pos, None, 0.1, num_keys=W, num_splits=splits,
                               block_n=4, block_h=4)
    assert not accesses.stray, accesses.stray
    keys = [[s for s in table[0, :11].tolist() if 0 <= s < n], [], [], table[1].tolist()]
    for t in range(T):
        torch.testing.assert_close(got[t], _attend(q_lat[t], q_pe[t], c_kv, k_pe, keys[t], 0.1), rtol=1e-4, atol=1e-4)


def test_moe_expert_ids_do_not_wrap(accesses):
    """Ids -1, past the experts and 2^32 + 1 (1 in 32 bits) are routes of no local expert: the same
    output as with those routes dropped (-1)."""
    gen = torch.Generator().manual_seed(4)
    E, H, inter = 4, 16, 32
    stacks = (torch.randn(E, inter, H, generator=gen), torch.randn(E, inter, H, generator=gen),
              torch.randn(E, H, inter, generator=gen))
    x, weights = torch.randn(3, H, generator=gen), torch.rand(3, 2, generator=gen)
    ids = torch.tensor([[0, 2 ** 32 + 1], [-1, 3], [E + 3, 2]])
    dropped = torch.where((ids >= 0) & (ids < E), ids, -1)
    got = tm.moe_experts(x, ids, weights, *stacks, lib=tt.JIT)
    assert not accesses.stray, accesses.stray
    torch.testing.assert_close(got, tm.moe_experts(x, dropped, weights, *stacks, lib=tt.JIT), rtol=0, atol=0)
