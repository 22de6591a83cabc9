"""bench/calibrate.py: its pure parts, and its CPU smoke run end to end (gloo, tiny sizes)."""
import subprocess
import sys
from pathlib import Path

import pytest

from glmc.calibration import load, validate

ROOT = Path(__file__).resolve().parents[1]
calibrate = pytest.importorskip("bench.calibrate")


def test_sizes_groups_and_shapes():
    sizes = calibrate.message_sizes()
    assert sizes[0] == 4096 and sizes[-1] == 256 * 2**20 and len(sizes) == 17
    assert [calibrate.group_sizes(n) for n in (1, 2, 6, 8)] == [[], [2], [2, 4, 6], [2, 4, 8]]
    assert calibrate.shapes("all_reduce", 4096, 2) == (2048, 2048, 4096)
    assert calibrate.shapes("all_gather", 4096, 8) == (256, 2048, 4096)       # output = the message
    assert calibrate.shapes("reduce_scatter", 4096, 8) == (2048, 256, 4096)   # input = the message
    assert calibrate.shapes("all_to_all", 4096, 8) == (256, 256, 4096)        # 8 ranks x 256 elements
    assert calibrate.shapes("all_gather", 4096, 3) == (682, 2046, 4092)       # rounded to split evenly
    for nbytes in (4096, 2**20, 256 * 2**20):
        reps, replays = calibrate.plan_calls(calibrate.guess_seconds(nbytes))
        assert 1 <= reps <= 20 and 2 <= replays <= 50
        assert reps * replays * calibrate.guess_seconds(nbytes) < 0.03
    assert calibrate.slug("NVIDIA H200", 2) == "nvidia-h200-x2" and calibrate.slug("NVIDIA H200", 1) == "nvidia-h200"


def test_assemble_writes_the_schema():
    measured = {"hbm_bytes_per_s": 4e12, "gemm_flops_per_s": {"bf16": 7e14, "fp32": 5e13},
                "kernel_overhead_s": 2e-6, "torch_op_overhead_s": 1e-6, "torch_op_s": 2e-6, "gemm_launch_s": 4e-6,
                "topk_select": {"k": 2048, "chunk": 4096, "row_len": 4097, "seconds": [[1, 6e-5]]},
                "collectives": {"2": {k: [[4096, 1e-5]] for k in calibrate.KINDS}}}
    cal = calibrate.assemble(measured, "NVIDIA H200", 2, "abc", False, {"seconds": 1.0})
    assert validate(cal) is cal and cal["measured"] is True and cal["schema"] == "glmc-calibration/2"


def test_smoke_run(tmp_path):
    """Two gloo processes measure every field at 4-16 KiB and write a file glmc explain reads."""
    run = subprocess.run([sys.executable, "-m", "bench.calibrate", "--smoke", "--out-dir",
                          str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    (path,) = tmp_path.glob("calibration_cpu-smoke-x2_*.json")
    cal = load(path)
    assert cal["measured"] is False and cal["gpus"] == 2
    tables = cal["collectives"]["2"]
    assert {k: [b for b, _ in tables[k]] for k in calibrate.KINDS} == {k: [4096, 8192, 16384] for k in calibrate.KINDS}
    # the one-shot peer-memory kernels (shared memory between the two processes), 1 and 2 rows of 256 B
    assert {k: [b for b, _ in t] for k, t in tables.items() if k.startswith("p2p_")} == \
        {"p2p_all_reduce": [256, 512], "p2p_reduce_scatter": [512, 1024], "p2p_all_gather": [512, 1024],
         "p2p_all_to_all": [512, 1024]}
    assert all(s > 0 for k, t in tables.items() for _, s in t) and "p2p_unavailable" not in cal
    assert f"wrote {path}" in run.stdout
    assert cal["torch_op_s"] > 0 and cal["gemm_launch_s"] > 0 and cal["torch_op_detail"]["aten_ops"] == 44   # align_rows 36 + add_rms 8
    assert [r for r, _ in cal["topk_select"]["seconds"]] == [1, 2]
