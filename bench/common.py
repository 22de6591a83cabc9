"""What the bench commands share: the GLM-5.3-width slice (config, randomised transformers model,
glmc plan, weights and runner over it), request tables and batches, timers and op-call recording,
and the test helpers some commands borrow (`tests_module`).

Import it as `from bench import common`; importing `bench` first makes glmc importable on a
machine without an install (bench/__init__.py).
"""
from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT

GLM53 = dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
             num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512,
             qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=256,
             num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
             routed_scaling_factor=2.5, index_topk=2048, index_n_heads=32, index_head_dim=128, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 8e6}, max_position_embeddings=202752,
             tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
SLICE = dict(num_hidden_layers=2, first_k_dense_replace=1, indexer_types=["full", "full"])
# Same structure at tiny widths, for CPU dry runs (power-of-two latent dims for the Triton kernels).
NARROW = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, index_topk=16, index_n_heads=4,
              index_head_dim=16)


# ----------------------------------------------------------------------------- the slice
def slice_model(device, dtype, seed=0, narrow=False, **overrides):
    """A randomised GlmMoeDsaForCausalLM slice built directly on `device` in `dtype` (eval mode)."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    cfg = GlmMoeDsaConfig(**{**GLM53, **SLICE, **(NARROW if narrow else {}), **overrides})
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = GlmMoeDsaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    randomize_on_device_(model, seed)
    return model


@__import__("torch").no_grad()
def randomize_on_device_(model, seed):
    """tests/tiny_hf.randomize_'s decisive scales, drawn on the parameters' device (GB-sized slices)."""
    import torch
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, t in sorted(list(model.named_parameters()) + list(model.named_buffers())):
        if "inv_freq" in name or not t.is_floating_point():
            continue
        if name.endswith("e_score_correction_bias") or name.endswith("k_norm.bias"):
            t.normal_(0.0, 0.2, generator=g)
        elif t.dim() == 1:
            t.normal_(1.0, 0.2, generator=g)
        elif name.endswith("embed_tokens.weight"):
            t.normal_(0.0, 1.0, generator=g)
        else:
            t.normal_(0.0, t.shape[-1] ** -0.5, generator=g)


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def glmc_plan(model, max_reqs, dtype_name, parallel="tp1", fp8=False, kv_dtype=None, **options):
    """The CUDA-target `Plan` of the model's config (written as config.json to a temp dir); fp8:
    with block-FP8 linear weights (the loader quantises unquantised weights on load); kv_dtype:
    `spec.kv_dtyped` (None: the config's default)."""
    from glmc.compiler import compile_plan
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.spec import kv_dtyped, load_spec
    d = Path(tempfile.mkdtemp(prefix="glmc_slice_"))
    raw = model.config.to_dict()
    raw.update(model_type="glm_moe_dsa", dtype=dtype_name, num_nextn_predict_layers=0)
    if fp8:
        raw["quantization_config"] = FP8_CONFIG
    (d / "config.json").write_text(json.dumps(raw))
    spec = kv_dtyped(load_spec(d), kv_dtype)
    return compile_plan(spec, parse_parallel(parallel, spec.config),
                        Options(device="cuda", max_batch=max_reqs, **options))


def gpu_runner(plan, weights, dev, max_reqs, max_ctx, capture=False, **kw):
    """The plan's `CudaExecutor` from the one loader (`runtime/worker/loader.py`): rows 0..max_reqs-1
    on pages 1.. of `req_table`, plus the loader's scratch page; decode graphs only (with
    `capture`). `kw`: more `RunConfig` fields, or the loader's `comm`, `target`, `stacks`."""
    from glmc.runtime.worker.loader import load_runner
    pages = max_reqs * -(-max_ctx // 64) + 1
    return load_runner(plan, weights, device=str(dev), num_pages=pages, max_context=max_ctx,
                       max_running=max_reqs, capture=capture, prefill_graphs=False, **kw).executor


def glmc_weights(model):
    """HF state dict -> (checkpoint-named weights, expert stacks {prefix: (gate, up, down)}), zero copy:
    gate and up are views of HF's fused gate_up_proj [E, 2I, H]."""
    sd = model.state_dict()
    weights, stacks = {}, {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj"):
            prefix = k[: -len(".gate_up_proj")]
            inter = sd[prefix + ".down_proj"].shape[-1]
            stacks[prefix] = (v[:, :inter], v[:, inter:], sd[prefix + ".down_proj"])
        elif not k.endswith("experts.down_proj") and "inv_freq" not in k:
            weights[k] = v
    return weights, stacks


def replay_ms(graph, replays: int = 20) -> float:
    """Milliseconds per replay of a captured decode graph (every rank replays the same count)."""
    import torch
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def req_table(num_rows, pages_per_req):
    """req_to_token: row r on pages r*ppr+1 .. (r+1)*ppr (page 0 unused; the pool's last page is scratch)."""
    import torch
    from glmc.runtime.worker.kv_cache import PAGE_SIZE
    pages = torch.arange(num_rows * pages_per_req).view(num_rows, pages_per_req) + 1
    return (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(num_rows, -1)


def prefill(runner, prompts, table, group=None):
    """Prefill prompts (rows 0..B-1), `group` requests per forward; -> logits [B, V]."""
    import torch
    from glmc.runtime.worker.forward_batch import ForwardBatch
    group, out = group or len(prompts), []
    for i in range(0, len(prompts), group):
        ps = prompts[i:i + group]
        batch = ForwardBatch.build("extend", ps, list(range(i, i + len(ps))), [0] * len(ps), table)
        out.append(runner.forward("prefill", batch)["logits"].float())
    return torch.cat(out)


def decode_batch(seqs, table):
    from glmc.runtime.worker.forward_batch import ForwardBatch
    return ForwardBatch.build("decode", [[s[-1]] for s in seqs], list(range(len(seqs))),
                              [len(s) - 1 for s in seqs], table)


def greedy(runner, prompts, steps, table):
    """Prefill + `steps` greedy decode steps; -> tokens [B, steps] (CPU)."""
    return greedy_logits(runner, prompts, steps, table)[0]


def greedy_logits(runner, prompts, steps, table, forced=None):
    """Prefill + `steps` greedy decode steps; -> (tokens [B, steps] (CPU), the logits [B, V] of the
    prefill and of every decode step, fp32 on the runner's device). `forced` ([B][>= steps] tokens):
    feed those instead of the argmax (teacher forcing)."""
    import torch
    seqs = [list(p) for p in prompts]
    logits = [prefill(runner, prompts, table)]
    tokens = []
    for i in range(steps):
        nxt = [f[i] for f in forced] if forced is not None else logits[-1].argmax(-1).tolist()
        tokens.append(nxt)
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits.append(runner.forward("decode", decode_batch(seqs, table))["logits"].float())
    return torch.tensor(tokens).T.reshape(len(prompts), steps), logits


def route_diffs(got: list, want: list, tokens=None) -> int:
    """Tokens x MoE layers whose routed expert sets differ between two runs' recorded calls (only
    the rows `tokens` of each call where given: a prefill's compared last tokens)."""
    return sum(int((a != b).any(-1)[slice(None) if tokens is None else tokens].sum()) for a, b in zip(got, want))


def tests_module(name: str):
    """tests/<name>.py as a module (`tiny_hf`'s checkpoints, `test_run_cli`'s server runner),
    loaded from its file: the module pytest already imported, if it did."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def command(name: str, *args: str) -> list[str]:
    """The argv of `python -m bench.<name> ARGS` in this interpreter, for a subprocess run with
    cwd=ROOT (where the `bench` package is found)."""
    return [sys.executable, "-m", f"bench.{name}", *args]


# ----------------------------------------------------------------------------- timing
def now():
    return time.perf_counter()


def bench_ms(fn, graph=True):
    """Median ms of fn: CUDA-graph replays (do_bench_cudagraph) or eager (do_bench); wall time on CPU."""
    import torch
    if not torch.cuda.is_available():
        t = now()
        fn()
        return (now() - t) * 1e3
    import triton.testing as tb
    fn()
    torch.cuda.synchronize()
    return tb.do_bench_cudagraph(fn, rep=20, return_mode="median") if graph else \
        tb.do_bench(fn, warmup=5, rep=30, return_mode="median")


def capture_graph(fn):
    """fn() captured in a CUDA graph after one warm-up call on a side stream (so that its first-call
    allocations and compilations happen outside the capture); -> (graph, what the captured call
    returned: the tensors each replay rewrites)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def step_wall_ms(fn, seconds=0.5, warmup=3):
    """Median wall ms of back-to-back calls of fn, each ending in a host sync (a whole decode step:
    inputs in, replay, logits read): what a serving loop sees, host included. Not do_bench's events,
    which time from after an L2-flushing memset and so hide host work shorter than that memset."""
    import statistics
    for _ in range(warmup):
        fn()
    times, end = [], now() + seconds
    while now() < end or len(times) < 5:
        t = now()
        fn()
        times.append(now() - t)
    return statistics.median(times) * 1e3


def ceilings(cpu):
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s), measured here."""
    import torch
    if cpu:
        return 1.0, 1.0
    a = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    gbps = 2 * a.nbytes / bench_ms(lambda: b.copy_(a), graph=False) / 1e6
    x, y = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tflops = 2 * 8192**3 / bench_ms(lambda: x @ y, graph=False) / 1e9
    del a, b, x, y
    return gbps, tflops


def with_impls(runner, wrap, run):
    """run() with each of `runner`'s op implementations f replaced by wrap(f); the table restored after."""
    impls = runner.impls
    runner.impls = {k: wrap(f) for k, f in impls.items()}
    try:
        return run()
    finally:
        runner.impls = impls


def op_calls(runner, run) -> list:
    """[(op, args, step, implementation)] of every op call `run()` makes on `runner`, in order."""
    calls = []
    with_impls(runner, lambda fn: lambda op, args, rt: calls.append((op, args, rt, fn)) or fn(op, args, rt), run)
    return calls


def fp8_exact(xq, xs, wq, ws, device=None):
    """The exact product of block-FP8 operands in fp64 (activations [M, K] with a scale per token per
    128 columns, weights [N, K] with one per 128 x 128 block), and the sum of |terms| per output:
    (x @ W^T, |x| @ |W|^T), [M, N] on `device` (default xq's)."""
    dev = device or xq.device

    def deq(q, s, rows):
        q, s = q.to(dev).double(), s.to(dev).double()
        return q * s.repeat_interleave(128, 1)[:, :q.shape[1]].repeat_interleave(rows, 0)[:q.shape[0]]
    xd, wd = deq(xq, xs, 1), deq(wq, ws, 128)
    return xd @ wd.T, xd.abs() @ wd.abs().T


def oracle_twin(plan, runner, w8a8=True):
    """A torch-target executor sharing the torch-target executor `runner`'s weights, with its own KV
    pool (caches the plan stores fp8 emulated), that runs the FP8 plan's activation quantisation
    (codegen/fp8_torch_target.py) with `w8a8`, else `runner`'s implementations."""
    from glmc.codegen import fp8_torch_target
    from glmc.runtime.worker.executor import PlanExecutor
    from glmc.runtime.worker.kv_cache import KVPool
    pool = KVPool.for_plan(plan, runner.pool.num_pages, runner.pool.dtype, runner.pool.device, fp8="emulate")
    return PlanExecutor(plan, runner.weights, pool, runner.comm, impls=fp8_torch_target.IMPLS if w8a8 else runner.impls,
                        device=runner.device, stacks=runner.stacks)
