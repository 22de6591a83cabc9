"""The small trained GLM (`tools/train_small.py`): the script's smoke run on CPU, and its checkpoints
under glmc against transformers (held-out perplexity) and against the script's own MTP layer.

glmc scores every position of a prompt with the `mtp_verify` phase (the target model over all new
tokens, logits at each: what speculative verification reads) and runs the MTP head with the
`mtp_draft` phase fed the verify pass's hidden states, both on the torch target in fp32.

Logits agree to ~1e-6 where attention is dense (positions < index_topk); past that, index scores
that tie exactly (every head's ReLU at 0) are broken by the lowest position in glmc and arbitrarily
by torch.topk, so the sparse region is compared through the losses (1e-3 relative), not bitwise.
"""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "models" / "small"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "heldout.txt",
         "train_log.json")
REL = 1e-3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _import_script():
    spec = importlib.util.spec_from_file_location("train_small", REPO / "tools" / "train_small.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


train_small = _import_script()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, one_torch_thread):
    out = tmp_path_factory.mktemp("small_smoke")
    return out, train_small.main(["--smoke", "--out", str(out)])


def test_smoke_run_learns_and_writes_a_glm_checkpoint(smoke):
    from safetensors import safe_open

    from glmc.runtime.worker.checkpoint import detect_mtp, expected_tensors
    from glmc.spec import load_spec
    out, log = smoke
    assert all((out / f).exists() for f in FILES)
    run = log["train"]
    assert run["steps"] == 8 and math.isfinite(run["loss_last"]) and run["loss_last"] < run["loss_first"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GlmMoeDsaForCausalLM"] and config["model_type"] == "glm_moe_dsa"
    assert config["torch_dtype"] == "bfloat16" and config["num_nextn_predict_layers"] == 1
    assert config["indexer_types"] == ["full", "shared", "full", "shared"]
    assert config["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
    spec = load_spec(out)
    assert detect_mtp(out) == {"mtp": True, "mtp_head": False, "mtp_embed": False}
    with safe_open(out / "model.safetensors", "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert set(dtypes) == set(expected_tensors(spec.config, mtp=True))
    assert {name for name, dt in dtypes.items() if dt != "BF16"} == \
        {f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3, 4)}
    assert (out / "heldout.txt").read_text(encoding="utf-8").count(train_small.EOT) >= 1


def test_indexer_training_signal_is_transformers_numerics(smoke):
    """The script's indexer KL reads transformers' own numbers: with top-k off, its dense attention
    distribution is HF's eager attention weights (summed over heads); HF's top-k is a top-k of its
    index scores. And the LM loss leaves every indexer without a gradient (HF's indexer runs under
    no_grad), which is why the script trains the indexers with that KL."""
    out, _ = smoke
    model, mtp = train_small.load_small(out)
    distill = train_small.IndexerDistillation(model, mtp)
    distill.active = True
    lm, mtp_loss, _, _ = train_small.losses(model, mtp, train_small.probe_windows(out, 2))
    (lm + mtp_loss).backward()
    indexers = [layer.self_attn.indexer for layer in [*model.model.layers, mtp] if layer.self_attn.indexer]
    assert len(indexers) == 3 and all(p.grad is None for i in indexers for p in i.parameters())
    attn = model.model.layers[0].self_attn
    x, pos_emb = distill.inputs[attn]
    k, n = attn.indexer.index_topk, x.shape[1]
    mask = train_small.causal_mask(n, "eager", x.device)
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        scores = train_small.index_scores(attn, x, pos_emb)
        chosen = attn.indexer(x, q_resid, pos_emb, mask[:, 0], None).long()[:, k:]
        kth = scores[:, k:].masked_fill(mask[0, 0, k:] < 0, float("-inf")).topk(k, dim=-1).values[..., -1:]
        assert (scores[:, k:].gather(-1, chosen) >= kth - 1e-5).all()
        attn.indexer.index_topk = n
        weights = attn(hidden_states=x, position_embeddings=pos_emb, attention_mask=mask)[1]
        assert (weights.sum(1) / weights.shape[1] - train_small.mla_probs(attn, x, pos_emb)).abs().max() < 1e-5


def glmc_scores(ckpt_dir, windows: torch.Tensor):
    """glmc's logits at every position of each window [W, S+1] (verify phase), its MTP draft logits
    (draft phase over the verify pass's hidden states) and a second draft pass over the first one's
    hidden states (the MTP layer's depth 1: what its draft chain feeds back at steps 1..):
    ([W, S, V], [W, S-1, V], [W, S-2, V])."""
    from glmc.api import load
    from glmc.runtime.worker.forward_batch import ForwardBatch
    from glmc.runtime.worker.kv_cache import PAGE_SIZE
    n, seq = windows.shape[0], windows.shape[1] - 1
    model = load(ckpt_dir, max_requests=n, pages_per_request=-(-seq // PAGE_SIZE))
    x, rows = windows[:, :-1], list(range(n))
    verify = model.executor.forward("mtp_verify", ForwardBatch.build("extend", x.tolist(), rows, [0] * n,
                                                                     model.req_to_token))
    hidden = verify["hidden"].view(n, seq, -1)[:, :-1].reshape(n * (seq - 1), -1)
    draft = model.executor.forward("mtp_draft", ForwardBatch.build("extend", x[:, 1:].tolist(), rows, [0] * n,
                                                                   model.req_to_token), hidden=hidden)
    hidden = draft["hidden"].view(n, seq - 1, -1)[:, :-1].reshape(n * (seq - 2), -1)
    depth1 = model.executor.forward("mtp_draft", ForwardBatch.build("extend", x[:, 2:].tolist(), rows, [0] * n,
                                                                    model.req_to_token), hidden=hidden)
    return (verify["logits"].view(n, seq, -1), draft["logits"].view(n, seq - 1, -1),
            depth1["logits"].view(n, seq - 2, -1))


def _mean_ce(logits, targets) -> float:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def _check_against_glmc(ckpt_dir, log: dict) -> None:
    """glmc's held-out perplexity of heldout.txt's first windows equals transformers' and its MTP loss
    the script's (1e-3 relative), at depth 0 and at depth 1 (the script trains the MTP layer on the
    hidden state glmc's draft chain feeds back), both equal the script's fp32 probe in
    train_log.json, and glmc's logits equal transformers' where attention is dense."""
    probe = log["probe"]
    windows = train_small.probe_windows(ckpt_dir, probe["windows"])
    model, mtp = train_small.load_small(ckpt_dir)
    with torch.no_grad():
        hf_lm, script_mtp, _, _ = train_small.losses(model, mtp, windows, depths=2)
        hf_logits = model(windows[:, :-1]).logits
    logits, draft, depth1 = glmc_scores(ckpt_dir, windows)
    lm, mtp_loss = _mean_ce(logits, windows[:, 1:]), _mean_ce(draft, windows[:, 2:])
    dense = model.config.index_topk
    assert (logits[:, :dense] - hf_logits[:, :dense]).abs().max() < 1e-4
    assert math.exp(lm) == pytest.approx(math.exp(hf_lm.item()), rel=REL)
    assert [mtp_loss, _mean_ce(depth1, windows[:, 3:])] == pytest.approx(script_mtp.tolist(), rel=REL)
    assert (lm, mtp_loss) == pytest.approx((probe["lm_loss"], probe["mtp_loss"]), rel=REL)


def test_smoke_checkpoint_scores_the_same_in_glmc_and_transformers(smoke):
    out, log = smoke
    _check_against_glmc(out, log)


@pytest.mark.skipif(not (SMALL / "model.safetensors").exists(),
                    reason="models/small/model.safetensors is absent: `python tools/train_small.py "
                           "--out models/small` on a GPU writes it")
def test_small_checkpoint_scores_the_same_in_glmc_and_transformers():
    _check_against_glmc(SMALL, json.loads((SMALL / "train_log.json").read_text()))
