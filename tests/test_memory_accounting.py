"""The bytes a runner holds against the plan's sizer (issue 10, items 1 and 5), on the CPU.

- Every expert weight is held once: the loader stacks each rank's experts into [E, ...] stacks and
  drops the per-expert entries (bf16 and FP8, the CUDA and the torch target, an EP shard's experts).
- `glmc explain`'s per-rank memory (passes/plan_memory.py) matches, field by field within 5%, what
  the CUDA target's runner loaded on the CPU holds after a prefill and a decode step
  (`bench/memory_check.runner_bytes`: unique storages of weights + expert stacks, the copies the CUDA
  target's op table keeps beside them, the KV and indexer pools, the req_to_token table), for bf16
  and FP8 plans with bf16 and FP8 KV.
"""
import json
import sys
from pathlib import Path

import pytest
import torch
from test_fp8_plan import cuda_plan, runner
from tiny_hf import save_tiny, save_tiny_fp8

from glmc.codegen.fp8_ref import Fp8Weight
from glmc.runtime.worker.comm import Coords
from glmc.runtime.worker.loader import stack_experts
from glmc.runtime.worker.shards import cut_rank_weights
from glmc.spec import kv_dtyped, load_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from memory_check import compare, explain_bytes, first_steps, runner_bytes  # noqa: E402


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{"bf16": a tiny checkpoint whose config says bfloat16, "fp8": a block-FP8 one}."""
    bf16, fp8 = tmp_path_factory.mktemp("bf16"), tmp_path_factory.mktemp("fp8")
    save_tiny(bf16, "grouped", seed=3)
    cfg = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    save_tiny_fp8(fp8, "grouped", seed=3)
    return {"bf16": bf16, "fp8": fp8}


def _experts_once(ex, plan):
    """No per-expert entry left in the weights; one [E, ...] stack per projection of each MoE layer."""
    assert not [n for n in ex.weights if ".experts." in n]
    moe = {op.attr("weight"): int(op.attr("experts")) for g in plan.graphs.values() for op in g.ops
           if op.kind == "moe.experts"}
    assert moe and {k for k in ex._stacks if not isinstance(k, tuple)} == set(moe)
    for key, parts in ex._stacks.items():
        if not isinstance(key, tuple):
            assert [p.shape[0] for p in parts] == [moe[key]] * 3


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_each_expert_is_held_once(ckpts, fmt, target):
    plan = cuda_plan(load_spec(ckpts[fmt]))
    assert plan.dtypes.weight == fmt
    ex = runner(plan, ckpts[fmt], target=target)
    _experts_once(ex, plan)
    stacked = [p for k, parts in ex._stacks.items() if not isinstance(k, tuple) for p in parts]
    want = Fp8Weight if fmt == "fp8" and target == "cuda" else torch.Tensor
    assert all(isinstance(p, want) for p in stacked)
    held = runner_bytes(ex)["weights"]
    per_name = sum(w.nbytes for w in ex.weights.values()) + sum(p.nbytes for p in stacked)
    assert held == per_name       # no storage shared, none counted twice
    want_mem = plan.graphs["decode"].meta["memory"]["weights_bytes"]
    if target == "cuda":
        assert abs(held / want_mem - 1) <= 0.05, (held, want_mem)


def test_an_ep_rank_stacks_only_its_experts(ckpts):
    """tp2ep2, rank 1: experts 4..7 of 8, stacked in order, nothing of them left per expert."""
    from safetensors.torch import load_file
    full = load_file(ckpts["bf16"] / "model.safetensors")
    plan = cuda_plan(load_spec(ckpts["bf16"]), "tp2ep2")
    coords = Coords(1, plan.mesh)
    local = cut_rank_weights(full, plan, coords)
    stacks = stack_experts(local, plan, coords)
    assert stacks and not [n for n in local if ".experts." in n]
    for key, (gate, up, down) in stacks.items():
        assert gate.shape[0] == 4 and torch.equal(gate[0], full[f"{key}.4.gate_proj.weight"])
        assert torch.equal(down[3], full[f"{key}.7.down_proj.weight"])


@pytest.mark.parametrize("fmt,kv", [("bf16", None), ("bf16", "fp8"), ("fp8", "fp8")])
def test_explain_matches_what_the_runner_holds(ckpts, fmt, kv, one_torch_thread):
    plan = cuda_plan(kv_dtyped(load_spec(ckpts[fmt]), kv))
    ex = runner(plan, ckpts[fmt])
    first_steps(ex, 1, 32)       # the op table makes its re-laid-out copies on first use
    fields = compare(runner_bytes(ex), explain_bytes(plan, ex))
    bad = {f: v for f, v in fields.items() if not v["pass"]}
    assert not bad, bad
    assert fields["kv"]["measured"] == fields["kv"]["explain"]
    assert fields["index"]["measured"] == fields["index"]["explain"]
