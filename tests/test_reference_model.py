"""ReferenceModel over the paged pool vs HF GlmMoeDsaForCausalLM (fp32 logits, DSA active)."""
import pytest
import torch
from glmc.runtime.worker.checkpoint import (
    expected_tensors,
    load_checkpoint,
)
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.kv_cache import PAGE_SIZE, KVPool
from glmc.runtime.worker.reference_model import (
    HF_INDEXER_NORM_EPS,
    HF_LATENT_NORM_EPS,
    ReferenceModel,
)
from tiny_hf import (
    checkpoint_names,
    glm_config,
    make_config,
    randomize_,
    save_tiny,
    shrink_latents_,
)
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

from tests.compile_util import spec

ATOL = 1e-4
# "fsfs": FSSF pattern string, 2 groups / top-1 group routing with norm_topk_prob off, and latents
# shrunk to the scale of the q_a/kv_a RMSNorm eps (HF: 1e-6, not rms_norm_eps) so that eps matters.
EXTRA = {"fsfs": dict(tweak=shrink_latents_, num_hidden_layers=4, indexer_types=None, index_topk_pattern="FSSF",
                      first_k_dense_replace=2, n_group=2, topk_group=1, norm_topk_prob=False,
                      routed_scaling_factor=1.0, index_topk=12)}


@pytest.fixture(scope="module", params=["grouped", "wide", "fsfs"])
def tiny(request, tmp_path_factory):
    """(HF oracle, weights loaded from its saved checkpoint) for each named config."""
    path = tmp_path_factory.mktemp(request.param)
    base = "grouped" if request.param == "fsfs" else request.param
    model = save_tiny(path, base, seed=7, **EXTRA.get(request.param, {}))
    return model, load_checkpoint(path, expected_tensors(glm_config(model.config)))


def table(num_rows, pages_per_row=2, seed=0):
    """req_to_token with every row on shuffled pages (plays the scheduler's page allocator)."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_rows * pages_per_row + 3, generator=g)[: num_rows * pages_per_row]
    pages = pages.view(num_rows, pages_per_row)
    return (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(num_rows, -1)


def reference(model, weights, num_rows, extra_layers=0, config=None):
    """A ReferenceModel (of the HF `config`, default the model's) over a fresh pool big enough for
    `num_rows` rows of table()."""
    c = glm_config(config or model.config)
    full = c.full_indexer_layers() | ({c.num_hidden_layers} if extra_layers else set())
    pool = KVPool(c.num_hidden_layers + extra_layers, full, num_rows * 2 + 3, c.kv_lora_rank,
                  c.qk_rope_head_dim, c.index_head_dim)
    return ReferenceModel(c, weights, pool), table(num_rows)


def prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_logits(model, ids):
    return model(torch.tensor([ids])).logits[0]


def test_batched_prefill_matches_hf(tiny):
    model, weights = tiny
    ps = prompts(model.config.vocab_size, [23, 40, 31])
    ref, r2t = reference(model, weights, 3)
    batch = ForwardBatch.build("extend", ps, [2, 0, 1], [0, 0, 0], r2t)
    all_logits = ref.forward(batch, return_all_logits=True)
    want = [hf_logits(model, p) for p in ps]
    assert (all_logits - torch.cat(want)).abs().max() < ATOL
    last = ref.forward(ForwardBatch.build("extend", ps, [2, 0, 1], [0, 0, 0], r2t))
    assert last.shape == (3, model.config.vocab_size)
    assert (last - torch.stack([w[-1] for w in want])).abs().max() < ATOL
    # Sparse attention is active: the same weights with a huge index_topk give other logits.
    cfg = make_config(**{**model.config.to_dict(), "index_topk": 4096})
    dense, r2t = reference(model, weights, 3, config=cfg)
    assert (dense.forward(batch, return_all_logits=True) - all_logits).abs().max() > 1e-2


def test_greedy_decode_matches_hf_generate(tiny):
    model, weights = tiny
    ps = prompts(model.config.vocab_size, [21, 29], seed=1)
    want = [model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p):].tolist() for p in ps]
    ref, r2t = reference(model, weights, 2)
    logits = ref.forward(ForwardBatch.build("extend", ps, [0, 1], [0, 0], r2t))
    got, lens = [[t] for t in logits.argmax(-1).tolist()], [len(p) for p in ps]
    for _ in range(31):  # both requests decode together, at different lengths
        batch = ForwardBatch.build("decode", [[g[-1]] for g in got], [0, 1], lens, r2t)
        for g, t in zip(got, ref.forward(batch).argmax(-1).tolist()):
            g.append(t)
        lens = [n + 1 for n in lens]
    assert got == want
    assert any(n > 2 * model.config.index_topk for n in lens)


def test_chunked_prefill_prefix_hit_and_mixed_batch(tiny):
    model, weights = tiny
    a, b = prompts(model.config.vocab_size, [40, 14], seed=2)
    b = a[:22] + b  # shares a 22-token prefix with a
    ref, r2t = reference(model, weights, 4)
    one_shot = ref.forward(ForwardBatch.build("extend", [a, b], [0, 1], [0, 0], r2t), return_all_logits=True)
    one_a, one_b = one_shot[:40], one_shot[40:]
    chunks = []  # row 2 = a in chunks of 15, 15, 10; the last chunk rides with a decode of row 3
    for start, end in ((0, 15), (15, 30)):
        step = ForwardBatch.build("extend", [a[start:end]], [2], [start], r2t)
        chunks.append(ref.forward(step, return_all_logits=True))
    ref.forward(ForwardBatch.build("extend", [b[:-1]], [3], [0], r2t))
    mixed = ref.forward(ForwardBatch.build("extend", [a[30:], b[-1:]], [2, 3], [30, len(b) - 1], r2t),
                        return_all_logits=True)
    assert (torch.cat(chunks + [mixed[:10]]) - one_a).abs().max() < ATOL
    assert (mixed[10] - one_b[-1]).abs().max() < ATOL
    # Prefix hit: row 3 reads row 2's KV for the shared 22 positions, then extends the rest.
    r2t[3, :22] = r2t[2, :22]
    hit = ref.forward(ForwardBatch.build("extend", [b[22:]], [3], [22], r2t), return_all_logits=True)
    assert (hit - one_b[22:]).abs().max() < ATOL
    assert (hit - hf_logits(model, b)[22:]).abs().max() < ATOL


def test_exact_index_ties_break_alike_in_chunks_decode_and_one_prefill(tmp_path):
    """One indexer head: half the index scores are exact-zero ties. Ties go to the lowest position
    whatever the row length, so chunked prefill, decode and one prefill keep the same keys."""
    model = save_tiny(tmp_path, "grouped", seed=3, index_n_heads=1)
    c = glm_config(model.config)
    weights = load_checkpoint(tmp_path, expected_tensors(c))
    (p,) = prompts(c.vocab_size, [40], seed=6)
    ref, r2t = reference(model, weights, 2)
    one = ref.forward(ForwardBatch.build("extend", [p], [0], [0], r2t), return_all_logits=True)
    pieces = [ref.forward(ForwardBatch.build("extend", [p[lo:hi]], [1], [lo], r2t), return_all_logits=True)
              for lo, hi in ((0, 13), (13, 29))]
    pieces += [ref.forward(ForwardBatch.build("decode", [[t]], [1], [n], r2t)) for n, t in enumerate(p[29:], 29)]
    assert (torch.cat(pieces) - one).abs().max() < 1e-5


def _mtp_oracle(model, seed):
    """HF modules for the MTP block (a full/MoE GlmMoeDsaDecoderLayer at index N) + checkpoint names."""
    cfg = model.config
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    ext = make_config(**{**cfg.to_dict(), "num_hidden_layers": n + 1, "indexer_types": cfg.indexer_types + ["full"],
                         "mlp_layer_types": cfg.mlp_layer_types + ["sparse"], "layer_types": None})
    ext._attn_implementation = "eager"  # unset, HF's block skips the top-k mask (flash-mla path)
    mods = torch.nn.ModuleDict({
        "block": hf.GlmMoeDsaDecoderLayer(ext, n), "enorm": hf.GlmMoeDsaRMSNorm(h, cfg.rms_norm_eps),
        "hnorm": hf.GlmMoeDsaRMSNorm(h, cfg.rms_norm_eps), "eh_proj": torch.nn.Linear(2 * h, h, bias=False),
        "shared_head": torch.nn.ModuleDict({"norm": hf.GlmMoeDsaRMSNorm(h, cfg.rms_norm_eps)}),
    })
    randomize_(mods, seed).eval()
    names = checkpoint_names(mods, f"model.layers.{n}.")
    names = {k.replace(".block.", "."): v for k, v in names.items()}
    return mods, ext, names


@torch.no_grad()
def test_mtp_block_matches_hf_modules(tiny):
    model, weights = tiny
    mods, ext, mtp_names = _mtp_oracle(model, seed=3)
    assert set(mtp_names) == set(expected_tensors(glm_config(model.config), mtp=True)) - set(weights)
    (ids,) = prompts(model.config.vocab_size, [26], seed=4)
    nxt = ids[1:] + [5]
    # Oracle: main-model post-norm hidden -> eh_proj -> HF decoder block (causal) -> norm -> lm_head.
    hid = model.model(torch.tensor([ids])).last_hidden_state
    e = mods["enorm"](model.model.embed_tokens(torch.tensor([nxt])))
    x = mods["eh_proj"](torch.cat([e, mods["hnorm"](hid)], -1))
    pos = torch.arange(len(ids))[None]
    mask = torch.full((len(ids), len(ids)), torch.finfo(torch.float32).min).triu(1)[None, None]
    out, _ = mods["block"](x, attention_mask=mask, position_ids=pos,
                           position_embeddings=hf.GlmMoeDsaRotaryEmbedding(ext)(x, pos))
    want = model.lm_head(mods["shared_head"]["norm"](out))[0]
    ref, r2t = reference(model, {**weights, **mtp_names}, 1, extra_layers=1)
    batch = ForwardBatch.build("extend", [ids], [0], [0], r2t)
    logits, h = ref.forward(batch, return_all_logits=True, return_hidden=True)
    assert (h - hid[0]).abs().max() < ATOL
    assert (ref.mtp_forward(h, torch.tensor(nxt), batch, return_all_logits=True) - want).abs().max() < ATOL
    # Decoding the MTP layer token by token over its own KV gives the same last-token draft.
    ref2, r2t = reference(model, {**weights, **mtp_names}, 1, extra_layers=1)
    ref2.mtp_forward(h[:-1], torch.tensor(nxt[:-1]), ForwardBatch.build("extend", [ids[:-1]], [0], [0], r2t))
    step = ForwardBatch.build("decode", [ids[-1:]], [0], [len(ids) - 1], r2t)
    assert (ref2.mtp_forward(h[-1:], torch.tensor(nxt[-1:]), step)[0] - want[-1]).abs().max() < ATOL


def test_idle_batch_and_pool_accounting(tiny):
    model, weights = tiny
    ref, _ = reference(model, weights, 1)
    assert ref.forward(ForwardBatch.idle()).shape == (0, model.config.vocab_size)
    c = glm_config(model.config)
    pool, full = ref.pool, c.full_indexer_layers()
    assert set(pool.index_k) == full and len(pool.kv) == c.num_hidden_layers
    per_token = (c.kv_lora_rank + c.qk_rope_head_dim) * c.num_hidden_layers + c.index_head_dim * len(full)
    assert pool.bytes_per_token() == 4 * per_token
    glm53 = spec("glm_moe_dsa").config
    glm5 = KVPool(78, set(glm53.full_indexer_layers()), 1, dtype=torch.bfloat16, device="meta")
    assert glm5.bytes_per_token() == 2 * (576 * 78 + 128 * 21)


def test_norm_eps_constants_are_hfs():
    """HF builds q_a/kv_a_layernorm without rms_norm_eps (so 1e-6) and the indexer k_norm with 1e-6."""
    attn = hf.GlmMoeDsaAttention(make_config(rms_norm_eps=1e-5), 0)
    assert attn.q_a_layernorm.variance_epsilon == attn.kv_a_layernorm.variance_epsilon == HF_LATENT_NORM_EPS
    assert attn.indexer.k_norm.eps == HF_INDEXER_NORM_EPS


def test_forward_batch_build_and_validation():
    r2t = table(2)
    b = ForwardBatch.build("extend", [[5, 6, 7], [8]], [1, 0], [0, 9], r2t)
    assert b.positions.tolist() == [0, 1, 2, 9] and b.seq_lens.tolist() == [3, 10]
    assert b.out_cache_loc.tolist() == r2t[1, :3].tolist() + [int(r2t[0, 9])]
    assert b.token_ranges() == [(0, 0, 3), (1, 3, 4)]
    with pytest.raises(ValueError, match=r"decode batch needs extend_lens all 1, got \[3, 1\]"):
        ForwardBatch.build("decode", [[5, 6, 7], [8]], [1, 0], [0, 9], r2t)
    with pytest.raises(ValueError, match=r"seq_lens"):
        ForwardBatch(**{**vars(b), "seq_lens": torch.tensor([3, 11])})
    idle = ForwardBatch.idle()
    assert idle.num_tokens == 0 and idle.batch_size == 0
