"""`python -m bench.quality --cpu` (perplexity and greedy agreement of glmc-small per storage format,
the torch target with FP8 emulated) as a short run, and `glmc explain` quoting the recorded table.

The short run scores 2 x 32 held-out tokens and a 4-token continuation: enough to see that each
format runs its own numerics (FP8 moves the perplexity) and that the bf16 row agrees with its own
decode steps, not to measure quality (docs/performance.md has the full run's numbers)."""
import json
from pathlib import Path

import pytest

from bench import quality
from glmc.api import plan_for
from glmc.explain import explain_plan, recorded_quality
from glmc.report import render

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[1]


def test_short_cpu_run(tmp_path):
    out = tmp_path / "quality.json"
    quality.main(["--cpu", "--contexts", "16,32", "--windows", "2", "--prompts", "1", "--continuation", "4",
                  "--chunk", "16", "--configs", "fp8_both", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["target"] == "cpu" and d["model"] == "models/small" and d["settings"]["perplexity_tokens"] == 64
    bf16, fp8 = d["results"]["bf16"], d["results"]["fp8_both"]
    assert (bf16["weights"], bf16["kv_cache"], fp8["weights"], fp8["kv_cache"]) == ("bf16", "bf16", "fp8", "fp8")
    for c in ("16", "32"):
        assert 1 < bf16["perplexity"][c] < 4096 and fp8["perplexity"][c] != bf16["perplexity"][c]
        assert bf16["agreement"][c] == 1.0 and bf16["first_diff"][c] == [4]
        assert 0 <= fp8["agreement"][c] <= 1 and len(fp8["first_diff"][c]) == 1


def test_explain_quotes_the_recorded_quality(tiny_ckpt):
    """A plan of glmc-small's config gets the recorded table, its own formats marked; another model none."""
    plan = plan_for(ROOT / "models" / "small", device="cuda", max_running=4)
    q = recorded_quality(plan)
    assert q is not None and Path(ROOT / q["source"]).is_file()
    assert q["target"] == "cuda"   # the GPU run for a CUDA plan, the CPU one for a CPU plan
    assert recorded_quality(plan_for(ROOT / "models" / "small", device="cpu", max_running=4))["target"] == "cpu"
    assert q["formats"] == "fp8_kv" and {r["format"] for r in q["rows"]} >= {"bf16", "fp8_kv"}
    text = render(explain_plan(plan, batch=4, context=512))
    assert "## Quality (recorded for models/small" in text and "| fp8_kv (this plan) |" in text
    assert recorded_quality(plan_for(ROOT / "models" / "small", device="cuda", max_running=4,
                                     quantize="fp8"))["formats"] == "fp8_both"
    assert recorded_quality(plan_for(tiny_ckpt, device="cuda", max_running=4)) is None
