"""Calibration files: the measured ceilings of one machine, read by `glmc explain --calibration`.

`bench/calibrate.py` measures them on the GPUs present and writes
`bench/results/calibration_<device>_<date>.json`:

    {"schema": "glmc-calibration/2", "device": "NVIDIA H200", "gpus": 2, "date": "2026-12-01",
     "commit": "abc1234", "measured": true,
     "hbm_bytes_per_s": 4.27e12,        # device copy: bytes read + written per second
     "gemm_flops_per_s": {"bf16": 7.7e14, "fp32": 5.0e13},   # large cuBLAS GEMMs ("fp8" optional)
     "attention_flops_per_s": 1.1e14,   # optional: glmc's sparse-MLA decode kernel, FLOPs over the
                                        # top-k slots it walks (64 heads, 2048 slots, 128 tokens)
     "kernel_overhead_s": 2.0e-6,       # per Triton kernel inside a CUDA-graph replay
     "torch_op_overhead_s": 0.9e-6,     # optional: a one-element torch add in a replay (the floor)
     "torch_op_s": 2.0e-6,              # /2: per aten op of the CUDA target's own torch code in a replay
     "gemm_launch_s": 4.5e-6,           # /2: per cuBLAS GEMM call, beyond its bytes at hbm_bytes_per_s
     "topk_select": {"k": 2048, "chunk": 4096, "row_len": 4097,      # /2: the indexer's top-k select
                     "seconds": [[1, 6.3e-05], [32, 5.9e-05], [128, 5.9e-05]]},
     "collectives": {"2": {"all_reduce": [[4096, 1.2e-05], ...], "all_gather": [...],
                           "reduce_scatter": [...], "all_to_all": [...]}}}

`collectives[<ranks>][<kind>]` lists [message_bytes, seconds] by increasing bytes: one collective
over a group of <ranks> GPUs, captured in a CUDA graph and replayed, seconds per call. Message
bytes follow `glmc.passes.costs`: the logical tensor, whatever each rank holds: all_reduce the
buffer reduced; all_gather its output (ranks x each rank's input); reduce_scatter its input (ranks
x each rank's output); all_to_all the data of the whole group (ranks x each rank's send buffer).
Other fields may be added (notes, sources, the benchmark's own numbers); `measured: false` marks a
file assembled from earlier measurements rather than written by the benchmark.

Schema /2 adds three required fields, each the measured cost of something the decode graph runs
that a launch floor plus bytes / bandwidth misses at small batch:
- `torch_op_s`: seconds per aten op of the CUDA target's torch code (the MoE row alignment, the
  top-k slot gather, the torch add + RMS norm: index gathers, scans, a sort, scatters, small
  element-wise ops) replayed in a graph at one token: replay time / aten ops
  (`codegen/launch_model.py`'s ALIGN_ROWS_OPS, ADD_RMS_TORCH_OPS). A one-element add (`torch_op_overhead_s`) is the floor.
- `gemm_launch_s`: seconds per cuBLAS GEMM call in a graph beyond its bytes / `hbm_bytes_per_s`,
  at one token row with the weights out of L2 (GLM-5.3's decode GEMM shapes): a skinny GEMM's
  pipeline fill and epilogue, and split-K's second (reduce) kernel where cuBLAS picks split-K.
- `topk_select`: glmc's top-k select kernel (`topk_select.py.j2`, `k` of `row_len` scores per
  row, `chunk` scores per counting pass): seconds per launch in a graph by rows [[rows, seconds],
  ...]. One program per row walks its row 34 times (33 counting passes, one compaction): latency,
  not bandwidth; rows run side by side on the SMs.
A /1 file is still read: without these fields the predictor charges torch ops
`torch_op_overhead_s`, GEMM calls `kernel_overhead_s` and no top-k latency, and says so in its
assumptions (re-run bench/calibrate.py for a /2 file).

Lookup (`collective_seconds`): log-log interpolation between table points; below the smallest
message the smallest's time (the latency floor); above the largest, linear in bytes. A group size
without a table uses the nearest measured one (the largest below, else the smallest above) at the
message that gives each rank the same wire bytes (ring: (n-1)/n of the message, (n-1)/n^2 for
all-to-all), so bus bandwidth and latency carry over unchanged: NVSwitch puts every GPU one hop
away; NCCL's small-message latency still grows with the group, which this does not model.
Optional tables `p2p_all_reduce` / `p2p_reduce_scatter` / `p2p_all_gather` / `p2p_all_to_all` (the MoE
exchange) time glmc's one-shot peer-memory kernel
(`p2p_collective_seconds`; without them its fitted model).
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

from glmc.passes.costs import p2p_seconds

SCHEMA = "glmc-calibration/2"
SCHEMA_V1 = "glmc-calibration/1"      # still read (module docstring)
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p_all_reduce",
                    "p2p_reduce_scatter", "p2p_all_gather", "p2p_all_to_all")
_REQUIRED_V1 = {"schema": str, "device": str, "gpus": int, "date": str, "commit": str,
                "hbm_bytes_per_s": float, "gemm_flops_per_s": dict, "kernel_overhead_s": float,
                "collectives": dict}
NEW_IN_V2 = {"torch_op_s": float, "gemm_launch_s": float, "topk_select": dict}
_REQUIRED = {SCHEMA_V1: _REQUIRED_V1, SCHEMA: {**_REQUIRED_V1, **NEW_IN_V2}}
_OPTIONAL = {"attention_flops_per_s": float, "torch_op_overhead_s": float, "measured": bool}


class CalibrationError(ValueError):
    """A calibration file that does not follow the schema; the message names the file and field."""


def _check_type(value, want, where: str, fail) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) if want is float else \
        isinstance(value, want) and not (want is int and isinstance(value, bool))
    if not ok:
        fail(f"'{where}' must be {want.__name__}, got {type(value).__name__} {value!r}"[:200])
    if want in (int, float) and not value > 0:
        fail(f"'{where}' must be > 0, got {value!r}")


def validate(data: dict, source: str = "<dict>") -> dict:
    """`data` if it follows the schema; else CalibrationError("calibration SOURCE: ...")."""
    def fail(msg):
        raise CalibrationError(f"calibration {source}: {msg}")
    if not isinstance(data, dict):
        fail(f"expected a JSON object, got {type(data).__name__}")
    if "schema" not in data:
        fail("missing 'schema'")
    if data["schema"] not in _REQUIRED:
        fail(f"'schema' is {data['schema']!r}; this glmc reads {SCHEMA!r} (and {SCHEMA_V1!r})")
    required = _REQUIRED[data["schema"]]
    for key, want in required.items():
        if key not in data:
            fail(f"missing '{key}'" + (f" (required by {SCHEMA!r}; re-run bench/calibrate.py)"
                                       if key in NEW_IN_V2 else ""))
        _check_type(data[key], want, key, fail)
    for key, want in {**_OPTIONAL, **NEW_IN_V2}.items():
        if key in data and key not in required:
            _check_type(data[key], want, key, fail)
    if "topk_select" in data:
        _check_topk(data["topk_select"], fail)
    for dtype in ("bf16", "fp32"):
        if dtype not in data["gemm_flops_per_s"]:
            fail(f"missing 'gemm_flops_per_s.{dtype}'")
    for dtype, rate in data["gemm_flops_per_s"].items():
        _check_type(rate, float, f"gemm_flops_per_s.{dtype}", fail)
    for ranks, tables in data["collectives"].items():
        if not ranks.isdigit() or int(ranks) < 2 or not isinstance(tables, dict):
            fail(f"'collectives.{ranks}': keys are group sizes >= 2, each an object of tables")
        for kind, points in tables.items():
            _check_table(points, f"collectives.{ranks}.{kind}", kind, fail)
    return data


def _check_table(points, where: str, kind: str, fail) -> None:
    if kind not in COLLECTIVE_KINDS:
        fail(f"'{where}': unknown collective; known: {', '.join(COLLECTIVE_KINDS)}")
    _check_points(points, where, "message_bytes", fail)


def _check_points(points, where: str, x: str, fail) -> None:
    """A non-empty list of [x, seconds] pairs, sorted by increasing x."""
    if not isinstance(points, list) or not points:
        fail(f"'{where}' must be a non-empty list of [{x}, seconds]")
    for i, p in enumerate(points):
        if not (isinstance(p, list) and len(p) == 2):
            fail(f"'{where}[{i}]' must be [{x}, seconds], got {p!r}")
        _check_type(p[0], float, f"{where}[{i}][0]", fail)
        _check_type(p[1], float, f"{where}[{i}][1]", fail)
    if any(a[0] >= b[0] for a, b in itertools.pairwise(points)):
        fail(f"'{where}' must be sorted by increasing {x.replace('_', ' ')}")


def _check_topk(t: dict, fail) -> None:
    for key in ("k", "chunk", "row_len"):
        if key not in t:
            fail(f"missing 'topk_select.{key}'")
        _check_type(t[key], int, f"topk_select.{key}", fail)
    _check_points(t.get("seconds"), "topk_select.seconds", "rows", fail)


def load(path: str | Path) -> dict:
    """Read and validate a calibration file; the dict gains `path`."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise CalibrationError(f"calibration {path}: not JSON ({e})") from e
    return {**validate(data, str(path)), "path": str(path)}


def table_seconds(points: list, nbytes: float) -> float:
    """Seconds for `nbytes` from [[bytes, seconds], ...]: log-log between points, the first point's
    time below the table, linear in bytes above it."""
    if nbytes <= points[0][0]:
        return float(points[0][1])
    if nbytes >= points[-1][0]:
        return points[-1][1] * nbytes / points[-1][0]
    for (b0, t0), (b1, t1) in itertools.pairwise(points):
        if b0 <= nbytes <= b1:
            f = math.log(nbytes / b0) / math.log(b1 / b0)
            return math.exp(math.log(t0) + f * math.log(t1 / t0))
    raise AssertionError("unreachable: the table is sorted")


def torch_op_seconds(cal: dict) -> float:
    """Seconds per aten op of the CUDA target's torch code (a /1 file: its floor, or a kernel's)."""
    return cal.get("torch_op_s") or cal.get("torch_op_overhead_s") or cal["kernel_overhead_s"]


def gemm_launch_seconds(cal: dict) -> float:
    """Seconds per cuBLAS GEMM call beyond its bytes (a /1 file: a kernel's launch)."""
    return cal.get("gemm_launch_s") or cal["kernel_overhead_s"]


def topk_select_seconds(cal: dict, rows: int, passes_ratio: float) -> float:
    """One launch of the top-k select over `rows` rows, `passes_ratio` x the calibration's row
    walks per row (`launch_model.topk_select_passes`); 0 without a `topk_select` (a /1 file).
    Rows: log-log between measured points, the first point's time below, linear in rows above the
    last (programs beyond the measured ones run in further waves)."""
    t = cal.get("topk_select")
    return table_seconds(t["seconds"], rows) * passes_ratio if t else 0.0


def wire_fraction(kind: str, ranks: int) -> float:
    """Bytes one rank sends per message byte (ring all-reduce: twice this)."""
    return (ranks - 1) / ranks / (ranks if kind == "all_to_all" else 1)


def measured_ranks(cal: dict, kind: str, ranks: int) -> int:
    """The group size whose table times `kind` over `ranks` GPUs (see the module docstring)."""
    have = sorted(int(r) for r, tables in cal["collectives"].items() if kind in tables)
    if not have:
        raise CalibrationError(f"calibration {cal.get('path', '<dict>')}: no '{kind}' table in "
                               f"'collectives'")
    if ranks in have:
        return ranks
    below = [r for r in have if r < ranks]
    return below[-1] if below else have[0]


def p2p_collective_seconds(cal: dict, kind: str, nbytes: float, ranks: int) -> float:
    """One all-reduce / reduce-scatter / all-gather (`kind`) run by the one-shot peer-memory kernel: the
    calibration's `p2p_<kind>` table for exactly `ranks` GPUs (the kernel with its add + RMSNorm,
    in a graph), else the model `glmc.passes.costs.p2p_seconds` fitted to torch's one-shot
    all-reduce on two H200s (it reads every peer's message, so other group sizes do not carry over
    as NCCL's ring does)."""
    tables = cal["collectives"].get(str(ranks), {})
    if f"p2p_{kind}" in tables:
        return table_seconds(tables[f"p2p_{kind}"], nbytes)
    return p2p_seconds(kind, nbytes, ranks)


def collective_seconds(cal: dict, kind: str, nbytes: float, ranks: int) -> float:
    """One `kind` of `nbytes` (message convention above) over `ranks` GPUs, in seconds."""
    if ranks <= 1:
        return 0.0
    base = measured_ranks(cal, kind, ranks)
    same_wire = nbytes * wire_fraction(kind, ranks) / wire_fraction(kind, base)
    return table_seconds(cal["collectives"][str(base)][kind], same_wire)
