"""MTP speculative decoding on the CUDA target, run on the CPU: the plan's Triton
kernels interpreted, no graph capture (the H200 check, `bench/mtp_gpu_check.py`, replays the
captured verify and draft graphs through the same `CudaExecutor.run_tokens`).

The verify phase is a decode step over several tokens per row and the draft phase one over the
MTP layer with a hidden row per token; the greedy output with drafts equals the output without,
token for token, with a prefix-cache hit and with cycles run whole on the device, and every page
comes back.
"""
import pytest
from glmc.runtime.engine.sampling import SamplingParams
from glmc.runtime.engine.startup import build_engine
from glmc.runtime.worker.cuda_executor import CudaExecutor

from glmc.api import plan_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(e, waves):
    """Each wave's (prompt, params) at once, waves one after another; -> every request's tokens."""
    out = []
    for specs in waves:
        reqs = [e.make_request(p, params) for p, params in specs]
        for r in reqs:
            e.submit(r)
        while not all(r.finished for r in reqs):
            e.step()
        out += [r.output_ids for r in reqs]
    return out


def engine(ckpt, n=0):
    plan = plan_for(ckpt, device="cuda", max_running=4, speculative_num_steps=n)
    return build_engine(plan, ckpt, device="cpu", warmup=False, max_running=4, num_pages=16,
                        overlap=False, speculative_num_steps=n)


def test_greedy_with_mtp_on_the_cuda_target_equals_without(tiny_ckpt):
    """Also with cycles run whole on the device (ids, positions and slots of the chain computed
    there: `CudaExecutor._device_inputs`), once the requests carry N drafts and room for them."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = [(37 * i + 11) % 500 + 10 for i in range(66)]
    specs = [[(first, greedy), ([11, 12, 13], greedy)], [(first[:64] + [5], greedy)]]  # a prefix hit
    want = run(engine(tiny_ckpt), specs)
    e = engine(tiny_ckpt, 2)
    assert isinstance(e.runner.executor, CudaExecutor) and e.runner.supports_speculative
    buckets = e.runner.executor.phase_buckets
    # decode buckets x (N + 1), then the prefill graphs' token counts (steps with prompts' chunks)
    assert buckets["mtp_verify"] == [3, 6, 12] + [b for b in buckets["prefill"] if b > 12] == [3, 6, 12, 16, 32, 64, 128, 256]
    assert set(buckets["mtp_draft"]) == set(buckets["mtp_verify"]) | set(buckets["decode"])
    assert run(e, specs) == want
    assert e.speculator.num_device_cycles > 0
    c = e.metrics.counters
    assert c["spec_verify_steps_total"] > 0 and c["prefix_cache_hit_tokens_total"] >= 64
    e.flush_cache()
    assert e.allocator.num_free == e.allocator.num_pages and e.req_pool.num_free == e.req_pool.max_reqs


def test_rows_are_copied_to_the_device_only_for_a_prefix_hit(tiny_ckpt, monkeypatch):
    """A verify copies its requests' req_to_token rows to the device only when the step admitted a
    request on cached pages (the device never computed those positions for its row, which still
    holds an earlier request's slots); every other speculative step finds them there."""
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    a = [(37 * i + 11) % 500 + 10 for i in range(66)]
    b = [(53 * i + 7) % 500 + 10 for i in range(66)]
    waves = [[(a, greedy), (b, short)], [(b[:64] + [5], greedy)]]
    want = run(engine(tiny_ckpt), waves)
    e = engine(tiny_ckpt, 2)
    loads = []
    original = CudaExecutor._load_rows
    monkeypatch.setattr(CudaExecutor, "_load_rows", lambda self, batch, width=None: loads.append(width)
                        or original(self, batch, width))
    got = run(e, waves[:1])
    assert loads == [] and e.req_pool._free[-1] == 0   # the next request gets a's row, b's pages
    got += run(e, waves[1:])
    assert got == want
    assert loads == [64]                                 # the admission step only: b's 64 cached positions


def test_a_cycle_in_one_call_is_the_steps_it_fuses(tiny_ckpt):
    """`CudaExecutor.cycle` (the body a cycle graph captures) against the general path's steps
    run one by one: verify, greedy acceptance, the draft-extend over the kept positions only,
    the chain at host positions. The drafts are the plain run's next tokens up to `held` and a
    wrong one after, so each count (which the tiny model's own drafts almost never make > 0) and
    the chain's positions and slots that follow from it are exercised, over one request's state
    (each cycle rewrites the positions the one before wrote)."""
    import torch
    from glmc.runtime.worker.forward_batch import ForwardBatch
    N = 2
    prompt = [(37 * i + 11) % 500 + 10 for i in range(66)]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    truth = run(engine(tiny_ckpt), [[(prompt, greedy)]])[0]
    e = engine(tiny_ckpt, N)
    assert e.runner.supports_cycle
    req = e.make_request(prompt, greedy)
    e.submit(req)
    while not req.output_ids:   # the prefill
        e.step()
    s, ex = e.scheduler.ranks[0], e.runner.executor
    n = req.num_computed
    assert req.output_ids == truth[:1] and n == len(prompt)
    assert s.reserve(req, n + 2 * N + 2)
    table = s.req_pool.table
    slots = torch.cat([torch.tensor([[n, N]]), table[req.row, n + 1:n + 2 * N][None]], 1)
    for held in (2, 1, 0):
        wrong = (truth[held + 1] + 1) % 500 + 10
        ids = [truth[0], *truth[1:1 + held], *[wrong] * (N - held)]
        got = ex.cycle(ForwardBatch.build("extend", [ids], [req.row], [n], table), slots, N)
        a = int(got[0])   # the device's table maps every position the cycle wrote to its own slot
        assert ex.r2t[req.row, n:n + a + N].tolist() == table[req.row, n:n + a + N].tolist()
        out = ex.forward("mtp_verify", ForwardBatch.build("extend", [ids], [req.row], [n], table))
        target = out["logits"].argmax(-1)
        a = int((target[:N] == torch.tensor(ids[1:])).long().cumprod(0).sum())
        assert a == held and target[:held + 1].tolist() == truth[1:held + 2]
        kept = ForwardBatch.build("extend", [target[:a + 1].tolist()], [req.row], [n], table)
        d = ex.forward("mtp_draft", kept, hidden=out["hidden"][:a + 1])
        drafts, hidden = [int(d["logits"][a].argmax())], d["hidden"][a:a + 1]
        for k in range(1, N):
            step = ForwardBatch.build("extend", [[drafts[-1]]], [req.row], [n + a + k], table)
            d = ex.forward("mtp_draft", step, hidden=hidden)
            drafts.append(int(d["logits"][0].argmax()))
            hidden = d["hidden"]
        assert got[0].tolist() == [a] and got[1].tolist() == target.tolist() and got[2].tolist() == [drafts], held


def test_a_cycle_chained_on_the_device_is_the_cycle_the_host_would_queue(tiny_ckpt):
    """`CudaExecutor.cycle_after` (the `mtp_cycle_next` graph's body: the next cycle's ids,
    positions, slots and table made on the device from the last cycle's unread outputs) gives
    what `cycle` gives when the host reads that cycle and builds the next from its counts: the
    same counts, tokens and drafts, and the same slots in the device's table. Drafts of the plain
    run's tokens up to `held` make each count; two cycles chain after the first."""
    import torch
    from glmc.runtime.worker.forward_batch import ForwardBatch
    N = 2
    prompt = [(37 * i + 11) % 500 + 10 for i in range(66)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    truth = run(engine(tiny_ckpt), [[(prompt, greedy)]])[0]

    def first_cycle(held):
        e = engine(tiny_ckpt, N)
        req = e.make_request(prompt, greedy)
        e.submit(req)
        while not req.output_ids:
            e.step()
        s, ex = e.scheduler.ranks[0], e.runner.executor
        n = req.num_computed
        assert s.reserve(req, n + 9 * N + 9)
        table = s.req_pool.table
        wrong = (truth[held + 1] + 1) % 500 + 10
        ids = [truth[0], *truth[1:1 + held], *[wrong] * (N - held)]
        slots = torch.cat([torch.tensor([[n, N]]), table[req.row, n + 1:n + 2 * N][None]], 1)
        return ex, req, table, n, ex.cycle(ForwardBatch.build("extend", [ids], [req.row], [n], table), slots, N)

    for held in (2, 0):
        ex, req, table, n, got = first_cycle(held)
        chained = []
        for _ in range(2):
            a = int(got[0])
            n_next = n + 1 + a
            window = table[req.row, n + 1:n + 3 * N + 1][None]
            got = ex.cycle_after(window, N)
            chained.append([t.tolist() for t in got])
            n = n_next
        r2t = ex.r2t[req.row, :n + N + 1].tolist()
        ex, req, table, n, got = first_cycle(held)
        host = []
        for _ in range(2):
            a, target, drafts = int(got[0]), got[1].tolist(), got[2][0].tolist()
            n += 1 + a
            ids = [target[a], *drafts]
            slots = torch.cat([torch.tensor([[n, N]]), table[req.row, n + 1:n + 2 * N][None]], 1)
            got = ex.cycle(ForwardBatch.build("extend", [ids], [req.row], [n], table), slots, N)
            host.append([t.tolist() for t in got])
        assert chained == host, held
        assert ex.r2t[req.row, :n + N + 1].tolist() == r2t == table[req.row, :n + N + 1].tolist()
