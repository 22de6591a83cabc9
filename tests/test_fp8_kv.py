"""FP8 KV cache on the CUDA target, on the CPU (Triton interpreted).

- Layouts (`codegen.fp8_ref`, `KVPool` format "fp8"): the latent cache is FlashMLA's 656-byte row
  (512 e4m3 + 4 fp32 scales + 64 bf16 k_pe), the indexer key cache 132 bytes per token in 64-slot
  pages (the page's e4m3 keys, then its fp32 scales).
- Kernels against the torch reference on the same pool: the KV write quantises in registers as
  `fp8_ref.quantize_token_groups` does (bit-exact up to e4m3 rounding flips where the kernel's and
  torch's norms differ in the last fp32 bit: at most one e4m3 step); the indexer scores and the
  sparse MLA kernel dequantise in registers and match the torch reference reading the same bytes.
- Plan level: the CUDA target with FP8 KV against the torch target whose pool rounds the same
  values through FP8 (`KVPool` format "fp8-emulated"): the same greedy tokens, logits within 1e-4
  relative (measured <= 1.8e-5: both compute in fp32 from the same cache values, except where the
  kernel's and torch's fp32 norms / RoPE differ in a last bit that moves a value across an e4m3 or
  bf16 rounding tie). Against the plain fp32 KV the same model's logits move by 4-6% in the first
  steps (FP8's 3 mantissa bits on a random model), which is why the oracle must emulate.
- The plan, plan.json, `glmc explain` and the pool the loader allocates agree on the KV bytes.
"""
import json

import pytest
import torch
from glmc.codegen import fp8_ref
from glmc.codegen import torch_ref as ref
from glmc.codegen import triton_launch as tt
from glmc.codegen.kernel_set import plan_kernels
from glmc.runtime.worker.kv_cache import PAGE_SIZE, KVPool
from test_fp8_plan import assert_greedy_agrees, cuda_plan, runner
from test_triton_kernels import (
    DI,
    DR,
    R,
    _indexer_inputs,
    _same_selection,
    make_batch,
    sparse_mla_case,
)
from tiny_hf import save_tiny

from glmc.explain import explain
from glmc.spec import kv_dtyped, load_spec


def fp8_pool(layers=2):
    return KVPool(layers, {0}, num_pages=2, kv_lora_rank=R, qk_rope_head_dim=DR, index_head_dim=DI,
                  kv_format="fp8")


def fill(pool):
    """Random rows through the pool's own writers (so the FP8 pool holds quantised values)."""
    loc = torch.arange(pool.num_slots)
    for layer in range(pool.num_layers):
        pool.write_kv(layer, loc, torch.randn(pool.num_slots, R), torch.randn(pool.num_slots, DR))
    for layer in pool.full_layers:
        pool.write_index_k(layer, loc, torch.randn(pool.num_slots, DI))
    return pool


def test_glm5_layouts_and_bytes():
    fp8 = KVPool(2, {0}, num_pages=1, kv_format="fp8")
    assert fp8.kv[0].shape == (PAGE_SIZE, 656) and fp8.index_k[0].shape == (1, PAGE_SIZE * 132)
    assert fp8.bytes_per_token_per_layer() == (656, 132)
    assert KVPool(2, {0}, 1, dtype=torch.bfloat16).bytes_per_token_per_layer() == (1152, 256)
    c_kv, k_pe = torch.randn(3, 512), torch.randn(3, 64)
    rows = fp8_ref.kv_fp8_pack(c_kv, k_pe)
    q, s, pe = fp8_ref.kv_fp8_views(rows, 512)
    assert torch.equal(q.view(torch.uint8), rows[:, :512]) and s.shape == (3, 4) and pe.shape == (3, 64)
    back, back_pe = fp8_ref.kv_fp8_unpack(rows, 512)
    assert torch.equal(back_pe, k_pe.bfloat16().float())
    assert float((back - c_kv).abs().max()) <= float(c_kv.abs().max()) / 16   # e4m3: 3 mantissa bits
    # index page: slot 5 of page 0 -> its key bytes at 5 * 128, its scale after the 64 x 128 keys
    fp8.write_index_k(0, torch.tensor([5]), torch.full((1, 128), 2.0))
    page = fp8.index_k[0][0]
    assert page[5 * 128:6 * 128].view(torch.float8_e4m3fn).float().eq(448.0).all()
    assert page[64 * 128 + 5 * 4:64 * 128 + 6 * 4].view(torch.float32).item() == torch.tensor(2.0 / 448).item()


def _one_step_apart(got, want, scale):
    """Dequantised values equal (up to the scale's last fp32 bits: the kernel's cos/sin and norm are
    not torch's bit for bit), or one e4m3 step apart where that moved a value across a rounding tie."""
    step = torch.maximum(want.abs() / 8, scale * 2.0 ** -9) * 1.01
    diff = (got - want).abs()
    assert bool((diff <= step).all())
    assert float((diff <= want.abs() * 1e-5 + 1e-7).float().mean()) > 0.95


@pytest.mark.parametrize("layer", [0, 1])
def test_qkv_write_quantises_in_registers(layer):
    pool, want, T = fp8_pool(), fp8_pool(), 5
    q_a, kv_a, ik = torch.randn(T, 40), torch.randn(T, R + DR), torch.randn(T, DI)
    qw, kvw, kw, kb = torch.randn(40), torch.randn(R), torch.randn(DI), torch.randn(DI)
    pos, loc = torch.tensor([3, 4, 0, 9, 10]), torch.tensor([70, 5, 64, 127, 1])
    full = layer in pool.full_layers
    tt.qkv_norm_rope_write(q_a, kv_a, pos, loc, pool.kv[layer], qw, kvw, 1e-6, 8e6,
                           index_k=ik if full else None, index_cache=pool.index_k.get(layer), k_norm_w=kw,
                           k_norm_b=kb, index_interleaved=False)
    ref.kv_write(want, layer, loc, ref.rms_norm(kv_a[:, :R], kvw, 1e-6), ref.rope(kv_a[:, R:], pos, 8e6))
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[loc] = False
    assert not pool.kv[layer][untouched].any()
    _, got_s, got_pe = fp8_ref.kv_fp8_views(pool.kv[layer][loc], R)
    _, want_s, want_pe = fp8_ref.kv_fp8_views(want.kv[layer][loc], R)
    torch.testing.assert_close(got_s, want_s, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_pe.float(), want_pe.float(), rtol=8e-3, atol=1e-6)   # one bf16 step
    _one_step_apart(pool.c_kv(layer, loc), want.c_kv(layer, loc), want_s.max())
    if full:
        k = ref.layer_norm(ik, kw, kb, 1e-6)
        ref.index_k_write(want, layer, loc, torch.cat([ref.rope(k[:, :DR], pos, 8e6, False), k[:, DR:]], -1))
        _one_step_apart(pool.index_keys(layer, loc), want.index_keys(layer, loc),
                        want.index_keys(layer, loc).abs().max() / 448)


@pytest.mark.parametrize("mode,prefix,extend,topk", [("extend", [0, 21, 2], [19, 3, 1], 8),
                                                     ("decode", [4, 40, 16], [1, 1, 1], 16)])
def test_indexer_scores_dequantise_in_registers(mode, prefix, extend, topk):
    pool = fill(fp8_pool())
    batch = make_batch(mode, prefix, extend, pool.num_slots)
    q, w = _indexer_inputs(batch)
    rows, pos = tt.token_rows(batch, q.device)
    got = tt.indexer_topk(q, w, pool.index_k[0], batch.req_to_token, rows, pos, topk, int(batch.seq_lens.max()),
                          block_n=16, chunk=16)
    _same_selection(got, ref.indexer_topk(q, w, pool, 0, batch, topk), batch)


@pytest.mark.parametrize("dequant", [False, True])
@pytest.mark.parametrize("key_major", [False, True])
@pytest.mark.parametrize("mode,prefix,extend,use_topk,splits", [("decode", [4, 40, 16], [1, 1, 1], True, 3),
                                                                ("extend", [0, 9], [12, 3], False, 2)])
def test_sparse_mla_dequantises_in_registers(mode, prefix, extend, use_topk, splits, key_major, dequant):
    """Per scale group (the scales multiply the dots' results) or per tile (`dequant`: the gathered
    tile scaled once, in the dot dtype: fp32 here, so exact to the reference's order of sums)."""
    got, want = sparse_mla_case(fill(fp8_pool()), mode, prefix, extend, use_topk, splits, key_major,
                                dequant=dequant)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dequant,key_major,v_parts,splits", [(False, False, 1, 3), (True, False, 1, 3),
                                                             (True, True, 1, 3), (True, False, 2, 3),
                                                             (True, False, 2, 1), (True, True, 1, 1)])
def test_sparse_mla_over_scale_groups_and_short_contexts(dequant, key_major, v_parts, splits):
    """Latent 256 = two FP8 scale groups, top-k 24 of contexts 5-40 (so most tokens select fewer
    than k keys: each splits only its own). Against fp32 softmax attention over the dequantised rows.
    One split: each program writes its rows of the output itself (no partials, no combine)."""
    torch.manual_seed(0)
    T, H, R2, DR2, K, n = 6, 4, 256, 16, 24, 200
    rows = fp8_ref.kv_fp8_pack(torch.randn(n, R2), torch.randn(n, DR2))
    c_kv, k_pe = fp8_ref.kv_fp8_unpack(rows, R2)
    pos = torch.tensor([4, 23, 24, 25, 39, 9])
    slots = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        m = min(int(pos[t]) + 1, K)
        slots[t, :m] = torch.randperm(n)[:m].to(torch.int32)
    q_lat, q_pe = torch.randn(T, H, R2), torch.randn(T, H, DR2)
    r2t = torch.zeros(T, 1, dtype=torch.int64)
    got = tt.sparse_mla_latent(q_lat, q_pe, rows, r2t, torch.arange(T), pos, slots.long(), 0.1, slots=slots,
                               num_splits=splits, block_n=4, block_h=4, key_major=key_major, dequant=dequant,
                               v_parts=v_parts)
    for t in range(T):
        sel = slots[t][slots[t] >= 0].long()
        p = torch.softmax(0.1 * (q_lat[t] @ c_kv[sel].T + q_pe[t] @ k_pe[sel].T), -1)
        torch.testing.assert_close(got[t], p @ c_kv[sel], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- plans
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv")
    save_tiny(path, "grouped", seed=3)
    return path


def test_plan_explain_and_pool_agree(ckpt, tmp_path):
    """The fp32 tiny checkpoint's plan keeps fp32 caches; `kv_dtyped(spec, "fp8")` (--kv-dtype fp8)
    makes both FP8: the plan's memory, plan.json, explain and the allocated pool say the same bytes,
    and only the FP8 plan carries the FP8-cache kernel variants."""
    spec = load_spec(ckpt)
    plain, fp8 = cuda_plan(spec), cuda_plan(kv_dtyped(spec, "fp8"))
    assert (plain.dtypes.kv_cache, fp8.dtypes.kv_cache, fp8.dtypes.index_cache) == ("fp32", "fp8", "fp8")
    for plan, kv_row, index_row in ((plain, 4 * (R + DR), 4 * DI), (fp8, R + 4 + 2 * DR, DI + 4)):
        pool = runner(plan, ckpt).pool
        assert pool.bytes_per_token_per_layer() == (kv_row, index_row)
        mem = plan.graphs["decode"].meta["memory"]
        assert mem["kv_bytes_per_token"] == kv_row * mem["kv_layers"]
        assert mem["index_bytes_per_token"] == index_row * mem["index_layers"]
        assert pool.bytes_per_token() == mem["kv_bytes_per_token"] + mem["index_bytes_per_token"]   # no MTP layer here
        plan.save(tmp_path / plan.dtypes.kv_cache)
        saved = json.loads((tmp_path / plan.dtypes.kv_cache / "plan.json").read_text())
        assert saved["dtypes"]["kv_cache"] == plan.dtypes.kv_cache
        shown = explain(tmp_path / plan.dtypes.kv_cache)["memory"]
        assert shown["kv_bytes_per_token_per_layer"] == kv_row and shown["index_bytes_per_token_per_layer"] == index_row
    variants = {(c.template, getattr(c, "kv_fp8", getattr(c, "fp8", None))) for c in plan_kernels(fp8).values()}
    assert {("qkv_norm_rope_write", True), ("indexer_scores", True), ("sparse_mla_decode", True)} <= variants
    assert not any(getattr(c, "kv_fp8", False) or getattr(c, "fp8", False) for c in plan_kernels(plain).values())
    assert runner(fp8, ckpt, target="cpu").pool.kv_format == "native"


def test_cuda_target_fp8_kv_matches_the_emulating_torch_target(ckpt, one_torch_thread):
    """Prompts past index_topk (sparse attention active): greedy tokens equal for 4 steps."""
    plan = cuda_plan(kv_dtyped(load_spec(ckpt), "fp8"))
    gpu = runner(plan, ckpt)
    oracle = runner(plan, ckpt, target="cpu", kv_fp8="emulate")
    assert gpu.pool.fp8 and oracle.pool.kv_format == "fp8-emulated"
    assert_greedy_agrees(gpu, oracle, steps=4)


def test_compile_and_run_take_kv_dtype(ckpt, tmp_path):
    """`glmc compile --kv-dtype fp8` writes an FP8-KV plan (the fp32 checkpoint's default is fp32);
    serving a plan dir asks for the same (`plan_for`, what `glmc run` calls)."""
    from glmc.api import plan_for
    from glmc.cli import main as glmc
    assert glmc(["compile", "--model", str(ckpt), "--kv-dtype", "fp8", "-o", str(tmp_path / "p")]) == 0
    dtypes = json.loads((tmp_path / "p" / "plan.json").read_text())["dtypes"]
    assert (dtypes["kv_cache"], dtypes["index_cache"]) == ("fp8", "fp8")
    assert plan_for(ckpt, tmp_path / "p", device="cuda", kv_dtype="fp8").dtypes.kv_cache == "fp8"
    with pytest.raises(ValueError, match="compiled with a fp8 KV cache, not bf16; compile with `glmc compile "
                                         "--kv-dtype bf16`"):
        plan_for(ckpt, tmp_path / "p", device="cuda", kv_dtype="bf16")


def test_prefill_attention_reads_fp8_rows():
    """codegen/triton_prefill.py (the MHA-form prefill kernel) expands keys from dequantised FP8 rows."""
    from test_triton_prefill import DN, DV, H, make_inputs, triton_mha
    from test_triton_prefill import make_batch as prefill_batch
    batch = prefill_batch([0, 21, 5], [19, 3, 9], 128)
    _, q_nope, q_pe, w = make_inputs(batch)
    pool = KVPool(1, {0}, num_pages=2, kv_lora_rank=R, qk_rope_head_dim=q_pe.shape[-1], index_head_dim=DI,
                  kv_format="fp8")
    pool.randomize_()
    args = (q_nope, q_pe, pool, 0, w, None, batch, 0.25, DN, DV)
    got = triton_mha(*args, block_m=8, block_n=16)
    assert got.shape == (batch.num_tokens, H * DV)
    torch.testing.assert_close(got, ref.mla_attention_mha(*args), rtol=1e-4, atol=1e-4)


def test_fp8_source_is_specialised_for_glm53():
    from filecheck import check
    qkv = tt.QkvNormRopeWriteCtx.make(2048, 512, 64, 1e-5, True, 128, kv_fp8=True, index_fp8=True)
    check(tt.render("qkv_norm_rope_write", qkv), "def _e4m3_round", "def _bf16_round", "tl.static_range(4)",
          "og < 512", "kv_scale_ptr + loc * kv_scale_stride + g", "(loc // 64) * ik_cache_stride",
          "(loc % 64) * 128", "ik_scale_ptr + (loc // 64)")
    plain = tt.QkvNormRopeWriteCtx.make(2048, 512, 64, 1e-5, True, 128)
    check(tt.render("qkv_norm_rope_write", plain), "dst + 512 + j", absent=("_e4m3_round", "kv_scale_ptr"))
    parts = tt.SparseMlaDecodeCtx.make(64, 512, 64, 2048, 1 / 16, torch.bfloat16, 4, kv_fp8=True)
    assert parts.v_parts == 2    # default at 4 tokens: 64 x 64 tiles, the latent output in two 256-wide parts
    check(tt.render("sparse_mla_decode", parts), "vp = tl.program_id(0) % 2", "rq = tl.arange(0, 2)",
          "kv_scale_ptr + slot[:, None] * kv_scale_stride + c0 // 128 + rq[None, :]",
          "tl.reshape(ck * sc.to(tl.bfloat16)[:, :, None], [64, 256])")
    mla = tt.SparseMlaDecodeCtx.make(64, 512, 64, 2048, 1 / 16, torch.bfloat16, 1, kv_fp8=True)
    assert mla.v_parts == 1      # default at one token: 16 x 32 tiles, fp16 dot operands, one part
    check(tt.render("sparse_mla_decode", mla), "kv_scale_ptr, kv_scale_stride, kv_pe_ptr",
          "rq = tl.arange(0, 4)", "kv_scale_ptr + slot[:, None] * kv_scale_stride + c0 // 128 + rq[None, :]",
          "tl.reshape(ck * sc.to(tl.float16)[:, :, None], [32, 512])", "kv_pe_ptr + slot[:, None] * kv_pe_stride",
          absent=("+ 512 + dr", "sc3", "ckv1", "tl.float32) * sc"))
    grouped = tt.SparseMlaDecodeCtx.make(64, 512, 64, 2048, 1 / 16, torch.bfloat16, 1, kv_fp8=True, dequant=False)
    check(tt.render("sparse_mla_decode", grouped), "sc3 = tl.load(kv_scale_ptr + slot * kv_scale_stride + 3",
          "* sc3[None, :]", "(p * sc3[None, :])", absent=("sc4", "tl.reshape"))
    check(tt.render("indexer_scores", tt.IndexerScoresCtx.make(32, 128, torch.bfloat16, fp8=True)),
          "slot // 64", "(slot % 64) * 128", "k = k * ks[:, None]")
