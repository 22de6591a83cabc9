"""`python -m bench.mtp_gpu_check --parts rank` (MTP on a mesh's rank): one rank of tp2ep2 alone
(`LoneComm`) on the narrow slice, Triton interpreted: every segment of the decode / verify / draft
steps timed without its collectives once per EP rank's experts, the slowest rank's compute plus the
calibrated collectives, and the prediction from them. And the helpers it stands on."""
import json
import subprocess
import sys
from pathlib import Path

import torch

from bench import mtp_gpu_check as mg

ROOT = Path(__file__).resolve().parents[1]


def test_peer_tokens_are_other_tokens_and_padding_one_token():
    E, k = 64, 4
    own = torch.stack([torch.randperm(E)[:k] for _ in range(2)]).to(torch.int32)    # R = 2 rows per rank
    peer = mg.peer_tokens(tokens=5, experts=E, seed=3)
    parts = [own] + [peer(p, own) for p in range(1, 4)]     # rows 0..7; 5..7 are padding
    rows = torch.cat(parts)
    assert rows.dtype == torch.int32 and rows.shape == (8, k)
    assert all(len(set(r.tolist())) == k for r in rows)       # each row: distinct experts
    assert len({tuple(r.tolist()) for r in rows[:5]}) == 5     # the real tokens route differently
    assert torch.equal(rows[5], rows[6]) and torch.equal(rows[6], rows[7])   # padding routes alike
    assert torch.equal(peer(2, own), parts[2])                 # the same step: the same routes
    # hidden rows: random at this rank's RMS, each real token its own, padding one row
    x = torch.randn(2, 32).to(torch.bfloat16) * 3
    h = torch.cat([x] + [peer(p, x) for p in range(1, 4)])
    assert h.dtype == torch.bfloat16 and h.shape == (8, 32) and h.isfinite().all()
    assert len({tuple(r.tolist()) for r in h[:5]}) == 5 and torch.equal(h[5], h[7])
    assert 1.5 < h[2:5].float().pow(2).mean().sqrt() < 6


def test_as_ep_rank_rotates_only_the_experts_ids():
    class Op:
        def __init__(self, kind):
            self.kind = kind
    x, w, ids = torch.rand(2, 8), torch.rand(2, 2), torch.tensor([[0, 5], [7, 3]], dtype=torch.int32)
    calls = [(Op("moe.experts"), (x, w, ids), None, None), (Op("moe.topk"), (ids,), None, None)]
    out = mg.as_ep_rank(calls, 4, 8)
    assert out[0][1][0] is x and out[0][1][1] is w
    assert out[0][1][2].tolist() == [[4, 1], [3, 7]] and out[0][1][2].dtype == torch.int32
    assert out[1][1][0] is ids
    assert mg.as_ep_rank(calls, 0, 8)[0][1][2] is ids


def test_a_lone_rank_is_measured_and_predicted(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.mtp_gpu_check", "--cpu", "--parts", "rank",
                           "--weights", "bf16", "--accept", "1=1.8,2=2.4,3=3.0", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(next(tmp_path.glob("mtp_gpu_check_*.json")).read_text())
    rank = res["rank_bf16"]
    assert rank["parallel"] == "tp2ep2" and rank["ep_ranks"] == 2
    assert set(rank["segments"]) == {f"B={b} T={t}" for b, ts in ((1, (1, 2, 3, 4)), (2, (2, 4, 6, 8))) for t in ts}
    moe = {"layer1", "layer2", "layer3"}      # the MoE layers (layer 3: the MTP layer)
    for point, row in rank["segments"].items():
        for phase, seg in row.items():
            part = rank["parts"][point][phase]
            per_rank = part["per_rank_ms"]
            assert set(per_rank["0"]) == set(seg) and set(per_rank["1"]) == set(seg) & moe, (point, phase)
            for k, ms in seg.items():
                compute = max(r[k] for r in per_rank.values() if k in r)
                assert part["compute_ms"][k] == compute > 0
                assert ms == compute + part["comm_ms"].get(k, 0.0)
            assert all(part["comm_ms"][k] > 0 for k in seg if k != "head"), part["comm_ms"]   # tp2: every layer
            # the step's real tokens (T, top-2 of 8 experts) spread over both ranks' experts
            T = int(point.split("T=")[1])
            for k, counts in part["experts_per_rank"].items():
                assert k in moe and len(counts) == 2 and 2 <= sum(counts) <= min(8, 2 * T), (point, phase, counts)
    pred = res["prediction_rank_bf16"]["rows"]
    assert set(pred) == {"c1", "c2"}
    for row in pred.values():
        assert set(row["mtp"]) == {"1", "2", "3"} and all(m["speedup"] > 0 for m in row["mtp"].values())
    assert "a rank's measured layers x 78 + calibrated collectives" in proc.stdout


def test_prediction_adds_the_measured_host_time_per_cycle():
    """The whole-model MTP prediction is graph time plus the speculative cycle's measured host
    work (`glmc.predict.spec_host_ms`); plain decoding is graph time (it overlaps its host work)."""
    from glmc.predict import spec_host_ms
    seg = {"layer0": 0.1, "layer1": 0.3, "layer2": 0.2, "head": 0.05}
    width = {"segments": {f"B={B} T={T}": {"decode": seg, "verify": seg, "draft": {"mtp": 0.04}}
                          for B in (1, 16) for T in (B, 2 * B, 4 * B)}}
    pred = mg.predict(width, {1: 1.8, 3: 2.9})
    for B in (1, 16):
        row = pred["rows"][f"c{B}"]
        for n, m in row["mtp"].items():
            graph = m["verify_ms"] + m["draft_extend_ms"] + (n - 1) * row["draft_step_ms"]
            assert m["host_ms"] == spec_host_ms(n, B) > 0
            assert m["cycle_ms"] == graph + m["host_ms"] and m["tpot_ms"] == m["cycle_ms"] / m["accept_length"]
