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
    ex, spec = build(path)
    prompts = _prompts(spec.config.vocab_size, [23, 37, 30])
    logits, _, _ = greedy(ex, prompts, 0)
    for b, p in enumerate(prompts):
        want = model(torch.tensor([p])).logits[0, -1]
        assert (logits[b] - want).abs().max() < ATOL


def test_plan_greedy_decode_matches_generate(ckpt):
    path, model = ckpt
    ex, spec = build(path)
    prompts = _prompts(spec.config.vocab_size, [26, 26], seed=1)
    _, tokens, _ = greedy(ex, prompts, 32)
    want = model.generate(torch.tensor(prompts), max_new_tokens=32, do_sample=False,
                          min_new_tokens=32)[:, 26:]
    assert torch.equal(tokens, want)
