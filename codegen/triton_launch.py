"""Triton target: launch wrappers over the kernels (contexts in ``triton_contexts``, rendering and
kernel libraries in ``triton_render``; both re-exported here).

Each kernel is one Jinja2 template, ``codegen/templates/<kernel>.py.j2``, holding one ``@triton.jit``
function. Templates are dumb (STYLE rule 10): every shape, tile size and flag is computed in Python
into a frozen ``*Ctx`` dataclass, and the template only substitutes ``{{ value }}`` and branches on
``{% if flag %}``. A kernel's source depends on the model's shapes, the dtype and a few tile classes,
never on the batch, the context length or the GPU (those choose grids and split counts at launch),
so a plan can hold every kernel it runs (``kernel_set``).

The launch wrappers below take torch tensors (no ForwardBatch, no KV pool) with the torch
reference's semantics (``codegen/torch_ref.py``), build the context from the shapes, get the kernel
from ``lib`` (a ``KernelLibrary``: the plan's kernels in the runtime, ``JIT`` by default) and launch.
Where a kernel's natural interface differs (slots instead of positions, split-K partials), the
wrapper adapts.
"""
from __future__ import annotations

import torch
from glmc.codegen import torch_ref as ref
from glmc.codegen import fp8_ref
from glmc.codegen.triton_contexts import (  # noqa: F401  (re-exported)
    ArgmaxCtx,
    GemvCtx,
    IndexerScoresCtx,
    MlaCombineCtx,
    MoeRouterCtx,
    NarrowGemmCtx,
    QkvNormRopeWriteCtx,
    QueryRope,
    RmsNormCtx,
    RopeCtx,
    SampleCtx,
    SiluMulCtx,
    SparseMlaDecodeCtx,
    StepInputsCtx,
    TopkSelectCtx,
)
from glmc.codegen.triton_render import (  # noqa: F401  (re-exported)
    _DOT,
    JIT,
    TEMPLATE_DIR,
    KernelLibrary,
    _warps,
    load_kernel,
    next_pow2,
    render,
    sm_count,
)
from glmc.target import FP8_BLOCK, argmax_splits, mla_num_splits, narrow_splits, topk_segment


# ----------------------------------------------------------------------------- launch wrappers
def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a unit inner stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


_INV_FREQ: dict = {}


def _inv_freq(theta: float, dim: int, device, scaling=None) -> torch.Tensor:
    """torch_ref.rope_inv_freq (plain or yarn), computed once on the CPU with its exact float ops, then moved."""
    key = (float(theta), dim, scaling, str(device))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = ref.rope_inv_freq(float(theta), dim, scaling).to(device)
    return _INV_FREQ[key]


def _rope_args(rope: QueryRope | None, device) -> list:
    """Kernel arguments of a query turned as loaded: the inv_freq table rope.apply's kernel reads."""
    return [] if rope is None else [_inv_freq(rope.theta, rope.dims, device, rope.scaling)]


def token_rows(batch, device):
    """Per token of a ForwardBatch: (req_to_token row, position) on `device`; decode and extend
    alike (the one adapter from the runtime's batch to the wrappers' tensors, for tests and benches)."""
    rows = batch.req_pool_indices.repeat_interleave(batch.extend_lens)
    return rows.to(device), batch.positions.to(device)


def rms_norm(x, weight, eps, lib: KernelLibrary = JIT, quant: bool = False):
    """torch_ref.rms_norm; output in x's dtype. `quant`: -> (out, (q, s)), out also quantised for
    an FP8 GEMM (triton_fp8.quantize_tokens' result, to the bit)."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    ctx = RmsNormCtx.make(x2.shape[1], eps, False, quant)
    qs = _quant_out(x2) if quant else ()
    if x2.shape[0]:
        lib(ctx)[_norm_grid(x2, quant)](x2, x2.stride(0), *_quant_args(qs), weight, out, out.stride(0),
                                        num_warps=ctx.num_warps)
    return (out.view(x.shape), qs) if quant else out.view(x.shape)


def _quant_out(x2):
    """e4m3 [M, K] and fp32 scales [M, K / 128] for an output quantised in its producer."""
    m, k = x2.shape
    return (torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x2.device),
            torch.empty(m, -(-k // FP8_BLOCK), dtype=torch.float32, device=x2.device))


def _norm_grid(x2, quant: bool) -> tuple:
    """A row per program, or with `quant` a (row, 128-column group) per program."""
    return (x2.shape[0], -(-x2.shape[1] // FP8_BLOCK)) if quant else (x2.shape[0],)


def _quant_args(qs) -> list:
    return [a for t in qs for a in (t, t.stride(0))]


def _xw_out(kernel: str, x, w, out, out_dtype):
    """x [M, K] and a contiguous weight [N, K] checked -> (x with unit column stride, the [M, N] output:
    `out` (a row-major view, e.g. columns of a wider output) or a new one in `out_dtype`, default x's)."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or w.stride(1) != 1 or w.stride(0) != k:
        raise ValueError(f"{kernel}: weight {tuple(w.shape)} / {w.stride()} is not a contiguous [N, {k}] matrix")
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device) if out is None else out
    if tuple(y.shape) != (m, n) or (n > 1 and y.stride(1) != 1):
        raise ValueError(f"{kernel}: out {tuple(y.shape)} / {y.stride()} is not a [{m}, {n}] row-major view")
    return (x if x.stride(1) == 1 else x.contiguous()), y


def gemv(x, w, out=None, out_dtype=None, lib: KernelLibrary = JIT):
    """x [M, K] @ w [N, K]^T for M <= glmc.target.GEMV_ROWS in one launch, fp32 math (`GemvCtx`) -> [M, N]
    in `out_dtype` (default x's), or written into `out` (an [M, N] view with unit column stride)."""
    x, y = _xw_out("gemv", x, w, out, out_dtype)
    (m, k), n = x.shape, w.shape[0]
    ctx = GemvCtx.make(k, m)
    if m:
        lib(ctx)[(-(-n // ctx.block_n),)](x, x.stride(0), w, y, y.stride(0), m, n, num_warps=ctx.num_warps)
    return y


def silu_mul(gu, lib: KernelLibrary = JIT):
    """SwiGLU's activation on the gate|up GEMM's output gu [T, 2I] (gate columns first, unit column
    stride) -> silu(gate) * up [T, I] in gu's dtype, one launch (`SiluMulCtx`)."""
    T, two = gu.shape
    if two % 2 or (gu.stride(1) != 1 and two > 1):
        raise ValueError(f"silu_mul: gate|up {tuple(gu.shape)} / {gu.stride()} is not [T, 2 * inter] row-major")
    ctx = SiluMulCtx.make(two // 2)
    h = torch.empty(T, ctx.inter, dtype=gu.dtype, device=gu.device)
    if T:
        lib(ctx)[(T, -(-ctx.inter // ctx.block))](gu, gu.stride(0), h, h.stride(0), num_warps=ctx.num_warps)
    return h


def narrow_gemm(x, w, out=None, out_dtype=None, lib: KernelLibrary = JIT, splits=None, ctx=None):
    """x [M, K] @ w [N, K]^T for a weight of few columns at any M (`NarrowGemmCtx`): one launch, or two
    with K split (`narrow_splits`; the fp32 partials summed in split order by fp8_split_reduce) ->
    [M, N] in `out_dtype` (default x's), or written into `out` (an [M, N] view with unit column
    stride). `splits` and `ctx` (other tiles, for sweeps) override the defaults. No host sync;
    CUDA-graph capturable."""
    from glmc.codegen.triton_fp8 import Fp8SplitReduceCtx, even_splits
    x, y = _xw_out("narrow_gemm", x, w, out, out_dtype)
    (m, k), n = x.shape, w.shape[0]
    if not m:
        return y
    ctx = ctx or NarrowGemmCtx.make(n, k, w.dtype)
    splits = even_splits(ctx.k_blocks, splits or narrow_splits(m, n, k, sm_count(x.device)))
    width = -(-ctx.k_blocks // splits)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    lib(ctx)[(-(-m // ctx.block_m) * ctx.n_tiles, splits)](x, x.stride(0), w, y, y.stride(0), part, m, splits, width,
                                                           num_warps=ctx.num_warps, num_stages=ctx.num_stages)
    if splits > 1:
        red = Fp8SplitReduceCtx.make()
        lib(red)[(m, -(-n // red.block))](part, y, y.stride(0), m, n, splits, n, 0, num_warps=red.num_warps)
    return y


def add_rms_norm(x, residual, weight, eps, lib: KernelLibrary = JIT, quant: bool = False, addend=None):
    """torch_ref.add_rms_norm: (rms_norm(x + residual), x + residual) in one pass; `quant`: the
    normalised output's FP8 quantisation third (as `rms_norm`). `addend` (x's shape and dtype): x +
    addend, rounded to x's dtype as torch adds them, takes x's place (a folded elt.add)."""
    x2, r2 = _rows(x), _rows(residual)
    new_res = torch.empty(x2.shape, dtype=torch.result_type(x, residual), device=x.device)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    ctx = RmsNormCtx.make(x2.shape[1], eps, True, quant, addend is not None)
    qs = _quant_out(x2) if quant else ()
    if addend is not None and (addend.shape != x.shape or addend.dtype != x.dtype):
        raise ValueError(f"add_rms_norm: addend {tuple(addend.shape)} {addend.dtype} is not x's "
                         f"{tuple(x.shape)} {x.dtype}")
    a2 = None if addend is None else _rows(addend)
    extra = [] if a2 is None else [a2, a2.stride(0)]
    if x2.shape[0]:
        lib(ctx)[_norm_grid(x2, quant)](x2, x2.stride(0), *extra, r2, r2.stride(0), new_res, new_res.stride(0),
                                        *_quant_args(qs), weight, out, out.stride(0), num_warps=ctx.num_warps)
    if quant:
        return out.view(x.shape), new_res.view(x.shape), qs
    return out.view(x.shape), new_res.view(x.shape)


def moe_route(x, gate_w, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
              lib: KernelLibrary = JIT):
    """torch_ref.moe_route: the fp32 gate GEMM in torch (cuBLAS), everything after it in one kernel.

    Ids come out in descending biased-score order, exact ties lowest index first, as torch_ref's.
    """
    logits = x.float() @ gate_w.float().T
    return moe_route_logits(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor, lib)


def moe_route_logits(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                     lib: KernelLibrary = JIT):
    """moe_route after the gate GEMM: fp32 logits [T, E] -> (weights [T, k] fp32, ids [T, k] int64)."""
    T, E = logits.shape
    ctx = MoeRouterCtx.make(E, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        lib(ctx)[(T,)](logits, logits.stride(0), bias, weights, ids, top_k, num_warps=ctx.num_warps)
    return weights, ids


def rope(x, positions, theta, interleaved=True, rope_dim=None, out=None, scaling=None, lib: KernelLibrary = JIT):
    """torch_ref.rope on the first rope_dim (default: all) dims of the last axis; the rest is copied.

    x is [T, D] or [T, H, D] (strided views such as q[..., dn:] are fine); out may be x (in place).
    `scaling` (yarn) changes the frequencies (host-computed) and scales cos/sin by its attention factor.
    """
    x3 = x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])
    T, H, D = x3.shape
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device) if out is None else out.view(T, H, D)
    ctx = RopeCtx.make(H, D, rope_dim or D, interleaved, ref.rope_attention_factor(scaling))
    if T:
        lib(ctx)[(T, -(-H // ctx.block_h))](
            x3, x3.stride(0), x3.stride(1), positions, _inv_freq(theta, ctx.rope_dim, x.device, scaling),
            out, out.stride(0), out.stride(1), num_warps=ctx.num_warps)
    return out.view(x.shape)


def qkv_norm_rope_write(q_a, kv_a, positions, out_cache_loc, kv_cache, q_norm_w, kv_norm_w, eps, theta,
                        interleaved=True, index_k=None, index_cache=None, k_norm_w=None, k_norm_b=None,
                        index_eps=1e-6, index_interleaved=True, scaling=None, lib: KernelLibrary = JIT):
    """After the fused A-projection, one kernel: returns c_q = rms_norm(q_a) and writes, at rows
    out_cache_loc, kv_cache = [rms_norm(kv_a[:, :R]) | rope(kv_a[:, R:])] (R = kv_cache width - rope
    dims) and (full layers, index_k given) index_cache = [rope(layer_norm(index_k)[:, :dr]) |
    layer_norm(index_k)[:, dr:]]. Both RoPEs use the same angles (theta, `scaling`); each has its own
    pairing (interleaved or halves). A uint8 kv_cache / index_cache is the FP8 layout of
    `codegen.fp8_ref` (`KVPool` format "fp8"): the rows are quantised in registers.
    """
    T, dr = q_a.shape[0], kv_a.shape[1] - kv_norm_w.shape[0]
    R = kv_norm_w.shape[0]
    has_ik = index_k is not None
    kv_fp8, index_fp8 = kv_cache.dtype == torch.uint8, has_ik and index_cache.dtype == torch.uint8
    ctx = QkvNormRopeWriteCtx.make(q_a.shape[1], R, dr, eps, interleaved, index_k.shape[1] if has_ik else 0,
                                   index_eps, index_interleaved, ref.rope_attention_factor(scaling), kv_fp8,
                                   index_fp8)
    c_q = torch.empty(q_a.shape, dtype=q_a.dtype, device=q_a.device)
    num_slots = min(kv_cache.shape[0], _index_slots(index_cache) if has_ik else kv_cache.shape[0])
    args = [q_a, q_a.stride(0), q_norm_w, c_q, c_q.stride(0), kv_a, kv_a.stride(0), kv_norm_w, positions,
            out_cache_loc, num_slots, _inv_freq(theta, dr, q_a.device, scaling)]
    args += _kv_args(kv_cache, R)
    if has_ik:
        args += [index_k, index_k.stride(0), k_norm_w, k_norm_b]
        args += _index_args(index_cache, index_k.shape[1])
    if T:
        lib(ctx)[(T,)](*args, num_warps=ctx.num_warps)
    return c_q


def _kv_args(kv_cache, kv_lora) -> list:
    """Kernel arguments of one layer's latent cache: the rows, or for FP8 rows (uint8) their three
    views (e4m3 latent, fp32 scales, bf16 k_pe), each with its row stride."""
    if kv_cache.dtype != torch.uint8:
        return [kv_cache, kv_cache.stride(0)]
    return [a for v in fp8_ref.kv_fp8_views(kv_cache, kv_lora) for a in (v, v.stride(0))]


def _table_args(req_to_token) -> list:
    """Kernel arguments of the req_to_token table: the rows, their stride and the table's shape, which
    bounds the rows and positions a kernel reads through it (request data never reaches past it)."""
    return [req_to_token, req_to_token.stride(0), *req_to_token.shape]


def _index_slots(index_cache) -> int:
    """KV slots of one layer's indexer cache: its rows, or its FP8 pages x fp8_ref.KV_PAGE."""
    return index_cache.shape[0] * (fp8_ref.KV_PAGE if index_cache.dtype == torch.uint8 else 1)


def _index_args(index_cache, dim) -> list:
    """Kernel arguments of one layer's indexer cache: the rows, or for the FP8 pages (uint8) the
    e4m3 keys and fp32 scales, each with its page stride."""
    if index_cache.dtype != torch.uint8:
        return [index_cache, index_cache.stride(0)]
    keys, scales = fp8_ref.index_fp8_views(index_cache, dim)
    return [keys, keys.stride(0), scales, scales.stride(0)]


def indexer_topk(q_idx, weights, index_cache, req_to_token, rows, pos, topk, max_len, block_n=None, chunk=None,
                 lib: KernelLibrary = JIT):
    """torch_ref.indexer_topk: [T, topk] key POSITIONS (ascending, -1 padded) in two kernels:
    scores over the paged indexer cache into a [T, max_len] fp32 workspace (max_len >= every
    token's position + 1), then exact top-k selection."""
    scores = indexer_scores(q_idx, weights, index_cache, req_to_token, rows, pos, max_len, block_n, lib)
    return topk_select(scores, pos + 1, topk, chunk, lib)


def indexer_scores(q_idx, weights, k_cache, req_to_token, rows, pos, max_len, block_n=None,
                   lib: KernelLibrary = JIT, w_scale=1.0, tiled=False, rope: QueryRope | None = None):
    """[T, >= max_len] fp32 index scores of every key position (-inf after the token's own position),
    with head weights `weights` x w_scale (fp32, in the kernel: the plan's raw weights_proj output
    and w_scale = heads ** -0.5 give torch_ref's pre-scaled weights to the bit).
    `tiled` (prefill: runs of consecutive tokens of one request): the token-block kernel
    (`IndexerScoresCtx.make_tiled`), which reads each key once per token block, not once per token;
    any token order stays correct (a block's tokens of other requests are scored one by one), the
    same scores up to the order of the sum over heads.
    `rope`: q_idx is turned by each token's position in the kernel, as `rope` would turn it first.
    Graph-safe: no host sync; max_len (>= every seq_len) fixes the workspace shape."""
    T, Hi, Di = q_idx.shape
    fp8 = k_cache.dtype == torch.uint8
    dtype = q_idx.dtype if fp8 else k_cache.dtype
    ctx = IndexerScoresCtx.make(Hi, Di, dtype, block_n, fp8, w_scale, rope)
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    width = -(-max_len // ctx.block_n) * ctx.block_n
    scores = torch.empty(T, width, dtype=torch.float32, device=q_idx.device)
    args = (q_idx, q_idx.stride(0), q_idx.stride(1), weights, weights.stride(0), *_index_args(k_cache, Di),
            _index_slots(k_cache), *_table_args(req_to_token), rows, pos, *_rope_args(rope, q_idx.device), scores,
            scores.stride(0))
    if T and tiled:   # True, or make_tiled's tile overrides (benchmarks)
        ctx = IndexerScoresCtx.make_tiled(Hi, Di, dtype, fp8, w_scale, rope=rope,
                                          **(tiled if isinstance(tiled, dict) else {}))
        lib(ctx)[(-(-T // ctx.block_m), -(-width // ctx.block_n))](*args, T, width, num_warps=ctx.num_warps,
                                                                  num_stages=ctx.num_stages)
    elif T:
        lib(ctx)[(T, width // ctx.block_n)](*args, num_warps=ctx.num_warps)
    return scores


TOPK_SEG_TILE = 32             # segments' histograms summed per load when a round's digit is found


def topk_select(scores, lens, k, chunk=None, lib: KernelLibrary = JIT, segment=None, slots_of=None, num_warps=None):
    """Per row t: positions of the k largest of scores[t, :lens[t]], ascending, -1 padded. [T, k] int64.
    Exact ties at the k-th score go to the lowest positions (torch_ref.topk_lowest_first's choice).
    `slots_of` = (req_to_token, rows): instead the KV slots req_to_token[rows[t], position] of the same
    selection, int32 [T, k], -1 padded (what `topk_slots` gives from the positions, without its gather).

    Rows of <= ctx.chunk scores: one program each, held in registers (one launch when the workspace
    is no wider). Longer rows: a byte-radix select split over programs of `segment` scores
    (`topk_segment` unless given) in five launches of the same kernel, STAGE 0..4, the last of
    which also runs the short rows (the template's docstring). Graph-safe: the split comes from the
    shapes, each row's length is read on the device. `num_warps` overrides the context's (sweeps)."""
    T, width = scores.shape
    ctx = TopkSelectCtx.make(k, width, chunk, num_warps)
    out = torch.empty(T, k, dtype=torch.int64 if slots_of is None else torch.int32, device=scores.device)
    if not T:
        return out
    r2t, rows = slots_of if slots_of is not None else (out, out)
    long_rows = width > ctx.chunk
    segment = segment or topk_segment(T, width)
    num_segs = -(-width // segment) if long_rows else 1
    hist = torch.empty(T, 4, num_segs, 256, dtype=torch.int32, device=scores.device) if long_rows else out
    state = torch.empty(T, 4, 2, dtype=torch.int32, device=scores.device) if long_rows else out
    gt = torch.empty(T, num_segs, dtype=torch.int32, device=scores.device) if long_rows else out
    kernel = lib(ctx)
    launches = [(stage, stage == 4) for stage in range(5)] if long_rows else [(-1, True)]
    for stage, short in launches:
        kernel[(T, num_segs)](scores, scores.stride(0), width, lens, out, out.stride(0), hist, state, gt, num_segs,
                              *_table_args(r2t), rows, STAGE=stage, SHORT=short, SEG=segment,
                              SEG_TILE=TOPK_SEG_TILE, SLOTS=slots_of is not None, num_warps=ctx.num_warps)
    return out


def sparse_mla_latent(q_lat, q_pe, kv_cache, req_to_token, rows, pos, topk, scale, num_keys=None, slots=None,
                      num_splits=None, lib: KernelLibrary = JIT, rope: QueryRope | None = None, **tiles):
    """out_lat[t, h] = softmax_s(scale (q_lat.c_kv_s + q_pe.k_pe_s)) c_kv_s over the token's keys s:
    its top-k positions (topk [T, K], -1 padded) or, with topk None, every position <= its own
    (num_keys >= max position + 1 then fixes the split count; read from pos if not given). Each token
    splits only its own keys (at most min(pos + 1, K)), so a short context does not pay for K.
    Graph-safe with topk or num_keys given. `slots` (topk_slots of topk) skips the conversion, e.g. when
    shared indexer layers reuse a full layer's top-k. `num_splits` overrides `mla_num_splits`;
    `tiles` override SparseMlaDecodeCtx.make's choices. `rope`: q_pe is turned by each token's
    position in the kernel, as `rope` would turn it first."""
    T, H, R = q_lat.shape
    dev = q_lat.device
    if topk is not None:
        num_keys = topk.shape[1]
    elif num_keys is None:
        num_keys = int(pos.max()) + 1 if T else 1
    fp8 = kv_cache.dtype == torch.uint8
    ctx = SparseMlaDecodeCtx.make(H, R, q_pe.shape[-1], None if topk is None else topk.shape[1], scale,
                                  q_lat.dtype if fp8 else kv_cache.dtype, T, kv_fp8=fp8, rope=rope, **tiles)
    S = num_splits or mla_num_splits(T, H, ctx.block_h, num_keys, ctx.block_n, sm_count(dev), ctx.v_parts,
                                     ctx.num_warps)
    # one split: the kernel's normalised rows are the output, stored in its dtype (the combine of one
    # split rescales by exp2(0) = 1: the same bits), so no fp32 partials and no combine launch
    o_part = torch.empty(T, H, S, R, dtype=torch.float32, device=dev) if S > 1 else None
    lse = torch.empty(T, H, S, dtype=torch.float32, device=dev)
    out = torch.empty(T, H, R, dtype=q_lat.dtype, device=dev)
    if not T:
        return out
    args = [q_lat, q_lat.stride(0), q_lat.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1),
            *_kv_args(kv_cache, R), kv_cache.shape[0], *_table_args(req_to_token), rows, pos, *_rope_args(rope, dev)]
    if topk is not None:
        slots = topk_slots(topk, req_to_token, rows, pos) if slots is None else slots
        args += [slots, slots.stride(0)]
    lib(ctx)[(-(-H // ctx.block_h) * ctx.v_parts, S, T)](*args, out if o_part is None else o_part, lse,
                                                           num_warps=ctx.num_warps, num_stages=ctx.num_stages)
    if o_part is not None:
        cctx = MlaCombineCtx.make(H, R, S)
        lib(cctx)[(T, H)](o_part, lse, out, out.stride(0), out.stride(1), S, num_warps=cctx.num_warps)
    return out


def mla_absorbed(q_nope, q_pe, w_uk, w_uv, kv_cache, req_to_token, rows, pos, topk, scale, num_keys=None,
                 slots=None, lib: KernelLibrary = JIT, rope: QueryRope | None = None, **tiles):
    """Absorbed MLA -> o [T, H, dv]: q_lat = q_nope W_UK (w_uk [H, dn, R]) and o = out_lat W_UV (w_uv
    [H, R, dv]) as cuBLAS batched GEMMs around the sparse latent kernel (`sparse_mla_latent`'s
    arguments, `rope` included: q_pe is turned after its cast to q_lat's dtype, which the CUDA
    target's q_pe already has) and its combine; both weights contiguous in the compute dtype. (Per-head Triton
    GEMVs at <= 4 tokens, the second merging the splits, lost to this on an H200: 32.1 against 24.5 us
    at 64 heads and one token.)"""
    T = q_nope.shape[0]
    q_lat = torch.bmm(q_nope.transpose(0, 1).to(w_uk.dtype), w_uk).transpose(0, 1)   # [T, H, R] view
    out_lat = sparse_mla_latent(q_lat, q_pe.to(q_lat.dtype), kv_cache, req_to_token, rows, pos, topk, scale,
                                num_keys, slots, lib=lib, rope=rope, **tiles)
    o = torch.empty(T, out_lat.shape[1], w_uv.shape[2], dtype=out_lat.dtype, device=out_lat.device)
    torch.bmm(out_lat.transpose(0, 1), w_uv, out=o.transpose(0, 1))   # cuBLAS writes [T, H, dv] itself: no copy
    return o


def topk_slots(topk, req_to_token, rows, pos):
    """Top-k positions [T, K] -> KV slots (int32), -1 where padded or after the token (causal).
    For top-k given as positions (the torch target's form; the CUDA target's select writes the slots
    itself, `topk_select(slots_of=)`): one gather in torch, so the attention kernel's loads depend
    on one index load, not two."""
    valid = (topk >= 0) & (topk <= pos[:, None])
    slots = req_to_token[rows[:, None], topk.clamp(min=0)]
    return torch.where(valid, slots, -1).to(torch.int32)


def mla_attention_absorbed(q_nope, q_pe, kv_cache, w_kv_b, topk, req_to_token, rows, pos, scale, dn, dv,
                           lib: KernelLibrary = JIT, **tiles):
    """torch_ref.mla_attention_absorbed through `mla_absorbed` (W_UK and W_UV cut out of kv_b_proj's
    weight in q_nope's dtype). -> [T, H*dv]."""
    T, H = q_nope.shape[:2]
    w = w_kv_b.view(H, dn + dv, -1).to(q_nope.dtype)
    w_uk, w_uv = w[:, :dn].contiguous(), w[:, dn:].transpose(1, 2).contiguous()
    return mla_absorbed(q_nope, q_pe, w_uk, w_uv, kv_cache, req_to_token, rows, pos, topk, scale, lib=lib,
                        **tiles).reshape(T, H * dv)


def sample(logits, temperature, top_k, top_p, min_p, seed, step, return_kept=False, lib: KernelLibrary = JIT):
    """torch_ref.sample as one Triton kernel (one program per row): same parameters ([B] tensors or
    scalars), same kept sets, same noise, so the same token ids [B] int64; with return_kept, also the
    kept mask [B, V] bool."""
    B, V = logits.shape
    dev = logits.device
    ctx = SampleCtx.make(V, return_kept)
    out = torch.empty(B, dtype=torch.int64, device=dev)
    kept = torch.empty(B, V, dtype=torch.int8, device=dev) if return_kept else None
    params = [torch.as_tensor(p, device=dev).expand(B).contiguous()
              for p in (temperature, top_k, top_p, min_p, seed, step)]
    lg = _rows(logits)
    if B:
        extra = [kept, kept.stride(0)] if return_kept else []
        lib(ctx)[(B,)](lg, lg.stride(0), *params, out, *extra, num_warps=ctx.num_warps)
    return (out, kept.bool()) if return_kept else out


def sample_greedy(logits, lib: KernelLibrary = JIT, num_splits=None):
    """The sampler at its defaults (temperature 0: argmax, lowest id on ties, NaN never chosen): the
    IR's `sample.tokens`, [B] int64. `sample`'s greedy rows, split over `num_splits` programs per row
    (default `argmax_splits`) in one launch (argmax.py.j2), plus the zeroed done-counter's memset."""
    B, V = logits.shape
    dev = logits.device
    ctx = ArgmaxCtx.make(V)
    out = torch.empty(B, dtype=torch.int64, device=dev)
    if not B:
        return out
    S = num_splits or argmax_splits(B, V, ctx.chunk, sm_count(dev))
    part_max = torch.empty(B, ctx.splits_block, dtype=torch.float32, device=dev)
    part_idx = torch.empty(B, ctx.splits_block, dtype=torch.int32, device=dev)
    count = torch.zeros(B, dtype=torch.int32, device=dev)
    lg = _rows(logits)
    lib(ctx)[(B, S)](lg, lg.stride(0), part_max, part_idx, count, out, S, num_warps=ctx.num_warps)
    return out


def step_inputs(ids, last_token, rows, pos, loc, r2t, lib: KernelLibrary = JIT):
    """One launch: -> (ids with each negative entry replaced by last_token[rows], lens = pos + 1),
    both int64 [T], and r2t[rows, pos] = loc written (r2t: the device's req_to_token table, row-major)."""
    ctx = StepInputsCtx.make()
    out, lens = torch.empty_like(ids), torch.empty_like(pos)
    T = ids.shape[0]
    if T:
        if r2t.stride(1) != 1:
            raise ValueError(f"step_inputs: req_to_token strides {r2t.stride()} are not row-major")
        lib(ctx)[(-(-T // ctx.block),)](ids, last_token, rows, pos, loc, r2t, r2t.stride(0),
                                         min(last_token.shape[0], r2t.shape[0]), r2t.shape[1], out, lens, T,
                                         num_warps=ctx.num_warps)
    return out, lens
