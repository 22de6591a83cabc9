"""The Triton MoE experts (codegen/triton_moe.py) against torch_ref.moe_experts, under the interpreter.

Tiny ragged shapes (hidden and intermediate not multiples of the tiles), skewed routing (some experts
empty, one crowded past a block), EP offsets (rows of other ranks' experts dropped), and HF's fused
gate_up layout as strided views. Outputs are allocated poisoned so an unwritten element fails.
Split K (decode): every split form against the unsplit kernel and the reference, bf16 and FP8, with the
launches recorded (the splits and the SwiGLU reduction ran); the launch choice at GLM-5.3 shapes; the
variants covering every launch; the one-program sort against the torch ops.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CI has no GPU

import pytest
import torch
from glmc.codegen import torch_ref as ref
from glmc import target
from glmc.codegen import triton_moe as tm

_EMPTY = torch.empty


def _poisoned_empty(*args, **kwargs):
    t = _EMPTY(*args, **kwargs)
    return t.fill_(float("nan") if t.is_floating_point() else -777)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
    torch.manual_seed(0)


def _routing(T, k, num_experts, skew=False):
    """Distinct expert ids per token; with skew, expert 1 is in every row (a crowded expert)."""
    ids = torch.stack([torch.randperm(num_experts)[:k] for _ in range(T)])
    if skew:
        ids[:, 0] = torch.where((ids[:, 1:] == 1).any(1), ids[:, 0], 1)
    w = torch.rand(T, k) + 0.1
    return w, ids


def _stacks(E, inter, hidden, fused=False):
    if fused:  # HF layout: gate_up [E, 2I, H]; gate and up are strided views of it
        gate_up = torch.randn(E, 2 * inter, hidden) / hidden ** 0.5
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
    else:
        gate, up = torch.randn(E, inter, hidden) / hidden ** 0.5, torch.randn(E, inter, hidden) / hidden ** 0.5
    return gate, up, torch.randn(E, hidden, inter) / inter ** 0.5


class _Launches(tm.KernelLibrary):
    """The JIT library, recording (context, grid) of every launch: which split form actually ran."""

    def __init__(self):
        super().__init__()
        self.grids = []

    def __call__(self, ctx):
        fn, grids = super().__call__(ctx), self.grids

        class _Grid:
            def __getitem__(self, grid):
                grids.append((ctx, grid))
                return fn[grid]
        return _Grid()


@pytest.mark.parametrize("T,k,E,skew,fused", [(1, 2, 8, False, False), (7, 3, 8, True, True),
                                                (20, 2, 6, True, False)])
def test_moe_experts_matches_reference(T, k, E, skew, fused):
    hidden, inter = 48, 40
    x = torch.randn(T, hidden)
    w, ids = _routing(T, k, E, skew)
    gate, up, down = _stacks(E, inter, hidden, fused)
    got = tm.moe_experts(x, ids, w, gate, up, down, tiles={"gate_up": {"block_k": 32}})
    want = ref.moe_experts(x, ids, w, gate, up, down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_moe_experts_ep_offset_drops_other_ranks_rows():
    T, k, hidden, inter = 9, 2, 32, 24
    x = torch.randn(T, hidden)
    w, ids = _routing(T, k, 8)
    gate, up, down = _stacks(4, inter, hidden)  # this rank holds experts 4..7
    got = tm.moe_experts(x, ids, w, gate, up, down, expert_offset=4)
    want = ref.moe_experts(x, ids, w, gate, up, down, expert_offset=4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_align_rows_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [3, 0]])
    rows, block_expert = tm.align_rows(ids, 4, 2)
    nb = tm.num_blocks_bound(6, 4, 2)
    assert rows.shape == (nb * 2,) and block_expert.shape == (nb,)
    # expert 0: rows 1, 5; expert 1: row 3 + pad; expert 3: rows 0, 2, 4 + pad; then unused blocks
    assert rows.tolist()[:8] == [1, 5, 3, 6, 0, 2, 4, 6]
    assert block_expert.tolist() == [0, 1, 3, 3] + [-1] * (nb - 4)


# rows up to ALIGN_ROWS (4096): one moe_align launch, 16 or 32 rows per program (so 1 to 128 programs,
# each counting every row); up to 256 local experts; global ids in [0, id_range),
# this rank holding [offset, offset + E) (EP: the other rows are dropped); int32 and int64 ids; the
# expert kernels' row blocks 16, 32 and 64 (a dp8ep8 rank's gathered rows: 32 experts, 64 rows each)
@pytest.mark.parametrize("T,k,E,offset,id_range,skew,bm", [
    (1, 8, 256, 0, 256, False, 16), (1, 8, 32, 64, 256, False, 16), (3, 2, 6, 0, 6, True, 16),
    (8, 8, 256, 0, 256, False, 16), (8, 4, 3, 1, 5, True, 32), (32, 2, 4, 2, 8, True, 64),
    (7, 1, 5, 0, 5, False, 16), (17, 8, 256, 0, 256, False, 16), (40, 8, 64, 64, 256, True, 16),
    (128, 8, 256, 0, 256, False, 16), (128, 8, 32, 224, 256, True, 32), (12, 8, 256, 0, 256, True, 16),
    (256, 8, 32, 32, 256, False, 64), (200, 8, 32, 0, 256, True, 32), (512, 8, 256, 0, 256, False, 16)])
def test_fused_align_equals_the_torch_ops(T, k, E, offset, id_range, skew, bm):
    """moe_align (one launch) gives align_rows' torch result exactly: the padded order, the padding
    sentinel, every block's expert and -1 past the end (all written: outputs start poisoned)."""
    _, ids = _routing(T, k, id_range, skew)
    ids = ids.int() if T == 3 else ids
    lib = _Launches()
    fused = tm.align_rows(ids, E, bm, offset, lib=lib)
    torch_ops = tm.align_rows(ids, E, bm, offset)
    assert [c.template for c, _ in lib.grids] == ["moe_align"]
    assert lib.grids[0][1] == (-(-T * k // lib.grids[0][0].rows),)          # the rows split over programs
    assert torch.equal(fused[0], torch_ops[0]) and torch.equal(fused[1], torch_ops[1])


def test_align_past_the_fused_size_uses_the_torch_ops():
    _, ids = _routing(513, 8, 256)                  # 4104 rows > ALIGN_ROWS
    lib = _Launches()
    rows, block_expert = tm.align_rows(ids, 256, 16, lib=lib)
    assert not lib.grids and torch.equal(rows, tm.align_rows(ids, 256, 16)[0])


@pytest.mark.parametrize("offset", [0, 4])
def test_padding_tokens_run_no_expert_and_combine_to_zero(offset):
    """pad = (loc, pad_slot): the tokens at the padding slot (a step's padding, all one token) route to
    experts no real token needs; moe_align drops their rows (the blocks are the real rows' alone,
    as if their ids were another rank's), the combine writes 0 for them, and the real tokens' rows
    are the reference's. bf16-free: fp32 and FP8 stacks."""
    from glmc.codegen import fp8_ref
    T, k, E, hidden, inter, pad_slot = 6, 3, 4, 32, 24, 99
    g = torch.Generator().manual_seed(2)
    ids = torch.tensor([[0, 1, 2], [1, 2, 3], [0, 2, 3], [3, 1, 0], [5, 6, 7], [5, 6, 7]]) + offset
    ids[4:] = (ids[4:] - offset + 2) % 8       # padding: experts 7, 0, 1 of this rank's 0..3 (offset 4: none)
    loc = torch.tensor([10, 11, 12, 13, pad_slot, pad_slot])
    x, w = torch.randn(T, hidden, generator=g), torch.rand(T, k, generator=g) + 0.1
    stacks = _stacks(E, inter, hidden)
    lib = _Launches()
    rows, block_expert = tm.align_rows(ids, E, 16, offset, lib=lib, pad=(loc, pad_slot))
    unrouted = torch.where(torch.arange(T)[:, None] >= 4, -1, ids)
    assert torch.equal(rows, tm.align_rows(unrouted, E, 16, offset)[0])
    assert torch.equal(block_expert, tm.align_rows(unrouted, E, 16, offset)[1])
    assert not set(rows.tolist()) & set(range(4 * k, T * k))           # no padding token's row
    real = ref.moe_experts(x[:4], ids[:4], w[:4], *stacks, expert_offset=offset)
    got = tm.moe_experts(x, ids, w, *stacks, expert_offset=offset, pad=(loc, pad_slot))
    torch.testing.assert_close(got[:4], real, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[4:], torch.zeros(2, hidden))
    q = [fp8_ref.Fp8Weight.quantize(s.contiguous()) for s in stacks]
    got = tm.moe_experts_fp8(x, ids, w, *q, expert_offset=offset, pad=(loc, pad_slot))
    torch.testing.assert_close(got[:4], fp8_ref.moe_experts_fp8(x[:4], ids[:4], w[:4], *q, expert_offset=offset),
                               rtol=1e-4, atol=1e-4)
    assert torch.equal(got[4:], torch.zeros(2, hidden))


def test_generated_source_is_specialised():
    from glmc.codegen.triton_launch import render
    ctx = tm.MoeExpertsCtx.make(True, 2048, 6144, 8, torch.bfloat16, 16)
    src = render("moe_experts", ctx)
    assert "for k0 in range(0, 2048, 128)" in src and "n < 6144" in src and "row // 8" not in src
    assert "tl.bfloat16" in src and "w2_ptr" not in src
    up = render("moe_experts", tm.MoeExpertsCtx.make(False, 6144, 2048, 8, torch.bfloat16, 16))
    assert "row // 8" in up and "acc2" in up and "route_w_ptr" not in up


# ----------------------------------------------------------------------------- split K (decode)
def _split_tiles(s1, s2, **both):
    """tiles: s1 gate/up and s2 down splits, `both` overrides for both stages."""
    return {"gate_up": {"splits": s1, **both}, "down": {"splits": s2, **both}}


# T = 1, 2, 3 (decode), 24 (a prefill at these widths); splits that divide the K steps, leave an
# uneven last run (3 of 48/16) and one with no K at all (4 over 3 steps); EP offsets
@pytest.mark.parametrize("T,offset,s1,s2", [(1, 0, 2, 2), (2, 0, 3, 4), (3, 2, 4, 3), (24, 0, 2, 2), (24, 3, 3, 2)])
def test_split_k_matches_unsplit_and_reference(T, offset, s1, s2):
    """The split-K forms (partial sums, then the reduction that applies SiLU-and-mul to the full sums,
    and the combine over splits and slots) give the unsplit kernel's and torch_ref's result; the
    launches prove the splits ran (grid axis 2) and the reduction after them."""
    k, E, hidden, inter = 2, 6, 48, 40
    x = torch.randn(T, hidden)
    w, ids = _routing(T, k, E + offset, skew=T > 3)
    gate, up, down = _stacks(E, inter, hidden, fused=T == 2)
    lib = _Launches()
    got = tm.moe_experts(x, ids, w, gate, up, down, expert_offset=offset,
                         tiles=_split_tiles(s1, s2, block_k=16), lib=lib)
    unsplit = tm.moe_experts(x, ids, w, gate, up, down, expert_offset=offset,
                             tiles=_split_tiles(1, 1, block_k=16))
    want = ref.moe_experts(x, ids, w, gate, up, down, expert_offset=offset)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, unsplit, rtol=1e-5, atol=1e-5)
    kinds = [(c.template, getattr(c, "down", None), getattr(c, "split", None), g[2:]) for c, g in lib.grids]
    assert kinds == [("moe_align", None, None, ()), ("moe_experts", False, True, (s1,)),
                     ("moe_swiglu_reduce", None, None, ()), ("moe_experts", True, True, (s2,)),
                     ("moe_combine", None, None, ())]


def test_split_k_is_bit_identical_run_to_run():
    T, k, E, hidden, inter = 3, 2, 6, 48, 40
    x = torch.randn(T, hidden)
    w, ids = _routing(T, k, E)
    stacks = _stacks(E, inter, hidden)
    runs = [tm.moe_experts(x, ids, w, *stacks, tiles=_split_tiles(3, 2, block_k=16)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("T,offset,s1,s2", [(1, 0, 4, 2), (2, 2, 2, 1), (3, 0, 3, 2), (12, 1, 2, 2)])
def test_fp8_split_k_matches_unsplit_and_reference(T, offset, s1, s2):
    """FP8 experts split K: h rounded, then quantised per row per 128 columns in the reduction (as the
    unsplit gate/up kernel does in its epilogue); a gate/up tile narrower than the 128-column group;
    the same bits on a second run."""
    from glmc.codegen import fp8_ref
    E, k, hidden, inter = 4, 2, 384, 256      # K blocks: 3 (gate/up), 2 (down)
    g = torch.Generator().manual_seed(5)
    ws = [fp8_ref.Fp8Weight.quantize(torch.randn(E, *shape, generator=g) * shape[1] ** -0.5)
          for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
    x = torch.randn(T, hidden, generator=g).to(torch.bfloat16).float()
    ids = torch.randint(0, E + offset, (T, k), generator=g)
    w = torch.rand(T, k, generator=g)
    lib = _Launches()
    tiles = _split_tiles(s1, s2, block_n=64)
    got = tm.moe_experts_fp8(x, ids, w, *ws, expert_offset=offset, tiles=tiles, lib=lib)
    unsplit = tm.moe_experts_fp8(x, ids, w, *ws, expert_offset=offset, tiles=_split_tiles(1, 1))
    want = fp8_ref.moe_experts_fp8(x, ids, w, *ws, expert_offset=offset)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, unsplit, rtol=1e-4, atol=1e-4)
    assert torch.equal(got, tm.moe_experts_fp8(x, ids, w, *ws, expert_offset=offset, tiles=tiles))
    grids = {(c.template, getattr(c, "down", None)): (c, g) for c, g in lib.grids}
    assert grids[("moe_experts_fp8", False)][1][2] == s1 and grids[("moe_experts_fp8", False)][0].block_n == 64
    assert grids[("moe_swiglu_reduce", None)][0].fp8
    assert grids[("moe_experts_fp8", True)][1][2] == s2 and grids[("moe_experts_fp8", True)][0].split == (s2 > 1)


def test_launch_choice_at_glm53_shapes():
    """FP8 experts at one decode token split the gate/up stage's K in two (8 experts x 32 tiles is 256
    programs, under 2 per SM of 132); the down stage's 768 tiles suffice; from two tokens on nothing
    splits; bf16 never splits (slower on the H200: bench/moe_sweep.py); a TP-sharded intermediate
    (256 columns) splits up to MOE_SPLIT_MAX."""
    def splits(T, inter=2048, fp8=True):
        launch = tm.moe_launch(8 * T, 256, 6144, inter, 132, fp8)
        return launch["block_m"], launch["gate_up"]["splits"], launch["down"]["splits"]
    assert [splits(T) for T in (1, 2, 4, 128)] == [(16, 2, 1), (16, 1, 1), (16, 1, 1), (16, 1, 1)]
    assert [splits(T, fp8=False) for T in (1, 2)] == [(16, 1, 1), (16, 1, 1)]
    assert splits(1, inter=256) == (16, target.MOE_SPLIT_MAX, 1)
    assert splits(1024) == (32, 1, 1)
    assert target.moe_num_splits(programs=10, n_in=1024, num_sms=132) == 2   # each split keeps >= MOE_SPLIT_MIN_K


@pytest.mark.parametrize("fp8", [False, True])
def test_variants_list_every_context_the_launches_pick(monkeypatch, fp8):
    """The plan renders `variants()` and the server compiles exactly those: every context a launch
    without overrides makes, at decode (split) and prefill row counts, is listed."""
    from glmc.codegen import fp8_ref
    monkeypatch.setattr(tm, "sm_count", lambda device: 132)    # the H200's count and K runs of 64
    monkeypatch.setattr(target, "MOE_SPLIT_MIN_K", 64)           # columns: decode splits at these widths
    E, k, hidden, inter = 4, 2, 256, 128
    stacks = [torch.randn(E, *shape) * 0.1 for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
    if fp8:
        stacks = [fp8_ref.Fp8Weight.quantize(s) for s in stacks]
    run = tm.moe_experts_fp8 if fp8 else tm.moe_experts
    lib = _Launches()
    for T in (1, 3, 70):                 # 140 rows over 4 experts: the 32-row class
        w, ids = _routing(T, k, E)
        run(torch.randn(T, hidden), ids, w, *stacks, lib=lib)
    listed = set((tm.MoeExpertsFp8Ctx if fp8 else tm.MoeExpertsCtx).variants(hidden, inter, k, torch.float32))
    launched = {c for c, _ in lib.grids if c.template != "fp8_quant_tokens"}
    assert launched <= listed
    forms = {(getattr(c, "split", None), getattr(c, "block_m", None)) for c in launched}
    assert forms >= ({(True, 16), (False, 32)} if fp8 else {(False, 16), (False, 32)})
    assert fp8 or not any(getattr(c, "split", False) for c in listed)   # bf16 experts never split


def test_split_sources_defer_swiglu_to_the_reduction():
    from glmc.codegen.triton_launch import render
    up = render("moe_experts", tm.MoeExpertsCtx.make(False, 6144, 2048, 8, torch.bfloat16, 16, split=True))
    assert "for k0 in range(k_lo, k_hi, 128)" in up and "tl.cdiv(48, num_splits)" in up and "tl.exp" not in up
    assert 'do_not_specialize=["num_rows", "num_splits"]' in up
    red = render("moe_swiglu_reduce", tm.MoeSwigluReduceCtx.make(2048, 16, torch.bfloat16, fp8=False))
    assert red.index("for s in range(0, num_splits)") < red.index("tl.exp(-g)") and "float8" not in red
    red8 = render("moe_swiglu_reduce", tm.MoeSwigluReduceCtx.make(2048, 16, torch.bfloat16, fp8=True))
    assert red8.index("tl.exp(-g)") < red8.index("_e4m3_round(v).to") and "tl.bfloat16" in red8
    up8 = render("moe_experts_fp8", tm.MoeExpertsFp8Ctx.make(False, 6144, 2048, 8, torch.bfloat16, 16, split=True))
    assert "range(kb_lo, tl.minimum(kb_lo + per_split, 48))" in up8 and "_e4m3_round" not in up8


def test_fp8_experts_take_rows_an_fp8_dispatch_quantised():
    """Rows that arrive quantised (an FP8 dispatch: e4m3 + fp32 scales per 128 columns, as the
    experts' own quantiser makes them) give the bits the experts give on x itself."""
    from glmc.codegen import fp8_ref
    from glmc.codegen.triton_fp8 import quantize_tokens
    E, k, hidden, inter, T = 4, 2, 384, 256, 3
    g = torch.Generator().manual_seed(6)
    ws = [fp8_ref.Fp8Weight.quantize(torch.randn(E, *shape, generator=g) * shape[1] ** -0.5)
          for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
    x = torch.randn(T, hidden, generator=g)
    ids = torch.randint(0, E, (T, k), generator=g)
    w = torch.rand(T, k, generator=g)
    xq, xs = quantize_tokens(x)
    got = tm.moe_experts_fp8(xq, ids, w, *ws, x_scales=xs, act_dtype=torch.float32)
    assert torch.equal(got, tm.moe_experts_fp8(x, ids, w, *ws))


def test_padding_ab_bench_runs(tmp_path):
    """`python -m bench.moe_sweep --padding` (the H200 A/B of dropping padding tokens), tiny shapes on the CPU:
    every PADDED step measured both ways, the dropped run touching only the real tokens' experts."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "bench.moe_sweep", "--tiny", "--padding",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "moe_sweep_padding.json").read_text())["rows"]
    assert [(r["dtype"], r["real"], r["T"]) for r in rows] == [(d, *p) for d in ("bf16", "fp8")
                                                                for p in ((3, 4), (5, 8), (13, 16), (1, 8))]
    for r in rows:
        assert r["dropped"]["us"] > 0 and r["run"]["us"] > 0
        assert r["dropped"]["touched"] <= r["run"]["touched"] and r["dropped"]["floor_us"] <= r["run"]["floor_us"]
    assert any(r["dropped"]["touched"] < r["run"]["touched"] for r in rows)
