"""FP8 kernels (codegen/triton_fp8.py) against fp8_ref, under TRITON_INTERPRET=1 (conftest)."""
import pytest
import torch
from filecheck import check
from glmc import target
from glmc.codegen import fp8_ref
from glmc.codegen import triton_fp8 as tf
from glmc.codegen.triton_render import render


@pytest.mark.parametrize("width", [300, 1300])
def test_quantize_tokens_is_bit_exact(width):
    """Per token, per 128 columns: the same scales and the same e4m3 bytes as the reference, with a
    ragged last group, an all-zero group and values at binade edges (where a cast that truncates, as
    the interpreter's does, would differ). 1300 columns: 11 groups over two programs of 8 groups,
    the second with 3 (its other groups masked)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, width, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    x[2, 128:256] = 0.0
    x[3, :4] = torch.tensor([448.0, 125.96, -31.63, 0.0151])   # s = 1: 125.96 -> 128, -31.63 -> -32
    q, s = tf.quantize_tokens(x)
    want_q, want_s = fp8_ref.quantize_token_groups(x)
    assert torch.equal(s, want_s) and s[2, 1] == 1.0
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert tf.Fp8QuantTokensCtx.make(width).grid(7) == (7, {300: 1, 1300: 2}[width])
    back = q.float().view(7, -1) * s.repeat_interleave(128, 1)[:, :width]
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + s.repeat_interleave(128, 1)[:, :width] * 2 ** -9).all()


@pytest.mark.parametrize("m,n,k,block_n", [(5, 160, 300, 32), (20, 96, 256, 64), (1, 256, 128, 128)])
def test_block_gemm_matches_the_reference(m, n, k, block_n):
    """Ragged M, N and K (masked tiles), tiles narrower than the 128-wide scale block, decode and
    prefill row classes: equal to fp8_ref.fp8_gemm up to fp32 summation order, and close to the
    dequantised product."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, :128] *= 20.0                                  # blocks with different scales
    wq, ws = fp8_ref.quantize_weight_blocks(w)
    x = torch.randn(m, k, generator=g)
    xq, xs = tf.quantize_tokens(x)
    got = tf.fp8_block_gemm(xq, xs, wq, ws, torch.float32, block_n=block_n)
    want = fp8_ref.fp8_gemm(xq, xs, wq, ws)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    deq = (xq.float() * xs.repeat_interleave(128, 1)[:, :k]) @ fp8_ref.fp8_block_dequant(wq, ws).T
    torch.testing.assert_close(got, deq, rtol=1e-4, atol=1e-4)
    exact = x @ w.T                                      # what FP8 costs against full precision
    assert float((got - exact).norm() / exact.norm()) < 0.08


def _operands(m, n, k, seed):
    """Quantised x [m, k] and a block-FP8 weight [n, k] whose K blocks differ in scale (every split
    carries a different share of the sum)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 * torch.logspace(0, 1.5, k)[None, :]
    wq, ws = fp8_ref.quantize_weight_blocks(w)
    return (*tf.quantize_tokens(torch.randn(m, k, generator=g)), wq, ws)


@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize("splits,used", [(7, 7), (2, 2), (3, 3), (5, 4)])
def test_split_k_matches_the_unsplit_kernel_and_the_reference(m, splits, used):
    """K = 850: 7 blocks of 128, the last ragged. Splits of 1 block each (7), and splits that do not
    divide the 7 blocks (4 + 3, 3 + 3 + 1; 5 asked -> 4 of 2 + 2 + 2 + 1): equal to the unsplit
    kernel and to fp8_ref up to fp32 summation order, and the same bits on a second run."""
    xq, xs, wq, ws = _operands(m, 96, 850, seed=m)
    assert tf.even_splits(7, splits) == used
    one = tf.fp8_block_gemm(xq, xs, wq, ws, torch.float32, splits=1)
    split = tf.fp8_block_gemm(xq, xs, wq, ws, torch.float32, splits=splits)
    want = fp8_ref.fp8_gemm(xq, xs, wq, ws)
    torch.testing.assert_close(one, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, one, rtol=1e-5, atol=1e-5)
    assert torch.equal(split, tf.fp8_block_gemm(xq, xs, wq, ws, torch.float32, splits=splits))


def test_split_reduction_adds_every_split_in_order():
    """fp8_split_reduce alone: part[s] = 2^s (distinct bits per split, so a dropped or repeated split
    shows), plus 1e8 then -1e8 in splits 1 and 2, where fp32 in split order loses split 0's 1
    (1 + 1e8 rounds to 1e8) and another order would not; written into a column slice of a wider
    output, leaving the other columns alone."""
    S, M, N = 5, 3, 40
    part = torch.stack([torch.full((M, N), 2.0 ** s) for s in range(S)])
    part[1, 0, 0], part[2, 0, 0] = 1e8, -1e8
    y = torch.zeros(M, N + 8)
    red = tf.Fp8SplitReduceCtx.make()
    tf.JIT(red)[(M, -(-N // red.block))](part, y[:, 4:], y.stride(0), M, N, S, N, 0, num_warps=red.num_warps)
    want = torch.zeros(M, N)
    for s in range(S):
        want += part[s]
    assert torch.equal(y[:, 4:N + 4], want) and float(want[0, 0]) == 8 + 16
    assert not y[:, :4].any() and not y[:, N + 4:].any()


@pytest.mark.parametrize("m,splits", [(1, 4), (3, 1), (20, 2)])
def test_joined_parts_with_a_padded_part(m, splits):
    """Parts of 200, 128 and 72 rows (GLM-5.3's q_a | kv_a | wk, scaled down): one group, the
    200-row part padded with 56 zero rows; the GEMM over the joined 456-row weight, split or not,
    writes the 400 real columns into a column slice of a wider output, equal to each part's own
    GEMM, and leaves the other columns alone."""
    rows = [200, 128, 72]
    assert target.fp8_row_groups(rows) == [[0, 1, 2]]
    assert target.fp8_group_gap(rows) == (200, 56)
    assert target.fp8_row_groups([200, 72, 100]) == [[0, 1], [2]]     # a second ragged part: new group
    assert target.fp8_group_gap([256, 72]) == (328, 0)
    g = torch.Generator().manual_seed(m)
    k = 384
    parts = [fp8_ref.Fp8Weight(*fp8_ref.quantize_weight_blocks(torch.randn(r, k, generator=g) * 0.05)) for r in rows]
    joined = fp8_ref.Fp8Weight.cat_rows(parts, pad=True)
    assert joined.shape == (456, k) and not joined.q[200:256].float().any()
    with pytest.raises(ValueError, match="128-row block"):
        fp8_ref.Fp8Weight.cat_rows(parts)
    xq, xs = tf.quantize_tokens(torch.randn(m, k, generator=g))
    y = torch.full((m, 410), 7.0)
    tf.fp8_block_gemm(xq, xs, joined.q, joined.scale_inv, torch.float32, out=y[:, 5:405], gap=(200, 56),
                      splits=splits)
    want = torch.cat([fp8_ref.fp8_gemm(xq, xs, p.q, p.scale_inv) for p in parts], 1)
    torch.testing.assert_close(y[:, 5:405], want, rtol=1e-5, atol=1e-5)
    assert (y[:, :5] == 7).all() and (y[:, 405:] == 7).all()


@pytest.mark.parametrize("inter,joined", [(256, True), (200, True), (200, False)])
@pytest.mark.parametrize("m,splits", [(1, 3), (5, 1), (3, None)])
def test_swiglu_quant_matches_the_reference(inter, joined, m, splits):
    """fp8_swiglu_quant: gate/up GEMMs (joined into one [2I, K] weight, the gate padded to its
    128-row block where I is ragged, or apart),
    split or not, then SwiGLU rounded to bf16 and quantised in the split reduction: equal to
    fp8_ref's GEMMs then silu * up, bf16, quantize_token_groups, up to fp32 summation order (the
    e4m3 codes within one step where the fp32 sums straddle a rounding edge), and the same bits on
    a second run."""
    g = torch.Generator().manual_seed(inter + m)
    k = 700
    x = torch.randn(m, k, generator=g)
    wg, wu = (fp8_ref.quantize_weight_blocks(torch.randn(inter, k, generator=g) * 0.05) for _ in range(2))
    xq, xs = tf.quantize_tokens(x)
    if joined:
        w = fp8_ref.Fp8Weight.cat_rows([fp8_ref.Fp8Weight(*wg), fp8_ref.Fp8Weight(*wu)], pad=True)
        parts = [(w.q, w.scale_inv, target.fp8_group_gap([inter, inter]))]
    else:
        parts = [wg, wu]
    hq, hs = tf.fp8_swiglu_quant(xq, xs, parts, torch.bfloat16, splits=splits)
    gg, uu = fp8_ref.fp8_gemm(xq, xs, *wg), fp8_ref.fp8_gemm(xq, xs, *wu)
    h = (torch.nn.functional.silu(gg) * uu).to(torch.bfloat16).float()
    wq_, ws_ = fp8_ref.quantize_token_groups(h)
    assert hq.shape == (m, inter) and hs.shape == (m, -(-inter // 128))
    torch.testing.assert_close(hs, ws_, rtol=1e-2, atol=0)
    got = hq.float() * hs.repeat_interleave(128, 1)[:, :inter]
    torch.testing.assert_close(got, h, rtol=0.07, atol=float(hs.max()) * 0.5)
    agree = (hq.view(torch.uint8) == wq_.view(torch.uint8)).float().mean()
    assert agree > 0.995, agree
    again = tf.fp8_swiglu_quant(xq, xs, parts, torch.bfloat16, splits=splits)
    assert torch.equal(again[0].view(torch.uint8), hq.view(torch.uint8)) and torch.equal(again[1], hs)


def test_default_splits_fill_the_gpu_and_stop_when_tiles_do():
    """default_config on an H200's 132 SMs: the indexer's wk at decode (1 tile, 48 K blocks) splits
    into 2-block ranges; q_b at M = 1 (128 tiles, about one wave) splits to ~3 waves; from 17 rows
    64 x 128 tiles split to one wave only (o_proj at 128 rows: 96 tiles, 2 splits); a full prefill
    does not split."""
    assert tf.default_config(1, 128, 6144, 132) == dict(block_m=16, block_n=128, num_warps=4, num_stages=3, splits=24)
    assert tf.default_config(1, 16384, 2048, 132)["splits"] == 4
    assert tf.default_config(128, 24576, 6144, 132)["splits"] == 1
    assert tf.default_config(128, 6144, 16384, 132) == dict(block_m=64, block_n=128, num_warps=4, num_stages=4,
                                                           splits=2)
    assert tf.default_config(4096, 6144, 16384, 132) == dict(block_m=64, block_n=128, num_warps=4, num_stages=4,
                                                            splits=1)
    assert tf.default_config(1, 128, 128, 132)["splits"] == 1        # one K block: nothing to split


def test_variants_cover_every_launch_of_the_glm53_plan():
    """Every context `fp8_block_gemm` builds by default for the FP8 GEMMs of GLM-5.3 (tp1 and tp8) at
    any row count up to 16k, and the split reduction, is one the plan's kernel set lists: serving
    never compiles a kernel the start-up did not."""
    from compile_util import plan as compiled
    from glmc.codegen.kernel_set import plan_kernels
    for parallel in ("tp1", "tp8"):
        listed = set(plan_kernels(compiled("glm_moe_dsa", parallel, device="cuda")).values())
        gemms = {(c.n, c.k, c.gapped) for c in listed if c.template == "fp8_block_gemm"}
        assert len(gemms) >= 8 and tf.Fp8SplitReduceCtx.make() in listed
        assert {(n, g) for n, _, g in gemms if g} == {(2048 + 640 + 128, True)}   # only the padded A-projection
        assert tf.Fp8SplitReduceCtx.make(gapped=True) in listed
        rows = sorted({*range(1, 300), *(2 ** i + d for i in range(8, 15) for d in (-1, 0, 1))})
        assert all(tf.Fp8BlockGemmCtx.make(n, k, m, gapped=g) in listed for n, k, g in gemms for m in rows)


def test_launches_use_only_the_listed_variants():
    """fp8_block_gemm through a library holding exactly `variants` (as a plan's does): every row class,
    split or not, runs without asking for another kernel (M = 1 splits K on the interpreter's 2 SMs)."""
    from glmc.codegen.triton_render import KernelLibrary
    xq, xs, wq, ws = _operands(300, 96, 600, seed=4)
    lib = KernelLibrary({repr(c): tf.JIT.path(c) for c in tf.Fp8BlockGemmCtx.variants(96, 600)}, "test",
                        jit_extra=False)
    want = fp8_ref.fp8_gemm(xq, xs, wq, ws)
    for m in (1, 17, 256, 300):
        got = tf.fp8_block_gemm(xq[:m], xs[:m], wq, ws, torch.float32, lib=lib)
        torch.testing.assert_close(got, want[:m], rtol=1e-5, atol=1e-5)
    assert sorted(p.stem.rsplit("_", 1)[0] for p in lib.loaded()) == ["fp8_block_gemm"] * 2 + ["fp8_split_reduce"]


def test_fp8_linear_in_bf16_and_bad_shapes():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 200, generator=g) * 0.1
    wq, ws = fp8_ref.quantize_weight_blocks(w)
    x = torch.randn(3, 200, generator=g).to(torch.bfloat16)
    y = tf.fp8_linear(x, wq, ws)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 64)
    torch.testing.assert_close(y.float(), fp8_ref.fp8_gemm(*fp8_ref.quantize_token_groups(x), wq, ws),
                               rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="do not fit 128 x 128 blocks"):
        tf.fp8_block_gemm(*tf.quantize_tokens(x), wq, ws[:, :1])
    with pytest.raises(ValueError, match="must be powers of two >= 16"):
        tf.Fp8BlockGemmCtx.make(64, 200, 3, block_n=48)


def test_weight_quantisation_round_trips_the_checkpoint_convention():
    """quantize_weight_blocks is the inverse of the loader's dequantisation (W = Wq * S per block)."""
    w = torch.randn(130, 260) * torch.rand(130, 1) * 3
    wq, ws = fp8_ref.quantize_weight_blocks(w)
    assert ws.shape == (2, 3) and wq.dtype == torch.float8_e4m3fn
    back = fp8_ref.fp8_block_dequant(wq, ws)
    assert float((back - w).norm() / w.norm()) < 0.04
    assert float(wq.float().abs().max()) <= 448.0


def test_sources_are_specialised():
    ctx = tf.Fp8BlockGemmCtx.make(6144, 2048, 1)
    check(render(ctx.template, ctx), "tl.arange(0, 16)", "tl.minimum(kb0 + split_blocks, 16)",
          "a = tl.load(a_ptrs + kb * 128, mask=mm[:, None]", "tl.dot(a, tl.trans(b), max_num_imprecise_acc=128)", "(pid_n * 128 // 128)",
          "if splits == 1:", "part_ptr + rows[:, None] * 6144")
    assert [(c.block_m, c.block_n) for c in tf.Fp8BlockGemmCtx.variants(6144, 2048)[:-1]] == [(16, 128), (64, 128)]
    wide = tf.Fp8BlockGemmCtx.make(6144, 300, 4096, block_n=256)
    check(render(wide.template, wide), "km = kb * 128 + rk < 300", "(rn // 128) * ws_stride")
    check(render("fp8_split_reduce", tf.Fp8SplitReduceCtx.make()), "for s in range(0, splits)",
          "(s * M + m).to(tl.int64) * (N + gap_w) + rn", absent=("src",))
    check(render("fp8_split_reduce", tf.Fp8SplitReduceCtx.make(gapped=True)), "src = tl.where(rn >= gap_at",
          "(s * M + m).to(tl.int64) * (N + gap_w) + src")
    check(render(ctx.template, ctx), "rn[None, :], acc.to(", absent=("keep",))
    gapped = tf.Fp8BlockGemmCtx.make(2816, 6144, 1, gapped=True)
    check(render(gapped.template, gapped), "col = tl.where(rn >= gap_at, rn - gap_w, rn)")
    check(render("fp8_quant_tokens", tf.Fp8QuantTokensCtx.make(6144)), "12582912.0", "c < 6144", "tl.float8e4nv")


@pytest.mark.parametrize("T,E,top_k,hidden,inter,offset", [(5, 4, 2, 160, 96, 0), (3, 3, 2, 128, 256, 2)])
def test_moe_experts_fp8_matches_the_reference(T, E, top_k, hidden, inter, offset):
    """Grouped FP8 experts (h quantised in the gate/up kernel) against fp8_ref.moe_experts_fp8: ragged
    hidden and intermediate widths, two 128-column groups of h, routes to experts another rank holds
    (offset); and close to the bf16-free product on the dequantised weights."""
    from glmc.codegen import torch_ref
    from glmc.codegen.triton_moe import moe_experts_fp8
    g = torch.Generator().manual_seed(3)
    ws = [fp8_ref.Fp8Weight.quantize(torch.randn(E, *shape, generator=g) * shape[1] ** -0.5)
          for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
    x = torch.randn(T, hidden, generator=g)
    ids = torch.randint(0, E + offset, (T, top_k), generator=g)
    w = torch.rand(T, top_k, generator=g)
    got = moe_experts_fp8(x, ids, w, *ws, expert_offset=offset)
    want = fp8_ref.moe_experts_fp8(x, ids, w, *ws, expert_offset=offset)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    exact = torch_ref.moe_experts(x, ids, w, *(q.dequant() for q in ws), expert_offset=offset)
    assert float((got - exact).norm() / exact.norm()) < 0.1


@pytest.mark.parametrize("hidden", [64, 300, 384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norms_quantise_their_output_as_quantize_tokens_does(hidden, dtype):
    """rms_norm / add_rms_norm with quant: the same outputs as without, and the quantisation of the
    stored output equal to quantize_tokens' to the bit (a zero row, a ragged last group, a width
    below one group)."""
    from glmc.codegen import triton_launch as tt
    g = torch.Generator().manual_seed(hidden)
    x, r = ((torch.randn(5, hidden, generator=g) * 3).to(dtype) for _ in range(2))
    w = torch.randn(hidden, generator=g).to(dtype)
    x[1] = 0
    out, (q, s) = tt.rms_norm(x, w, 1e-6, quant=True)
    assert torch.equal(out, tt.rms_norm(x, w, 1e-6))
    want_q, want_s = tf.quantize_tokens(out)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    normed, res, (q, s) = tt.add_rms_norm(x, r, w, 1e-6, quant=True)
    assert all(torch.equal(a, b) for a, b in zip((normed, res), tt.add_rms_norm(x, r, w, 1e-6)))
    want_q, want_s = tf.quantize_tokens(normed)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    normed, res, (q, s) = tt.add_rms_norm(x, r, w, 1e-6, quant=True, addend=r)    # a folded add: x + r first
    assert all(torch.equal(a, b) for a, b in zip((normed, res), tt.add_rms_norm(x, r, w, 1e-6, addend=r)))
    want_q, want_s = tf.quantize_tokens(normed)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
