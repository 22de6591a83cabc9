"""The FP8 plan op by op against its oracle (`runtime/worker/op_compare.py`) on the CPU: the CUDA target
(Triton interpreted) on a tiny block-FP8 checkpoint whose FP8 blocks are whole (widths of 128 and 256),
each op fed the w8a8 torch target's own upstream values.

Every op lies within its rounding bound, the FP8 GEMMs within theirs around the exact product of
their own quantised input; an FP8 code of a SwiGLU's h that lands on the other side of a rounding
boundary is admitted only through the bound's flip term. A wrong weight scale and a wrong kernel
result are both caught, at the op that has them.
"""
from dataclasses import replace

import pytest
import torch
from tiny_hf import save_tiny_fp8

from glmc.codegen import cuda_target, fp8_torch_target
from glmc.codegen.fp8_ref import Fp8Weight
from glmc.codegen.torch_target import unfused_args
from glmc.codegen.triton_contexts import QueryRope
from glmc.compiler import compile_plan
from glmc.config import Options
from glmc.parallel import parse_parallel
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.kv_cache import PAGE_SIZE
from glmc.runtime.worker.loader import load_runner
from glmc.runtime.worker.op_compare import bound, compare_step, summary, ulp, unit_roundoff
from glmc.spec import kv_dtyped, load_spec

ALIGNED = dict(v_head_dim=64, intermediate_size=256, moe_intermediate_size=256)


@pytest.fixture(scope="module")
def plan_and_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8_aligned")
    save_tiny_fp8(path, "grouped", seed=3, **ALIGNED)
    spec = load_spec(path)
    return compile_plan(spec, parse_parallel("tp1", spec.config), Options(device="cuda", max_batch=4)), path


def executors(plan, path):
    mk = lambda **kw: load_runner(plan, path, device="cpu", num_pages=8, max_context=128,   # noqa: E731
                                  max_running=4, capture=False, **kw).executor
    target, oracle, again = mk(), mk(target="cpu"), mk(target="cpu")
    oracle.impls = again.impls = fp8_torch_target.IMPLS
    return target, oracle, again


def scale_result(target, kind, layer, factor):
    """The target's `kind` ops of `layer` return their result times `factor` (a small kernel bug)."""
    impl = cuda_target.IMPLS[kind]

    def off_by_a_little(op, args, ctx):
        out = impl(op, args, ctx)
        return out * factor if op.layer == layer else out
    target.impls = {**target.impls, kind: off_by_a_little}


def batches():
    pages = torch.arange(4 * 2).view(4, 2) + 1
    table = (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(4, -1)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (14, 11)]
    prefill = ForwardBatch.build("extend", prompts, [0, 1], [0, 0], table)
    decode = ForwardBatch.build("decode", [[5], [7]], [0, 1], [14, 11], table)
    return prefill, decode


def test_ulp_and_bound():
    x = torch.tensor([1.0, 1.5, 2.0, -3.0, 0.0])
    assert ulp(x, torch.bfloat16)[:4].tolist() == [2 ** -7, 2 ** -7, 2 ** -6, 2 ** -6]
    assert ulp(x, torch.float32)[0] == 2 ** -23
    b = bound(x.view(1, -1), torch.bfloat16)
    assert torch.all(b >= ulp(x, torch.bfloat16)) and torch.all(b < ulp(x, torch.bfloat16) + 1e-3)


def test_every_op_within_its_bound(plan_and_ckpt, one_torch_thread):
    plan, path = plan_and_ckpt
    target, oracle, again = executors(plan, path)
    for phase, batch in zip(("prefill", "decode"), batches()):
        rows = compare_step(target, oracle, again, phase, batch)
        kinds = summary(rows)
        assert {"linear", "mla.a_proj", "mlp.swiglu", "moe.experts", "attn.mla_mha" if phase == "prefill"
                else "attn.mla_absorbed", "idx.topk", "moe.topk"} <= set(kinds), sorted(kinds)
        assert [r.as_dict() for r in rows if not r.ok()] == []
        fp8 = [r for r in rows if r.fp8_out_of_bound is not None]
        assert len(fp8) >= 10 and all(r.in_flips == 0.0 for r in fp8)   # fp32 plan: the same inputs
        for r in rows:
            if r.set_diff_rows is not None:
                assert r.set_diff_rows == 0.0, r.as_dict()
            if r.out_of_bound:     # only an FP8 code of h on the other side of a boundary
                assert r.kind in ("mlp.swiglu", "moe.experts") and r.flip_rows >= 1, r.as_dict()


def test_a_wrong_weight_scale_is_caught_at_its_op(plan_and_ckpt, one_torch_thread):
    plan, path = plan_and_ckpt
    target, oracle, again = executors(plan, path)
    name = "model.layers.1.self_attn.o_proj.weight"
    w = target.weights[name]
    assert isinstance(w, Fp8Weight)
    w.scale_inv[0, 0] *= 1.01
    rows = compare_step(target, oracle, again, "prefill", batches()[0])
    bad = [r for r in rows if not r.ok()]
    assert bad and bad[0].result == "L1.o" and bad[0].fp8_out_of_bound > 0


def test_a_wrong_query_turn_is_caught_at_its_reader(plan_and_ckpt, one_torch_thread, monkeypatch):
    """Layer 2's query RoPEs turned with theta 0.1% off, inside the kernels that read the queries
    (fuse-query-rope: the indexer and the attention turn their query as they load it): caught at
    that layer's reader, not elsewhere."""
    plan, path = plan_and_ckpt
    target, oracle, again = executors(plan, path)
    of = QueryRope.of

    def off_by_a_little(op):
        rope = of(op)
        return replace(rope, theta=rope.theta * (1 + 1e-3)) if rope is not None and op.layer == 2 else rope
    monkeypatch.setattr(QueryRope, "of", staticmethod(off_by_a_little))
    rows = compare_step(target, oracle, again, "prefill", batches()[0])
    bad = {r.result for r in rows if not r.ok()}
    assert "L2.attn" in bad and bad <= {"L2.topk", "L2.attn"}, bad


def test_a_wrong_attention_result_is_caught_at_its_op(plan_and_ckpt, one_torch_thread, monkeypatch):
    """The MLA's oracle (`attention_oracle`: the kernel's input-determined roundings done alike, the
    others bounded) holds an fp32 plan's attention to a few fp32 ulps: one part in 10^4 is caught."""
    plan, path = plan_and_ckpt
    target, oracle, again = executors(plan, path)
    scale_result(target, "attn.mla_mha", layer=1, factor=1 + 1e-4)
    rows = compare_step(target, oracle, again, "prefill", batches()[0])
    assert {r.result for r in rows if not r.ok()} == {"L1.attn"}
    assert all(r.slack_rel < 1e-5 for r in rows if r.kind == "attn.mla_mha")


@pytest.mark.parametrize("kind", ["idx.topk", "moe.topk"])
def test_a_changed_choice_is_reported_with_its_margin(plan_and_ckpt, one_torch_thread, kind):
    """A top-k that picks the (k+1)-th key or expert instead of the k-th, in one row: the row's set
    differs and the margin reported is the gap between the two in what the op ranks (finite, > 0),
    not a tie."""
    plan, path = plan_and_ckpt
    target, oracle, again = executors(plan, path)
    impl = cuda_target.IMPLS[kind]
    done = []

    def one_swapped(op, args, ctx):
        out = impl(op, args, ctx)
        if done:
            return out
        done.append(op.layer)
        if kind == "moe.topk":
            w, ids = out
            ids = ids.clone()
            ids[-1, -1] = next(e for e in range(8) if e not in ids[-1].tolist())
            return w, ids
        slots = out.clone()       # the last token: 14 keys, 8 chosen; one chosen slot -> an unchosen one
        row = slots[13]
        spare = next(s for s in ctx.r2t[ctx.rows[13], :14].tolist() if s not in row.tolist())
        row[-1] = spare
        return slots
    target.impls = {**target.impls, kind: one_swapped}
    rows = compare_step(target, oracle, again, "prefill", batches()[0])
    changed = [r for r in rows if r.kind == kind and r.set_diff_rows and r.layer == done[0]]
    assert len(changed) == 1 and 0 < changed[0].min_margin < float("inf"), [r.as_dict() for r in changed]


def test_ops_after_a_choice_are_judged_on_the_choice_the_target_was_given(plan_and_ckpt, one_torch_thread):
    """The target's attention runs on the oracle's top-k; the rerun on rounded inputs must attend to
    those same keys, not to a top-k it chooses again (where rounding flipped a near-tie, its keys
    differ and attention would be judged against other keys). Here the oracle's choice swaps a key
    that its scores would not pick: every float result stays within its bound."""
    plan, path = plan_and_ckpt
    target, oracle, again = executors(plan, path)
    impl = oracle.impls["idx.topk"]

    def one_swapped(op, args, ctx):
        pos = impl(op, args, ctx).clone()    # the last token: 14 keys, 8 chosen; one chosen -> an unchosen one
        pos[13, -1] = next(p for p in range(14) if p not in pos[13].tolist())
        return pos
    oracle.impls = {**oracle.impls, "idx.topk": one_swapped}
    rows = compare_step(target, oracle, again, "prefill", batches()[0])
    assert [r.result for r in rows if not r.ok() and r.kind != "idx.topk"] == []
    assert any(r.kind.startswith("attn") for r in rows)


def test_unit_roundoff_is_half_an_ulp_at_one():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        u = unit_roundoff(dtype)
        assert torch.tensor(1 + u * 1.01, dtype=torch.float32).to(dtype).item() > 1.0
        assert torch.tensor(1 + u * 0.99, dtype=torch.float32).to(dtype).item() == 1.0


def test_the_spread_moves_each_value_at_most_one_ulp():
    """bench.fp8_op_check's perturbed oracle: a 16-bit value rounds to one of its two neighbours,
    an fp32 value moves to a neighbour or stays; never further, and both ways occur."""
    from bench.fp8_op_check import perturbed
    from glmc.ir import Op
    x = torch.randn(4096) * 3
    for dt in (torch.bfloat16, torch.float32):
        op = Op.make("embed.lookup", "h", ("ids",))
        impls = perturbed({"embed.lookup": lambda op, args, ctx: x.clone()}, {"h": dt}, seed=0)
        y = impls["embed.lookup"](op, [], None)
        d = (y - x).abs()
        assert torch.all(d <= ulp(x, dt)), dt
        if dt == torch.bfloat16:
            assert torch.all(y.to(dt).float() == y)          # a bf16 value
        else:
            assert 0 < int((y == x).sum()) < x.numel()
        assert (y > x).sum() > 100 and (y < x).sum() > 100


class _TiledRows:
    """The oracle's pool as the per-tile FP8 kernel reads it: each latent value code x scale
    rounded to bf16 with the scale rounded first (`sparse_mla_decode`'s `dequant` form)."""

    def __init__(self, pool):
        self.pool, self.kv_format = pool, pool.kv_format

    def c_kv(self, layer, slots):
        from glmc.codegen.fp8_ref import quantize_token_groups
        code, s = quantize_token_groups(self.pool.c_kv(layer, slots).float())
        bf = torch.bfloat16
        return (code.float().to(bf) * s.repeat_interleave(128, 1)[:, :code.shape[1]].to(bf)).float()

    def k_pe(self, layer, slots):
        return self.pool.k_pe(layer, slots)


def kernel_roundings(op, args, ctx):
    """Absorbed MLA with the kernel's roundings into bf16, in torch (round to nearest): q_lat, the
    FP8 rows' dequantised values, each exp(s - max) before the PV product (over an fp32 sum), out_lat."""
    from glmc.codegen.torch_ref import latent_probs
    q_nope, q_pe, layer, topk = args
    bf, dn, dv = torch.bfloat16, int(op.attr("dn")), int(op.attr("dv"))
    T, H = q_nope.shape[:2]
    w = ctx.w(op.attr("weight")).float().view(H, dn + dv, -1)
    q_lat = torch.einsum("thd,hdr->thr", q_nope.float(), w[:, :dn]).to(bf).float()
    pool = _TiledRows(ctx.pool) if ctx.pool.kv_format != "native" else ctx.pool
    out_lat = torch.zeros_like(q_lat)
    for tok, p, c in latent_probs(q_lat, q_pe, pool, layer, topk, ctx.batch, op.attr("scale")):
        e = p / p.amax(-1, keepdim=True)      # exp(s - max): 1 at the largest score
        out_lat[tok] = torch.einsum("htl,lr->thr", e.to(bf).float(), c) / e.sum(-1).transpose(0, 1)[..., None]
    return torch.einsum("thr,hvr->thv", out_lat.to(bf).float(), w[:, dn:]).reshape(T, H * dv)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_the_attention_bound_covers_bf16_roundings_and_is_tight(plan_and_ckpt, one_torch_thread, kv):
    """`attention_oracle`'s probabilistic bound at bf16 holds the kernel's roundings (emulated in
    torch above; FP8 rows in the per-tile form) at every element, is about a tenth of the output's
    norm wide (bf16 rows 0.06, FP8 0.10; the worst-case bound it replaced was half the norm at
    GLM-5.3 width), and a 10% error in the output falls outside it at a fifth of the elements or more."""
    from glmc.runtime.worker.op_compare import attention_oracle
    plan, path = plan_and_ckpt
    if kv == "fp8":
        spec = kv_dtyped(load_spec(path), "fp8")
        plan = compile_plan(spec, parse_parallel("tp1", spec.config), Options(device="cuda", max_batch=4))
    ex = load_runner(plan, path, device="cpu", target="cpu", num_pages=8, max_context=128, max_running=4,
                     capture=False, kv_fp8="emulate" if kv == "fp8" else "none").executor
    assert (ex.pool.kv_format != "native") == (kv == "fp8")
    seen = []

    def check(op, args, ctx):
        plain = unfused_args(op, args)   # q_pe turned by the positions (fuse-query-rope), as the kernel turns it
        got = kernel_roundings(op, plain, ctx)
        want, slack = attention_oracle(op, plain, ctx, torch.bfloat16)
        limit = bound(want, torch.bfloat16) + slack
        seen.append({"width": float(slack.norm() / want.norm()), "outside": int(((got - want).abs() > limit).sum()),
                     "caught": float((got * 1.1 - want).abs().gt(limit).float().mean())})
        return impl(op, args, ctx)
    impl = ex.impls["attn.mla_mha"]
    ex.impls = {**ex.impls, "attn.mla_mha": check}
    for batch in batches():
        ex.forward("prefill" if batch.mode == "extend" else "decode", batch)
    assert len(seen) == 4, seen      # two MLA layers, prefill and decode
    assert all(s["outside"] == 0 and s["width"] < 0.15 and s["caught"] > 0.2 for s in seen), seen
