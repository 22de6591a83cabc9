"""The fuzzer (`tests/server_fuzz.py`) for about a minute against the tiny model: thousands of
generated bodies, zero 5xx, every error in OpenAI's shape, the server healthy and its KV pool
empty afterwards. The long run (100k bodies) is `python tests/server_fuzz.py`."""
import asyncio

import pytest
from glmc.api import build_engine
from glmc.runtime.serving.server import create_app
from server_fuzz import MODEL, fuzz, settled
from test_server import Server

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NUM_CASES = 2000


def test_fuzzed_requests_get_4xx_or_well_formed_answers(tiny_ckpt):
    # a short context bounds every generation (a body without max_tokens asks for all of it)
    engine = build_engine(tiny_ckpt, warmup=False, num_pages=32, max_context=256,
                          max_running=16, max_waiting=4096)
    with Server(create_app(engine, MODEL)) as server:
        report = asyncio.run(fuzz(server.url, NUM_CASES, seed=0))
        assert not report.failures, "\n".join(report.failures)
        assert report.sent == NUM_CASES and report.statuses.get(200, 0) > NUM_CASES // 10
        assert settled(server.url) is None
        engine.flush_cache()
        assert engine.allocator.num_free == engine.allocator.num_pages
        assert engine.req_pool.num_free == engine.req_pool.max_reqs
