"""FP8 kernels (codegen/triton_fp8.py) against fp8_ref, under TRITON_INTERPRET=1 (conftest)."""
import pytest
import torch
from filecheck import check
from glmc.codegen import fp8_ref
from glmc.codegen import triton_fp8 as tf
from glmc.codegen.triton_render import render


def test_quantize_tokens_is_bit_exact():
    """Per token, per 128 columns: the same scales and the same e4m3 bytes as the reference, with a
    ragged last group, an all-zero group and values at binade edges (where a cast that truncates, as
    the interpreter's does, would differ)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 300, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    x[2, 128:256] = 0.0
    x[3, :4] = torch.tensor([448.0, 125.96, -31.63, 0.0151])   # s = 1: 125.96 -> 128, -31.63 -> -32
    q, s = tf.quantize_tokens(x)
    want_q, want_s = fp8_ref.quantize_token_groups(x)
    assert torch.equal(s, want_s) and s[2, 1] == 1.0
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    back = q.float().view(7, -1) * s.repeat_interleave(128, 1)[:, :300]
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + s.repeat_interleave(128, 1)[:, :300] * 2 ** -9).all()


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
    with pytest.raises(ValueError, match="block_n must divide 128"):
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
    check(render(ctx.template, ctx), "tl.arange(0, 16)", "range(0, 16)", "k < 2048", "tl.dot(a, tl.trans(b))",
          "(n0 // 128)")
    assert [c.block_m for c in tf.Fp8BlockGemmCtx.variants(6144, 2048)] == [16, 64]
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
