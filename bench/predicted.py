"""Predicted decode steps next to measured ones, for the benchmarks' `--calibration FILE`.

The prediction is `glmc explain --calibration`'s (glmc/predict.py) for the plan the benchmark ran,
at the bucket it replayed, with the dtypes the runner really holds: today's runtime keeps weights,
KV and indexer caches in the compute dtype (FP8 checkpoints are dequantised on load), so those
replace the plan's storage dtypes here.
"""
from __future__ import annotations

TOLERANCE = 0.20     # the target: the prediction within 20% of the measured step for every spec


def runner_dtypes(plan):
    """The plan's dtypes as the runner of the recorded 2026-11-30 runs allocated them (the runs
    predict_check and tests/test_predict.py compare against): everything in the compute dtype. Since
    2026-12-01 the CUDA runner stores FP8 weights and caches FP8, as the plan's dtypes say."""
    act = plan.dtypes.activation
    return plan.dtypes.model_copy(update={"weight": act, "kv_cache": act, "index_cache": act})


def predict_ms(plan, tokens_per_rank: int, context: int, calibration: dict, program=None) -> float:
    """Predicted graph replay (ms) of the plan's decode step at `tokens_per_rank` (the bucket), its
    launches `program`'s (default: the plan's launch program there, `glmc.launches.LaunchCounts`)."""
    from glmc.launches import LaunchCounts
    from glmc.predict import predict_step
    env = {"T": tokens_per_rank, "B": tokens_per_rank, "S": context, "K": plan.config.index_topk}
    program = program or LaunchCounts(plan)("decode", tokens_per_rank, context)
    return predict_step(plan.graphs["decode"], env, runner_dtypes(plan), calibration, plan.world,
                        program)["step_s"] * 1e3


def compare(name: str, predicted_ms: float, measured_ms: float | None) -> dict:
    """{predicted_ms, measured_ms, ratio, within} and a printed line."""
    ratio = predicted_ms / measured_ms if measured_ms else None
    within = ratio is not None and abs(ratio - 1) <= TOLERANCE
    verdict = "no measurement" if ratio is None else f"ratio {ratio:.2f}, " + \
        ("within" if within else "OUTSIDE") + f" {TOLERANCE:.0%}"
    print(f"PREDICTED {name}: predicted {predicted_ms:.3f} ms, measured "
          f"{'-' if measured_ms is None else f'{measured_ms:.3f}'} ms ({verdict})", flush=True)
    return {"predicted_ms": predicted_ms, "measured_ms": measured_ms, "ratio": ratio, "within_20pct": within}
