"""The compiled plan on the torch target (one process, tp1) against transformers."""
import pytest
import torch
from tiny_hf import save_tiny

from tests.plan_run import build, greedy

ATOL = 1e-4


@pytest.fixture(scope="module", params=["grouped", "wide"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny(path, request.param, seed=3)
    return path, model


def _prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_plan_prefill_matches_transformers(ckpt):
    path, model = ckpt
    m = build(path)
    prompts = _prompts(m.spec.config.vocab_size, [23, 37, 30])
    logits, _, _ = greedy(m, prompts, 0)
    for b, p in enumerate(prompts):
        want = model(torch.tensor([p])).logits[0, -1]
        assert (logits[b] - want).abs().max() < ATOL


def test_plan_greedy_decode_matches_generate(ckpt):
    path, model = ckpt
    m = build(path)
    prompts = _prompts(m.spec.config.vocab_size, [26, 26], seed=1)
    _, tokens, _ = greedy(m, prompts, 32)
    want = model.generate(torch.tensor(prompts), max_new_tokens=32, do_sample=False,
                          min_new_tokens=32)[:, 26:]
    assert torch.equal(tokens, want)


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    """A tiny checkpoint with an MTP layer (model.layers.N.*), config num_nextn_predict_layers 1."""
    import json

    from safetensors.torch import load_file, save_file
    from test_reference_model import _mtp_oracle
    path = tmp_path_factory.mktemp("mtp")
    model = save_tiny(path, "grouped", seed=3)
    _, _, mtp = _mtp_oracle(model, seed=9)
    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, **{k: v.contiguous() for k, v in mtp.items()}}, path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return path


def test_mtp_draft_phase_matches_direct_composition(mtp_ckpt):
    """eh_proj over [enorm(embed(next)), hnorm(h)] -> one decoder block -> shared head, as planned."""
    from glmc.runtime.worker.checkpoint import (
        detect_mtp,
        expected_tensors,
        load_checkpoint,
    )
    from glmc.runtime.worker.forward_batch import ForwardBatch
    from glmc.runtime.worker.reference_model import ReferenceModel
    m = build(mtp_ckpt)
    ex, spec, r2t = m.executor, m.spec, m.req_to_token
    assert "mtp_draft" in ex.graphs
    (ids,) = _prompts(spec.config.vocab_size, [25], seed=2)
    nxt = ids[1:] + [7]
    weights = load_checkpoint(mtp_ckpt, expected_tensors(spec.config, **detect_mtp(mtp_ckpt)))
    ref = ReferenceModel(spec.config, weights, _fresh_pool(spec))
    batch = ForwardBatch.build("extend", [ids], [0], [0], r2t)
    _, h = ref.forward(batch, return_all_logits=True, return_hidden=True)
    want = ref.mtp_forward(h, torch.tensor(nxt), batch, return_all_logits=True)
    ex.forward("prefill", batch)
    mtp_batch = ForwardBatch.build("extend", [nxt], [0], [0], r2t)
    got = ex.forward("mtp_draft", ForwardBatch(**{**mtp_batch.__dict__, "positions": batch.positions}),
                     hidden=h)["logits"]
    assert got.shape == want.shape and (got - want).abs().max() < 1e-5


def _fresh_pool(spec):
    from glmc.runtime.worker.kv_cache import KVPool
    c = spec.config
    full = {i for i, t in enumerate(c.layer_indexer_types()) if t == "full"}
    return KVPool(c.num_hidden_layers + 1, full | {c.num_hidden_layers}, 64, c.kv_lora_rank,
                  c.qk_rope_head_dim, c.index_head_dim)


def test_chunked_prefill_and_prefix_hit_equal_one_prefill(tmp_path):
    """Through the plan: a prompt in 3 chunks, and a second request reusing the first's prefix
    KV, give one prefill's logits. One indexer head makes exact top-k ties common: they break by
    the lowest position whatever the chunking."""
    from glmc.runtime.worker.forward_batch import ForwardBatch
    save_tiny(tmp_path, "grouped", seed=11, index_n_heads=1)
    m = build(tmp_path)
    (p,) = _prompts(m.spec.config.vocab_size, [40], seed=5)
    r2t = m.req_to_token
    one = m.executor.forward("prefill", ForwardBatch.build("extend", [p], [0], [0], r2t))["logits"]
    ex2 = build(tmp_path).executor
    for lo, hi in ((0, 15), (15, 30), (30, 40)):
        last = ex2.forward("prefill", ForwardBatch.build("extend", [p[lo:hi]], [0], [lo], r2t))
    assert (last["logits"] - one).abs().max() < 1e-5
    # request row 1 shares row 0's first 24 cached tokens (same slots), computes only the rest
    r2t[1, :24] = r2t[0, :24]
    hit = ex2.forward("prefill", ForwardBatch.build("extend", [p[24:]], [1], [24], r2t))
    assert (hit["logits"] - one).abs().max() < 1e-5
