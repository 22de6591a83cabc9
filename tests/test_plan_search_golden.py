"""`glmc plan`'s whole output for a fixed calibration, pinned: every priced row, the dropped rows
with their reasons, the Pareto front, the pick, `--explain` and the SVG chart, byte for byte, for
the tiny model on two GPUs. A change to how the search runs (parallel compiles, where it prices)
must leave them unchanged; a change to what it predicts refreshes them with
`python -m pytest tests/test_plan_search_golden.py --update-golden` and says why in the commit."""
from pathlib import Path

from glmc.cli import main

GOLDEN = Path(__file__).parent / "golden"
CALIBRATION = "bench/results/calibration_nvidia-h200-x2_2026-11-30.json"
ARGS = ["plan", "--model", "glm_moe_dsa_tiny", "--gpus", "2", "--workload", "in=512,out=128",
        "--concurrency", "1,8,64", "--slo", "tpot_ms=0.33", "--gpu-memory-gb", "0.1",
        "--calibration", CALIBRATION, "--no-compile", "--explain"]


def test_plan_search_output_is_the_golden(tmp_path, capsys, update_golden):
    assert main(ARGS + ["-o", str(tmp_path)]) == 0
    table = capsys.readouterr().out.replace(str(tmp_path), "OUT")
    outputs = {"plan_search.tiny2.json": (tmp_path / "plan_search.json").read_text(),
               "plan_search.tiny2.svg": (tmp_path / "pareto.svg").read_text(),
               "plan_search.tiny2.txt": table}
    for name, text in outputs.items():
        path = GOLDEN / name
        if update_golden:
            path.write_text(text)
        assert path.exists(), f"missing golden {path.name}: run pytest {__file__} --update-golden"
        assert text == path.read_text(), f"{name} differs from its golden"
