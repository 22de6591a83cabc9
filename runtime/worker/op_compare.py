"""Op-by-op comparison of a plan's target against its oracle, each op on the oracle's own upstream values.

A plan-level comparison (logits after every layer) cannot tell a kernel bug from rounding that a
random model amplifies. Here every op of one step is checked alone:

1. the oracle (a torch-target `PlanExecutor`, fp32) runs the step and every value it makes is kept;
2. the target (`CudaExecutor`, or the torch target itself) runs the step with each op's operands
   replaced by the oracle's values, rounded to the dtype the target holds them in (its own
   operand's dtype), so no error compounds from op to op;
3. a second oracle executor (its own KV pool) runs the step on those same rounded operands in fp32,
   and on the same choices (integer operands such as top-k keys and expert ids are the oracle's, as
   the target got them): the op's exact arithmetic on the target's inputs (for an op whose contract
   rounds inside, `ROUNDED_KINDS`, its torch implementation on those operands in the target's dtype;
   for MLA, `attention_oracle` over the target's own cache: the kernel's input-determined roundings
   done alike, the others bounded probabilistically).

Per op and result, `compare_step` reports the error of (2) against (3) and how many elements lie
outside the op's rounding bound: one unit in the last place of the target's dtype at the oracle's
value, plus `REL_SLACK` of the row's RMS (fp32 summation order). For an op whose FP8 GEMMs read a
quantised activation (linear, the A-projection, the LM head with FP8 weights) the target's own
quantisation of its input is read back (the step's `memo`, where the CUDA target keeps it) and

- `in_flips`: the fraction of FP8 codes (value x scale) that differ from the oracle's quantisation of
  the same rounded input; a code differs from the fp32 oracle's when rounding the input to the
  target's dtype moved it across an FP8 rounding boundary or moved its group's scale;
- `fp8_out_of_bound`: elements of the target's result outside the bound around the exact GEMM of
  the target's own quantised input (`fp8_ref.fp8_gemm`), widened by the FP8 tensor core's
  accumulation (`FP8_ACC_REL`): this, not the plain error, decides whether the FP8 GEMM is right,
  since in_flips alone move the result by whole FP8 steps.

Ops whose result is an integer tensor (top-k indices, routed expert ids) report the fraction of
rows whose sets differ (`set_diff_rows`), and for `moe.topk` and `idx.topk` the smallest margin among
them: the gap between the k-th and (k+1)-th largest of what the op ranks (the router: sigmoid of
the logits plus the correction bias, with grouped routing the ranks inside the chosen groups can be
closer; the indexer: each key's index score on the oracle's cache).
Both sides rank the same logits, so only a gap of a few fp32 ulps may flip; the router's weights are
held to their bound on the rows whose sets agree and count the others as `flip_rows`.

The contract: the two executors run the same plan on the same weights; the target runs eagerly
(no captured graph replays: a replay runs no Python); the step's batch is given to both.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from glmc.codegen.fp8_ref import Fp8Weight, quantize_token_groups
from glmc.codegen.torch_ref import index_head_scale, indexer_scores, latent_probs
from glmc.codegen.torch_target import unfused_args
from glmc.ir.dialect import ROPE_READERS
from glmc.target import FP8_BLOCK as FP8_KV_GROUP

# Summation order in fp32 (blocked, split-K, tensor-core fragments) moves a result by up to a few
# 2^-24 of the sum of |terms|; against the row's RMS this slack is generous for every op here and
# still 30x below one bf16 ulp.
REL_SLACK = 2.0 ** -14
# Op kinds checked around the exact FP8 GEMM of their own quantised input (`fp8_in`, `_fp8_check`)
FP8_GEMM_KINDS = ("linear", "mla.a_proj", "lm.head")
# An FP8 GEMM's tensor-core accumulation: Hopper's FP8 wgmma keeps about 14 bits of its running sum
# over the 128 products of a K block (Triton's default, `triton_render.FP8_DOT_PROMOTE`), fp32 across
# blocks. Its error is bounded by FP8_ACC_REL times the sum of |terms| (|x| @ |W|^T of the dequantised
# operands). On an H100 (2026-12-05) bench/fp8_accumulation.py found the worst element at 2^-14.67 of
# it over GLM-5.3's prefill GEMMs (`acc_bits`), but bench/fp8_kernel_check.py's 20 x 96 x 256 case
# (two K blocks) left 2 of 1920 elements past 2^-14: few terms keep less, so one bit more.
FP8_ACC_REL = 2.0 ** -13
# Ops whose contract rounds inside: the oracle for them is the op's own torch implementation on the
# target's operands in the target's dtype (a folded add and the residual sum rounded as the model
# adds them in its dtype, the norm over that rounded sum), not the fp32 arithmetic end to end.
ROUNDED_KINDS = ("fused.add_rms",)
ATTN_KINDS = ("attn.mla_mha", "attn.mla_absorbed", "attn.sparse_mla")
# Attention's probabilistic rounding bound (`attention_oracle`): an element outside it has probability
# <= 2 exp(-32) ~ 2.5e-14 under the model, so ~1e8 elements of a slice's steps expect no false alarm.
ATTN_LAMBDA = 8.0


@dataclass
class OpRow:
    """One result of one op: where, what, and how far the target is from the oracle."""
    op: str
    kind: str
    layer: int | None
    result: str
    dtype: str
    numel: int
    rel_err: float | None = None
    max_abs: float | None = None
    out_of_bound: int = 0
    vs_fp32_input: float | None = None   # the oracle's own move when its inputs are rounded (3 vs 1)
    set_diff_rows: float | None = None
    min_margin: float | None = None
    in_flips: float | None = None
    fp8_rel_err: float | None = None
    fp8_out_of_bound: int | None = None
    slack_rel: float | None = None       # an op-specific bound's width past the rounding bound, relative
    worst: float | None = None           # the largest |error| / bound over the elements (> 1: out of bound)
    scale_rel: float | None = None
    flip_rows: int | None = None          # rows outside the plain bound that an FP8 flip of h explains
    note: str = ""

    def ok(self) -> bool:
        """Within its bound: every element of a float result (for an FP8 GEMM, around the exact
        product of its own quantised input); integer results are reported, not judged here."""
        if self.fp8_out_of_bound is not None:
            return self.fp8_out_of_bound == 0
        return self.out_of_bound == 0

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None and v != ""}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at |x| (fp32 tensor; normal numbers)."""
    mant = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    tiny = torch.finfo(dtype).tiny
    _, e = torch.frexp(x.abs().clamp_min(tiny))
    return torch.ldexp(torch.ones_like(x), e - 1 - mant)


def bound(want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rounding bound around an fp32 result `want` for a result held in `dtype`."""
    w = want.float()
    rows = w.reshape(w.shape[0], -1) if w.dim() > 1 else w.reshape(1, -1)
    rms = rows.pow(2).mean(1, keepdim=True).sqrt().expand_as(rows).reshape(w.shape)
    return ulp(w, dtype) + REL_SLACK * rms


def _substitute(own, given):
    """The target's operand replaced by the oracle's value, in the target's dtype and device (its
    rows past the oracle's kept: padding); anything not a tensor of the same rank is kept."""
    if not isinstance(own, torch.Tensor) or not isinstance(given, torch.Tensor) or own.dim() != given.dim() \
            or own.dtype == torch.float8_e4m3fn or own.is_floating_point() != given.is_floating_point():
        return own
    if own.shape[1:] != given.shape[1:] or own.shape[0] < given.shape[0]:
        return own
    out = own.clone()
    out[:given.shape[0]] = given.to(own.device, own.dtype)
    return out


def _fp32_of(own, rounded):
    """The oracle's operand: the rounded value the target saw, back in fp32 on the oracle's device."""
    if isinstance(rounded, torch.Tensor) and rounded.is_floating_point() and rounded.dtype != torch.float8_e4m3fn:
        return rounded.to(own.device if isinstance(own, torch.Tensor) else rounded.device, torch.float32)
    return own


def _is_float(v) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _given(own, oracle):
    """An integer operand (top-k keys, expert ids) as the target was given it: the oracle's, in the
    oracle's form (positions, not slots), so the rerun decides on the same choice, not on its own
    from rounded inputs (a near-tie that rounding flips is reported at the choosing op)."""
    if isinstance(own, torch.Tensor) and isinstance(oracle, torch.Tensor) and oracle.shape == own.shape \
            and not oracle.is_floating_point():
        return oracle.to(own.device, own.dtype)
    return own


def _wrap(impls: dict, hook) -> dict:
    return {kind: (lambda fn: lambda op, args, ctx: hook(fn, op, args, ctx))(fn) for kind, fn in impls.items()}


def _results(op, out) -> list:
    return list(zip(op.results, out if isinstance(out, tuple) else (out,)))


@dataclass
class _Run:
    values: dict = field(default_factory=dict)     # value -> tensor (the oracle's, fp32)
    seen: dict = field(default_factory=dict)       # value -> the operand as the target saw it
    target_out: dict = field(default_factory=dict)  # value -> the target's result
    fp8_in: dict = field(default_factory=dict)     # op result -> (xq, xs, weights) of its FP8 GEMMs
    slots: dict = field(default_factory=dict)      # idx.topk result -> its positions as KV slots
    order: list = field(default_factory=list)      # (op, result) in step order
    slot_ctx: object = None                        # the target's step (its req_to_token) for slots
    target_pool: object = None                     # the target's KV pool: what its attention reads
    kv_diff: dict = field(default_factory=dict)    # attention result -> (values differing, past one FP8 step)


def _record(run: _Run):
    def hook(fn, op, args, ctx):
        out = fn(op, args, ctx)
        for name, v in _results(op, out):
            if isinstance(v, torch.Tensor):
                run.values[name] = v
        return out
    return hook


def _fp8_parts(op, ctx):
    """The target's weights of a linear-type op, where any of them is FP8 (else None)."""
    names = op.attr("weight")
    ws = [ctx.w(n) for n in (names if isinstance(names, tuple) else (names,))]
    return ws if any(isinstance(w, Fp8Weight) for w in ws) else None


def positions_to_slots(pos: torch.Tensor, ctx) -> torch.Tensor:
    """Top-k positions (the torch target's idx.topk, -1 padded) as the KV slots the CUDA target's
    idx.topk gives its attention ops (int32, -1 padded): slot = req_to_token[row of the token, pos]."""
    pos = pos.to(ctx.r2t.device)
    rows = ctx.rows[:pos.shape[0]]
    slots = ctx.r2t[rows[:, None], pos.clamp_min(0)]
    return torch.where(pos >= 0, slots, -1).to(torch.int32)


def _substituted(run: _Run):
    def hook(fn, op, args, ctx):
        args = [_substitute(a, run.slots.get(name, run.values.get(name))) for name, a in zip(op.operands, args)]
        for name, a in zip(op.operands, args):
            if isinstance(a, torch.Tensor):
                run.seen[name] = a
        out = fn(op, args, ctx)
        if op.kind == "idx.topk" and out.dtype == torch.int32 and run.values[op.results[0]].dtype != torch.int32:
            run.slots[op.results[0]] = positions_to_slots(run.values[op.results[0]], ctx)
            run.slot_ctx = ctx
        for name, v in _results(op, out):
            if isinstance(v, torch.Tensor) and name in run.values:
                run.target_out[name] = v
                run.order.append((op, name))
        if op.kind in ("mlp.swiglu", "moe.experts"):
            memo = getattr(ctx, "memo", {}).get((op.operands[0], "fp8_tokens"))
            if memo is not None:
                run.fp8_in[op.results[0]] = (memo[0], memo[1], args)
        if op.kind in FP8_GEMM_KINDS and (parts := _fp8_parts(op, ctx)) is not None:
            memo = getattr(ctx, "memo", {}).get((op.operands[0], "fp8_tokens"))
            if memo is not None:
                run.fp8_in[op.results[0]] = (memo[0], memo[1], [isinstance(w, Fp8Weight) for w in parts], args[0])
        return out
    return hook


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half an ulp at 1: the largest relative error of one round-to-nearest into `dtype`."""
    return {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]


class TargetCache:
    """The target's latent cache as `latent_probs` reads it (the values its attention kernel reads),
    compared on every read with the oracle's cache `own`: `differ` counts latent values that differ,
    `far` those further apart than one step of the cache's format (an FP8 code, or an ulp of a 16-bit
    cache: a write may round its input across a boundary; one that misplaces or mis-scales a row
    lands further)."""

    def __init__(self, target, own):
        self.target, self.own, self.kv_format = target, own, target.kv_format
        self.differ = self.far = self.read = 0

    def c_kv(self, layer, slots):
        got = self.target.c_kv(layer, slots.to(self.target.device)).float().to(slots.device)
        want = self.own.c_kv(layer, slots).float()
        gap, tol = (got - want).abs(), bound(want, torch.float32)
        step = fp8_step(want) if self.kv_format != "native" else ulp(want, self.target.dtype)
        self.read += gap.numel()
        self.differ += int((gap > tol).sum())
        self.far += int((gap > step * 1.001 + tol).sum())
        return got

    def k_pe(self, layer, slots):
        return self.target.k_pe(layer, slots.to(self.target.device)).float().to(slots.device)


def fp8_step(x: torch.Tensor, group: int = FP8_KV_GROUP) -> torch.Tensor:
    """One step of the e4m3 code at each value of x [n, d] quantised per `group` values
    (`quantize_token_groups`): the scale times the code's spacing (2^-9 below 2^-6, else 2^(e - 3))."""
    code, s = quantize_token_groups(x, group=group)
    _, e = torch.frexp(code.float().abs().clamp_min(2.0 ** -6))
    return torch.ldexp(torch.ones_like(x), e - 4) * s.repeat_interleave(group, 1)[:, :x.shape[1]]


def attention_oracle(op, args, ctx, dtype: torch.dtype, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA target's MLA (absorbed for every phase: `triton_launch.mla_absorbed`) over `cache`,
    with the roundings its arithmetic makes in `dtype` that are fixed by its inputs done the
    same way, and a bound for the ones that are not. -> (want, slack), [T, H * dv] fp32 on the
    oracle's device.

    Done the same way: W_UK and W_UV held in `dtype` (the CUDA target keeps kv_b_proj in its compute
    dtype, an FP8 checkpoint's dequantised at load), q_lat = q_nope W_UK rounded to `dtype` (a GEMM's
    fp32 sum, then one rounding).
    Bounded: the kernel's other roundings into `dtype` (unit roundoff u = `unit_roundoff(dtype)`),
    each a relative error |d| <= u of one factor of a long sum, taken as independent and of mean zero
    (round to nearest) so that a sum of terms a_i d_i stays within ATTN_LAMBDA u sqrt(sum a_i^2)
    except with probability <= 2 exp(-ATTN_LAMBDA^2 / 2) per element (Higham & Mary's probabilistic
    rounding-error analysis). With p_j a head's softmax weight of key j, c_j its latent row,
    Y_j = c_j W_UV^T the key's value in output space (Y_jg: latent group g's part of it), the
    variances per output element are:
    - the softmax weights rounded for the PV product (the kernel's own l is fp32):
      sum_j p_j^2 Y_j^2;
    - FP8 rows: a group's scale rounded (the per-tile kernel, or p_j sc_g rounded in the per-group
      kernel instead of p_j), sum_j p_j^2 sum_g Y_jg^2; every dequantised value rounded (the per-tile
      kernel), sum_j p_j^2 sum_r c_jr^2 W_UV[v, r]^2; and those rounded keys moving the
      scores, a separate term (correlated with the last two): score error s_j with variance
      scale^2 (sum_g (q_g . c_jg)^2 + sum_r q_r^2 c_jr^2), which moves the output by
      sum_j p_j s_j (Y_j - o), variance sum_j p_j^2 var(s_j) (Y_j - o)^2;
    - out_lat rounded before W_UV: sum_r W_UV[v, r]^2 out_lat_r^2.
    slack = ATTN_LAMBDA u (sqrt(PV terms) + sqrt(score term) + sqrt(out_lat term)), plus the output's
    own rounding (`bound`). `OpRow.slack_rel` reports its width against the output. `args` and `ctx`:
    the torch target's (positions for top-k; with the positions the op turns q_pe by, q_pe turned
    first, `unfused_args`); `cache` the keys to attend over (`TargetCache`: the target's, which its
    own writes filled from the same inputs), else the oracle's pool."""
    q_nope, q_pe, layer, topk = unfused_args(op, args)
    u = unit_roundoff(dtype)
    scale, dn, dv = op.attr("scale"), int(op.attr("dn")), int(op.attr("dv"))
    T, H = q_nope.shape[:2]
    w = ctx.w(op.attr("weight")).float().to(dtype).float().view(H, dn + dv, -1)
    w_uk, w_uv = w[:, :dn], w[:, dn:]                                         # [H, dn | dv, R]
    R = w.shape[-1]
    cache = ctx.pool if cache is None else cache
    fp8 = getattr(cache, "kv_format", "native") != "native"
    G = -(-R // FP8_KV_GROUP)
    q_lat = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk).to(dtype).float()
    out_lat = q_lat.new_zeros(q_lat.shape)
    var_pv, var_s = q_lat.new_zeros(T, H, dv), q_lat.new_zeros(T, H, dv)
    for tok, p, c in latent_probs(q_lat, q_pe, cache, layer, topk, ctx.batch, scale):
        out_lat[tok] = torch.einsum("htl,lr->thr", p, c)
        p2 = p * p
        y = torch.einsum("lr,hvr->lhv", c, w_uv)
        var_pv[tok] = torch.einsum("htl,lhv->thv", p2, y * y)
        if not fp8:
            continue
        cg = c.view(c.shape[0], G, -1)
        yg = torch.einsum("lgr,hvgr->lghv", cg, w_uv.view(H, dv, G, -1)).pow(2).sum(1)
        var_pv[tok] += torch.einsum("htl,lhv->thv", p2, yg)
        var_pv[tok] += torch.einsum("thr,hvr->thv", torch.einsum("htl,lr->thr", p2, c * c), w_uv * w_uv)
        q = q_lat[tok]
        var_score = torch.einsum("thr,lr->htl", q * q, c * c)
        for g in range(G):                  # one group's scale (or p sc_g) rounding moves all its terms
            var_score += torch.einsum("thr,lr->htl", q.view(*q.shape[:2], G, -1)[:, :, g], cg[:, g]).pow(2)
        wts = p2 * var_score * scale ** 2
        o = torch.einsum("thr,hvr->thv", out_lat[tok], w_uv)
        var_s[tok] = (torch.einsum("htl,lhv->thv", wts, y * y) - 2 * o * torch.einsum("htl,lhv->thv", wts, y)
                      + o * o * wts.sum(-1).transpose(0, 1)[..., None]).clamp(min=0)
    var_lat = torch.einsum("thr,hvr->thv", out_lat * out_lat, w_uv * w_uv)
    want = torch.einsum("thr,hvr->thv", out_lat, w_uv).reshape(T, H * dv)
    slack = ATTN_LAMBDA * u * (var_pv.sqrt() + var_s.sqrt() + var_lat.sqrt())
    return want, slack.reshape(T, H * dv)


def _unfolded(op, args, run: _Run):
    """A reader that turns its query by the positions (fuse-query-rope) as the plain reader of the
    query its kernel computes: turned in fp32 and rounded to the dtype the target holds the query in;
    the positions and the rope_* attributes dropped. Other ops as they are."""
    i, n = ROPE_READERS.get(op.kind, (0, len(args)))
    if len(args) <= n:
        return op, args
    args = unfused_args(op, args)
    seen = run.seen.get(op.operands[i])
    if isinstance(seen, torch.Tensor) and seen.is_floating_point():
        args[i] = args[i].to(seen.dtype).float()
    plain = tuple(a for a in op.attrs if not a[0].startswith("rope_"))
    return replace(op, operands=op.operands[:n], attrs=plain), args


def _index_scores(op, args, ctx) -> torch.Tensor:
    """What an idx.topk ranks: each key's index score [T, keys], future keys at -inf."""
    q, w, layer = args
    per_request = indexer_scores(q, w.float() * index_head_scale(op), ctx.pool, layer, ctx.batch)
    width = max((index.shape[1] for _, index, _ in per_request), default=0)
    choice = torch.full((q.shape[0], width), float("-inf"), device=q.device)
    for tok, index, _ in per_request:
        choice[tok, :index.shape[1]] = index
    return choice


def _rerun(run: _Run, again: dict, rounded: dict, slack: dict, ranked: dict):
    def hook(fn, op, args, ctx):
        if op.kind == "moe.topk":    # what the router ranks: sigmoid(logits) + the correction bias
            choice = torch.sigmoid(_fp32_of(args[0], run.seen.get(op.operands[0])).float())
            ranked[op.results[-1]] = choice + ctx.w(ctx.gate_bias(op)).float().to(choice.device)
        if op.kind in ROUNDED_KINDS:
            seen = [run.seen.get(name) for name in op.operands]
            own = [s.to(a.device) if isinstance(s, torch.Tensor) and isinstance(a, torch.Tensor) else a
                   for s, a in zip(seen, args)]
            for name, v in _results(op, fn(op, own, ctx)):
                if isinstance(v, torch.Tensor):
                    rounded[name] = v
        args = [_fp32_of(a, run.seen.get(name)) if _is_float(a) else _given(a, run.values.get(name))
                for name, a in zip(op.operands, args)]
        op, args = _unfolded(op, args, run)
        if op.kind == "idx.topk":    # what the indexer ranks: each key's index score, future keys at -inf
            ranked[op.results[-1]] = _index_scores(op, args, ctx)
        out = fn(op, args, ctx)
        for name, v in _results(op, out):
            if isinstance(v, torch.Tensor):
                again[name] = v
        if op.kind in ATTN_KINDS and op.results[0] in run.target_out:
            cache = TargetCache(run.target_pool, ctx.pool)
            rounded[op.results[0]], slack[op.results[0]] = attention_oracle(op, args, ctx,
                                                                            run.target_out[op.results[0]].dtype, cache)
            run.kv_diff[op.results[0]] = cache
        return out
    return hook


def _float_row(row: OpRow, got, want, fp32_want, slack=None):
    got, want = got.float().cpu()[:want.shape[0]], want.float().cpu()
    err = (got - want).nan_to_num(float("inf"))
    norm = float(want.norm())
    row.rel_err = float(err.norm()) / norm if norm else float(err.norm())
    row.max_abs = float(err.abs().max()) if err.numel() else 0.0
    b = bound(want, getattr(torch, row.dtype))
    if slack is not None:
        slack = slack.float().cpu()[:b.shape[0]]
        row.slack_rel = float(slack.norm()) / norm if norm else 0.0
        b = b + slack
    row.out_of_bound = int((err.abs() > b).sum())
    row.worst = float((err.abs() / b).max()) if err.numel() else 0.0
    if fp32_want is not None:
        f = fp32_want.float().cpu()
        n = float(f.norm())
        row.vs_fp32_input = float((want - f).norm()) / n if n else 0.0


def _int_row(row: OpRow, got, want, scores=None, k=None):
    got, want = got.cpu()[:want.shape[0]], want.cpu()
    if got.shape != want.shape:
        row.note = f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}"
        return
    a, b = got.reshape(got.shape[0], -1).sort(-1).values, want.reshape(want.shape[0], -1).sort(-1).values
    diff = (a != b).any(-1)
    row.set_diff_rows = float(diff.float().mean()) if diff.numel() else 0.0
    row.diff_mask = diff
    if scores is not None and bool(diff.any()):
        s = scores.float().cpu()[:want.shape[0]][diff]
        top = s.topk(min(k + 1, s.shape[-1]), -1).values
        row.min_margin = float((top[:, k - 1] - top[:, k]).min()) if top.shape[-1] > k else None


def _fp8_check(row: OpRow, got, xq, xs, fp8_parts, x_in, weights, want_fp32_in):
    """The product of the target's own quantised input (and, for parts whose weights are not FP8,
    its rounded input) with the oracle's weights (FP8 ones dequantised), exact in fp32, against
    the target's result, within the rounding bound plus the tensor core's accumulation
    (`FP8_ACC_REL` of the sum of |terms|); and the fraction of the input's FP8 codes that differ from the oracle's
    quantisation of its own fp32 input."""
    dev = weights[0].device
    deq = lambda q, s: q.float() * s.repeat_interleave(128, 1)[:, :q.shape[1]]   # noqa: E731
    xd, x = deq(xq, xs).to(dev), x_in.float().to(dev)
    exact = torch.cat([(xd if fp8 else x) @ w.float().T for fp8, w in zip(fp8_parts, weights)], 1)
    terms = torch.cat([(xd.abs() @ w.float().abs().T) * FP8_ACC_REL if fp8 else torch.zeros(x.shape[0], w.shape[0],
                                                                                             device=dev)
                       for fp8, w in zip(fp8_parts, weights)], 1)
    exact, terms = exact[:got.shape[0]].cpu(), terms[:got.shape[0]].cpu()
    g = got.float().cpu()[:exact.shape[0]]
    err = g - exact
    row.fp8_rel_err = float(err.norm() / exact.norm()) if float(exact.norm()) else float(err.norm())
    row.fp8_out_of_bound = int((err.abs() > bound(exact, getattr(torch, row.dtype)) + terms).sum())
    row.slack_rel = float(terms.norm() / exact.norm()) if float(exact.norm()) else 0.0
    _in_flips(row, xq, xs, want_fp32_in)


def _in_flips(row: OpRow, xq, xs, want_fp32_in):
    """in_flips: the fraction of the target's FP8 codes of its input that differ from the oracle's
    quantisation of its fp32 input; scale_rel: the largest relative difference of their scales."""
    oq, os_ = quantize_token_groups(want_fp32_in.float().to(xq.device)[:xq.shape[0]])
    n = min(xq.shape[0], oq.shape[0])
    row.in_flips = float((xq[:n].float() != oq[:n].float()).float().mean()) if n else 0.0
    row.scale_rel = float(((xs[:n] - os_[:n]).abs() / os_[:n].clamp_min(1e-30)).max()) if n else 0.0


def _deq(q, s):
    return q.float() * s.repeat_interleave(128, 1)[:, :q.shape[1]]


def _silu_mul(g, u):
    return g / (1.0 + torch.exp(-g)) * u


def _ambiguous_h(h, act_dtype, h_err=None):
    """(the FP8 quantisation of h as the kernel takes it: h rounded to `act_dtype`, then per token
    per 128 columns, dequantised; how far each element's dequantised value could move had h come
    out a rounding step either way): a kernel computes h with another summation order, so an h
    next to a rounding boundary (of act_dtype, or of FP8, or moving its group's scale) may land on
    the other side. `h_err`: a bound on how far the kernel's h may lie from `h` before that
    rounding (its FP8 GEMMs' accumulation, carried through SiLU-and-mul)."""
    hr = h.to(act_dtype).float()
    q, sc = quantize_token_groups(hr)
    amax = sc.repeat_interleave(128, 1)[:, :h.shape[1]] * 448.0
    rms = h.pow(2).mean(1, keepdim=True).sqrt()
    eps = ulp(hr, act_dtype) + 2.0 ** -16 * hr.abs() + ulp(amax, act_dtype) / amax.clamp_min(1e-30) * hr.abs() \
        + 2.0 ** -20 * rms
    if h_err is not None:
        eps = eps + h_err
    lo, hi = (_deq(*quantize_token_groups(hr + d)) for d in (-eps, eps))
    return _deq(q, sc), (hi - lo).abs() + (_deq(q, sc) - lo).abs() + (hi - _deq(q, sc)).abs()


def swiglu_error(g, u, g_err, u_err):
    """A first-order bound on how far silu(g) * u moves when g and u move by at most g_err, u_err."""
    sig = torch.sigmoid(g)
    return (sig * (1 + g * (1 - sig)) * u).abs() * g_err + (g * sig).abs() * u_err


def mlp_check(row: OpRow, got, xq, xs, act_dtype, parts: list, dev):
    """An FP8 SwiGLU, or routed experts: `parts` [(rows, gate, up, down, route weight or None)];
    out[rows] += w * down(Q(silu(gate x) up x)). The exact result from the target's quantised input
    and the oracle's weights, with a bound that admits the FP8 codes of h near a rounding boundary
    (`_ambiguous_h`, widened by the gate/up GEMMs' accumulation) moving one step, and the down
    GEMM's accumulation (`FP8_ACC_REL`): out-of-bound elements beyond that are errors."""
    xd = _deq(xq, xs).to(dev)
    exact = torch.zeros(got.shape[0], got.shape[1], dtype=torch.float32, device=dev)
    slack = torch.zeros_like(exact)
    for rows, gate, up, down, w in parts:
        x = xd[rows]
        g, u = x @ gate.float().T, x @ up.float().T
        acc = lambda wt: FP8_ACC_REL * (x.abs() @ wt.float().abs().T)   # noqa: E731
        hd, amb = _ambiguous_h(_silu_mul(g, u), act_dtype, swiglu_error(g, u, acc(gate), acc(up)))
        y, b = hd @ down.float().T, amb @ down.float().abs().T + FP8_ACC_REL * (hd.abs() @ down.float().abs().T)
        if w is not None:
            y, b = y * w[:, None], b * w.abs()[:, None]
        exact.index_add_(0, rows, y)
        slack.index_add_(0, rows, b)
    exact, slack = exact.cpu(), slack.cpu()
    err = (got.float().cpu() - exact).abs()
    row.fp8_rel_err = float(err.norm() / exact.norm()) if float(exact.norm()) else float(err.norm())
    row.fp8_out_of_bound = int((err > bound(exact, got.dtype) + slack).sum())
    row.flip_rows = int(((err > bound(exact, got.dtype)) & (slack > 0)).any(-1).sum())


def _device(ex):
    return ex.device if ex.device is not None else torch.device("cpu")


def _mlp_parts(op, oracle, args) -> list:
    """`mlp_check`'s parts from the oracle's weights: a SwiGLU's one part over every row, or one
    part per routed expert (the rows routed to it and their route weights, `args` = x, w, ids)."""
    dev = _device(oracle)
    if op.kind == "mlp.swiglu":
        p = op.attr("weight")
        gate, up, down = (oracle.weight(f"{p}.{n}_proj.weight") for n in ("gate", "up", "down"))
        return [(torch.arange(args[0].shape[0], device=dev), gate, up, down, None)]
    _, w, ids = args
    gate, up, down = oracle.expert_stacks(op)
    ep = int(op.attr("ep", 1))
    offset = oracle.comm.coords.of("ep") * (int(op.attr("experts")) // ep) if ep > 1 else 0
    flat, wf = ids.reshape(-1).to(dev) - offset, w.reshape(-1).float().to(dev)
    k, parts = ids.shape[1], []
    for e in range(gate.shape[0]):
        sel = (flat == e).nonzero().flatten()
        if sel.numel():
            parts.append((sel // k, gate[e], up[e], down[e], wf[sel]))
    return parts


def compare_step(target, oracle, again, phase: str, batch, hidden=None) -> list[OpRow]:
    """Every op of one `phase` step of `batch` on `target` against the oracle (module doc).
    `oracle` and `again` are two torch-target executors of the same plan and weights with their
    own KV pools (`again` computes on the target's rounded inputs); all three step once."""
    run, again_vals, rounded, slack, ranked = _Run(), {}, {}, {}, {}
    saved = target.impls, oracle.impls, again.impls
    try:
        oracle.impls = _wrap(saved[1], _record(run))
        oracle.forward(phase, batch, hidden)
        target.impls = _wrap(saved[0], _substituted(run))
        target.forward(phase, batch, hidden)
        run.target_pool = target.pool
        again.impls = _wrap(saved[2], _rerun(run, again_vals, rounded, slack, ranked))
        again.forward(phase, batch, hidden)
    finally:
        target.impls, oracle.impls, again.impls = saved
    rows = []
    for op, name in run.order:
        got, want = run.target_out[name], rounded.get(name, again_vals.get(name))
        if want is None:
            continue
        if name in run.slots:     # the oracle's positions as the target's slots
            want = positions_to_slots(want, run.slot_ctx)
        row = OpRow(op=op.where(), kind=op.kind, layer=op.layer, result=name,
                    dtype=str(got.dtype).removeprefix("torch."), numel=got.numel())
        if got.is_floating_point() and got.dtype != torch.float8_e4m3fn:
            _float_row(row, got, want, run.values.get(name), slack.get(name))
        elif not got.is_floating_point():
            scores = None
            if op.kind in ("moe.topk", "idx.topk"):
                scores = ranked.get(name)
            _int_row(row, got, want, scores, int(op.attr("top_k", 0)) or int(op.attr("k", 0)) or got.shape[-1])
        if name in run.kv_diff:     # the keys it read: values of the target's cache unlike the oracle's
            cache = run.kv_diff[name]
            row.in_flips = cache.differ / max(cache.read, 1)
            row.out_of_bound += cache.far
        if name in run.fp8_in and op.kind in ("mlp.swiglu", "moe.experts"):
            xq, xs, args = run.fp8_in[name]
            mlp_check(row, got, xq, xs, args[0].dtype, _mlp_parts(op, again, args), _device(again))
            _in_flips(row, xq, xs, run.values[op.operands[0]])
        elif name in run.fp8_in:
            xq, xs, fp8_parts, x_in = run.fp8_in[name]
            names = op.attr("weight")
            weights = [again.weight(n) for n in (names if isinstance(names, tuple) else (names,))]
            _fp8_check(row, got, xq, xs, fp8_parts, x_in, weights, run.values[op.operands[0]])
        rows.append(row)
        if op.kind == "moe.topk" and name == op.results[-1] and getattr(row, "diff_mask", None) is not None:
            _route_weights(next(r for r in rows if r.result == op.results[0]), run.target_out[op.results[0]],
                           rounded.get(op.results[0], again_vals[op.results[0]]), row.diff_mask)
    for r in rows:
        r.__dict__.pop("diff_mask", None)
    return rows


def _route_weights(row: OpRow, got, want, diff):
    """A router's weights, held to their bound on the rows whose expert sets agree; rows whose sets
    differ (reported with their margin on the ids' row) count as `flip_rows`."""
    got, want = got.float().cpu()[:want.shape[0]], want.float().cpu()
    same = ~diff
    row.out_of_bound = int(((got - want).abs()[same] > bound(want, torch.float32)[same]).sum())
    row.flip_rows = int(diff.sum())


def summary(rows: list[OpRow]) -> dict:
    """Per op kind: count, worst plain error, elements out of bound, FP8 GEMMs out of their bound,
    the largest input-flip fraction, the widest op-specific slack (relative to the result's norm:
    how coarse that op's bound is), and integer results whose sets differ."""
    out: dict = {}
    for r in rows:
        s = out.setdefault(r.kind, {"results": 0, "max_rel_err": 0.0, "out_of_bound": 0})
        s["results"] += 1
        s["max_rel_err"] = max(s["max_rel_err"], r.rel_err or 0.0)
        s["out_of_bound"] += r.out_of_bound
        if r.fp8_out_of_bound is not None:
            s["fp8_out_of_bound"] = s.get("fp8_out_of_bound", 0) + r.fp8_out_of_bound
            s["max_fp8_rel_err"] = max(s.get("max_fp8_rel_err", 0.0), r.fp8_rel_err)
            s["max_in_flips"] = max(s.get("max_in_flips", 0.0), r.in_flips)
        if r.slack_rel is not None:
            s["max_slack_rel"] = max(s.get("max_slack_rel", 0.0), r.slack_rel)
        if r.worst is not None:
            s["worst"] = max(s.get("worst", 0.0), r.worst)
        if r.set_diff_rows is not None:
            s["set_diff_rows"] = max(s.get("set_diff_rows", 0.0), r.set_diff_rows)
    return out
