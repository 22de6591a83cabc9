"""`python -m bench.sanitize` (every plan kernel under compute-sanitizer on the GPU): its verdict
from the tool's output, and a lone rank's workload (prefill, decode, verify, draft), interpreted."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CI has no GPU

from bench import sanitize

CLEAN = """\
========= COMPUTE-SANITIZER
sanitize workload done: {"steps": ["decode B=1"], "pass": true}
========= ERROR SUMMARY: 0 errors
"""
DIRTY = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 2 bytes
=========     at topk_select_kernel+0x1d0
=========     by thread (3,0,0) in block (17,0,0)
=========     Address 0x7f00001000 is out of bounds
========= ERROR SUMMARY: 1 error
"""


def test_verdict_reads_the_error_summary_and_the_workload():
    ok = sanitize.verdict(CLEAN)
    assert ok["errors"] == 0 and ok["workload"] == {"steps": ["decode B=1"], "pass": True}
    assert sanitize.clean({"rc": 0, **ok}, cpu=False)
    bad = sanitize.verdict(DIRTY)
    assert bad["errors"] == 1 and bad["workload"] is None
    assert bad["first"][1] == "========= Invalid __global__ read of size 2 bytes"
    assert not sanitize.clean({"rc": 9, **bad}, cpu=False)
    # a tool that never reached its summary (killed, timed out) is no verdict, and not clean
    cut = sanitize.verdict("========= COMPUTE-SANITIZER\n")
    assert cut["errors"] is None and not sanitize.clean({"rc": None, **cut}, cpu=False)
    # racecheck's summary is its own line (compute-sanitizer 2025)
    races = "========= COMPUTE-SANITIZER\n========= RACECHECK SUMMARY: {} hazards displayed ({} errors, {} warnings)\n"
    calm = sanitize.verdict(races.format(0, 0, 0))
    assert calm["errors"] == 0 and calm["race_warnings"] == 0 and calm["first"] == ["========= COMPUTE-SANITIZER"]
    hazard = sanitize.verdict(races.format(3, 2, 1))
    assert hazard["errors"] == 2 and hazard["race_warnings"] == 1
    assert not sanitize.clean({"rc": 0, **hazard}, cpu=False)
    # a workload whose own check failed is not clean whatever the tool says
    failed = sanitize.verdict(CLEAN.replace("true", "false"))
    assert not sanitize.clean({"rc": 0, **failed}, cpu=False)


def test_lone_rank_runs_every_phase():
    got = sanitize.lone_rank("cpu", "tp2ep2", ctx=64, requests=2, prefill_tokens=128)
    assert got["steps"] == ["decode B=1", "decode B=2", "verify T=8", "draft T=8"]
    assert got["prefill_tokens_per_forward"] == 128
