"""`python -m bench.spec_host_profile` (where a speculative cycle's host time goes), on the CPU:
every step's wall time is split over the watched functions and the rest, exclusive of callees."""
import json

import pytest

from bench import spec_host_profile


def test_host_profile_splits_each_step(tmp_path):
    out = tmp_path / "profile.json"
    spec_host_profile.main(["--cpu", "--gen", "8", "--drafts", "0,2", "--concurrency", "2", "--general",
                            "--out", str(out)])
    res = json.loads(out.read_text())
    for n in ("N=0", "N=2"):
        run = res["runs"][n]["c2"]
        assert run["steps"] > 0
        total = sum(f["ms_per_step"] for f in run["functions"].values())
        assert total == pytest.approx(run["step_ms_mean"], rel=1e-6)   # exclusive times and the rest add up
    spec = res["runs"]["N=2"]["c2"]["functions"]
    assert spec["runner.verify_dp"]["calls_per_step"] == pytest.approx(1.0)   # one verify per cycle
    assert spec["speculator.read"]["calls_per_step"] == pytest.approx(1.0)    # and one read back
    assert "runner.verify_dp" not in res["runs"]["N=0"]["c2"]["functions"]
    assert spec["speculator._run_on_device"]["calls_per_step"] > 0 < res["runs"]["N=2"]["c2"]["device_cycles"]
    general = res["runs"]["N=2 general"]["c2"]
    assert general["device_cycles"] == 0 and "speculator._run_on_device" not in general["functions"]
