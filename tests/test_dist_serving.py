"""Serving over several ranks. In process: the engine's attention-DP scheduling (one scheduler,
pool and req_to_token per DP rank, requests balanced, idle ranks still stepping). For real:
`glmc run --parallel tp2 | dp2ep2` as gloo processes behind the HTTP API, called with the `openai`
client, gives the same greedy output as tp1."""
import asyncio
import re

import httpx
import openai
import pytest
import torch
from glmc.runtime.engine.engine import Engine
from glmc.runtime.engine.sampling import SamplingParams
from glmc.runtime.engine.tokenizer import Tokenizer
from glmc.runtime.worker.loader import load_runner
from glmc.runtime.worker.model_runner import ModelRunner
from test_run_cli import GlmcRun

from glmc.api import build_engine, plan_for
from glmc.tiny import TINY_NAME, make_tiny_checkpoint

MAX_TOKENS = 8
QUESTIONS = ["What is 2+2?", "Name a colour.", "Tell me a joke about compilers.", "Hello!",
             "Why is the sky blue? Answer at length, please."]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cache") / "tiny")


class TwoDPRanks(ModelRunner):
    """Two tp1 plans, each with its own KV pool, standing in for two attention-DP ranks."""

    num_dp = 2

    def __init__(self, ckpt):
        plan = plan_for(ckpt)
        self.ranks = [load_runner(plan, ckpt, num_pages=8) for _ in range(2)]
        r = self.ranks[0]
        self.vocab_size, self.num_pages, self.max_context = r.vocab_size, r.num_pages, r.max_context
        self.modes: list[tuple[str, str]] = []

    def forward(self, batch):
        raise AssertionError("a DP runner is driven through forward_dp")

    def forward_dp(self, batches):
        self.modes.append(tuple(b.mode for b in batches))
        return [r.forward(b) if b.num_tokens else torch.empty(0, self.vocab_size)
                for r, b in zip(self.ranks, batches)]


def prompts(n):
    return [[(31 * i + 7 * k) % 500 + 10 for i in range(20 + 23 * k)] for k in range(n)]


def test_dp_ranks_split_requests_and_serve_what_one_rank_does(ckpt):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [r.output_ids for r in build_engine(ckpt, warmup=False).generate(prompts(5), params)]
    runner = TwoDPRanks(ckpt)
    engine = Engine(runner, Tokenizer.from_dir(ckpt), max_running=4, max_batch_tokens=64)
    reqs = engine.generate(prompts(5), params)
    assert [r.output_ids for r in reqs] == want
    assert [r.dp_rank for r in reqs] == [0, 1, 0, 1, 0]  # least loaded first
    assert engine.metrics.admitted_by_dp_rank == {0: 3, 1: 2}
    assert ("decode", "idle") in runner.modes  # rank 1 finished first and kept stepping
    for s in engine.scheduler.ranks:  # every rank's pages and rows come back
        assert s.num_pages_held == 0 and s.req_pool.num_free == s.req_pool.max_reqs
    # Each rank has its own prefix cache; at equal load a request goes where its prefix is.
    again = engine.generate([prompts(5)[3]], params) + engine.generate([prompts(5)[4]], params)
    assert [r.dp_rank for r in again] == [1, 0] and [r.num_cached_tokens for r in again] == [64, 64]
    assert [r.output_ids for r in again] == want[3:]


@pytest.fixture(scope="module")
def tp1_answers(ckpt):
    """Greedy answers of the one-process tp1 engine: token ids of each chat question."""
    engine = build_engine(ckpt, warmup=False)
    tok = engine.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    return [[tok.id_to_token(t) for t in r.output_ids] for r in engine.generate(ids, params)]


async def ask_all(url: str) -> list[list[str]]:
    """Every question at once (so DP ranks share the load), one of them streamed."""
    c = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)

    async def one(i, q):
        kw = dict(model=TINY_NAME, messages=[{"role": "user", "content": q}], temperature=0,
                  max_tokens=MAX_TOKENS, logprobs=True, extra_body={"ignore_eos": True})
        if i != 1:
            r = await c.chat.completions.create(**kw)
            return [t.token for t in r.choices[0].logprobs.content]
        stream = await c.chat.completions.create(stream=True, **kw)
        return [t.token async for ch in stream if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    try:
        return await asyncio.gather(*(one(i, q) for i, q in enumerate(QUESTIONS)))
    finally:
        await c.close()


@pytest.mark.parametrize("parallel", ["tp2", "dp2ep2"])
def test_parallel_server_gives_tp1_greedy_output(ckpt, tp1_answers, tmp_path, parallel):
    args = ["--parallel", parallel, "--port", "0", "--log-level", "warning", "--num-pages", "16",
            "--max-running", "4", "--weights", "glmc-tiny", "--cache-dir", str(ckpt.parent)]
    with GlmcRun(args, tmp_path / "log") as run:
        assert asyncio.run(ask_all(run.url)) == tp1_answers
        one = run.client.completions.create(model=TINY_NAME, prompt="Hi", max_tokens=3,
                                            extra_body={"ignore_eos": True})  # a drawn eos stops it
        assert one.usage.completion_tokens == 3  # a single request: the other DP rank idles
        metrics = httpx.get(run.url.removesuffix("/v1") + "/metrics").text
        admitted = dict(re.findall(r'requests_admitted_total\{dp_rank="(\d)"\} (\d+)', metrics))
        assert set(admitted) == ({"0", "1"} if parallel.startswith("dp") else {"0"})


def test_followers_see_each_request_in_its_own_row():
    """What rank 0 ships is cut to the batch's rows; a follower puts them back at their real rows,
    so a request keeps its row on every rank as the batch around it changes (the CUDA target keeps
    rows on the device between steps)."""
    from glmc.runtime.engine.distributed import RowMirror, compact
    from glmc.runtime.worker.forward_batch import ForwardBatch
    table = torch.arange(8 * 128).view(8, 128)
    mirror = RowMirror()
    first = ForwardBatch.build("extend", [[1] * 5, [2] * 7], [3, 6], [0, 0], table)
    got = mirror.apply(compact(first))
    assert got.req_pool_indices.tolist() == [3, 6]
    assert torch.equal(got.req_to_token[3, :5], table[3, :5])
    assert torch.equal(got.req_to_token[6, :7], table[6, :7])
    later = ForwardBatch.build("decode", [[9]], [6], [7], table)   # request 3 finished
    got = mirror.apply(compact(later))
    assert got.req_pool_indices.tolist() == [6] and torch.equal(got.req_to_token[6, :8], table[6, :8])
    assert mirror.apply(compact(ForwardBatch.idle(table))).mode == "idle"
