"""`python -m bench.spec_host_profile` (where a speculative cycle's host time goes), on the CPU:
every step's wall time is split over the watched functions and the rest, exclusive of callees."""
import json

import pytest

from bench import spec_host_profile


def test_host_profile_splits_each_step(tmp_path):
    out = tmp_path / "profile.json"
    spec_host_profile.main(["--cpu", "--gen", "8", "--drafts", "0,2", "--concurrency", "2", "--general",
                            "--unchained", "--out", str(out)])
    res = json.loads(out.read_text())
    for n in ("N=0", "N=2"):
        run = res["runs"][n]["c2"]
        assert run["steps"] > 0
        total = sum(f["ms_per_step"] for f in run["functions"].values())
        assert total == pytest.approx(run["step_ms_mean"], rel=1e-6)   # exclusive times and the rest add up
    spec = res["runs"]["N=2"]["c2"]["functions"]
    steps = res["runs"]["N=2"]["c2"]["steps"]
    verifies, reads = (spec[k]["calls_per_step"] * steps for k in ("runner.verify_dp", "speculator.read"))
    # one verify and one read per cycle, at most one cycle a step (the last step may only read)
    assert verifies == pytest.approx(reads) and steps - 1 <= round(verifies) <= steps
    assert "runner.verify_dp" not in res["runs"]["N=0"]["c2"]["functions"]
    assert spec["speculator._chain_next"]["calls_per_step"] > 0 < res["runs"]["N=2"]["c2"]["device_cycles"]
    unchained = res["runs"]["N=2 unchained"]["c2"]
    assert unchained["functions"]["speculator._run_on_device"]["calls_per_step"] > 0 < unchained["device_cycles"]
    assert "speculator._chain_next" not in unchained["functions"]
    general = res["runs"]["N=2 general"]["c2"]
    assert general["device_cycles"] == 0 and "speculator._run_on_device" not in general["functions"]
