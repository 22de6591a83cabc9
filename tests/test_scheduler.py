"""Scheduler policy (pure Python, a fake model) and the engine loop over the real tiny model (its
compiled plan, the default runner): chunked prefill, retraction, prefix cache and abort never change
greedy output, pages come back, and the plan serves exactly what the reference model does."""
import pytest
import torch
from glmc.runtime.engine.pages import PageAllocator, ReqToTokenPool, slots_for
from glmc.runtime.engine.prefix_cache import NoPrefixCache, RadixCache
from glmc.runtime.engine.request import Request, Status
from glmc.runtime.engine.sampling import SamplingParams
from glmc.runtime.engine.scheduler import ScheduledBatch, Scheduler
from glmc.runtime.worker.checkpoint import (
    detect_mtp,
    expected_tensors,
    load_checkpoint,
)
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.kv_cache import KVPool
from glmc.runtime.worker.model_runner import PlanRunner, ReferenceRunner
from glmc.runtime.worker.reference_model import ReferenceModel

from glmc.api import build_engine
from glmc.spec import load_spec

# -- the policy, with a fake model ----------------------------------------------------------------


def scheduler(num_pages, max_running=8, max_batch_tokens=128, cache=True):
    a = PageAllocator(num_pages)
    return Scheduler(a, ReqToTokenPool(max_running, 4096), RadixCache(a) if cache else NoPrefixCache(),
                     max_running=max_running, max_batch_tokens=max_batch_tokens)


def req(prompt_len, max_tokens=4, base=0):
    return Request([(base + i) % 500 for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens))


def step(s):
    """Schedule, 'run', and append a token that depends only on the sequence (like greedy)."""
    batch = s.schedule()
    if batch is None:
        return None
    s.commit(batch)
    for r in batch.reqs:
        assert s.req_pool.table[r.row, :r.num_computed].tolist() == slots_for(r.pages, 0, r.num_computed)
        if r.num_pending == 0:
            r.output_ids.append(sum(r.all_ids) % 97)
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r, "length")
    return batch


def run(s, reqs):
    for r in reqs:
        s.add(r)
    batches = []
    while not all(r.finished for r in reqs):
        batches.append(step(s))
    return batches


def test_chunked_prefill_rides_along_with_decodes():
    """While a request decodes, a prompt prefills in chunks of mixed_prefill_tokens (default a
    quarter of the budget) next to it; alone, it takes the whole budget."""
    s = scheduler(64, max_batch_tokens=64)
    a, b = req(10, max_tokens=4), req(300, base=7)
    s.add(a)
    step(s)
    s.add(b)
    batch = step(s)
    assert batch.mode == "extend" and batch.reqs == [a, b] and batch.extend_lens == [1, 16]
    while not a.finished:
        batch = step(s)
        assert batch.extend_lens[0] == 1 and batch.num_tokens <= 1 + 16
    batch = step(s)
    assert batch.reqs == [b] and batch.extend_lens == [64]   # alone: full chunks
    while b.num_pending > 1 or not b.output_ids:
        step(s)
    assert step(s).mode == "decode"
    wide = scheduler(64, max_batch_tokens=64)
    wide.mixed_prefill_tokens = 63
    c, d = req(10, max_tokens=20), req(300, base=7)
    wide.add(c)
    step(wide)
    wide.add(d)
    assert step(wide).extend_lens == [1, 63]


def test_admission_waits_for_pages():
    s = scheduler(4)
    a, b = req(150), req(100, base=3)  # 3 pages, then 2 pages + 1 of headroom for a
    s.add(a), s.add(b)
    step(s)
    assert s.running == [a] and list(s.waiting) == [b]
    while not a.finished:
        step(s)
    step(s)
    assert b.status is Status.RUNNING


def test_retraction_finishes_everything_with_the_same_tokens():
    reqs = [req(60, max_tokens=100, base=i) for i in range(4)]
    roomy = [req(60, max_tokens=100, base=i) for i in range(4)]
    run(scheduler(64), roomy)
    s = scheduler(5)  # 3 pages each at the end: 4 requests cannot all fit
    batches = run(s, reqs)
    assert sum(len(b.retracted) for b in batches) > 0
    assert [r.output_ids for r in reqs] == [r.output_ids for r in roomy]
    assert s.num_pages_held == 0
    s.cache.reset()
    assert s.allocator.num_free == 5 and s.req_pool.num_free == 8


def test_abort_frees_every_page():
    s = scheduler(8, cache=False)
    a, b = req(100, max_tokens=50), req(10, max_tokens=50)
    s.add(a), s.add(b)
    for _ in range(3):
        step(s)
    s.finish(a, "abort")
    assert a.pages == [] and a.row is None and s.allocator.num_used == len(b.pages)
    s.finish(b, "abort")
    assert s.allocator.num_free == 8 and s.req_pool.num_free == 8 and not s.running


def test_prefix_hit_skips_whole_pages_only():
    s = scheduler(16)
    run(s, [req(130)])
    again, exact = req(130), req(128)
    run(s, [again])
    assert again.num_cached_tokens == 128
    run(s, [exact])  # one token must be computed for its logits: a 128-token prompt reuses 64
    assert exact.num_cached_tokens == 64


# -- the engine over the real tiny model ----------------------------------------------------------

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt


def engine(ckpt, **kw):
    return build_engine(ckpt, warmup=False, **kw)


def reference_greedy(ckpt, prompt, max_tokens):
    """Greedy decoding with the bare ReferenceModel: one request, positions mapped to slots 1:1."""
    c = load_spec(ckpt).config
    mtp = detect_mtp(ckpt)
    extra = {c.num_hidden_layers} if mtp["mtp"] else set()   # the MTP layer's KV lives in the pool too
    pool = KVPool(c.num_hidden_layers + len(extra), c.full_indexer_layers() | extra, 8, c.kv_lora_rank,
                  c.qk_rope_head_dim, c.index_head_dim)
    model = ReferenceModel(c, load_checkpoint(ckpt, expected_tensors(c, **mtp)), pool)
    table = torch.arange(8 * 64).view(1, -1)
    logits, out = model.forward(ForwardBatch.build("extend", [prompt], [0], [0], table)), []
    for _ in range(max_tokens):
        out.append(int(logits[0].argmax()))
        fb = ForwardBatch.build("decode", [[out[-1]]], [0], [len(prompt) + len(out) - 1], table)
        logits = model.forward(fb)
    return out


def prompts(*lengths):
    return [[(37 * i + 11 * n) % 500 + 10 for i in range(n)] for n in lengths]


def test_engine_greedy_equals_reference_model(ckpt):
    ps = prompts(5, 70, 140)
    got = [r.output_ids for r in engine(ckpt).generate(ps, GREEDY)]
    assert got == [reference_greedy(ckpt, p, GREEDY.max_tokens) for p in ps]


def test_chunked_prefill_same_greedy_tokens(ckpt):
    ps = prompts(150, 9, 100)
    whole = engine(ckpt, max_batch_tokens=512).generate(ps, GREEDY)
    chunked = engine(ckpt, max_batch_tokens=16).generate(ps, GREEDY)
    assert [r.output_ids for r in chunked] == [r.output_ids for r in whole]


def test_prefix_cache_same_output_and_skips_prefill(ckpt):
    cached, plain = engine(ckpt), engine(ckpt, enable_prefix_cache=False)
    p = prompts(150)
    first = cached.generate(p, GREEDY)[0]
    computed = cached.metrics.counters["prefill_tokens_total"]
    second = cached.generate(p, GREEDY)[0]
    assert second.num_cached_tokens == 128
    assert cached.metrics.counters["prefill_tokens_total"] - computed == 150 - 128
    assert first.output_ids == second.output_ids == plain.generate(p, GREEDY)[0].output_ids


def test_retraction_same_greedy_output(ckpt):
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    ps = prompts(60, 61, 62, 63)
    roomy = engine(ckpt).generate(ps, params)
    tight = engine(ckpt, num_pages=5)
    got = tight.generate(ps, params)
    assert tight.metrics.counters["requests_retracted_total"] > 0
    assert [r.output_ids for r in got] == [r.output_ids for r in roomy]
    tight.flush_cache()
    assert tight.allocator.num_free == 5


def test_abort_mid_generation_frees_pages(ckpt):
    e = engine(ckpt, enable_prefix_cache=False)
    # ignore_eos: sampled at temperature 1 from an unseeded draw, a could otherwise stop before the abort
    a, b = (e.make_request(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts(100, 20))
    e.submit(a), e.submit(b)
    for _ in range(4):
        e.step()
    e.abort(a.rid)
    e.step()
    assert a.finish_reason == "abort" and a.pages == [] and e.allocator.num_used == len(b.pages)
    while not b.finished:
        e.step()
    assert e.allocator.num_free == e.allocator.num_pages and e.req_pool.num_free == e.req_pool.max_reqs


def test_plan_runner_serves_what_the_reference_runner_does(ckpt):
    """Mixed prefill + decode batches, chunked prefill and prefix hits, through both runners."""
    ps = prompts(150, 9, 100, 70) + [prompts(150)[0][:130] + [5, 6]]  # the last one hits the cache
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plan, ref = engine(ckpt, max_batch_tokens=48), engine(ckpt, runner="reference",
                                                          max_batch_tokens=48)
    assert isinstance(plan.runner, PlanRunner) and isinstance(ref.runner, ReferenceRunner)
    assert plan.runner.executor.pool.num_pages == plan.runner.num_pages + 1  # + the scratch page
    got = [[r.output_ids for r in e.generate(ps[:4], params) + e.generate(ps[4:], params)]
           for e in (plan, ref)]
    assert got[0] == got[1]
    assert plan.metrics.counters["prefix_cache_hit_tokens_total"] >= 128


@pytest.mark.parametrize("inflight", [0, 2])
def test_request_ids_slices_all_ids(inflight):
    """`Request.ids(a, b)` (a step's inputs, built without the whole sequence) == all_ids[a:b]
    across the prompt / output / in-flight boundaries."""
    req = Request([1, 2, 3, 4, 5], SamplingParams(max_tokens=20))
    req.output_ids, req.num_inflight = [6, 7, 8], inflight
    full = req.all_ids
    for a in range(len(full) + 2):
        for b in range(a, len(full) + 3):
            assert req.ids(a, b) == full[a:b], (a, b)


def test_busy_requests_sit_out_the_schedule_and_are_never_retracted():
    """`schedule(busy)` (a speculative cycle already queued for them): busy requests get no
    tokens, count as decoding for the mixed-prefill budget, and when the pool runs dry a prompt's
    chunk retracts a request that is not busy (itself at the last) rather than a busy one."""
    def setup():
        s = scheduler(4, max_batch_tokens=64)
        a, c = req(60, max_tokens=100), req(100, max_tokens=4, base=7)
        s.add(a)
        while len(a.output_ids) < 2:
            step(s)
        s.add(c)
        while c.num_computed < s.page_size:   # c admitted, its chunks beside a's decodes: a page full
            step(s)
        while s.allocator.num_free:   # a holds the pages c's next chunks would need (its drafts')
            s.reserve(a, len(a.pages) * s.page_size + 1)
        s.running = [c, a]   # a last: the first the pool would retract
        return s, a, c

    s, a, c = setup()
    assert c.num_pending > 1 and a.is_decoding
    b = s.schedule(busy=frozenset([a]))
    assert a not in b.reqs and b.retracted == [c] and a.status is Status.RUNNING and a.pages
    s, a, c = setup()
    b = s.schedule()
    assert b.retracted == [a]
    # the prefill budget: a busy request counts as decoding (mixed chunks, not the whole budget)
    s = scheduler(64, max_batch_tokens=64)
    a, c = req(10, max_tokens=100), req(200, base=3)
    s.add(a)
    while len(a.output_ids) < 2:
        step(s)
    s.reserve(a, a.num_tokens + 8)   # a cycle queued for a: its positions run ahead of its tokens
    s.commit(ScheduledBatch([a], [a.num_computed], [4]))
    s.add(c)
    assert not a.is_decoding
    b = s.schedule(busy=frozenset([a]))
    assert b.reqs == [c] and b.extend_lens == [s.mixed_prefill_tokens]
