"""The bytes a runner holds against the plan's sizer, on the CPU.

- Every expert weight is held once: the loader stacks each rank's experts into [E, ...] stacks and
  drops the per-expert entries (bf16 and FP8, the CUDA and the torch target, an EP shard's experts).
- `glmc explain`'s per-rank memory (passes/plan_memory.py) matches, field by field within 5%, what
  the CUDA target's runner loaded on the CPU holds after a prefill and a decode step
  (`bench/memory_check.runner_bytes`: unique storages of weights + expert stacks, the copies the CUDA
  target's op table keeps beside them, the KV and indexer pools, the req_to_token table), for bf16
  and FP8 plans with bf16 and FP8 KV.
- The plan-memory pass's step model (`passes/step_memory.py`) equals what the CUDA target's runner
  allocates on the CPU, measured by `runtime/worker/live_bytes.LiveBytes` (every tensor storage a
  step creates, views once, until it dies): op by op (live bytes at the op's start, its peak, at its
  end) for a prefill at the plan's largest chunk, eager decodes at buckets 1 and 4 and capture-like
  runs of the decode body (what `CudaExecutor.capture` records) at every bucket, bf16 and FP8 plans.
  Tolerance: 8 bytes per op, for one 0-d tensor torch.where makes of a Python scalar on the CPU
  (host memory on a GPU, where the model does not count it). Allocator rounding (512-byte blocks) is
  the model's `rounding`, checked separately; the 2 MB segments are not modelled. A workspace left
  out of an op's model fails the per-op comparison naming the op (checked by leaving one out).
"""
import json

import pytest
import torch
from test_fp8_plan import cuda_plan, runner
from tiny_hf import save_tiny, save_tiny_fp8

from glmc.codegen.fp8_ref import Fp8Weight
from glmc.compiler import compile_plan
from glmc.config import Options
from glmc.parallel import parse_parallel
from glmc.passes import op_memory
from glmc.passes.plan_memory import target_of
from glmc.passes.step_memory import graph_pool, step_memory
from glmc.runtime.worker.comm import Coords
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.live_bytes import LiveBytes, measure
from glmc.runtime.worker.loader import load_runner, stack_experts
from glmc.runtime.worker.shards import cut_rank_weights
from glmc.spec import kv_dtyped, load_spec

from bench.common import decode_batch, req_table
from bench.memory_check import compare, explain_bytes, first_steps, model_step, runner_bytes


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
    assert moe and {k for k in ex.stacks if not isinstance(k, tuple)} == set(moe)
    for key, parts in ex.stacks.items():
        if not isinstance(key, tuple):
            assert [p.shape[0] for p in parts] == [moe[key]] * 3


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_each_expert_is_held_once(ckpts, fmt, target):
    plan = cuda_plan(load_spec(ckpts[fmt]))
    assert plan.dtypes.weight == fmt
    ex = runner(plan, ckpts[fmt], target=target)
    _experts_once(ex, plan)
    stacked = [p for k, parts in ex.stacks.items() if not isinstance(k, tuple) for p in parts]
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


# ----------------------------------------------------------------------------- the step model
CHUNK = 64       # the plan's largest prefill chunk (Options.chunked_prefill), small for the interpreter
SCALAR = 8       # torch.where's wrapped Python scalar: a 0-d CPU tensor the model does not count


class Measured:
    """One CPU runner's steps under LiveBytes: {point name: (model args, LiveBytes)}."""

    def __init__(self, ckpt):
        spec = load_spec(ckpt)
        self.plan = compile_plan(spec, parse_parallel("tp1", spec.config),
                                 Options(device="cuda", max_batch=4, chunked_prefill=CHUNK))
        self.runner = ex = load_runner(self.plan, ckpt, device="cpu", num_pages=8, max_context=128,
                                       max_running=4, capture=False).executor
        table = req_table(4, 2)
        ex.forward("prefill", ForwardBatch.build("extend", [[5] * 4] * 2, [2, 3], [0, 0], table))  # weight copies
        prompts = [list(range(1, 33)), list(range(40, 72))]
        chunk = ForwardBatch.build("extend", prompts, [0, 1], [0, 0], table)
        self.points = {"prefill": (("prefill", CHUNK, 2, 32, "prefill"),
                                   measure(ex, lambda: ex.forward("prefill", chunk)))}
        for b in (1, 4):
            seqs = [p + [7] for p in prompts] + [[5] * 5] * 2
            batch = decode_batch(seqs[:b], table)
            mem = measure(ex, lambda: ex.forward("decode", batch))
            self.points[f"decode{b}"] = (("decode", b, b, 128, "eager"), mem)
        self.graphs_keep = self._capture_like()

    def _capture_like(self) -> int:
        """`CudaExecutor.capture`'s recorded region per bucket (largest first), each bucket's static
        inputs made and its outputs kept, as the graphs keep them; -> the bytes kept after the last."""
        ex, kept = self.runner, []
        with LiveBytes() as mem:
            for b in sorted(ex.buckets, reverse=True):
                packed = torch.zeros(4, b, dtype=torch.int64)     # made outside the pool, kept
                packed[2].fill_(ex.scratch), packed[3].fill_(ex.pad_row)
                with mem.region(b) as r:
                    kept.append((packed, ex.run_tokens("decode", packed)))
                self.points[f"graph{b}"] = (("decode", b, b, 128, "graph"), r.peak - r.start)
            return mem.live


@pytest.fixture(scope="module")
def measured(ckpts, one_torch_thread):
    cache = {}

    def get(fmt):
        if fmt not in cache:
            cache[fmt] = Measured(ckpts[fmt])
        return cache[fmt]
    return get


def mismatches(mem: LiveBytes, model) -> list[str]:
    """Ops whose (start, peak, end) differ between the measurement and the model by more than SCALAR."""
    out = []
    for r, (op, start, peak, end) in zip(mem.regions, model.regions, strict=True):
        got, want = (r.start, r.peak - r.start, r.end - r.start), (start, peak - start, end - start)
        if any(abs(g - w) > SCALAR for g, w in zip(got, want)):
            out.append(f"{op.where()}: measured (start, +peak, +kept) {got}, model {want}")
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_the_step_model_equals_the_cpu_runner_op_by_op(measured, fmt):
    m = measured(fmt)
    for name, (args, mem) in m.points.items():
        model = model_step(m.plan, *args, cpu=True)
        if isinstance(mem, int):        # a capture-like run: its peak
            assert abs(model.peak - mem) <= SCALAR, (name, model.peak, mem)
            continue
        assert not model.guessed, model.guessed
        assert not mismatches(mem, model), (name, mismatches(mem, model))
        assert abs(model.peak - mem.peak) <= SCALAR, (name, model.peak, mem.peak)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_the_graphs_keep_their_outputs_and_inputs(measured, fmt):
    """After capture-like runs of every bucket, what stays allocated is the graph pool's outputs +
    static inputs (the model's graph_pool without the cuBLAS workspaces, which the CPU has not)."""
    m = measured(fmt)
    steps = {b: model_step(m.plan, "decode", b, b, 128, "graph", cpu=True) for b in m.runner.buckets}
    pool = graph_pool(steps, {b: target_of(m.plan.dtypes, b, b, 128, num_sms=2) for b in steps}, 1, workspace=0)
    assert m.graphs_keep == pool["outputs"] + pool["inputs"] == pool["allocated"]


def test_a_workspace_left_out_fails_naming_its_op(measured, monkeypatch):
    """The comparison above is what catches a wrong workspace: with the split-K partials of one
    split more than the kernel runs, the decode step's attention ops no longer match, and only they."""
    m = measured("bf16")
    args, mem = m.points["decode4"]
    splits = op_memory.mla_splits
    monkeypatch.setattr(op_memory, "mla_splits", lambda T, H, R, K, s: splits(T, H, R, K, s) + 1)
    off = mismatches(mem, model_step(m.plan, *args, cpu=True))
    assert off and all("attn.mla_absorbed" in line for line in off), off


def test_rounding_books_each_allocation_as_a_512_byte_block(measured):
    """The model's rounding = LiveBytes(allocator=True): every storage rounded up to 512 bytes."""
    m = measured("fp8")
    args, _ = m.points["decode4"]
    ex = m.runner
    batch = decode_batch([list(range(1, 34)), list(range(40, 73)), [5] * 5, [5] * 5], req_table(4, 2))
    with LiveBytes(allocator=True) as mem:
        ex.forward("decode", batch)
    model = step_memory(m.plan.graphs["decode"], target_of(m.plan.dtypes, 4, 4, 128, num_sms=2), m.plan.config,
                        "eager", rounding=512)
    assert abs(model.peak - mem.peak) <= 512 and model.peak > model_step(m.plan, *args, cpu=True).peak


def test_attention_splits_match_the_launch():
    """The memory model's flash-decoding split count (from the target's tile rules) is the one the
    CUDA target's SparseMlaDecodeCtx launches with."""
    from glmc.codegen import triton_contexts
    from glmc.passes import step_arena
    from glmc.target import mla_num_splits
    for T, H, fp8, topk in [(1, 64, True, 2048), (32, 64, True, 2048), (48, 64, True, 64), (64, 64, True, 2048),
                            (128, 64, False, 2048), (1, 64, False, 2048), (8192, 16, True, None), (8, 64, True, 2048),
                            (16, 64, False, 1024), (128, 64, True, 2048)]:
        ctx = triton_contexts.SparseMlaDecodeCtx.make(H, 512, 64, topk, 0.1, torch.bfloat16, T, kv_fp8=fp8)
        want = mla_num_splits(T, H, ctx.block_h, topk or 4096, ctx.block_n, 132, ctx.v_parts, ctx.num_warps)
        s = type("S", (), {"t": step_arena.Target(2, True, fp8, T, T, 4096)})()
        assert op_memory.mla_splits(T, H, 512, topk, s) == want, (T, H, fp8, ctx.v_parts)
