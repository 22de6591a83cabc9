"""torch_ref ops against the HF modules they mirror (GlmMoeDsa*, DeepseekV32*), and against each other."""
import pytest
import torch
import torch.nn.functional as F
from glmc.codegen import fp8_ref
from glmc.codegen import torch_ref as ref
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.kv_cache import PAGE_SIZE, KVPool
from tiny_hf import YARN, glm_config, make_config, randomize_
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_ds
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

G = torch.Generator().manual_seed(1234)


def randn(*shape):
    return torch.randn(*shape, generator=G)


def shuffled_table(num_reqs, num_pages, pages_per_req):
    """req_to_token whose rows live on scattered pages, so slot != position anywhere."""
    pages = torch.randperm(num_pages, generator=G)[: num_reqs * pages_per_req].view(num_reqs, pages_per_req)
    return (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(num_reqs, -1)


def test_norms_match_hf():
    x, w = randn(5, 32), randn(32)
    norm = hf.GlmMoeDsaRMSNorm(32, eps=1e-5)
    norm.weight.data.copy_(w)
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-5), norm(x), rtol=0, atol=1e-6)
    r = randn(5, 32)
    normed, new_r = ref.add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(new_r, x + r, rtol=0, atol=0)
    torch.testing.assert_close(normed, norm(x + r), rtol=0, atol=1e-6)
    ln = torch.nn.LayerNorm(32, eps=1e-6)
    ln.weight.data.copy_(w), ln.bias.data.copy_(randn(32))
    torch.testing.assert_close(ref.layer_norm(x, ln.weight, ln.bias, 1e-6), ln(x), rtol=0, atol=1e-6)


def test_rope_matches_hf_both_layouts():
    cfg = make_config(qk_rope_head_dim=16)
    pos = torch.tensor([0, 3, 17, 200])
    q, k = randn(4, 3, 16), randn(4, 1, 16)  # [T, H, d]
    cos, sin = hf.GlmMoeDsaRotaryEmbedding(cfg)(q, pos[None])
    hq, hk = hf.apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ref.rope(q, pos, 10000.0), hq[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(ref.rope(k, pos, 10000.0), hk[0].transpose(0, 1), rtol=0, atol=1e-6)
    lq, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ref.rope(q, pos, 10000.0, interleaved=False), lq[0].transpose(0, 1), rtol=0, atol=1e-6)
    # Relative position only: shifting both positions leaves q.k unchanged.
    a = (ref.rope(q[:1], pos[:1] + 5, 10.0) * ref.rope(k[:1], pos[:1] + 2, 10.0)).sum()
    b = (ref.rope(q[:1], pos[:1] + 13, 10.0) * ref.rope(k[:1], pos[:1] + 10, 10.0)).sum()
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("yarn", [YARN, {**YARN, "mscale": None, "truncate": False, "beta_fast": 8, "beta_slow": 2},
                                  {**YARN, "attention_factor": 1.25, "factor": 2.0}])
def test_yarn_rope_matches_hf(yarn):
    """Yarn frequencies (bit for bit) and cos/sin attention factor, both pair layouts, as DeepSeek-V3.2."""
    cfg = make_config("dsv32", qk_rope_head_dim=16, rope_parameters=yarn)
    scaling = glm_config(cfg).rope_scaling_attr
    rotary = hf_ds.DeepseekV32RotaryEmbedding(cfg)
    assert torch.equal(ref.rope_inv_freq(10000.0, 16, scaling), rotary.inv_freq)
    assert ref.rope_attention_factor(scaling) == rotary.attention_scaling
    pos = torch.tensor([0, 3, 17, 200, 511])
    q, k = randn(5, 3, 16), randn(5, 1, 16)
    cos, sin = rotary(q, pos[None])
    hq, hk = hf_ds.apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ref.rope(q, pos, 10000.0, True, scaling), hq[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(ref.rope(k, pos, 10000.0, True, scaling), hk[0].transpose(0, 1), rtol=0, atol=1e-6)
    half, _ = hf_ds.apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)  # the indexer's form
    torch.testing.assert_close(ref.rope(q, pos, 10000.0, False, scaling), half[0], rtol=0, atol=1e-6)
    assert not torch.allclose(ref.rope(q, pos, 10000.0, True, scaling), ref.rope(q, pos, 10000.0), atol=1e-3)


def test_moe_route_matches_hf_router_grouped():
    cfg = make_config(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2)
    router = randomize_(hf.GlmMoeDsaTopkRouter(cfg), seed=3)
    x = randn(40, cfg.hidden_size)
    _, hw, hids = router(x)
    w, ids = ref.moe_route(x, router.weight, router.e_score_correction_bias, 3, 4, 2, True, cfg.routed_scaling_factor)
    hs, ms = hids.sort(-1), ids.sort(-1)
    assert torch.equal(hs.values, ms.values)
    torch.testing.assert_close(w.gather(1, ms.indices), hw.gather(1, hs.indices), rtol=0, atol=1e-6)
    groups = ids // 4  # every token's experts come from at most topk_group groups
    assert all(len(set(row.tolist())) <= 2 for row in groups)
    torch.testing.assert_close(w.sum(-1), torch.full((40,), cfg.routed_scaling_factor))


def test_moe_experts_match_hf_and_split_over_ranks():
    cfg = make_config()
    experts = randomize_(hf.GlmMoeDsaExperts(cfg), seed=4)
    E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    x = randn(12, cfg.hidden_size)
    ids = torch.stack([torch.randperm(E, generator=G)[:2] for _ in range(12)])
    w = torch.rand(12, 2, generator=G)
    gate, up, down = experts.gate_up_proj[:, :inter], experts.gate_up_proj[:, inter:], experts.down_proj
    full = ref.moe_experts(x, ids, w, gate, up, down)
    torch.testing.assert_close(full, experts(x, ids, w), rtol=0, atol=1e-5)
    ep = sum(ref.moe_experts(x, ids, w, gate[r * 4 : r * 4 + 4], up[r * 4 : r * 4 + 4], down[r * 4 : r * 4 + 4],
                             expert_offset=r * 4) for r in range(2))
    torch.testing.assert_close(ep, full, rtol=0, atol=1e-5)
    h = inter // 2  # moe_tp: shard the intermediate dim, each rank returns a partial sum
    tp = sum(ref.moe_experts(x, ids, w, gate[:, s], up[:, s], down[:, :, s]) for s in (slice(0, h), slice(h, None)))
    torch.testing.assert_close(tp, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model", ["glm", "dsv32"])
def test_indexer_topk_matches_hf_indexer(model):
    """GLM's indexer (interleaved RoPE) and DeepSeek-V3.2's (halves, yarn angles); 16 heads: no ties."""
    cfg = make_config(index_topk=6) if model == "glm" else make_config("dsv32", index_topk=6)
    c, module = glm_config(cfg), (hf.GlmMoeDsaIndexer if model == "glm" else hf_ds.DeepseekV32Indexer)
    rotary = (hf.GlmMoeDsaRotaryEmbedding if model == "glm" else hf_ds.DeepseekV32RotaryEmbedding)(cfg)
    indexer = randomize_(module(cfg, 0), seed=5)
    L, dr, heads = 20, cfg.qk_rope_head_dim, cfg.index_n_heads
    x, q_lat, pos = randn(1, L, cfg.hidden_size), randn(1, L, cfg.q_lora_rank), torch.arange(L)
    mask = torch.full((L, L), float("-inf")).triu(1)[None]
    want = indexer(x, q_lat, rotary(x, pos[None]), mask, pos[None])[0]
    # Same math through the pool: keys written at scattered slots, then ranked.
    table = shuffled_table(1, 4, 1)
    batch = ForwardBatch.build("extend", [list(range(L))], [0], [0], table)
    pool = KVPool(1, {0}, 4, 8, dr, cfg.index_head_dim)

    def rot(t):
        roped = ref.rope(t[..., :dr], pos, c.rope_theta, c.indexer_rope_interleave, c.rope_scaling_attr)
        return torch.cat([roped, t[..., dr:]], -1)
    k = ref.layer_norm(x[0] @ indexer.wk.weight.T, indexer.k_norm.weight, indexer.k_norm.bias, 1e-6)
    ref.index_k_write(pool, 0, batch.out_cache_loc, rot(k))
    q = rot((q_lat[0] @ indexer.wq_b.weight.T).view(L, heads, -1))
    got = ref.indexer_topk(q, (x[0] @ indexer.weights_proj.weight.T) * heads**-0.5, pool, 0, batch, 6)
    for t in range(L):
        hf_row = {int(i) for i in want[t] if i <= t}
        assert {int(i) for i in got[t] if i >= 0} == hf_row, t
        assert int((got[t] >= 0).sum()) == min(6, t + 1)


def _random_pool_batch(H=3, dn=8, dv=6, R=16, dr=4):
    """Two requests (one with a cached prefix) over a pool of random latent KV."""
    table = shuffled_table(2, 6, 2)
    pool = KVPool(1, {0}, 6, R, dr, 8)
    pool.kv[0].copy_(randn(*pool.kv[0].shape))
    batch = ForwardBatch.build("extend", [list(range(9)), list(range(5))], [1, 0], [0, 30], table)
    T = batch.num_tokens
    return pool, batch, randn(T, H, dn), randn(T, H, dr), randn(H * (dn + dv), R)


def test_absorbed_equals_mha_dense_and_sparse():
    pool, batch, q_nope, q_pe, w_kv_b = _random_pool_batch()
    topk = torch.full((batch.num_tokens, 5), -1)
    for t in range(batch.num_tokens):  # random visible subsets, some rows shorter than 5
        p = int(batch.positions[t])
        pick = torch.randperm(p + 1, generator=G)[:5]
        topk[t, : pick.numel()] = pick
    for tk in (None, topk):
        mha = ref.mla_attention_mha(q_nope, q_pe, pool, 0, w_kv_b, tk, batch, 0.3, 8, 6)
        absorbed = ref.mla_attention_absorbed(q_nope, q_pe, pool, 0, w_kv_b, tk, batch, 0.3, 8, 6)
        torch.testing.assert_close(absorbed, mha, rtol=0, atol=1e-5)


def test_mha_is_causal_softmax_attention_over_topk():
    pool, batch, q_nope, q_pe, w_kv_b = _random_pool_batch()
    t = 12  # request 1, position 33: its keys are row 0's slots 0..33
    topk = torch.full((batch.num_tokens, 4), -1)
    topk[t] = torch.tensor([0, 7, 33, 20])
    out = ref.mla_attention_mha(q_nope, q_pe, pool, 0, w_kv_b, topk, batch, 0.3, 8, 6)[t].view(3, 6)
    slots = batch.req_to_token[0, topk[t]]
    kv = (pool.kv[0][slots, :16] @ w_kv_b.T).view(4, 3, 14)
    k = torch.cat([kv[..., :8], pool.kv[0][slots, 16:][:, None].expand(4, 3, 4)], -1)
    q = torch.cat([q_nope[t], q_pe[t]], -1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * 0.3, -1)
    torch.testing.assert_close(out, torch.einsum("hl,lhd->hd", p, kv[..., 8:]), rtol=0, atol=1e-5)


def test_fp8_block_dequant_uses_per_block_scales():
    w = torch.randint(-8, 8, (200, 300)).float().to(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out = fp8_ref.fp8_block_dequant(w, s)
    assert out.dtype == torch.float32 and out.shape == (200, 300)
    torch.testing.assert_close(out[127, 255], w[127, 255].float() * 2.0)
    torch.testing.assert_close(out[128, 256], w[128, 256].float() * 6.0)
    torch.testing.assert_close(out[199, 0:128], w[199, 0:128].float() * 4.0)
    assert F.mse_loss(out[:128, :128], w[:128, :128].float()) == 0
