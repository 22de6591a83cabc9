"""The one sampler (semantics: runtime/engine/sampling.py) across its implementations: `torch_ref.sample` and
the Triton kernel (`triton_launch.sample`, run in the interpreter) keep the same tokens and draw the
same ones for the same logits, parameters and seeds; seeds do not depend on the batch; draws follow
the kept distribution; ties go to the lowest id; the IR's `sample.tokens` is the greedy case."""
import pytest
import torch
from glmc.codegen import torch_ref as ref
from glmc.codegen import torch_target
from glmc.codegen import triton_launch as tt
from glmc.runtime.engine.request import Request
from glmc.runtime.engine.sampling import SamplingBatch, SamplingParams, sample_batch

IMPLS = {"torch": ref.sample, "triton": tt.sample}


def params(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0):
    """Per-row parameter tensors, as torch_ref.sample / triton_launch.sample take them."""
    def col(v, dtype):
        return torch.as_tensor(v, dtype=dtype).expand(n).clone()
    return (col(temperature, torch.float32), col(top_k, torch.int64), col(top_p, torch.float32),
            col(min_p, torch.float32), col(seed, torch.int64), col(step, torch.int64))


def kept(impl, logits, **kw):
    return IMPLS[impl](logits, *params(logits.shape[0], **kw), return_kept=True)[1]


@pytest.mark.parametrize("impl", IMPLS)
def test_filters_apply_in_sequence(impl):
    """The module docstring's example and the filters one by one, on both implementations."""
    example = torch.log(torch.tensor([[0.3, 0.3, 0.2, 0.2]]))
    assert kept(impl, example, top_k=2, top_p=0.5)[0].tolist() == [True, False, False, False]
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert kept(impl, logits, top_k=2)[0].tolist() == [True, True, False, False]
    assert kept(impl, logits, top_p=0.7)[0].tolist() == [True, True, False, False]
    assert kept(impl, logits, top_p=0.1)[0].tolist() == [True, False, False, False]  # >= 1 token
    assert kept(impl, logits, min_p=0.5)[0].tolist() == [True, True, False, False]  # >= .5 * .5
    # top-p on what top-k left: {.5, .3} renormalised is {.625, .375}, and .625 < .7
    assert kept(impl, logits, top_k=2, top_p=0.7)[0].tolist() == [True, True, False, False]
    # {.5, .3, .15} renormalised: .5 / .95 > .52, so token 0 alone reaches it; unfiltered, it does not
    assert kept(impl, logits, top_k=3, top_p=0.52)[0].tolist() == [True, False, False, False]
    assert kept(impl, logits, top_p=0.52)[0].tolist() == [True, True, False, False]
    # temperature sharpens before the nucleus is taken
    assert kept(impl, logits, temperature=0.1, top_p=0.9)[0].tolist() == [True, False, False, False]


@pytest.mark.parametrize("impl", IMPLS)
def test_ties_go_to_the_lowest_id(impl):
    logits = torch.tensor([[1.0, 3.0, 0.0, 3.0, 3.0, -1.0]])
    greedy = IMPLS[impl](logits, *params(1, temperature=0.0))
    assert greedy.tolist() == [1]
    assert kept(impl, logits, top_k=2)[0].tolist() == [False, True, False, True, False, False]
    assert kept(impl, logits, top_k=1)[0].tolist() == [False, True, False, False, False, False]
    # a third of the mass is one tied token: top_p = .5 needs two of the three, lowest ids first
    assert kept(impl, logits, temperature=0.01, top_p=0.5)[0].tolist() == [
        False, True, False, True, False, False]


def mixed_batch(B=12, V=96):
    """Rows with ties, integer logits, greedy rows and every filter on and off; per-row seeds."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, V, generator=g) * 2
    logits[1, 5:15] = logits[1].max()  # a tie at the top
    logits[2] = torch.round(logits[2])  # many ties
    temperature = torch.rand(B, generator=g) * 1.5 + 0.2
    temperature[0] = 0.0
    top_k = torch.tensor([0, 3, 7, -1, 20, 95, 96, 1, 0, 10, 40, 5])[:B]
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.3, 1.0, 0.8, 0.95, 1.0, 0.6, 0.99, 1.0, 0.7])[:B]
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.2, 0.0, 0.01, 0.0, 0.3, 0.0])[:B]
    seed = torch.randint(-2**62, 2**62, (B,), generator=g)
    step = torch.randint(0, 5000, (B,), generator=g)
    return logits, (temperature, top_k, top_p, min_p, seed, step)


def test_torch_and_triton_keep_the_same_sets_and_draw_the_same_tokens():
    logits, ps = mixed_batch()
    want_tokens, want_kept = ref.sample(logits, *ps, return_kept=True)
    got_tokens, got_kept = tt.sample(logits, *ps, return_kept=True)
    assert torch.equal(got_kept, want_kept)
    assert torch.equal(got_tokens, want_tokens)
    assert bool(want_kept.gather(1, want_tokens[:, None]).all())
    sizes = want_kept.sum(1)
    assert int(sizes[0]) == 1 and int((sizes < logits.shape[1]).sum()) >= 9  # the filters bite
    assert int((sizes > 1).sum()) >= 9


def test_torch_and_triton_agree_on_many_draws():
    """Same tokens over many seeds and steps (min-p only: the interpreter's fast path)."""
    V, n = 64, 64
    logits = (torch.randn(1, V, generator=torch.Generator().manual_seed(4)) * 2).expand(n, V)
    ps = params(n, temperature=0.8, min_p=0.02, seed=torch.arange(n) * 7919, step=torch.arange(n))
    assert torch.equal(ref.sample(logits, *ps), tt.sample(logits, *ps))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_seeded_draw_does_not_depend_on_the_batch(impl):
    """Row `seed 11, step s` draws the same token alone, or among other rows in any position."""
    g = torch.Generator().manual_seed(5)
    mine = torch.randn(1, 64, generator=g)
    others = torch.randn(4, 64, generator=g)
    steps = range(2) if impl == "triton" else range(6)
    alone = [int(IMPLS[impl](mine, *params(1, min_p=0.05, seed=11, step=s))) for s in steps]
    for pos in (0, 4):
        logits = torch.cat([others[:pos], mine, others[pos:]])
        for s in steps:
            ps = params(5, min_p=0.05, seed=torch.arange(5) + 100, step=torch.full((5,), 7))
            ps[4][pos], ps[5][pos] = 11, s
            assert int(IMPLS[impl](logits, *ps)[pos]) == alone[s]
    assert len(set(alone)) > 1  # the step counter moves the draw


def chi_square(tokens, probs):
    counts = torch.bincount(tokens, minlength=probs.numel()).float()
    expected = probs * tokens.numel()
    support = expected > 0
    assert bool((counts[~support] == 0).all()), "drew a token outside the kept set"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum()), int(support.sum())


def kept_distribution(logits, temperature, kept_mask):
    p = torch.softmax(logits.float() / temperature, -1) * kept_mask
    return p / p.sum()


def test_draw_frequencies_follow_the_kept_distribution():
    """6000 seeded draws through top-k, top-p and min-p (chi-square, ~5 sigma bound). On torch:
    the kernel draws the same tokens (above), at interpreter speed."""
    V, n = 24, 6000
    logits = (torch.randn(1, V, generator=torch.Generator().manual_seed(6)) * 1.5).expand(n, V)
    ps = params(n, temperature=0.9, top_k=12, top_p=0.9, min_p=0.02, seed=42, step=torch.arange(n))
    tokens, kept_mask = ref.sample(logits, *ps, return_kept=True)
    stat, support = chi_square(tokens, kept_distribution(logits[0], 0.9, kept_mask[0]))
    assert 3 <= support <= 12 and stat < support - 1 + 5 * (2 * (support - 1)) ** 0.5


def test_sample_batch_runs_both_paths_alike():
    """The engine's entry point: per-request params, bias and penalties, then either draw."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 64, generator=g) * 2
    reqs = [Request([1, 2], SamplingParams(temperature=0.0), seed=1),
            Request([3], SamplingParams(top_k=5, top_p=0.8, repetition_penalty=1.3), [4, 4], seed=2),
            Request([5], SamplingParams(logit_bias={t: -100.0 for t in range(64) if t != 9}), seed=3),
            Request([6], SamplingParams(temperature=1.3, min_p=0.1, presence_penalty=1.0), [7], seed=4)]
    batch = SamplingBatch.from_requests(reqs, "cpu")
    got = sample_batch(logits, batch, use_triton=False).token_ids
    assert torch.equal(got, sample_batch(logits, batch, use_triton=True).token_ids)
    assert int(got[0]) == int(logits[0].argmax()) and int(got[2]) == 9


@pytest.mark.parametrize("greedy", [ref.sample_greedy, tt.sample_greedy,
                                    lambda x: torch_target.IMPLS["sample.tokens"](None, [x], None)])
def test_the_ir_sample_op_is_the_greedy_sampler(greedy):
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(9))
    logits[2, [4, 30]] = 9.0
    want = logits.argmax(-1)
    assert int(want[2]) == 4 and torch.equal(greedy(logits), want)


@pytest.mark.parametrize("num_splits", [None, 1, 2, 3, 5])
def test_split_greedy_argmax_matches_the_sampler(num_splits):
    """tt.sample_greedy splits each row over programs (argmax.py.j2; 5 splits of 2048 ids leave two
    empty): the same ids as torch_ref's sampler, ties across splits going to the lowest id, a row of
    -inf giving 0; NaN is never chosen, as by the one-program Triton sampler (torch's argmax would
    pick it)."""
    V = 3 * 2048 + 77
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    logits[1, [5, 2048 + 7, 3 * 2048 + 70]] = 50.0          # one tie per split: id 5 wins
    logits[2, [2048 + 9, 4000]] = 60.0                         # tie inside and across splits, none in the first
    logits[3] = float("-inf")
    logits[4] = 0.0                                            # all equal: 0
    logits[5, V - 1] = 70.0                                    # the last id, past the last full chunk
    want = ref.sample_greedy(logits)
    assert want[1:].tolist() == [5, 2048 + 9, 0, 0, V - 1]
    got = tt.sample_greedy(logits, num_splits=num_splits)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(tt.sample_greedy(-logits, num_splits=num_splits), ref.sample_greedy(-logits))
    logits[5, :100] = float("nan")
    zero = torch.zeros(6)
    one_program = tt.sample(logits, zero, zero.long(), zero + 1.0, zero, zero.long(), zero.long())
    assert int(one_program[5]) == V - 1 and torch.equal(tt.sample_greedy(logits, num_splits=num_splits), one_program)
