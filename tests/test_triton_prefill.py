"""Sparse prefill attention (codegen/triton_prefill.py) against torch_ref.mla_attention_mha.

Runs on CPU under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) with tiny GLM-like
shapes: ragged requests over shuffled rows and scattered KV slots, prefix hits / chunked prefill, rows
with fewer than k visible keys, top-k rows with duplicates, future positions and -1 pads. The output is
allocated NaN-poisoned, so a (token, head) the kernel forgot to write fails the comparison. Small tiles
(8 / 16) make every request span several query blocks and key tiles.
"""
import pytest
import torch
from filecheck import check
from glmc.codegen import torch_ref as ref
from glmc.codegen import triton_prefill as tp
from glmc.codegen.triton_launch import render
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.kv_cache import KVPool

H, DN, DR, DV, R, DI = 4, 16, 8, 16, 32, 16  # heads, nope, rope, v, kv_lora, indexer head dim
_EMPTY = torch.empty


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    def empty(*args, **kwargs):
        t = _EMPTY(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -777)
    monkeypatch.setattr(torch, "empty", empty)
    torch.manual_seed(0)


def make_batch(prefix_lens, extend_lens, num_slots, max_ctx=64):
    """An extend ForwardBatch over shuffled request rows and scattered KV slots (-777 elsewhere)."""
    B = len(prefix_lens)
    rows = torch.randperm(B + 1)[:B].tolist()
    table = torch.full((B + 1, max_ctx), -777, dtype=torch.int64)
    slots, used = torch.randperm(num_slots), 0
    for row, p, n in zip(rows, prefix_lens, extend_lens):
        table[row, : p + n] = slots[used: used + p + n]
        used += p + n
    return ForwardBatch.build("extend", [[1] * n for n in extend_lens], rows, prefix_lens, table)


def make_inputs(batch, dtype=torch.float32, dn=DN, dr=DR, dv=DV):
    pool = KVPool(1, {0}, num_pages=2, kv_lora_rank=R, qk_rope_head_dim=dr, index_head_dim=DI, dtype=dtype)
    pool.kv[0].copy_(torch.randn(pool.kv[0].shape))
    pool.index_k[0].copy_(torch.randn(pool.index_k[0].shape))
    T = batch.num_tokens
    q_nope, q_pe = torch.randn(T, H, dn).to(dtype), torch.randn(T, H, dr).to(dtype)
    return pool, q_nope, q_pe, (torch.randn(H * (dn + dv), R) * 0.2).to(dtype)


def indexer_topk(pool, batch, k):
    q, w = torch.randn(batch.num_tokens, 4, DI), torch.randn(batch.num_tokens, 4) * 0.5
    return ref.indexer_topk(q, w, pool, 0, batch, k)


def messy_topk(batch, k):
    """Random rows with duplicates, future positions and -1 pads; each row keeps its own position."""
    seq = torch.repeat_interleave(batch.seq_lens, batch.extend_lens)
    topk = (torch.rand(batch.num_tokens, k) * (seq[:, None] + 1)).long() - 1  # in [-1, seq_len)
    topk[:, 1] = topk[:, 2]
    topk[:, 0] = batch.positions
    return topk


def reqs_of(batch):
    return tp.Requests(batch.req_pool_indices, batch.extend_lens, batch.seq_lens, batch.positions)


def triton_mha(q_nope, q_pe, pool, layer, w, topk, batch, scale, dn, dv, **tiles):
    """tp.mla_attention_mha with torch_ref's (pool, batch) arguments."""
    return tp.mla_attention_mha(q_nope, q_pe, pool.kv[layer], w, topk, reqs_of(batch), batch.req_to_token, scale,
                                dn, dv, **tiles)


def close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("prefix,extend,k,source,block_m,block_n", [
    ([0, 21, 5], [19, 3, 9], 8, "indexer", 8, 8),    # ragged, prefix hits, early rows see < k keys
    ([0, 21, 5], [19, 3, 9], 16, "indexer", 16, 16),
    ([0, 21, 5], [19, 3, 9], 12, "messy", 8, 8),
    ([40, 0], [7, 6], 16, "indexer", 8, 8),          # a chunk after a long prefix: sparse compact keys
    ([0, 21, 5], [19, 3, 9], None, "dense", 8, 16),  # dense causal (context <= index_topk)
    ([33], [14], None, "dense", 16, 8),
])
def test_matches_reference(prefix, extend, k, source, block_m, block_n):
    batch = make_batch(prefix, extend, 128)
    pool, q_nope, q_pe, w = make_inputs(batch)
    topk = {"indexer": lambda: indexer_topk(pool, batch, k), "messy": lambda: messy_topk(batch, k),
            "dense": lambda: None}[source]()
    args = (q_nope, q_pe, pool, 0, w, topk, batch, 0.25, DN, DV)
    got = triton_mha(*args, block_m=block_m, block_n=block_n)
    assert got.shape == (batch.num_tokens, H * DV) and got.dtype == torch.float32
    close(got, ref.mla_attention_mha(*args), 1e-4)


@pytest.mark.parametrize("dn,dr,dv,k", [(24, 8, 32, 8), (20, 6, 12, None)])
def test_split_and_padded_head_dims(dn, dr, dv, k):
    """GLM's 192 = 128 + 64 nope split at 24 = 16 + 8; then every chunk padded (20 = 16 + 4, dr 6, dv 12)."""
    batch = make_batch([0, 21, 5], [19, 3, 9], 128)
    pool, _, _, w = make_inputs(batch, dn=dn, dr=dr, dv=dv)
    q = torch.randn(batch.num_tokens, H, dn + dr)  # q_nope, q_pe as strided views of q_b's output
    topk = indexer_topk(pool, batch, k) if k else None
    args = (q[..., :dn], q[..., dn:], pool, 0, w, topk, batch, 0.3, dn, dv)
    close(triton_mha(*args, block_m=8, block_n=16), ref.mla_attention_mha(*args), 1e-4)


def test_row_without_keys_is_zero():
    batch = make_batch([3, 0], [5, 4], 128)
    pool, q_nope, q_pe, w = make_inputs(batch)
    topk = messy_topk(batch, 6)
    topk[2] = -1
    topk[6, :] = int(batch.positions[6]) + 1  # only a future position: nothing allowed
    args = (q_nope, q_pe, pool, 0, w, topk, batch, 0.25, DN, DV)
    got, want = triton_mha(*args, block_m=8, block_n=8), ref.mla_attention_mha(*args)
    keep = torch.ones(batch.num_tokens, dtype=torch.bool)
    keep[[2, 6]] = False
    close(got[keep], want[keep], 1e-4)
    assert bool((got[~keep] == 0).all())


@pytest.mark.parametrize("k", [8, None])
def test_bf16(k):
    batch = make_batch([0, 21, 5], [19, 3, 9], 128)
    pool, q_nope, q_pe, w = make_inputs(batch, torch.bfloat16)
    topk = indexer_topk(pool, batch, k) if k else None
    got = triton_mha(q_nope, q_pe, pool, 0, w, topk, batch, 0.25, DN, DV, block_m=16, block_n=16)
    assert got.dtype == torch.bfloat16
    pool.kv[0] = pool.kv[0].float()
    want = ref.mla_attention_mha(q_nope.float(), q_pe.float(), pool, 0, w.float(), topk, batch, 0.25, DN, DV)
    close(got, want, 3e-2)


def test_prefill_keys_reads_only_wanted_tiles():
    """A 4-token chunk after a 60-token prefix with top-2: the compact keys are the union of the rows and
    each block lists exactly the key tiles some query of it wants."""
    batch = make_batch([60], [4], 128)
    topk = torch.tensor([[3, 60], [61, 17], [-1, 62], [40, 3]])
    keys = tp.prefill_keys(reqs_of(batch), batch.req_to_token, topk, 2, 4, "cpu")
    row = batch.req_to_token[int(batch.req_pool_indices[0])]
    assert keys.slots.tolist() == row[[3, 17, 40, 60, 61, 62]].tolist()
    assert keys.blocks.tolist() == [[0, 2, 0, 6], [2, 4, 0, 6]]
    assert keys.bits.tolist() == [[0b1001, 0], [0b10, 0b1], [0, 0b10], [0b101, 0]]  # 4-bit words (block_n)
    assert keys.num_tiles.tolist() == [2, 2] and keys.tiles.tolist() == [[0, 1], [0, 1]]
    keys = tp.prefill_keys(reqs_of(batch), batch.req_to_token, torch.tensor([[60], [-1], [3], [40]]), 2, 2,
                            "cpu")  # keys 3, 40 | 60
    assert keys.num_tiles.tolist() == [1, 1] and keys.tiles[:, 0].tolist() == [1, 0]


# ----------------------------------------------------------------------------- generated source


def test_source_is_specialised_for_glm53():
    ctx = tp.SparseMlaPrefillCtx.make(64, 192, 64, 256, True, 1 / 16, torch.bfloat16, interpret=False)
    assert (ctx.nope_lo, ctx.nope_hi, ctx.kv_head, ctx.word_bits) == (128, 64, 448, 32)
    check(render("sparse_mla_prefill", ctx), "bits_ptr", "tl.arange(0, 64)", "tl.arange(0, 128)",
          "128 + tl.arange(0, 64)", "d_hi < 192", ".to(tl.bfloat16)", "h * 448",
          "range(0, tl.load(num_tiles_ptr + qb))",
          "c // 32", "tl.dot(q_lo", 'input_precision="tf32"', "tl.dot(q_hi", "tl.dot(q_pe",
          "* 0.09016844005556021", "krow + 192 + dv", absent=("qpos",))
    dense = tp.SparseMlaPrefillCtx.make(64, 128, 64, 128, False, 1 / 16, torch.float32, 32, 16)
    check(render("sparse_mla_prefill", dense), "tl.arange(0, 32)", "tl.arange(0, 128)", "qpos = tl.load",
          "range(0, tl.load(pos_ptr", "tl.arange(0, 16)", "c[None, :] <= qpos[:, None]", 'input_precision="ieee"',
          absent=("bits_ptr", "num_tiles", "q_hi"))  # DeepSeek-V3.2's nope 128: one nope chunk
