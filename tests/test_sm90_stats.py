"""tools/sm90_stats.py: the plan's kernels compiled for Hopper (sm_90a) on this CPU host, through
Triton and the ptxas it ships; the compiler facts that tile choices rest on."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rows(*args):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "sm90_stats.py"), *args, "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_mla_decode_tiles_use_the_warp_group_mma_from_32_tokens():
    wide, narrow = rows("mla", "--tokens", "128", "--tiles", "0:16:32:4:2")
    assert wide["default"] and wide["tiles"]["block_h"] == 64 and wide["tiles"]["num_warps"] == 8
    assert wide["wgmma"] > 0 and wide["mma_sync"] == 0 and 0 < wide["regs"] <= 255 and wide["shared"] > 0
    assert narrow["wgmma"] == 0 and narrow["mma_sync"] > 0      # 16 heads: below wgmma's 64 rows


def test_prefill_indexer_kernel_does_not_spill():
    (fp8,) = rows("indexer", "--kv", "fp8")
    assert fp8["tiles"] == {"block_m": 64, "block_n": 256, "num_warps": 8, "num_stages": 3}
    assert fp8["wgmma"] > 0 and fp8["spill_stores"] == 0, fp8
