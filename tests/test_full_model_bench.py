"""`python -m bench.full_model --cpu` (the full-size script) end to end over two gloo processes on
the tiny config's random checkpoint: each rank makes its random shard, decodes at every concurrency
with MTP on and off, and the calibrated prediction of the whole GLM-5.3 on 8 GPUs is printed."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_full_model_script_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.full_model", "--cpu", "--specs", "dp-a2a,tp",
                           "--mtp", "1", "--accept", "1.8", "--concurrency", "3", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(next(tmp_path.glob("full_model_2gpu_*.json")).read_text())
    assert [(s["parallel"], s["moe"]) for s in res["specs"]] == [("dp2ep2", "a2a"), ("tp2ep2", "-")]
    for spec in res["specs"]:
        want_b = {3: 2} if spec["parallel"].startswith("dp") else {3: 3}   # DP splits the requests
        assert {r["concurrency"]: r["batch_per_rank"] for r in spec["rows"]} == want_b, spec
        for r in spec["rows"]:
            assert r["tpot_ms"] > 0 and r["tok_s_per_gpu"] > 0
            assert r["mtp"]["cycle_ms"] > 0 and r["mtp"]["tpot_ms"] == r["mtp"]["cycle_ms"] / 1.8
    pred = res["predicted_8gpu"]
    assert [(r["parallel"], r["concurrency"]) for r in pred] == [("dp8ep8", 3), ("tp8ep8", 3)]
    assert all(r["predicted_tpot_ms"] > 1 for r in pred)    # 78 layers: milliseconds, not microseconds
    assert "predicted, whole GLM-5.3 on 8 GPUs" in proc.stdout
