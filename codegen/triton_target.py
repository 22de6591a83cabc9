"""Triton target: typed kernel contexts, template rendering, kernel loading and launch wrappers.

Each kernel is one Jinja2 template, ``codegen/templates/<kernel>.py.j2``, holding one ``@triton.jit``
function. Templates are dumb (STYLE rule 10): every shape, tile size and flag is computed here, in
Python, into a frozen ``*Ctx`` dataclass, and the template only substitutes ``{{ value }}`` and
branches on ``{% if flag %}``. ``render`` turns (kernel, ctx) into source; ``write_kernels`` writes
sources into a plan directory so users can read exactly what runs; ``load_kernel`` imports one.

The launch wrappers at the bottom take torch tensors with the torch reference's interface
(``codegen/torch_ref.py``), build the context from the shapes, render/load (cached) and launch. Where
a kernel's natural interface differs (slots instead of positions, split-K partials), the wrapper adapts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import ClassVar, Mapping

import jinja2
import torch

TEMPLATE_DIR = Path(__file__).parent / "templates"
_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
    undefined=jinja2.StrictUndefined,  # a context field the template names but lacks is an error
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block shapes must be powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


# torch dtype -> (Triton dot operand type, dot precision). fp32 asks for exact IEEE products so the
# GPU agrees with the fp32 reference; bf16/fp16 operands always accumulate in fp32.
_DOT = {
    torch.float32: ("tl.float32", "ieee"),
    torch.bfloat16: ("tl.bfloat16", "tf32"),
    torch.float16: ("tl.float16", "tf32"),
}


def _warps(elements: int, per_warp: int = 512, cap: int = 8) -> int:
    """Warps for a tile of `elements`: enough to keep each thread's share small, at most `cap`."""
    return max(1, min(cap, next_pow2(max(1, elements // per_warp))))


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; a small stand-in on CPU (the interpreter is serial)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


# ----------------------------------------------------------------------------- contexts
@dataclass(frozen=True)
class RmsNormCtx:
    """rms_norm.py.j2: one row per program; optional fused residual add."""
    template: ClassVar[str] = "rms_norm"
    hidden: int
    eps: float
    has_residual: bool
    block_d: int
    num_warps: int

    @classmethod
    def make(cls, hidden: int, eps: float, has_residual: bool) -> "RmsNormCtx":
        block = next_pow2(hidden)
        return cls(hidden, float(eps), bool(has_residual), block, _warps(block, 1024))


@dataclass(frozen=True)
class MoeRouterCtx:
    """moe_router.py.j2: experts as a [groups, experts per group] tile; top-k by repeated argmax."""
    template: ClassVar[str] = "moe_router"
    num_experts: int
    n_group: int
    group_size: int
    topk_group: int
    top_k: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    group_limited: bool
    masked_score: str  # what experts of dropped groups score: torch_ref uses -inf (SGLang); HF uses 0.0
    block_groups: int
    block_group_size: int
    block_k: int
    num_warps: int

    @classmethod
    def make(cls, num_experts, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor):
        if num_experts % n_group or not 1 <= topk_group <= n_group or top_k > num_experts:
            raise ValueError(f"moe_router: experts {num_experts}, n_group {n_group}, topk_group {topk_group},"
                             f" top_k {top_k} are inconsistent")
        gs = num_experts // n_group
        return cls(num_experts, n_group, gs, topk_group, top_k, bool(norm_topk_prob),
                   float(routed_scaling_factor), topk_group < n_group, 'float("-inf")',
                   next_pow2(n_group), next_pow2(gs), next_pow2(top_k), _warps(num_experts, 64, 4))


@dataclass(frozen=True)
class RopeCtx:
    """rope.py.j2: rotate the first rope_dim of head_dim dims of [T, heads, head_dim]."""
    template: ClassVar[str] = "rope"
    num_heads: int
    head_dim: int
    rope_dim: int
    half_rope: int
    interleaved: bool
    has_pass: bool
    block_h: int
    block_half: int
    block_pass: int
    num_warps: int

    @classmethod
    def make(cls, num_heads, head_dim, rope_dim, interleaved):
        half, rest = rope_dim // 2, head_dim - rope_dim
        block_h = min(next_pow2(num_heads), 16)
        return cls(num_heads, head_dim, rope_dim, half, bool(interleaved), rest > 0, block_h, next_pow2(half),
                   next_pow2(max(rest, 1)), _warps(block_h * head_dim, 512, 4))


@dataclass(frozen=True)
class QkvNormRopeWriteCtx:
    """qkv_norm_rope_write.py.j2: q/kv latent RMSNorm, k_pe RoPE, KV (and indexer K) cache write."""
    template: ClassVar[str] = "qkv_norm_rope_write"
    q_lora: int
    kv_lora: int
    rope_dim: int
    half_rope: int
    kv_pe_hi: int  # kv_lora + half_rope: where the rotated second halves go in a cache row
    eps: float
    interleaved: bool
    has_index_k: bool
    index_dim: int
    index_eps: float
    index_interleaved: bool
    block_q: int
    block_kv: int
    block_half: int
    block_index: int
    num_warps: int

    @classmethod
    def make(cls, q_lora, kv_lora, rope_dim, eps, interleaved, index_dim=0, index_eps=1e-6,
             index_interleaved=True):
        half = rope_dim // 2
        return cls(q_lora, kv_lora, rope_dim, half, kv_lora + half, float(eps), bool(interleaved),
                   index_dim > 0, index_dim, float(index_eps), bool(index_interleaved), next_pow2(q_lora),
                   next_pow2(kv_lora), next_pow2(half), next_pow2(max(index_dim, 1)), _warps(q_lora, 512, 4))


@dataclass(frozen=True)
class IndexerScoresCtx:
    """indexer_scores.py.j2: one (token, key block) per program, heads padded to a dot tile."""
    template: ClassVar[str] = "indexer_scores"
    num_heads: int
    index_dim: int
    scale: float
    block_h: int
    block_n: int
    dot_dtype: str
    dot_precision: str
    num_warps: int

    @classmethod
    def make(cls, num_heads, index_dim, dtype, block_n=None):
        dot_dtype, precision = _DOT[dtype]
        block_n = block_n or 64
        return cls(num_heads, index_dim, index_dim ** -0.5, max(16, next_pow2(num_heads)), block_n,
                   dot_dtype, precision, 4)


@dataclass(frozen=True)
class TopkSelectCtx:
    """topk_select.py.j2: exact k-th-largest threshold by bitwise search, then ordered compaction."""
    template: ClassVar[str] = "topk_select"
    k: int
    chunk: int
    num_warps: int

    @classmethod
    def make(cls, k, row_len, chunk=None):
        chunk = chunk or min(4096, next_pow2(max(row_len, 16)))
        return cls(k, chunk, _warps(chunk, 256, 8))


@dataclass(frozen=True)
class SparseMlaDecodeCtx:
    """sparse_mla_decode.py.j2: absorbed MLA split-K partials over top-k slots (or causal positions)."""
    template: ClassVar[str] = "sparse_mla_decode"
    num_heads: int
    kv_lora: int
    rope_dim: int
    has_topk: bool
    topk: int
    num_splits: int
    block_h: int
    block_n: int
    key_major: bool  # [keys, heads] scores: lets the MMA's M be keys / latent dims instead of heads
    qk_scale_log2: float  # softmax scale * log2(e): the kernel works in exp2
    dot_dtype: str
    dot_precision: str
    num_warps: int
    num_stages: int

    @classmethod
    def make(cls, num_heads, kv_lora, rope_dim, topk, num_keys, scale, dtype, num_tokens, num_sms,
             block_h=None, block_n=None, num_splits=None, num_warps=None, num_stages=None, key_major=None):
        if kv_lora != next_pow2(kv_lora) or rope_dim != next_pow2(rope_dim):
            raise ValueError(f"sparse_mla_decode needs power-of-two kv_lora/rope dims, got {kv_lora}/{rope_dim}")
        dot_dtype, precision = _DOT[dtype]
        # Measured on an H200 (bench/results/gpu_kernels_2026-11-29.json, K=2048, 64 heads): with >= 32
        # tokens, key-major 64 heads x 32 keys (one KV read per token, wgmma) was fastest (318 us at
        # B=128 vs 355); with 1 token, head-major 16 x 32 at 4 warps (9.9 us vs 16.6). Both spill-free.
        wide = num_tokens >= 32 and num_heads >= 64 and key_major is None
        if key_major is None:
            key_major = wide
        block_h = block_h or (64 if wide else 16)
        block_n = block_n or 32
        num_warps = num_warps or (8 if block_h > 16 else 4)
        num_stages = num_stages or (1 if wide else 2)
        if num_splits is None:  # flash-decoding: enough programs for ~2 waves, >= 2 key blocks per split
            programs = num_tokens * -(-num_heads // block_h)
            num_splits = max(1, min(-(-2 * num_sms // programs), num_keys // (2 * block_n)))
        return cls(num_heads, kv_lora, rope_dim, topk is not None, topk or 0, num_splits, block_h, block_n,
                   bool(key_major), float(scale) * 1.4426950408889634, dot_dtype, precision, num_warps, num_stages)


@dataclass(frozen=True)
class MlaCombineCtx:
    """mla_combine.py.j2: merge split-K partials by their log-sum-exp."""
    template: ClassVar[str] = "mla_combine"
    num_heads: int
    kv_lora: int
    num_splits: int
    block_splits: int
    num_warps: int

    @classmethod
    def make(cls, num_heads, kv_lora, num_splits):
        return cls(num_heads, kv_lora, num_splits, next_pow2(num_splits), _warps(kv_lora * num_splits, 1024, 4))


@dataclass(frozen=True)
class SampleCtx:
    """sample.py.j2: one vocab row per program, chunked passes, exponential-race draw."""
    template: ClassVar[str] = "sample"
    vocab: int
    chunk: int
    write_probs: bool
    num_warps: int

    @classmethod
    def make(cls, vocab, write_probs=False, chunk=None):
        chunk = chunk or min(4096, next_pow2(vocab))
        return cls(vocab, chunk, bool(write_probs), _warps(chunk, 256, 8))


# ----------------------------------------------------------------------------- render / write / load
def render(kernel: str, ctx) -> str:
    """Source of `kernel` specialised by `ctx` (a *Ctx whose template is `kernel`)."""
    if ctx.template != kernel:
        raise ValueError(f"render: context {type(ctx).__name__} is for {ctx.template!r}, not {kernel!r}")
    return _ENV.get_template(f"{kernel}.py.j2").render(ctx_repr=repr(ctx), **dataclasses.asdict(ctx))


def write_kernels(plan_dir, kernels: Mapping[str, object]) -> dict[str, Path]:
    """Write each named context's rendered kernel to `plan_dir/kernels/<name>.py`; returns the paths."""
    out = Path(plan_dir) / "kernels"
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, ctx in kernels.items():
        paths[name] = out / f"{name}.py"
        paths[name].write_text(render(ctx.template, ctx))
    return paths


def load_kernel(path) -> ModuleType:
    """Import a rendered kernel module from `path` (Triton reads the jit source back from the file)."""
    path = Path(path).resolve()
    name = f"glmc_kernels.{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_KERNELS: dict = {}
_KERNEL_DIR: list[Path] = []


def _kernel_dir() -> Path:
    """Where launch wrappers cache rendered sources: $GLMC_KERNEL_DIR, else one temp dir per process."""
    if not _KERNEL_DIR:
        env = os.environ.get("GLMC_KERNEL_DIR")
        _KERNEL_DIR.append(Path(env) if env else Path(tempfile.mkdtemp(prefix="glmc_kernels_")))
        _KERNEL_DIR[0].mkdir(parents=True, exist_ok=True)
    return _KERNEL_DIR[0]


def kernel_for(ctx):
    """The @triton.jit function for ctx: rendered, written (content-addressed) and imported once."""
    fn = _KERNELS.get(ctx)
    if fn is None:
        src = render(ctx.template, ctx)
        path = _kernel_dir() / f"{ctx.template}_{hashlib.sha1(src.encode()).hexdigest()[:12]}.py"
        if not path.exists():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(src)
            tmp.replace(path)  # atomic: concurrent processes never import a half-written file
        fn = _KERNELS[ctx] = getattr(load_kernel(path), f"{ctx.template}_kernel")
    return fn


# ----------------------------------------------------------------------------- launch wrappers
def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a unit inner stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


_INV_FREQ: dict = {}


def _inv_freq(theta: float, dim: int, device) -> torch.Tensor:
    """theta^(-2j/dim), computed on the CPU with torch_ref.rope's exact float ops, then moved."""
    key = (float(theta), dim, str(device))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = (1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).to(device)
    return _INV_FREQ[key]


def _token_rows(batch, device):
    """Per token: (req_to_token row, position) on `device`; decode and extend alike."""
    rows = batch.req_pool_indices.repeat_interleave(batch.extend_lens)
    return rows.to(device), batch.positions.to(device)


def rms_norm(x, weight, eps):
    """torch_ref.rms_norm; output in x's dtype."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    ctx = RmsNormCtx.make(x2.shape[1], eps, False)
    if x2.shape[0]:
        kernel_for(ctx)[(x2.shape[0],)](x2, x2.stride(0), weight, out, out.stride(0), num_warps=ctx.num_warps)
    return out.view(x.shape)


def add_rms_norm(x, residual, weight, eps):
    """torch_ref.add_rms_norm: (rms_norm(x + residual), x + residual) in one pass."""
    x2, r2 = _rows(x), _rows(residual)
    new_res = torch.empty(x2.shape, dtype=torch.result_type(x, residual), device=x.device)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    ctx = RmsNormCtx.make(x2.shape[1], eps, True)
    if x2.shape[0]:
        kernel_for(ctx)[(x2.shape[0],)](x2, x2.stride(0), r2, r2.stride(0), new_res, new_res.stride(0),
                                        weight, out, out.stride(0), num_warps=ctx.num_warps)
    return out.view(x.shape), new_res.view(x.shape)


def moe_route(x, gate_w, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor):
    """torch_ref.moe_route: the fp32 gate GEMM in torch (cuBLAS), everything after it in one kernel.

    Ids come out in descending biased-score order (torch_ref's order is torch.topk's; compare as sets).
    """
    logits = x.float() @ gate_w.float().T
    return moe_route_logits(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)


def moe_route_logits(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor):
    """moe_route after the gate GEMM: fp32 logits [T, E] -> (weights [T, k] fp32, ids [T, k] int64)."""
    T, E = logits.shape
    ctx = MoeRouterCtx.make(E, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        kernel_for(ctx)[(T,)](logits, logits.stride(0), bias, weights, ids, top_k, num_warps=ctx.num_warps)
    return weights, ids


def rope(x, positions, theta, interleaved=True, rope_dim=None, out=None):
    """torch_ref.rope on the first rope_dim (default: all) dims of the last axis; the rest is copied.

    x is [T, D] or [T, H, D] (strided views such as q[..., dn:] are fine); out may be x (in place).
    """
    x3 = x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])
    T, H, D = x3.shape
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device) if out is None else out.view(T, H, D)
    ctx = RopeCtx.make(H, D, rope_dim or D, interleaved)
    if T:
        kernel_for(ctx)[(T, -(-H // ctx.block_h))](
            x3, x3.stride(0), x3.stride(1), positions, _inv_freq(theta, ctx.rope_dim, x.device),
            out, out.stride(0), out.stride(1), num_warps=ctx.num_warps)
    return out.view(x.shape)


def qkv_norm_rope_write(q_a, kv_a, positions, out_cache_loc, pool, layer, q_norm_w, kv_norm_w, eps, theta,
                        interleaved=True, index_k=None, k_norm_w=None, k_norm_b=None, index_eps=1e-6,
                        index_interleaved=True):
    """After the fused A-projection, one kernel: returns c_q = rms_norm(q_a) and writes, at out_cache_loc,
    pool.kv[layer] = [rms_norm(kv_a[:, :R]) | rope(kv_a[:, R:])] and (full layers, index_k given)
    pool.index_k[layer] = [rope(layer_norm(index_k)[:, :dr]) | layer_norm(index_k)[:, dr:]].
    """
    T, R, dr = q_a.shape[0], pool.kv_lora_rank, pool.qk_rope_head_dim
    has_ik = index_k is not None
    ctx = QkvNormRopeWriteCtx.make(q_a.shape[1], R, dr, eps, interleaved, index_k.shape[1] if has_ik else 0,
                                   index_eps, index_interleaved)
    c_q = torch.empty(q_a.shape, dtype=q_a.dtype, device=q_a.device)
    kv = pool.kv[layer]
    args = [q_a, q_a.stride(0), q_norm_w, c_q, c_q.stride(0), kv_a, kv_a.stride(0), kv_norm_w, positions,
            out_cache_loc, _inv_freq(theta, dr, q_a.device), kv, kv.stride(0)]
    if has_ik:
        ik = pool.index_k[layer]
        args += [index_k, index_k.stride(0), k_norm_w, k_norm_b, ik, ik.stride(0)]
    if T:
        kernel_for(ctx)[(T,)](*args, num_warps=ctx.num_warps)
    return c_q


def indexer_topk(q_idx, weights, pool, layer, batch, topk, max_len=None, block_n=None, chunk=None):
    """torch_ref.indexer_topk: [T, topk] key POSITIONS (ascending, -1 padded) in two kernels:
    scores over the paged indexer cache into a [T, max_len] fp32 workspace, then exact top-k selection.
    """
    rows, pos = _token_rows(batch, q_idx.device)
    max_len = (max_len or int(batch.seq_lens.max())) if batch.num_tokens else 1
    scores = indexer_scores(q_idx, weights, pool.index_k[layer], batch.req_to_token.to(q_idx.device), rows, pos,
                            max_len, block_n)
    return topk_select(scores, pos + 1, topk, chunk)


def indexer_scores(q_idx, weights, k_cache, req_to_token, rows, pos, max_len, block_n=None):
    """[T, >= max_len] fp32 index scores of every key position (-inf after the token's own position).
    Graph-safe: no host sync; max_len (>= every seq_len) fixes the workspace shape."""
    T, Hi, Di = q_idx.shape
    ctx = IndexerScoresCtx.make(Hi, Di, k_cache.dtype, block_n)
    width = -(-max_len // ctx.block_n) * ctx.block_n
    scores = torch.empty(T, width, dtype=torch.float32, device=q_idx.device)
    if T:
        kernel_for(ctx)[(T, width // ctx.block_n)](
            q_idx, q_idx.stride(0), q_idx.stride(1), weights, weights.stride(0), k_cache, k_cache.stride(0),
            req_to_token, req_to_token.stride(0), rows, pos, scores, scores.stride(0), num_warps=ctx.num_warps)
    return scores


def topk_select(scores, lens, k, chunk=None):
    """Per row t: positions of the k largest of scores[t, :lens[t]], ascending, -1 padded. [T, k] int64."""
    T = scores.shape[0]
    ctx = TopkSelectCtx.make(k, scores.shape[1], chunk)
    out = torch.empty(T, k, dtype=torch.int64, device=scores.device)
    if T:
        kernel_for(ctx)[(T,)](scores, scores.stride(0), lens, out, out.stride(0), num_warps=ctx.num_warps)
    return out


def sparse_mla_latent(q_lat, q_pe, kv_cache, req_to_token, rows, pos, topk, scale, num_keys=None, slots=None,
                      **tiles):
    """out_lat[t, h] = softmax_s(scale (q_lat.c_kv_s + q_pe.k_pe_s)) c_kv_s over the token's keys s:
    its top-k positions (topk [T, K], -1 padded) or, with topk None, every position <= its own
    (num_keys >= max position + 1 then fixes the split size; read from pos if not given).
    Graph-safe with topk or num_keys given. `slots` (topk_slots of topk) skips the conversion, e.g. when
    shared indexer layers reuse a full layer's top-k. `tiles` override SparseMlaDecodeCtx.make's choices."""
    T, H, R = q_lat.shape
    dev = q_lat.device
    if topk is not None:
        num_keys = topk.shape[1]
    elif num_keys is None:
        num_keys = int(pos.max()) + 1 if T else 1
    ctx = SparseMlaDecodeCtx.make(H, R, q_pe.shape[-1], None if topk is None else topk.shape[1], num_keys,
                                  scale, kv_cache.dtype, T, _num_sms(dev), **tiles)
    S = ctx.num_splits
    per_split = -(-(-(-num_keys // S)) // ctx.block_n) * ctx.block_n
    o_part = torch.empty(T, H, S, R, dtype=torch.float32, device=dev)
    lse = torch.empty(T, H, S, dtype=torch.float32, device=dev)
    out = torch.empty(T, H, R, dtype=q_lat.dtype, device=dev)
    if not T:
        return out
    args = [q_lat, q_lat.stride(0), q_lat.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1), kv_cache,
            kv_cache.stride(0), req_to_token, req_to_token.stride(0), rows, pos]
    if topk is not None:
        slots = topk_slots(topk, req_to_token, rows, pos) if slots is None else slots
        args += [slots, slots.stride(0)]
    kernel_for(ctx)[(-(-H // ctx.block_h), S, T)](*args, o_part, lse, per_split, num_warps=ctx.num_warps,
                                                   num_stages=ctx.num_stages)
    cctx = MlaCombineCtx.make(H, R, S)
    kernel_for(cctx)[(T, H)](o_part, lse, out, out.stride(0), out.stride(1), num_warps=cctx.num_warps)
    return out


def topk_slots(topk, req_to_token, rows, pos):
    """Top-k positions [T, K] -> KV slots (int32), -1 where padded or after the token (causal).
    One gather per layer in torch, so the attention kernel's loads depend on one index load, not two."""
    valid = (topk >= 0) & (topk <= pos[:, None])
    slots = req_to_token[rows[:, None], topk.clamp(min=0)]
    return torch.where(valid, slots, -1).to(torch.int32)


def mla_attention_absorbed(q_nope, q_pe, pool, layer, w_kv_b, topk, batch, scale, dn, dv, **tiles):
    """torch_ref.mla_attention_absorbed: W_UK / W_UV absorption as torch batched GEMMs around the
    sparse latent-attention kernel. -> [T, H*dv]."""
    T, H = q_nope.shape[:2]
    w = w_kv_b.view(H, dn + dv, -1)
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w[:, :dn].to(q_nope.dtype))
    rows, pos = _token_rows(batch, q_nope.device)
    out_lat = sparse_mla_latent(q_lat, q_pe, pool.kv[layer], batch.req_to_token.to(q_nope.device), rows, pos,
                                topk, scale, **tiles)
    return torch.einsum("thr,hvr->thv", out_lat, w[:, dn:].to(out_lat.dtype)).reshape(T, H * dv)


def sample(logits, temperature, top_k, top_p, min_p, generator=None, return_probs=False):
    """torch_ref.sample with per-row [B] parameters: greedy where temperature <= 0, else an exponential-race
    draw (Philox noise, seeded from `generator`) from the top-k/top-p/min-p filtered softmax.

    With return_probs, also returns the filtered, renormalised [B, V] distribution that was drawn from.
    """
    B, V = logits.shape
    dev = logits.device
    ctx = SampleCtx.make(V, return_probs)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    out = torch.empty(B, dtype=torch.int64, device=dev)
    probs = torch.empty(B, V, dtype=torch.float32, device=dev) if return_probs else None
    params = [torch.as_tensor(p, device=dev).expand(B).contiguous() for p in (temperature, top_k, top_p, min_p)]
    lg = _rows(logits)
    if B:
        extra = [probs, probs.stride(0)] if return_probs else []
        kernel_for(ctx)[(B,)](lg, lg.stride(0), *params, seed, out, *extra, num_warps=ctx.num_warps)
    return (out, probs) if return_probs else out
