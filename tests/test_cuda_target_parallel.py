"""The CUDA target over two gloo processes on the CPU (Triton interpreted, the plan's kernel library
strict): `python -m bench.multi_gpu_check --cpu` for the specs whose kernels differ from tp1's (tokens split
over attention TP; one dispatched row per route under a2a). Greedy tokens equal tp1's and logits are
within tolerance (the per-step bill is checked on the GPUs, where steps replay captured buckets); a
kernel the plan's kernel set misses fails here, not first on the GPUs. The plans' small all-reduces
and reduce-scatters run the one-shot peer-memory kernel (shared memory between the processes).
The same with FP8 weights (`--fp8`)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tp2ep2_and_dp2ep2_a2a_on_the_cuda_target(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.multi_gpu_check", "--cpu", "--skip-width",
                           "--only", "tp2ep2/gather,dp2ep2/a2a", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["parallel"], r["moe"]) for r in rows] == [("tp2ep2", "gather"), ("dp2ep2", "a2a")]
    for r in rows:
        assert r["pass"] and r["tokens_equal"] and r["logits_ok"], r
    # tp2ep2's reductions (its reduce-scatters + add + RMSNorm) ran the one-shot peer-memory kernel
    # over shared memory between the two processes (select-collective-backend: 2 ranks, 4 MiB)
    step = rows[0]["counts_rank0"]
    reductions = [step[k] for k in ("all_reduce", "reduce_scatter") if k in step]
    assert reductions and all(c.get("p2p") == c["count"] > 0 for c in reductions), step
    # dp2ep2's a2a MoE exchange (the fixed-capacity dispatch and combine) ran it too
    step = rows[1]["counts_rank0"]
    assert all(step[k].get("p2p") == step[k]["count"] > 0 for k in ("dispatch", "combine")), step


def test_fp8_weights_under_tp2_and_dp2ep2_a2a(tmp_path):
    """FP8 weights over several ranks, on the CPU: a block-FP8 checkpoint, kept FP8 on every rank
    (weight shards cut along 128-blocks, each rank's FP8 GEMMs on its slice, the a2a dispatch sending e4m3 rows): tokens
    equal tp1's and logits within fp32 summation order. The widths give every rank whole 128-column
    activation groups (`multi_gpu_check.FP8_ALIGNED`), so no rank quantises differently from tp1."""
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.multi_gpu_check", "--cpu", "--skip-width",
                           "--fp8", "--only", "tp2/-,dp2ep2/a2a", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["parallel"], r["moe"]) for r in rows] == [("tp2", "-"), ("dp2ep2", "a2a")]
    for r in rows:
        assert r["pass"] and r["tokens_equal"] and r["max_rel_err"] < 1e-5, r
