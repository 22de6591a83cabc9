"""Triton kernels (codegen/triton_launch.py) against the torch target (codegen/torch_ref.py).

Runs on CPU under the Triton interpreter, so shapes are tiny and ragged (non-power-of-two widths,
uneven request lengths, scattered KV slots). Every kernel output is allocated poisoned (NaN / a
sentinel) so an element the kernel forgot to write fails the comparison. The FileCheck-style tests
at the end read the generated source: the specialised constants must be in it.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CI has no GPU

import pytest
import torch
from filecheck import check
from glmc.codegen import torch_ref as ref
from glmc.codegen import triton_launch as tt
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.kv_cache import KVPool

R, DR, DI, HI = 32, 8, 16, 4  # kv_lora, rope dim, indexer head dim, indexer heads (tiny GLM)
_EMPTY = torch.empty
INT_POISON = -777


def _poisoned_empty(*args, **kwargs):
    """torch.empty whose contents are NaN (floats) or INT_POISON (ints): unwritten outputs show."""
    t = _EMPTY(*args, **kwargs)
    return t.fill_(float("nan") if t.is_floating_point() else INT_POISON)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
    torch.manual_seed(0)


def make_batch(mode, prefix_lens, extend_lens, num_slots, max_ctx=64):
    """A ForwardBatch over shuffled request rows and scattered (non-contiguous) KV slots."""
    B = len(prefix_lens)
    rows = torch.randperm(B + 1)[:B].tolist()
    table = torch.full((B + 1, max_ctx), INT_POISON, dtype=torch.int64)
    slots, used = torch.randperm(num_slots), 0
    for row, p, n in zip(rows, prefix_lens, extend_lens):
        table[row, : p + n] = slots[used: used + p + n]
        used += p + n
    ids = [[1] * n for n in extend_lens]
    return ForwardBatch.build(mode, ids, rows, prefix_lens, table)


def make_pool(dtype=torch.float32):
    """Two layers (0 full, 1 shared), random contents so a wrong gather reads wrong numbers."""
    pool = KVPool(2, {0}, num_pages=2, kv_lora_rank=R, qk_rope_head_dim=DR, index_head_dim=DI, dtype=dtype)
    for t in pool.kv + list(pool.index_k.values()):
        t.copy_(torch.randn(t.shape))
    return pool


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, equal_nan=True)


# ----------------------------------------------------------------------------- norms / router / rope
def test_step_inputs():
    """Device-sampled ids (< 0) come from last_token[row]; each token's slot lands in r2t[row, pos];
    lens = pos + 1."""
    g = torch.Generator().manual_seed(3)
    r2t = torch.full((5, 80), -7, dtype=torch.int64)
    last = torch.randint(0, 1000, (5,), generator=g)
    for T in (1, 3, 300):            # 300: two programs; distinct (row, pos) cells
        cells = torch.randperm(r2t.numel(), generator=g)[:T]
        rows, pos = cells // r2t.shape[1], cells % r2t.shape[1]
        ids = torch.randint(-2, 1000, (T,), generator=g)
        loc = torch.randint(0, 10_000, (T,), generator=g)
        want_r2t = r2t.clone()
        want_r2t[rows, pos] = loc
        got, lens = tt.step_inputs(ids, last, rows, pos, loc, r2t)
        assert torch.equal(got, torch.where(ids < 0, last[rows], ids)), T
        assert torch.equal(lens, pos + 1), T
        assert torch.equal(r2t, want_r2t), T


def test_gemv_takes_narrow_outputs_only_at_few_rows():
    """The gemv serves a decode step's router (256 outputs) up to 16 rows but an output as narrow as
    weights_proj's 32 only up to 4 (a program per two columns leaves the GPU idle: 37.8 us vs
    cuBLAS's 8.2 at 16 rows on an H200)."""
    from glmc.target import gemv_takes
    assert gemv_takes(16, 256) and not gemv_takes(17, 256)
    assert gemv_takes(4, 32) and not gemv_takes(5, 32) and not gemv_takes(16, 32)


def test_mla_split_count_is_the_measured_best():
    """mla_num_splits gives the split count that was fastest in the H200 sweeps (kernel + combine, 64
    heads, 132 SMs, a top-k of 2048, so num_keys 2048 at every context): a power of two, the programs'
    warps within 8 per SM, >= 2 key blocks a split. 2026-12-04 (bench/results/h200_2026-12-04/
    mla_tiles_sweep_splits.json, 1-16 tokens, the current tile classes): within 2% of the best count at
    every point but bf16 rows at 2 tokens over a 1K context (12.2 us at 32 splits against 11.0 at 16);
    2026-12-03 for 32 and 128 tokens. (tokens, FP8 rows, context) -> splits."""
    from glmc.codegen.triton_contexts import SparseMlaDecodeCtx
    from glmc.target import mla_num_splits
    best = {(1, True, 1024): 32, (1, False, 1024): 32, (1, True, 2048): 32, (2, True, 2048): 32,
            (4, True, 1024): 16, (4, True, 2048): 16, (4, False, 2048): 16, (8, True, 1024): 16,
            (8, False, 2048): 16, (16, True, 2048): 8, (16, False, 1024): 8, (32, True, 1024): 4,
            (32, False, 2048): 4, (128, True, 1024): 1, (128, False, 2048): 1}
    for (T, fp8, ctx), want in best.items():
        c = SparseMlaDecodeCtx.make(64, 512, 64, 2048, 0.1, torch.bfloat16, T, kv_fp8=fp8)
        got = mla_num_splits(T, 64, c.block_h, 2048, c.block_n, 132, c.v_parts, c.num_warps)
        assert got == want, (T, fp8, ctx, got)


def test_mla_tile_classes_are_the_measured_best():
    """SparseMlaDecodeCtx's defaults per token count at 64 heads are the fastest of the H200 sweep of
    2026-12-04 (bench/results/h200_2026-12-04/mla_tiles_sweep_small.json), and a tensor-parallel
    rank's 8 heads stay in 16-head tiles. (heads, tokens, FP8 rows) -> (block_h, block_n, warps,
    stages, v_parts, dot operands)."""
    from glmc.codegen.triton_contexts import SparseMlaDecodeCtx
    want = {(64, 1, True): (16, 32, 4, 1, 1, "tl.float16"), (64, 2, True): (16, 32, 4, 1, 1, "tl.float16"),
            (64, 4, True): (64, 64, 8, 2, 2, "tl.bfloat16"), (64, 8, True): (64, 64, 8, 2, 1, "tl.bfloat16"),
            (64, 16, True): (64, 64, 8, 2, 1, "tl.bfloat16"), (64, 128, True): (64, 64, 8, 2, 1, "tl.bfloat16"),
            (64, 4, False): (16, 32, 4, 2, 1, "tl.bfloat16"), (64, 8, False): (64, 64, 8, 2, 1, "tl.bfloat16"),
            (8, 8, True): (16, 32, 4, 1, 2, "tl.float16"), (8, 64, False): (16, 32, 4, 2, 1, "tl.bfloat16")}
    for (H, T, fp8), tiles in want.items():
        c = SparseMlaDecodeCtx.make(H, 512, 64, 2048, 0.1, torch.bfloat16, T, kv_fp8=fp8)
        assert (c.block_h, c.block_n, c.num_warps, c.num_stages, c.v_parts, c.dot_dtype) == tiles, (H, T, fp8)
    variants = SparseMlaDecodeCtx.variants(64, 512, 64, 2048, 0.1, torch.bfloat16, kv_fp8=True)
    for T in (1, 2, 3, 4, 7, 8, 31, 32, 500):   # the kernel set holds every class a batch can take
        assert SparseMlaDecodeCtx.make(64, 512, 64, 2048, 0.1, torch.bfloat16, T, kv_fp8=True) in variants


@pytest.mark.parametrize("m", [1, 3, 4, 16])
def test_gemv_is_fp32_math_into_a_column_slice(m):
    """The decode GEMV: fp32 weights (the router) and bf16 (weights_proj) against an fp64 product,
    within fp32 summation error (no bf16 or TF32 rounding of the products), written into a column
    slice of a wider output without touching the rest; more rows than its largest class is an error."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 600, generator=g).to(torch.bfloat16)
    for wd in (torch.float32, torch.bfloat16):
        w = torch.randn(37, 600, generator=g).to(wd)
        want = x.double() @ w.double().T
        y = tt.gemv(x, w, out_dtype=torch.float32)
        assert y.dtype == torch.float32 and (y.double() - want).abs().max() < 1e-4
        wide = torch.full((m, 45), 5.0)
        tt.gemv(x, w, out=wide[:, 3:40])
        assert torch.allclose(wide[:, 3:40].double(), want, atol=1e-4) and (wide[:, :3] == 5).all() \
            and (wide[:, 40:] == 5).all()
    with pytest.raises(ValueError, match="17 rows"):
        tt.gemv(torch.zeros(17, 600), torch.zeros(4, 600))


@pytest.mark.parametrize("m,splits", [(17, 1), (17, 3), (70, None), (70, 5)])
def test_narrow_gemm_past_the_gemv_rows(m, splits):
    """The router / weights_proj GEMM past the gemv's rows: fp32 weights (three TF32 products) within
    fp32 summation error of an fp64 product, bf16 weights exact products; K split or not (5 asked of
    10 K blocks: 5 splits of 2; the last K block ragged), written into a column slice of a wider
    output without touching the rest; its contexts are what the kernel set lists for the router."""
    from glmc.codegen.kernel_set import _gate
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 600, generator=g).to(torch.bfloat16)
    for wd in (torch.float32, torch.bfloat16):
        w = torch.randn(37, 600, generator=g).to(wd)
        want = x.double() @ w.double().T
        y = tt.narrow_gemm(x, w, out_dtype=torch.float32, splits=splits)
        assert y.dtype == torch.float32 and (y.double() - want).abs().max() < 1e-4 * want.abs().max()
        wide = torch.full((m, 45), 5.0)
        tt.narrow_gemm(x, w, out=wide[:, 3:40], splits=splits)
        assert torch.allclose(wide[:, 3:40].double(), want, atol=1e-4 * float(want.abs().max())) \
            and (wide[:, :3] == 5).all() and (wide[:, 40:] == 5).all()
    assert tt.narrow_splits(128, 256, 6144, 132) == 16 and tt.narrow_splits(4096, 256, 6144, 132) == 1
    op = type("Op", (), {"attr": lambda self, k: {"hidden": 600, "experts": 37}[k]})()
    assert tt.NarrowGemmCtx.make(37, 600, torch.float32) in _gate(op, None, torch.bfloat16)
    with pytest.raises(ValueError, match="not a contiguous"):
        tt.narrow_gemm(x, torch.zeros(600, 4).T)


def test_rms_norm_and_fused_residual():
    x, res, w = torch.randn(5, 48), torch.randn(5, 48), torch.randn(48)
    close(tt.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    normed, new_res = tt.add_rms_norm(x, res, w, 1e-6)
    ref_normed, ref_res = ref.add_rms_norm(x, res, w, 1e-6)
    close(new_res, ref_res, 0)
    close(normed, ref_normed)


def test_add_rms_norm_folds_a_plain_add():
    """fused.add_rms with three operands: (a + b) rounded to the dtype as the elt.add it replaces,
    then the residual add and the norm: the same bits as the add then the two-operand kernel. In
    fp16: the interpreter rounds fp32 -> fp16 to nearest even as torch and the GPU do (its bf16
    conversion does not)."""
    g = torch.Generator().manual_seed(1)
    a, b, res = ((torch.randn(5, 48, generator=g) * 3).to(torch.float16) for _ in range(3))
    w = torch.randn(48, generator=g).to(torch.float16)
    normed, new_res = tt.add_rms_norm(a, res, w, 1e-6, addend=b)
    want_normed, want_res = tt.add_rms_norm(a + b, res, w, 1e-6)
    assert torch.equal(new_res, want_res) and torch.equal(normed, want_normed)
    assert not torch.equal(new_res, (a.float() + b.float() + res.float()).to(torch.float16))   # rounded twice
    with pytest.raises(ValueError, match="addend"):
        tt.add_rms_norm(a, res, w, 1e-6, addend=b.float())


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_moe_route(n_group, topk_group):
    x, gate_w, bias = torch.randn(7, 64), torch.randn(16, 64) * 0.3, torch.randn(16) * 0.1
    w, ids = tt.moe_route(x, gate_w, bias, 4, n_group, topk_group, True, 2.5)
    ref_w, ref_ids = ref.moe_route(x, gate_w, bias, 4, n_group, topk_group, True, 2.5)
    assert torch.equal(ids, ref_ids)  # both in descending biased score
    close(w, ref_w)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_moe_route_ties_go_to_the_lowest_index(n_group, topk_group):
    """Equal router scores (a zero gate): the lowest groups, then the lowest experts, in torch and Triton;
    and rows of few distinct logits (many exact ties) agree id for id."""
    bias = torch.zeros(16)
    for logits in (torch.zeros(3, 16), torch.randint(-1, 2, (9, 16)).float()):
        w, ids = tt.moe_route_logits(logits, bias, 4, n_group, topk_group, True, 2.5)
        ref_w, ref_ids = ref.moe_route_logits(logits, bias, 4, n_group, topk_group, True, 2.5)
        assert torch.equal(ids, ref_ids)
        close(w, ref_w)
    assert ids.dtype == torch.int64 and ref.moe_route_logits(torch.zeros(1, 16), bias, 4, n_group, topk_group,
                                                              True, 2.5)[1].tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_partial_strided(interleaved):
    q = torch.randn(6, 3, 24)  # rotate q[..., 16:] like q_pe inside q, and the first 8 of 16 like q_idx
    pos = torch.tensor([0, 1, 7, 40, 41, 1000])
    close(tt.rope(q[..., 16:], pos, 8e6, interleaved), ref.rope(q[..., 16:], pos, 8e6, interleaved))
    got = tt.rope(q[..., :16], pos, 1e4, interleaved, rope_dim=8)
    want = torch.cat([ref.rope(q[..., :8], pos, 1e4, interleaved), q[..., 8:16]], dim=-1)
    close(got, want)


@pytest.mark.parametrize("layer", [0, 1])
def test_qkv_norm_rope_write(layer):
    """Layer 0 is full (also writes the indexer key), layer 1 shared (no indexer cache)."""
    pool, T = make_pool(), 5
    for t in pool.kv + list(pool.index_k.values()):
        t.fill_(float("nan"))
    want = make_pool()
    for a, b in zip(pool.kv + list(pool.index_k.values()), want.kv + list(want.index_k.values())):
        b.copy_(a)
    q_a, kv_a, ik = torch.randn(T, 40), torch.randn(T, R + DR), torch.randn(T, DI)
    qw, kvw, kw, kb = torch.randn(40), torch.randn(R), torch.randn(DI), torch.randn(DI)
    pos, loc = torch.tensor([3, 4, 0, 9, 10]), torch.tensor([70, 5, 64, 127, 1])
    full = layer in pool.full_layers
    c_q = tt.qkv_norm_rope_write(q_a, kv_a, pos, loc, pool.kv[layer], qw, kvw, 1e-6, 8e6,
                                 index_k=ik if full else None, index_cache=pool.index_k.get(layer), k_norm_w=kw,
                                 k_norm_b=kb, index_interleaved=False)
    close(c_q, ref.rms_norm(q_a, qw, 1e-6))
    ref.kv_write(want, layer, loc, ref.rms_norm(kv_a[:, :R], kvw, 1e-6), ref.rope(kv_a[:, R:], pos, 8e6))
    if full:
        k = ref.layer_norm(ik, kw, kb, 1e-6)
        ref.index_k_write(want, layer, loc, torch.cat([ref.rope(k[:, :DR], pos, 8e6, False), k[:, DR:]], -1))
        close(pool.index_k[layer], want.index_k[layer])
    close(pool.kv[layer], want.kv[layer])


# ----------------------------------------------------------------------------- indexer / attention
def _indexer_inputs(batch):
    T = batch.num_tokens
    return torch.randn(T, HI, DI), torch.randn(T, HI) * HI ** -0.5


@pytest.mark.parametrize("mode,prefix,extend,topk", [
    ("extend", [0, 21, 2], [19, 3, 1], 8),  # ragged chunked prefill: short rows keep all keys
    ("decode", [4, 40, 16], [1, 1, 1], 16),
])
def test_indexer_topk(mode, prefix, extend, topk):
    pool = make_pool()
    batch = make_batch(mode, prefix, extend, pool.num_slots)
    q, w = _indexer_inputs(batch)
    got = triton_indexer_topk(q, w, pool, batch, topk)
    want = ref.indexer_topk(q, w, pool, 0, batch, topk)
    _same_selection(got, want, batch)


def triton_indexer_topk(q, w, pool, batch, topk):
    """tt.indexer_topk over layer 0's indexer cache, the batch's rows, positions and table."""
    rows, pos = tt.token_rows(batch, q.device)
    return tt.indexer_topk(q, w, pool.index_k[0], batch.req_to_token, rows, pos, topk, int(batch.seq_lens.max()),
                           block_n=16, chunk=16)


def _same_selection(got, want, batch):
    """Per token the same key positions (Triton: ascending; torch: by score), -1 padded alike."""
    for t in range(batch.num_tokens):
        g, r = got[t][got[t] >= 0], want[t][want[t] >= 0]
        assert g.numel() == r.numel() and torch.equal(got[t][g.numel():], torch.full_like(got[t][g.numel():], -1))
        assert g.unique().numel() == g.numel() and int(g.max()) <= int(batch.positions[t])
        assert torch.equal(g.sort().values, r.sort().values), (t, g, r)


@pytest.mark.parametrize("kv_format", ["native", "fp8"])
@pytest.mark.parametrize("prefix,extend", [([0, 21, 2], [19, 3, 1]), ([0, 5], [70, 30])])
def test_indexer_scores_token_blocks(prefix, extend, kv_format):
    """The prefill kernel (64-token blocks sharing each key tile) gives the per-token kernel's scores
    (up to the order of the sum over heads), also in blocks that straddle requests (their other
    requests' tokens are scored one by one) and past the last token; bf16 and FP8 key caches."""
    pool = KVPool(2, {0}, num_pages=4, kv_lora_rank=R, qk_rope_head_dim=DR, index_head_dim=DI,
                  kv_format="fp8" if kv_format == "fp8" else "native", dtype=torch.float32)
    loc = torch.arange(pool.num_slots)
    pool.write_index_k(0, loc, torch.randn(pool.num_slots, DI))
    batch = make_batch("extend", prefix, extend, pool.num_slots, max_ctx=128)
    q, w = _indexer_inputs(batch)
    rows, pos = tt.token_rows(batch, q.device)
    width = int(batch.seq_lens.max())
    args = (q, w, pool.index_k[0], batch.req_to_token, rows, pos, width)
    want = tt.indexer_scores(*args, w_scale=0.5)
    got = tt.indexer_scores(*args, w_scale=0.5, tiled=True)
    assert got.shape == want.shape and int(got.shape[1]) >= width
    assert torch.equal(torch.isinf(got), torch.isinf(want))       # -inf exactly after each token's position
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_indexer_topk_ties_go_to_the_lowest_positions():
    """Every index score ReLU'd to 0 (q = 0): each token keeps its first min(k, pos + 1) positions,
    in torch_ref and in the Triton kernels alike, whatever the row length."""
    pool = make_pool()
    batch = make_batch("extend", [0, 21, 2], [19, 3, 1], pool.num_slots)
    q, w = torch.zeros(batch.num_tokens, HI, DI), torch.randn(batch.num_tokens, HI)
    got = triton_indexer_topk(q, w, pool, batch, 8)
    want = ref.indexer_topk(q, w, pool, 0, batch, 8)
    _same_selection(got, want, batch)
    for t in range(batch.num_tokens):
        keep = min(8, int(batch.positions[t]) + 1)
        assert got[t].tolist() == list(range(keep)) + [-1] * (8 - keep)


@pytest.mark.parametrize("chunk", [16, 64])   # rows over several chunks / each row held in one chunk
def test_topk_select_heavy_ties(chunk):
    """Radix select with many exact ties, negatives and short rows (lens <= k keep every position)."""
    values = torch.tensor([-1.5, -0.25, 0.0, 0.25, 3.0, float("-inf")])
    scores = values[torch.randint(0, 5, (5, 48))]
    lens = torch.tensor([48, 40, 7, 33, 12])
    got = tt.topk_select(scores, lens, 12, chunk=chunk)
    for t in range(5):
        n = int(lens[t])
        g = got[t][got[t] >= 0]
        assert g.numel() == min(n, 12) and bool((got[t][g.numel():] == -1).all())
        assert g.unique().numel() == g.numel() and int(g.max()) < n
        assert g.tolist() == sorted(ref.topk_lowest_first(scores[t][:n], 12).tolist())  # ties: lowest first


YARN = (("type", "yarn"), ("factor", 8.0), ("original_max_position_embeddings", 16), ("beta_fast", 32.0),
        ("beta_slow", 1.0), ("truncate", True), ("attention_factor", 1.2))
# (pairing, yarn scaling) of a query turned as loaded: GLM-5.3's, DeepSeek-V3.2's indexer (yarn, halves)
TURNS = [(True, None), (False, YARN)]


@pytest.mark.parametrize("interleaved,scaling", TURNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiled", [False, True])
def test_indexer_scores_turn_q_as_they_load_it(tiled, dtype, interleaved, scaling):
    """fuse-query-rope's indexer: the scores kernel given the un-turned q and the rope (its first DR of
    DI dims) gives, to the bit, the scores of the rope kernel's output (both kernels, both caches'
    dtypes, both pairings, yarn)."""
    pool = make_pool(dtype)
    batch = make_batch("extend", [0, 21, 2], [19, 3, 1], pool.num_slots)
    q, w = (x.to(dtype) for x in _indexer_inputs(batch))
    rows, pos = tt.token_rows(batch, q.device)
    rope = tt.QueryRope(DR, 8e6, interleaved, scaling)
    args = (w, pool.index_k[0], batch.req_to_token, rows, pos, int(batch.seq_lens.max()))
    turned = tt.rope(q, pos, 8e6, interleaved, rope_dim=DR, scaling=scaling)
    want = tt.indexer_scores(turned, *args, w_scale=0.5, tiled=tiled)
    assert torch.equal(tt.indexer_scores(q, *args, w_scale=0.5, tiled=tiled, rope=rope), want)


@pytest.mark.parametrize("interleaved,scaling", TURNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,prefix,extend,use_topk,splits", [
    ("decode", [4, 40, 16], [1, 1, 1], True, 3),
    ("extend", [0, 9], [12, 3], False, 2),
])
def test_sparse_mla_turns_q_pe_as_it_loads_it(mode, prefix, extend, use_topk, splits, dtype, interleaved, scaling):
    """fuse-query-rope's attention: the latent kernel given the un-turned q_pe and the rope gives, to
    the bit, the attention of the rope kernel's q_pe (top-k and dense causal keys, split or not)."""
    pool = make_pool(dtype)
    batch = make_batch(mode, prefix, extend, pool.num_slots)
    T, H, dn, dv = batch.num_tokens, 4, 16, 8
    topk = ref.indexer_topk(*_indexer_inputs(batch), pool, 0, batch, 16) if use_topk else None
    q_nope, q_pe = torch.randn(T, H, dn, dtype=dtype), torch.randn(T, H, DR, dtype=dtype)
    w_kv_b = (torch.randn(H * (dn + dv), R) * 0.2).to(dtype)
    rows, pos = tt.token_rows(batch, q_nope.device)
    args = (pool.kv[0], w_kv_b, topk, batch.req_to_token, rows, pos, 0.25, dn, dv)
    want = tt.mla_attention_absorbed(q_nope, tt.rope(q_pe, pos, 8e6, interleaved, scaling=scaling), *args,
                                     num_splits=splits, block_n=16)
    got = tt.mla_attention_absorbed(q_nope, q_pe, *args, num_splits=splits, block_n=16,
                                    rope=tt.QueryRope(DR, 8e6, interleaved, scaling))
    assert torch.equal(got, want)


@pytest.mark.parametrize("key_major", [False, True])
@pytest.mark.parametrize("mode,prefix,extend,use_topk,splits", [
    ("decode", [4, 40, 16], [1, 1, 1], True, 3),
    ("decode", [4, 40, 16], [1, 1, 1], True, 1),   # one split: the kernel writes the output, no combine
    ("extend", [0, 9], [12, 3], True, None),
    ("extend", [0, 9], [12, 3], False, 2),  # dense causal (context <= index_topk)
])
def test_sparse_mla(mode, prefix, extend, use_topk, splits, key_major):
    close(*sparse_mla_case(make_pool(), mode, prefix, extend, use_topk, splits, key_major), 1e-4)


@pytest.mark.parametrize("v_parts", [2])
def test_sparse_mla_latent_in_parts(v_parts):
    """Each program accumulates kv_lora / v_parts output columns (scores still over all of them)."""
    close(*sparse_mla_case(make_pool(), "decode", [4, 40, 16], [1, 1, 1], True, 3, False, v_parts=v_parts), 1e-4)
    with pytest.raises(ValueError, match="v_parts=2 needs head-major"):
        tt.SparseMlaDecodeCtx.make(4, R, DR, 16, 0.25, torch.float32, 1, key_major=True, v_parts=2)


@pytest.mark.parametrize("T,inter", [(1, 24), (5, 40)])
def test_silu_mul(T, inter):
    """SwiGLU's activation over the gate|up GEMM's output (gate columns first), ragged widths."""
    gu = torch.randn(T, 2 * inter) * 3
    close(tt.silu_mul(gu), torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:], 1e-5)
    with pytest.raises(ValueError, match=r"not \[T, 2 \* inter\]"):
        tt.silu_mul(torch.randn(2, 7))


def sparse_mla_case(pool, mode, prefix, extend, use_topk, splits, key_major, **tiles):
    """(the Triton sparse MLA's output, torch_ref's) on random queries over `pool`'s layer 0."""
    H, dn, dv = 4, 16, 8
    batch = make_batch(mode, prefix, extend, pool.num_slots)
    T = batch.num_tokens
    topk = ref.indexer_topk(*_indexer_inputs(batch), pool, 0, batch, 16) if use_topk else None
    q_nope, q_pe, w_kv_b = torch.randn(T, H, dn), torch.randn(T, H, DR), torch.randn(H * (dn + dv), R) * 0.2
    rows, pos = tt.token_rows(batch, q_nope.device)
    got = tt.mla_attention_absorbed(q_nope, q_pe, pool.kv[0], w_kv_b, topk, batch.req_to_token, rows, pos, 0.25,
                                    dn, dv, num_splits=splits, block_n=16, key_major=key_major, **tiles)
    return got, ref.mla_attention_absorbed(q_nope, q_pe, pool, 0, w_kv_b, topk, batch, 0.25, dn, dv)


# (the sampling kernel: tests/test_sampler.py, against torch_ref.sample)


# ----------------------------------------------------------------------------- generated source


def test_source_is_specialised_for_glm53(tmp_path):
    norm = tt.RmsNormCtx.make(6144, 1e-5, True)
    check(tt.render("rms_norm", norm), "res_ptr", "tl.arange(0, 8192)", "offs < 6144", "x = new_res", "+ 1e-05")
    check(tt.render("rms_norm", tt.RmsNormCtx.make(512, 1e-6, False)), "offs < 512", absent=("res_ptr",))
    router = tt.MoeRouterCtx.make(256, 1, 1, 8, True, 2.5)
    check(tt.render("moe_router", router), "tl.arange(0, 256)", "tl.static_range(8)", "1e-20", "* 2.5",
          absent=("gscore",))
    check(tt.render("moe_router", tt.MoeRouterCtx.make(256, 8, 4, 8, True, 2.5)), "tl.arange(0, 8)",
          "tl.arange(0, 32)", "gscore", "tl.static_range(4)", 'float("-inf")')
    mla = tt.SparseMlaDecodeCtx.make(64, 512, 64, 2048, 1 / 16, torch.bfloat16, 1)
    check(tt.render("sparse_mla_decode", mla), "tl.arange(0, 512)", "tl.arange(0, 64)",
          "num_keys = tl.minimum(qpos + 1, 2048)",
          "+ 512 + dr", "tl.bfloat16", "* 0.09016844005556021", absent=("num_keys = qpos + 1",))
    wide = tt.SparseMlaDecodeCtx.make(64, 512, 64, 2048, 1 / 16, torch.bfloat16, 128)
    assert (wide.key_major, wide.block_h, wide.block_n, wide.num_warps, wide.num_stages) == (False, 64, 64, 8, 2)
    check(tt.render("sparse_mla_decode", wide), "tl.zeros([64, 512]", "tl.dot(q0, tl.trans(ckv0)",
          "tl.dot(p.to(tl.bfloat16), ckv0", absent=("q1", "sc0", "tl.trans(q0)"))
    fp8 = tt.SparseMlaDecodeCtx.make(64, 512, 64, 2048, 1 / 16, torch.bfloat16, 32, kv_fp8=True)
    assert (fp8.dequant, fp8.block_h, fp8.block_n, fp8.dot_dtype) == (True, 64, 64, "tl.bfloat16")
    check(tt.render("sparse_mla_decode", fp8), "tl.arange(0, 4)", "tl.reshape(ck * sc.to(tl.bfloat16)",
          absent=("q1", "sc0", "ckv1"))
    qkv = tt.QkvNormRopeWriteCtx.make(2048, 512, 64, 1e-5, True, 128)
    check(tt.render("qkv_norm_rope_write", qkv), "oq < 2048", "oc < 512", "ia = 2 * j", "dst + 512 + j",
          "dst + 544 + j", "oi < 128", "+ 1e-06")
    check(tt.render("topk_select", tt.TopkSelectCtx.make(2048, 8192)), "n <= 8192", "tl.arange(0, 8192)", "n > 2048")
    check(tt.render("sample", tt.SampleCtx.make(154880)), "range(0, 154880, 1024)", "range(0, 154880, 4096)",
          absent=("kept_ptr",))
    (tmp_path / "norm.py").write_text(tt.render("rms_norm", norm))
    assert hasattr(tt.load_kernel(tmp_path / "norm.py"), "rms_norm_kernel")
