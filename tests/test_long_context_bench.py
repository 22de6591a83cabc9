"""`python -m bench.long_context_bench --cpu --prefill` (chunked prefill at long context) end to end on the
narrow slice, Triton interpreted: a prompt longer than one chunk runs as chunks over the cache the
earlier ones wrote, each with its time, the cost model's FLOPs and the roofline at the run's rate,
and (--profile) each op kind's time and FLOPs."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_chunked_prefill_table(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.long_context_bench", "--cpu", "--prefill", "200",
                           "--chunk", "96", "--kv-dtypes", "bf16", "--profile", "--indexer-tiles", "16:32:4:1",
                           "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(next(tmp_path.glob("long_context_bench_*.json")).read_text())["prefill"]
    assert [(r["prefix"], r["chunk"]) for r in rows] == [(0, 96), (96, 96), (192, 8)]
    for r in rows:
        assert r["ms"] > 0 and r["flops"] > 0 and r["x_roof"] == r["ms"] / r["roof_ms"], r
    # a chunk after a prefix attends (and its indexer scores) more keys than the first one
    assert rows[1]["flops"] > rows[0]["flops"]
    assert "x roof" in proc.stdout
    # --profile: every op kind of the prefill graph timed, its FLOPs the chunk's, split by kind
    for r in rows:
        ops = {o["op"]: o for o in r["ops"]}
        assert {"attn.mla_mha", "idx.topk", "moe.experts"} <= set(ops), sorted(ops)
        assert all(o["ms"] > 0 and o["calls"] >= 1 for o in ops.values())
        assert abs(sum(o["flops"] for o in ops.values()) - r["flops"]) <= 1e-9 * r["flops"]
    assert "calls" in proc.stdout
    # --indexer-tiles: the token-block kernel on the last chunk, the per-token kernel's scores
    per_token, tiled, *select = rows[-1]["indexer_tiles"]
    assert per_token["us"] > 0 and tiled["us"] > 0 and tiled["same_inf"] and tiled["max_rel_diff"] < 1e-5, tiled
    assert select[0]["us"] > 0 and all(s["same"] for s in select[1:]), select   # same top-k, whole-row programs
    assert "indexer_tiles" not in rows[0]


def test_decode_points_over_a_model_written_cache(tmp_path):
    """Decode points (the default `--fill model`): each request's context prefilled through the plan,
    then the decode step, its roofline and the per-kernel rows."""
    proc = subprocess.run([sys.executable, "-m", "bench.long_context_bench", "--cpu", "--skip", "hf,topk",
                           "--kv-dtypes", "bf16", "--contexts", "200", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    point = json.loads(next(tmp_path.glob("long_context_bench_*.json")).read_text())["glmc"]["bf16"]["200"]
    assert point["setup"]["fill"] == "model"
    step = point["1"]
    assert step["replay_ms"] > 0 and step["x_roofline"] == step["replay_ms"] / step["roofline_ms"], step
    kernels = {r["kernel"]: r for r in step["kernels"]}
    assert {"indexer scores", "top-k select", "sparse MLA decode"} <= set(kernels), kernels


def test_plan_check_counts_route_differences_at_compared_tokens():
    """gpu_plan_check --routes: a prefill's logits are its prompts' last tokens, so its route count
    looks only at those rows (a flip elsewhere does not excuse a logit error); decode counts all."""
    import torch
    from bench import common
    a = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    b = torch.tensor([[0, 9], [2, 3], [4, 5], [6, 8]])   # rows 0 and 3 routed elsewhere
    assert common.route_diffs([a, a], [b, a]) == 2
    last = torch.tensor([1, 3]).cumsum(0) - 1               # prompts of 1 and 3 tokens: rows 0, 3
    assert common.route_diffs([a, b], [b, b], last) == 2 and common.route_diffs([a], [b], torch.tensor([1, 2])) == 0


def test_whole_step_is_wall_time_of_back_to_back_calls():
    """The decode benchmarks' whole-step time: the median wall time of back-to-back calls, host work
    included (a call that sleeps 4 ms costs >= 4 ms), at least 5 calls after the warm-up ones."""
    import time
    from bench import common
    calls = []

    def step():
        calls.append(1)
        time.sleep(0.004)
    ms = common.step_wall_ms(step, seconds=0.01, warmup=2)
    assert 4.0 <= ms < 40.0 and len(calls) >= 7, (ms, len(calls))
