"""The prefill step's indexer on the CUDA target (run on the CPU, Triton interpreted): an eager
prefill whose requests average >= TOKEN_RUN tokens scores keys with the token-block kernel, and its
logits are the per-token kernel's (the same top-k: the scores differ only in the order of the sum
over heads); a block that straddles two requests is scored right."""

import pytest
import torch
from glmc.codegen import triton_launch as tt
from glmc.compiler import compile_plan
from glmc.config import Options
from glmc.parallel import parse_parallel
from glmc.runtime.worker import cuda_executor
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.loader import load_runner
from glmc.spec import load_spec

from bench.common import req_table

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_long_prefill_runs_take_the_token_block_indexer(tiny_ckpt, monkeypatch):
    spec = load_spec(tiny_ckpt)
    plan = compile_plan(spec, parse_parallel("tp1", spec.config), Options(device="cuda", max_batch=2))
    ex = load_runner(plan, tiny_ckpt, device="cpu", num_pages=8, max_context=256, max_running=2,
                     capture=False).executor
    tiled = []
    scores = tt.indexer_scores
    monkeypatch.setattr(tt, "indexer_scores", lambda *a, **kw: tiled.append(kw.get("tiled")) or scores(*a, **kw))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (130, 20)]   # 150 tokens / 2 >= 64
    batch = ForwardBatch.build("extend", prompts, [0, 1], [0, 0], req_table(2, 4))
    got = ex.forward("prefill", batch)["logits"]
    assert tiled and all(tiled), tiled            # every full indexer layer: the token-block kernel
    tiled.clear()
    monkeypatch.setattr(cuda_executor, "TOKEN_RUN", 10 ** 6)
    want = ex.forward("prefill", batch)["logits"]
    assert tiled and not any(tiled), tiled
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    short = ForwardBatch.build("extend", [p[:20] for p in prompts], [0, 1], [0, 0], req_table(2, 4))
    monkeypatch.setattr(cuda_executor, "TOKEN_RUN", 64)
    tiled.clear()
    ex.forward("prefill", short)                  # 20 tokens a request: the per-token kernel
    assert tiled and not any(tiled), tiled
