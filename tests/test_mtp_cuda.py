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
    assert e.runner.executor.phase_buckets["mtp_verify"] == [3, 6, 12]   # decode buckets x (N + 1)
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
