"""The overlapped engine loop (step N+1 queued before step N's tokens are read) serves exactly what
the synchronous loop does: tokens, finish reasons, text, logprobs, seeded draws; with stop tokens and
strings found one step late, chunked prefill, prefix hits, penalties, retraction and aborts; and it
leaves no page, row or placeholder token behind."""
import pytest
from glmc.runtime.engine.request import FUTURE_TOKEN
from glmc.runtime.engine.sampling import SamplingParams

from glmc.api import build_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def engine(ckpt, overlap, **kw):
    return build_engine(ckpt, warmup=False, overlap=overlap, **kw)


def prompts(*lengths):
    return [[(37 * i + 11 * n) % 500 + 10 for i in range(n)] for n in lengths]


def run(e, specs):
    """Submit (prompt, params) pairs at once; step until all finished; -> what each returned."""
    reqs = [e.make_request(p, params) for p, params in specs]
    for r in reqs:
        e.submit(r)
    while not all(r.finished for r in reqs):
        e.step()
    while e.step():   # a queued step of finished requests is read and dropped
        pass
    return [(r.output_ids, r.finish_reason, r.output_text, r.output_logprobs) for r in reqs]


def same(got, want) -> bool:
    """Equal tokens, finish reasons and text; logprobs equal up to float summation order (the two
    loops may cut prefill chunks differently: a request found finished one step late still takes a
    decode slot in the step after)."""
    def close(a, b):
        return (len(a) == len(b) and all(abs(x.logprob - y.logprob) < 1e-3 and [t for t, _ in x.top] ==
                                          [t for t, _ in y.top] for x, y in zip(a, b)))
    return all(g[:3] == w[:3] and close(g[3], w[3]) for g, w in zip(got, want)) and len(got) == len(want)


def leaks(e) -> list[str]:
    e.flush_cache()
    bad = []
    if e.allocator.num_free != e.allocator.num_pages:
        bad.append(f"{e.allocator.num_pages - e.allocator.num_free} pages held")
    if e.req_pool.num_free != e.req_pool.max_reqs:
        bad.append("rows held")
    return bad


def test_overlap_serves_what_the_synchronous_loop_does(tiny_ckpt):
    ps = prompts(150, 9, 100, 70, 33)
    greedy = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    sync = engine(tiny_ckpt, False, max_batch_tokens=48)
    probe = run(sync, [(p, greedy) for p in ps])
    # stop on a token request 0 produces mid-way, and on the text request 1 has produced by then
    stop_id, stop_text = probe[0][0][5], probe[1][2][3:6]
    specs = [
        (ps[0], SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=[stop_id])),
        (ps[1], SamplingParams(max_tokens=14, temperature=0.0, stop=[stop_text] if stop_text else [])),
        (ps[2], SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=7, logprobs=True,
                               top_logprobs=3)),
        (ps[3], SamplingParams(max_tokens=9, temperature=0.8, seed=3, repetition_penalty=1.3,
                               frequency_penalty=0.5)),
        (ps[4], SamplingParams(max_tokens=1, temperature=0.0)),
        (ps[0][:130] + [5, 6], greedy),  # a prefix hit on request 0's pages
    ]
    want = run(engine(tiny_ckpt, False, max_batch_tokens=48), specs)
    e = engine(tiny_ckpt, True, max_batch_tokens=48)
    assert e.overlap
    assert same(run(e, specs), want)
    assert want[0][1] == "stop" and len(want[0][0]) < 14
    assert e.metrics.counters["prefix_cache_hit_tokens_total"] >= 128
    keys = _cache_keys(e)
    assert keys and all(FUTURE_TOKEN not in key for key in keys)
    assert not leaks(e)


def test_overlap_with_retraction_and_abort(tiny_ckpt):
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ps = prompts(60, 61, 62, 63)
    want = run(engine(tiny_ckpt, False), [(p, params) for p in ps])
    tight = engine(tiny_ckpt, True, num_pages=5)
    assert same(run(tight, [(p, params) for p in ps]), want)
    assert tight.metrics.counters["requests_retracted_total"] > 0
    assert not leaks(tight)

    e = engine(tiny_ckpt, True, enable_prefix_cache=False)
    a, b = (e.make_request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts(100, 20))
    e.submit(a), e.submit(b)
    for _ in range(4):
        e.step()
    assert a.num_inflight == 1   # a step of `a` is queued, its token not read
    e.abort(a.rid)
    e.step()
    assert a.finish_reason == "abort" and a.pages == [] and a.num_inflight == 0
    assert FUTURE_TOKEN not in a.output_ids
    while not b.finished:
        e.step()
    assert not leaks(e) and len(b.output_ids) == 30


def test_overlap_refused_by_a_runner_that_cannot(tiny_ckpt):
    with pytest.raises(ValueError, match="cannot overlap"):
        engine(tiny_ckpt, True, runner="reference")
    assert not engine(tiny_ckpt, None, runner="reference").overlap


def test_warm_lengths_cover_the_integer_classes():
    from glmc.runtime.engine.startup import warm_lengths
    got = warm_lengths(2048, 4000)
    assert {1, 2, 3, 15, 16, 17, 31, 32, 33, 1023, 1024, 1025, 2047, 2048} <= set(got)
    assert max(got) == 2048 and got == sorted(set(got))
    assert max(warm_lengths(2048, 300)) == 300


def _cache_keys(e):
    """Every token sequence the prefix cache would match (its nodes' keys)."""
    out, stack = [], [e.cache.root]
    while stack:
        node = stack.pop()
        out += [list(node.key)] if node.key else []
        stack.extend(node.children.values())
    return out
