"""MTP speculative decoding in the engine (`runtime/engine/speculative.py`), torch target, tp1,
and tp2 / dp2ep2 as gloo processes.

Greedy output with drafts equals the plain engine's token for token, with chunked prefill, prefix
hits, stop tokens and strings, logprobs, aborts and retraction, for N = 1, 2, 3; sampled requests
(standard speculative sampling: its distribution is tested in test_spec_sampling.py) give the
same tokens for a seed whatever shares their batch; every page comes back; the prefix cache holds
only token sequences some request really produced.
The tiny random model's MTP layer guesses almost nothing (so rejection and rollback run on nearly
every step); the trained small model's guesses mostly hold: its acceptance length on held-out
text is measured through the metrics.
"""
import re
from pathlib import Path

import pytest
from glmc.runtime.engine.engine import Engine
from glmc.runtime.engine.sampling import SamplingParams

from glmc.api import build_engine

SMALL = Path(__file__).resolve().parents[1] / "models" / "small"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompts(*lengths):
    return [[(37 * i + 11 * n) % 500 + 10 for i in range(n)] for n in lengths]


def run(e, specs):
    """Submit (prompt, params) pairs at once; step until all finished; -> what each returned
    (token ids, finish reason, text, logprobs: [(chosen, alternative ids, their logprobs)])."""
    reqs = [e.make_request(p, params) for p, params in specs]
    for r in reqs:
        e.submit(r)
    while not all(r.finished for r in reqs):
        e.step()
    return [(r.output_ids, r.finish_reason, r.output_text,
             [(lp.logprob, [t for t, _ in lp.top], [v for _, v in lp.top])
              for lp in r.output_logprobs]) for r in reqs]


def same(got, want) -> bool:
    """Equal outputs; logprobs to 1e-4 (the verify phase computes attention in another order
    than decode: ~1e-5 apart)."""
    def values(out):
        return [v for lps in out for chosen, _, top in lps[3] for v in (chosen, *top)]

    def exact(out):
        return [(ids, reason, text, [alts for _, alts, _ in lps]) for ids, reason, text, lps in out]
    return exact(got) == exact(want) and values(got) == pytest.approx(values(want), abs=1e-4)


def cache_keys(e) -> list[list[int]]:
    return cache_keys_of(e.cache)


def cache_keys_of(cache) -> list[list[int]]:
    """Every token sequence the prefix cache would match (root-to-node paths)."""
    out, stack = [], [(cache.root, [])]
    while stack:
        node, path = stack.pop()
        path = path + list(node.key or [])
        out += [path] if node.key else []
        stack.extend((child, path) for child in node.children.values())
    return out


def check_clean(e, specs, outputs) -> None:
    """Cached sequences are prefixes of what requests produced; no page or row is held after."""
    produced = [p + out[0] for (p, _), out in zip(specs, outputs)]
    keys = cache_keys(e)
    assert keys and all(any(seq[:len(k)] == k for seq in produced) for k in keys)
    e.flush_cache()
    assert e.allocator.num_free == e.allocator.num_pages
    assert e.req_pool.num_free == e.req_pool.max_reqs


def test_output_with_mtp_is_output_without(tiny_ckpt):
    ps = prompts(150, 9, 100, 70, 33)
    greedy = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    plain = build_engine(tiny_ckpt, warmup=False, overlap=False, max_batch_tokens=48)
    probe = run(plain, [(p, greedy) for p in ps])
    stop_id, stop_text = probe[0][0][5], probe[1][2][3:6]
    specs = [
        (ps[0], SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=[stop_id])),
        (ps[1], SamplingParams(max_tokens=14, temperature=0.0, stop=[stop_text] if stop_text else [])),
        (ps[2], SamplingParams(max_tokens=14, temperature=0.0, logprobs=True, top_logprobs=2)),
        (ps[3], SamplingParams(max_tokens=9, temperature=0.8, seed=3, repetition_penalty=1.3)),
        (ps[4], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)),
        (ps[0][:130] + [5, 6], greedy),  # a prefix hit on request 0's pages
        (ps[2][:40], SamplingParams(max_tokens=1, temperature=0.0)),
    ]
    want = run(build_engine(tiny_ckpt, warmup=False, overlap=False, max_batch_tokens=48), specs)
    assert want[0][1] == "stop" and len(want[0][0]) < 14
    sampled = [3, 4]
    for n in (1, 2, 3):
        e = build_engine(tiny_ckpt, warmup=False, max_batch_tokens=48, speculative_num_steps=n)
        assert not e.overlap
        got = run(e, specs)
        assert same([g for i, g in enumerate(got) if i not in sampled],
                    [w for i, w in enumerate(want) if i not in sampled]), f"N={n}"
        alone = [run(build_engine(tiny_ckpt, warmup=False, max_batch_tokens=48, speculative_num_steps=n),
                     [specs[i]])[0] for i in sampled]
        assert same([got[i] for i in sampled], alone), f"N={n}"
        counters = e.metrics.counters
        assert counters["prefix_cache_hit_tokens_total"] >= 128
        assert counters["spec_verify_steps_total"] > 0
        assert counters["spec_draft_tokens_total"] > counters["spec_verify_steps_total"] * (n - 1)
        check_clean(e, specs, got)


def test_retraction_under_speculation(tiny_ckpt):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    specs = [(p, params) for p in prompts(60, 61, 62, 63)]
    want = run(build_engine(tiny_ckpt, warmup=False, overlap=False), specs)
    tight = build_engine(tiny_ckpt, warmup=False, num_pages=5, speculative_num_steps=2)
    assert same(run(tight, specs), want)
    assert tight.metrics.counters["requests_retracted_total"] > 0
    check_clean(tight, specs, want)


def test_speculation_needs_a_runner_that_drafts(tiny_ckpt):
    with pytest.raises(ValueError, match="without overlap"):
        build_engine(tiny_ckpt, warmup=False, overlap=True, speculative_num_steps=1)
    with pytest.raises(ValueError, match="ReferenceRunner cannot run speculative decoding"):
        build_engine(tiny_ckpt, warmup=False, runner="reference", speculative_num_steps=1)
    e = build_engine(tiny_ckpt, warmup=False, overlap=False)
    with pytest.raises(ValueError, match=">= 0"):
        Engine(e.runner, e.tokenizer, speculative_num_steps=-1)


@pytest.mark.skipif(not (SMALL / "model.safetensors").exists(), reason="models/small is absent")
@pytest.mark.parametrize("temperature, min_accept_length", [(0.0, 2.0), (1.0, 1.7)])
def test_small_model_accepts_most_drafts_on_heldout_text(temperature, min_accept_length):
    """models/small's MTP layer on held-out text: greedy outputs equal plain decoding (seeded ones
    at temperature 1 equal a re-run in another batch order), and the mean tokens per verify
    (accepted drafts + 1) at N=3 is well above 1 (measured on 8 prompts of 96 tokens, 48
    generated: greedy 1.89 / 2.43 / 2.95 at N = 1 / 2 / 3, temperature 1 with standard speculative
    sampling 1.72 / 2.05 / 2.27, 1.43 / 1.59 / 1.69 with the exact matching before it);
    `/metrics` exposes it as a histogram."""
    e = build_engine(SMALL, warmup=False, overlap=False) if temperature == 0 else \
        build_engine(SMALL, warmup=False, speculative_num_steps=3)
    ids = e.tokenizer.encode((SMALL / "heldout.txt").read_text(encoding="utf-8"))
    stride = len(ids) // 4
    specs = [(ids[i * stride:i * stride + 80], SamplingParams(
        max_tokens=32, temperature=temperature, seed=i, ignore_eos=True)) for i in range(4)]
    want = run(e, specs) if temperature == 0 else run(e, specs[::-1])[::-1]
    spec = build_engine(SMALL, warmup=False, speculative_num_steps=3)
    assert same(run(spec, specs), want)
    m = spec.metrics
    assert m.accept_length > min_accept_length, m.counters
    assert m.value("spec_accept_length_count") == m.counters["spec_verify_steps_total"]
    assert "glmc_spec_accept_length_bucket" in m.render()


@pytest.mark.skipif(not (SMALL / "model.safetensors").exists(), reason="models/small is absent")
@pytest.mark.parametrize("n", [1, 3])
def test_greedy_cycles_run_whole_on_the_device_as_the_general_path_would(n):
    """A greedy cycle is queued whole before its read (verify, acceptance, the draft-extend over
    every verified position, the chain at positions computed on the device): its tokens, its
    drafts (so the acceptance, which a draft at a wrong position or with a wrong input changes)
    and its reads are the general path's, on models/small, whose drafts mostly hold, so the
    accepted counts vary from 0 to N. Requests that sample, ask for logprobs or near their end
    take the general path."""
    probe = build_engine(SMALL, warmup=False, overlap=False)
    ids = probe.tokenizer.encode((SMALL / "heldout.txt").read_text(encoding="utf-8"))
    stride = len(ids) // 5
    specs = [(ids[i * stride:i * stride + 50 + 7 * i], SamplingParams(
        max_tokens=30 + 3 * i, temperature=0.0, ignore_eos=True)) for i in range(4)]
    stop_id = run(probe, specs[:1])[0][0][20]
    specs.append((ids[4 * stride:4 * stride + 40], SamplingParams(max_tokens=30, temperature=0.0,
                                                                   stop_token_ids=[stop_id])))

    def go(on, specs):
        e = build_engine(SMALL, warmup=False, speculative_num_steps=n)
        e.speculator.device_cycles = on
        out = run(e, specs)
        c = e.metrics.counters
        return e, out, (c["spec_verify_steps_total"], c["spec_accepted_tokens_total"],
                        e.speculator.num_reads), e.speculator.num_device_cycles
    e, fast, counts, cycles = go(True, specs)
    _, general, want_counts, none = go(False, specs)
    # one read per cycle; a step that also carries the last prompt's chunk (the five prompts
    # overfill the first step) reads for its cycles and for the chunk apart
    assert same(fast, general) and counts[:2] == want_counts[:2] and none == 0
    assert want_counts[2] <= counts[2] <= want_counts[2] + 2, (counts, want_counts)
    assert cycles > counts[0] // (2 * len(specs)), (cycles, counts)
    assert 0 < counts[1] < counts[0] * n   # some drafts held, some not
    check_clean(e, specs, fast)
    others = [SamplingParams(max_tokens=30, temperature=0.7, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, logprobs=True, ignore_eos=True)]
    for params in others:
        assert go(True, [(specs[0][0], params)])[3] == 0


@pytest.mark.skipif(not (SMALL / "model.safetensors").exists(), reason="models/small is absent")
def test_prompts_arriving_leave_the_other_cycles_on_the_device():
    """A step that carries a new prompt's chunks (mixed prefill) runs the decoding requests'
    greedy cycles whole on the device and the chunks apart on the general path: same tokens and
    acceptance as every step on the general path, and every step with a request decoding makes a
    device cycle."""
    probe = build_engine(SMALL, warmup=False, overlap=False)
    ids = probe.tokenizer.encode((SMALL / "heldout.txt").read_text(encoding="utf-8"))
    stride = len(ids) // 4
    specs = [(ids[i * stride:i * stride + 150 + 9 * i], SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True)) for i in range(4)]

    def go(on):
        e = build_engine(SMALL, warmup=False, speculative_num_steps=3)
        e.speculator.device_cycles = on
        reqs, steps = [], []   # per step: (a chunk in it, a request decoding in it, device cycles after)
        while len(reqs) < len(specs) or not all(r.finished for r in reqs):
            if len(reqs) < len(specs) and len(steps) % 5 == 0:
                reqs.append(e.make_request(*specs[len(reqs)]))
                e.submit(reqs[-1])
            decoding = any(r.num_generated and not r.finished for r in reqs)
            chunk = any(not r.num_generated and not r.finished for r in reqs)
            e.step()
            steps.append((chunk, decoding, e.speculator.num_device_cycles))
        c = e.metrics.counters
        return [r.output_ids for r in reqs], steps, (c["spec_verify_steps_total"], c["spec_accepted_tokens_total"])
    fast, steps, counts = go(True)
    general, _, want = go(False)
    assert fast == general and counts == want
    mixed = [i for i, (chunk, decoding, _) in enumerate(steps) if chunk and decoding and i]
    assert len(mixed) >= 6, steps
    assert all(steps[i][2] == steps[i - 1][2] + 1 for i in mixed), steps


@pytest.mark.skipif(not (SMALL / "model.safetensors").exists(), reason="models/small is absent")
def test_cycles_chain_while_prompts_arrive_and_up_to_a_requests_end():
    """A chained cycle's requests sit out the step's schedule (`Scheduler.schedule(busy)`): the
    prompts that arrive meanwhile run their chunks beside it, and a request in its last cycles
    chains too (its tokens past its end are dropped): the tokens and acceptance of every cycle on
    the general path; a lone request's cycles all chain after its first; chained cycles in steps
    that carry a prompt's chunk."""
    probe = build_engine(SMALL, warmup=False, overlap=False)
    ids = probe.tokenizer.encode((SMALL / "heldout.txt").read_text(encoding="utf-8"))
    stride = len(ids) // 4
    specs = [(ids[i * stride:i * stride + 150 + 9 * i], SamplingParams(
        max_tokens=30 + i, temperature=0.0, ignore_eos=True)) for i in range(4)]

    def go(on, specs, every=4):
        e = build_engine(SMALL, warmup=False, speculative_num_steps=3)
        e.speculator.device_cycles = on
        reqs, steps = [], []   # per step: (a prompt's chunk in it, chained cycles after)
        while len(reqs) < len(specs) or not all(r.finished for r in reqs):
            if len(reqs) < len(specs) and len(steps) % every == 0:
                reqs.append(e.make_request(*specs[len(reqs)]))
                e.submit(reqs[-1])
            chunk = any(not r.num_generated and not r.finished for r in reqs)
            e.step()
            steps.append((chunk, e.metrics.cycles.get("chained", 0)))
        c = e.metrics.counters
        return ([r.output_ids for r in reqs], steps, e.metrics.cycles,
                (c["spec_verify_steps_total"], c["spec_accepted_tokens_total"]))
    out, _, cycles, _ = go(True, specs[:1])
    assert len(out[0]) == 30 and cycles["device"] == 1 and cycles["chained"] >= 6, cycles
    fast, steps, cycles, counts = go(True, specs)
    general, _, _, want = go(False, specs)
    assert fast == general and counts == want
    beside = [i for i in range(1, len(steps)) if steps[i][0] and steps[i][1] > steps[i - 1][1]]
    assert len(beside) >= 3, steps


@pytest.mark.skipif(not (SMALL / "model.safetensors").exists(), reason="models/small is absent")
@pytest.mark.parametrize("chained", [True, False])
def test_a_device_cycle_streams_the_cycle_befores_tokens_while_it_runs(monkeypatch, chained):
    """Chained (the default): each cycle after the first is queued from the one before's outputs
    before that one is read, and the one before's tokens stream while it runs (all taken at a
    read were streamed before it). Not chained: a cycle streams the tokens the cycle before took
    between queueing its work and its read; its own stream during the next."""
    from glmc.runtime.engine import speculative
    e = build_engine(SMALL, warmup=False, speculative_num_steps=3)
    e.speculator.overlap_cycles = chained
    ids = e.tokenizer.encode((SMALL / "heldout.txt").read_text(encoding="utf-8"))[:60]
    events, at_read = [], []
    req = e.make_request(ids, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))

    def streamed():   # tokens streamed so far (a cycle's run of them is one event)
        return events[-1].num_output_tokens if events else 0
    monkeypatch.setattr(speculative, "read_back", lambda t: at_read.append(
        (streamed(), len(req.output_ids), e.speculator.num_device_cycles)) or t.tolist())
    e.submit(req, events.append)
    after_step = []
    while not req.finished:
        e.step()
        after_step.append((streamed(), len(req.output_ids), e.speculator.num_device_cycles))
    device = [(i, n, out, cycles) for i, (n, out, cycles) in enumerate(at_read) if cycles > 1]
    assert len(device) > 3 and all(n == out for _, n, out, _ in device)   # all taken before streamed
    # read i (the first: the prompt's): chained, the cycle after the one read is queued already
    ahead = [cycles - i for i, _, _, cycles in device]
    if chained:
        assert ahead.count(1) >= len(ahead) - 2, ahead
        assert all(n == out for n, out, _ in after_step)   # streamed within the step
    else:
        assert set(ahead) == {0}, ahead
        assert sum(n < out for n, out, cycles in after_step[:-1] if cycles) > 3   # deferred to the next
    # a cycle's accepted run is one event: its text, its last token, the count so far
    assert "".join(ev.text for ev in events) == req.output_text
    assert [ev.token_id for ev in events] == [req.output_ids[ev.num_output_tokens - 1] for ev in events]
    assert len(events) < len(req.output_ids) and streamed() == len(req.output_ids) == 40
    cycles = e.metrics.cycles   # /metrics: cycles by how they ran
    assert cycles.get("chained", 0) + cycles["device"] == e.speculator.num_device_cycles
    assert (cycles.get("chained", 0) > 0) == chained and "general" not in cycles


def test_abort_mid_draft_frees_everything(tiny_ckpt):
    e = build_engine(tiny_ckpt, warmup=False, speculative_num_steps=3)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reqs = [e.make_request(p, params) for p in prompts(70, 20)]
    for r in reqs:
        e.submit(r)
    while not reqs[0].draft_ids:
        e.step()
    e.abort(reqs[0].rid)
    while not reqs[1].finished:
        e.step()
    assert reqs[0].finish_reason == "abort" and not reqs[0].draft_ids and reqs[0].row is None
    assert len(reqs[1].output_ids) == 40
    e.flush_cache()
    assert e.allocator.num_free == e.allocator.num_pages and e.req_pool.num_free == e.req_pool.max_reqs


@pytest.mark.parametrize("parallel", ["tp2", "dp2ep2"])
def test_parallel_server_with_mtp_gives_tp1_greedy_output(tiny_ckpt, tmp_path, parallel):
    """`glmc run --parallel tp2|dp2ep2 --speculative-num-steps 2`: two gloo ranks, rank 0 drafting
    and verifying through `DistRunner` (every rank steps every draft step), answer what the
    one-process plain engine does."""
    import asyncio

    import httpx
    from test_dist_serving import MAX_TOKENS, QUESTIONS, GlmcRun, ask_all
    plain = build_engine(tiny_ckpt, warmup=False)
    tok = plain.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [[tok.id_to_token(t) for t in r.output_ids] for r in plain.generate(ids, params)]
    args = ["--parallel", parallel, "--speculative-num-steps", "2", "--port", "0", "--log-level",
            "warning", "--num-pages", "16", "--max-running", "4", "--weights", "glmc-tiny",
            "--cache-dir", str(tiny_ckpt.parent)]
    with GlmcRun(args, tmp_path / "log") as run:
        assert asyncio.run(ask_all(run.url)) == want
        metrics = httpx.get(run.url.removesuffix("/v1") + "/metrics").text
    assert float(re.search(r"^glmc_spec_verify_steps_total (\S+)$", metrics, re.M).group(1)) > 0


def test_scheduler_reserves_draft_pages_and_rolls_them_back():
    """Drafts ride on the pending token's step; a rollback frees pages wholly past the accepted
    sequence and leaves the prefix cache with accepted tokens only."""
    from glmc.runtime.engine.pages import PageAllocator, ReqToTokenPool, slots_for
    from glmc.runtime.engine.prefix_cache import RadixCache
    from glmc.runtime.engine.request import Request
    from glmc.runtime.engine.scheduler import Scheduler
    allocator = PageAllocator(4)
    s = Scheduler(allocator, ReqToTokenPool(2, 512), RadixCache(allocator))
    req = Request(list(range(62)), SamplingParams(max_tokens=20))
    s.add(req)
    s.commit(s.schedule())
    req.output_ids.append(7)                            # token 62 pending; drafts for 63..66
    assert s.reserve(req, 62 + 4 + 1) and len(req.pages) == 2 and allocator.num_free == 2
    req.draft_ids = [1, 2, 3, 4]
    batch = s.schedule()
    assert batch.extend_lens == [5] and batch.prefix_lens == [62]
    assert s.req_pool.table[req.row, :67].tolist() == slots_for(req.pages, 0, 67)
    req.draft_ids = []                                  # the engine takes them for the step
    s.commit(batch)
    assert s.cache.num_cached_pages == 0                # page 0's last token is not known yet
    s.rollback(req, 63)                                 # draft 1 rejected: 62 and the bonus kept
    req.output_ids.append(9)
    s.offer_pages(req)
    assert len(req.pages) == 1 and allocator.num_free == 3   # positions 64.. were drafts only
    assert s.cache.num_cached_pages == 0                # 63 computed tokens: no page full yet
    s.commit(s.schedule())                              # the bonus token's KV: page 0 is full
    assert len(req.pages) == 1 and s.cache.num_cached_pages == 1
    assert cache_keys_of(s.cache) == [list(range(62)) + [7, 9]]
    s.finish(req, "length")
    s.cache.reset()
    assert allocator.num_free == 4


def test_reserve_walks_the_prefix_cache_only_when_free_pages_fall_short(monkeypatch):
    """Drafts reserve pages every cycle for every request: counting the cache's evictable pages
    walks its whole tree, so it is done only when the free pages do not cover the need."""
    from glmc.runtime.engine.pages import PageAllocator, ReqToTokenPool
    from glmc.runtime.engine.prefix_cache import RadixCache
    from glmc.runtime.engine.request import Request
    from glmc.runtime.engine.scheduler import Scheduler
    allocator = PageAllocator(4)
    cache = RadixCache(allocator)
    s = Scheduler(allocator, ReqToTokenPool(2, 512), cache)
    walks = []
    counted = cache.num_evictable_pages
    monkeypatch.setattr(cache, "num_evictable_pages", lambda: walks.append(1) or counted())
    req = Request(list(range(62)), SamplingParams(max_tokens=300))
    s.add(req)
    s.commit(s.schedule())
    walks.clear()
    assert s.reserve(req, 62 + 4 + 1) and not walks                 # 1 page needed, 3 free
    assert not s.reserve(req, 5 * 64) and walks == [1]              # 3 more needed, 2 free: counted
    assert len(req.pages) == 2 and allocator.num_free == 2          # nothing changed


def test_one_read_back_per_cycle_without_grammars(tiny_ckpt, monkeypatch):
    """Acceptance, the next draft inputs and the draft chain stay on the device: each cycle
    reads back once (accepted tokens, counts, logprobs in one packed tensor), whatever N, the
    batch's mix of greedy, sampled and logprob requests, or chunked prefills; a request whose
    draws read its history (penalties) reads its drafts as they are drawn."""
    from glmc.runtime.engine import sampling, speculative

    def never(*_):
        raise AssertionError("the plain sampler's read-back ran in a speculative cycle")
    monkeypatch.setattr(sampling.SampledTokens, "to_host", never)
    reads = []
    monkeypatch.setattr(speculative, "read_back", lambda t: reads.append(t.numel()) or t.tolist())
    plain = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=7, temperature=0.8, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True)]
    for n in (1, 3):
        e = build_engine(tiny_ckpt, warmup=False, max_batch_tokens=48, speculative_num_steps=n)
        reqs = [e.make_request(p, params) for p, params in zip(prompts(70, 9, 30), plain)]
        for r in reqs:
            e.submit(r)
        reads.clear()
        cycles = 0   # steps that append tokens (a step of prefill chunks only has none to read)
        while not all(r.finished for r in reqs):
            before, emitted = len(reads), sum(len(r.output_ids) for r in reqs)
            e.step()
            cycles += sum(len(r.output_ids) for r in reqs) > emitted
            assert len(reads) - before == (sum(len(r.output_ids) for r in reqs) > emitted)
        assert e.speculator.num_reads == len(reads) == cycles > 3
    penalised = SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)
    e = build_engine(tiny_ckpt, warmup=False, speculative_num_steps=3)
    run(e, [(prompts(12)[0], penalised)])
    assert e.speculator.num_reads > e.metrics.counters["spec_verify_steps_total"]


@pytest.mark.skipif(not (SMALL / "model.safetensors").exists(), reason="models/small is absent")
def test_tokens_stream_after_the_drafts_are_queued_and_stop_strings_cut_there(monkeypatch):
    """A cycle takes its tokens (its drafts read them) and streams them once its drafts are
    queued, while they run: the events are the plain engine's, one per kept token,
    none past a stop string (the taken tokens after it are dropped), the last one finishing the
    request. The small model accepts most drafts, so a stop string often ends mid-cycle."""
    from glmc.runtime.engine import speculative
    stream, dropped = speculative.MtpSpeculator._stream, []

    def counted(self):
        taken = [(r, len(r.output_ids)) for _, r, _ in self.unstreamed]
        stream(self)
        dropped.extend(n - len(r.output_ids) for r, n in taken if r.finish_reason == "stop")
    monkeypatch.setattr(speculative.MtpSpeculator, "_stream", counted)
    plain = build_engine(SMALL, warmup=False, overlap=False)
    p = plain.tokenizer.encode((SMALL / "heldout.txt").read_text(encoding="utf-8"))[:40]

    def events(e, params):
        got = []
        req = e.make_request(p, params)
        e.submit(req, got.append)
        while not req.finished:
            e.step()
        while e.step():
            pass
        return req, [(ev.token_id, ev.text, ev.finish_reason, ev.num_output_tokens) for ev in got]
    text = events(plain, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].output_text
    for a, b in ((6, 9), (10, 13), (14, 17)):
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[text[a:b]])
        want_req, want = events(plain, params)
        e = build_engine(SMALL, warmup=False, speculative_num_steps=3)
        req, got = events(e, params)
        assert want_req.finish_reason == "stop" and len(want_req.output_ids) < 24
        assert got == want and req.output_ids == want_req.output_ids
        assert req.output_text == want_req.output_text
        e.flush_cache()
        assert e.allocator.num_free == e.allocator.num_pages
    assert any(dropped), dropped


@pytest.mark.skipif(not (SMALL / "model.safetensors").exists(), reason="models/small is absent")
def test_a_cycles_run_of_tokens_streams_as_one_event_with_the_text_of_one_by_one():
    """`Engine.append_tokens`: a run that only its count could end goes as one event (one
    detokenizer pass, one metrics record) whose text and counts are what appending the tokens
    one by one gives, multi-byte characters split across tokens included; a run with a stop
    token, stop strings or logprobs goes token by token and stops where one by one would."""
    e = build_engine(SMALL, warmup=False, overlap=False)
    text = "def f(x):\n    return 'héllo wörld ✓ 日本語'  # ünïcode\n" * 3
    ids = e.tokenizer.encode(text)

    def appended(params, runs, one_by_one):
        req = e.make_request(ids[:5], params)
        events = []
        e.submit(req, events.append)
        e._drain_inbox()
        for run in runs:
            if one_by_one:
                for t in run:
                    if not req.finished:
                        e.append_token(req, t, None)
            elif not req.finished:
                e.append_tokens(req, [(t, None) for t in run])
        return req, events

    runs = [ids[i:i + 3] for i in range(5, len(ids) - 3, 3)]
    before = e.metrics.counters["generation_tokens_total"]
    greedy = SamplingParams(max_tokens=1000, temperature=0.0)
    req, events = appended(greedy, runs, one_by_one=False)
    assert e.metrics.counters["generation_tokens_total"] - before == len(req.output_ids) == 3 * len(runs)
    want, want_events = appended(greedy, runs, one_by_one=True)
    assert req.output_text == want.output_text == "".join(ev.text for ev in events)
    assert req.output_ids == want.output_ids and len(events) == len(runs) < len(want_events)
    assert [ev.num_output_tokens for ev in events] == [3 * (k + 1) for k in range(len(runs))]
    for params in (SamplingParams(max_tokens=1000, temperature=0.0, stop=["wörld"]),
                   SamplingParams(max_tokens=1000, temperature=0.0, stop_token_ids=[ids[12]]),
                   SamplingParams(max_tokens=10, temperature=0.0)):
        got, _ = appended(params, runs, one_by_one=False)
        want, _ = appended(params, runs, one_by_one=True)
        assert got.finished and (got.output_ids, got.output_text, got.finish_reason) == \
            (want.output_ids, want.output_text, want.finish_reason), params


def test_a_request_offers_the_prefix_cache_each_page_once_as_it_fills(tiny_ckpt):
    """Speculative cycles offer a request's pages after every take; the cache is walked only when
    a page has filled since the last offer (and once more at the release)."""
    e = build_engine(tiny_ckpt, warmup=False, speculative_num_steps=2)
    inserts = []
    cache = e.scheduler.ranks[0].cache
    insert = cache.insert
    cache.insert = lambda tokens, pages: inserts.append(len(pages)) or insert(tokens, pages)
    req, = [e.make_request(prompts(70)[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))]
    e.submit(req)
    while not req.finished:
        e.step()
    assert len(req.output_ids) == 200 and e.metrics.counters["spec_verify_steps_total"] > 60
    full = (70 + 200) // 64
    assert sorted(set(inserts)) == list(range(1, full + 1)) and len(inserts) <= full + 2, inserts
