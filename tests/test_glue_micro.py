"""`bench/glue_micro.py`'s absorbed-MLA A/B (part `heads`), dry-run on the CPU at tiny dims under the
Triton interpreter: both forms run and agree, every field is filled, every swept tile is right."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CI has no GPU

import sys
from pathlib import Path

import torch
from glmc.codegen import triton_target as tt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import glue_micro as gm  # noqa: E402


def test_heads_ab_dry_run():
    calls = []
    rows = gm.heads_ab(torch, tt, torch.Generator().manual_seed(0), dev="cpu",
                       dims=dict(heads=(4,), R=32, DR=8, DN=16, DV=8, K=16),
                       time_us=lambda fn: (calls.append(fn()), 1.0)[1])
    assert [(r["kv"], r["tokens"]) for r in rows] == [(kv, t) for kv in ("fp8", "bf16") for t in (1, 2, 4)]
    for r in rows:
        assert {"cublas_op_us", "head_gemv_op_us", "kernel_us", "w_uk_bmm_us", "w_uk_head_us", "w_uv_bmm_us",
                "merge_head_us"} <= set(r)
        swept = {k: v for k, v in r.items() if k.startswith(("w_uk_n", "merge_n"))}
        assert len(swept) >= 10 and all(v == 1.0 for v in swept.values())   # no tile came out "WRONG"
        assert r["rel_diff"] < 2e-2      # the forms differ by out_lat's bf16 rounding (the cuBLAS form's)
    assert len(calls) == sum(7 + sum(1 for k in r if k.startswith(("w_uk_n", "merge_n"))) for r in rows)
