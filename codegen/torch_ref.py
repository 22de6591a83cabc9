"""The `torch` codegen target: one pure, fp32-exact reference function per op of glm_moe_dsa.

These are the numerics every other target is checked against (and, composed by
`runtime/worker/reference_model.py`, what is checked against Hugging Face). Clarity beats speed: attention
and the indexer loop over requests and gather each request's KV through `req_to_token`.

Conventions: token-major tensors ([T, ...]); linear weights in HF layout [out, in] (y = x @ W.T);
RoPE output uses HF's layout (see `rope`); top-k indices are POSITIONS within the request (columns of
`req_to_token`), -1 padded, never slots, so a shared layer can reuse them whatever the page layout.
"""
from __future__ import annotations

import functools
import math
import torch
import torch.nn.functional as F
from glmc.codegen.context import PagedCache, StepBatch


def rms_norm(x, weight, eps):
    """y = weight * x / sqrt(mean(x^2, -1) + eps), computed in fp32."""
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def add_rms_norm(x, residual, weight, eps):
    """r = x + residual; returns (rms_norm(r), r): the fused pre-norm of the next sub-layer."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def layer_norm(x, weight, bias, eps):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim (biased variance)."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, eps)


@functools.lru_cache(maxsize=64)
def rope_inv_freq(theta: float, dim: int, scaling: tuple | None = None) -> torch.Tensor:
    """Per pair j < dim/2: the angle per position, fp32 on the CPU, with transformers' float ops.

    Plain RoPE: theta^(-2j/dim). Yarn (`scaling`: the IR's (name, value) pairs, see
    `glmc.config.RopeScaling.ir_attr`): `_compute_yarn_parameters`' blend of interpolated
    (theta^(2j/dim) * factor)^-1 and extrapolated theta^(-2j/dim) frequencies, with a linear ramp
    over the correction range [low, high] of pairs that turn beta_fast..beta_slow times in the
    original context.
    """
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if scaling is None:
        return 1.0 / pos_freqs
    s = dict(scaling)
    if s["type"] != "yarn":
        raise ValueError(f"rope scaling type {s['type']!r} is not implemented (yarn only)")
    low, high = _yarn_correction_range(s["beta_fast"], s["beta_slow"], dim, theta,
                                       s["original_max_position_embeddings"], s["truncate"])
    if low == high:
        high += 0.001  # transformers: prevent a singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (s["factor"] * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_correction_range(beta_fast, beta_slow, dim, theta, original_max_positions, truncate):
    """Pairs [low, high] between full extrapolation (>= beta_fast turns in the original context)
    and full interpolation (<= beta_slow turns), as transformers' `find_correction_range`."""
    def pair(turns):
        return (dim * math.log(original_max_positions / (turns * 2 * math.pi))) / (2 * math.log(theta))
    low, high = pair(beta_fast), pair(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def rope_attention_factor(scaling: tuple | None) -> float:
    """The factor on cos and sin: yarn's attention_factor, 1 for plain RoPE."""
    return 1.0 if scaling is None else float(dict(scaling)["attention_factor"])


def rope(x, positions, theta, interleaved=True, scaling=None):
    """Rotate x[t, ..., :] by angle positions[t] * inv_freq[j] per pair j of the last dim
    (`rope_inv_freq`: plain theta^(-2j/d), or yarn's with `scaling`, whose attention factor also
    multiplies cos and sin, as transformers' rotary embedding does).

    interleaved=True pairs (x[2j], x[2j+1]) (DeepSeek/GLM MLA, GLM's indexer) and, like HF, writes
    the result de-interleaved: [rotated evens | rotated odds]. interleaved=False pairs (x[j], x[j + d/2])
    (rotate_half: DeepSeek-V3.2's indexer) and keeps that layout. A dot product of two vectors
    rotated the same way is layout-independent, so q and k (and the KV cache) must just use the same call.
    """
    d = x.shape[-1]
    # Same float ops as HF's rotary embedding so angles match bit for bit.
    freqs = positions.float()[:, None] * rope_inv_freq(float(theta), d, scaling).to(positions.device)  # [T, d/2]
    shape = (freqs.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = freqs.cos(), freqs.sin()
    factor = rope_attention_factor(scaling)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    cos, sin = cos.view(shape), sin.view(shape)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def kv_write(pool: PagedCache, layer, loc, c_kv, k_pe):
    """pool.kv[layer][loc] = [c_kv | k_pe] (normalised latent, then RoPE'd shared key; `KVPool.write_kv`
    quantises where the pool is FP8 or emulates it)."""
    pool.write_kv(layer, loc, c_kv, k_pe)


def index_k_write(pool: PagedCache, layer, loc, k):
    """pool.index_k[layer][loc] = k (the RoPE'd, LayerNorm'd indexer key; full layers only)."""
    pool.write_index_k(layer, loc, k)


def _requests(batch: StepBatch):
    """Yield (token slice, key positions' slots [L], query positions [n]) per request."""
    for b, start, end in batch.token_ranges():
        row, seq_len = int(batch.req_pool_indices[b]), int(batch.seq_lens[b])
        slots = batch.req_to_token[row, :seq_len].long()
        yield slice(start, end), slots, batch.positions[start:end]


def _on(batch_tensor, device):
    """A batch index tensor (built on the host) on the device of the data it indexes."""
    return batch_tensor.to(device)


def topk_lowest_first(scores, k):
    """Indices of the k largest along the last dim, in descending order, exact ties broken by the
    LOWEST index first (a stable descending sort). Every top-k of glmc (indexer, router; torch and
    Triton, CPU and GPU) breaks ties this way; torch.topk's choice among ties is unspecified and
    differs between devices and row lengths."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def index_head_scale(op) -> float:
    """HF's scaling of the indexer's head weights (weights_proj's output), heads^-0.5, for an
    `idx.topk` op: what every target multiplies them by (the torch target before `indexer_topk`,
    the CUDA target and its kernel set in the scores kernel)."""
    return int(op.attr("heads")) ** -0.5


def indexer_scores(q_idx, weights, pool: PagedCache, layer, batch: StepBatch):
    """I(t,s) = sum_h w_h(t) relu(q_h(t).k(s) Di^-0.5) per request: [(token slice, [n, L] scores with
    future keys at -inf, query positions [n])], L = the request's seq_len. `weights` is
    weights_proj(x) * Hi^-0.5 (the caller applies HF's head scaling)."""
    dev = q_idx.device
    scale = q_idx.shape[-1] ** -0.5
    out = []
    for tok, slots, qpos in _requests(batch):
        slots, qpos = _on(slots, dev), _on(qpos, dev)
        k = pool.index_keys(layer, slots).float()  # [L, Di]
        scores = torch.relu(torch.einsum("thd,ld->thl", q_idx[tok].float(), k) * scale)
        index = torch.einsum("th,thl->tl", weights[tok].float(), scores)  # [n, L]
        future = torch.arange(k.shape[0], device=dev)[None, :] > qpos[:, None]
        out.append((tok, index.masked_fill(future, float("-inf")), qpos))
    return out


def indexer_topk(q_idx, weights, pool: PagedCache, layer, batch: StepBatch, topk):
    """The top-k POSITIONS of `indexer_scores` per token, -1 padded.

    Like HF, a row holds all seq_len keys of the request, future keys at -inf, and k = min(topk,
    seq_len); exact ties (keys whose every head is ReLU'd to 0) go to the lowest position
    (`topk_lowest_first`), so a chunked prefill, a whole one and decode pick the same keys. Future
    positions filling a short row become -1.
    """
    out = torch.full((q_idx.shape[0], topk), -1, dtype=torch.int64, device=q_idx.device)
    for tok, index, qpos in indexer_scores(q_idx, weights, pool, layer, batch):
        picked = topk_lowest_first(index, min(topk, index.shape[1]))
        picked = picked.masked_fill(picked > qpos[:, None], -1)
        out[tok, : picked.shape[1]] = picked
    return out


def _allowed(qpos, num_keys, topk_pos):
    """Key mask [n, L]: causal, and (if topk_pos is given) among the top-k positions."""
    causal = torch.arange(num_keys, device=qpos.device)[None, :] <= qpos[:, None]
    if topk_pos is None:
        return causal
    chosen = torch.zeros(qpos.shape[0], num_keys + 1, dtype=torch.bool, device=qpos.device)
    # -1 pads land in the extra last column, which is dropped.
    chosen.scatter_(1, torch.where(topk_pos < 0, num_keys, topk_pos), True)
    return causal & chosen[:, :num_keys]


def _softmax_masked(scores, allowed):
    """softmax over keys of scores [H, n, L] restricted to allowed [n, L]."""
    return torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)


def mla_attention_mha(q_nope, q_pe, pool: PagedCache, layer, w_kv_b, topk, batch: StepBatch, scale, dn, dv):
    """o_h = softmax(s (q_nope.k_nope + q_pe.k_pe) | causal & top-k) v, with [k_nope|v] = kv_b(c_kv).

    Prefill form: every request's latent KV is gathered through req_to_token and expanded per head.
    `topk` is [T, K] positions from `indexer_topk` (-1 padded) or None for dense causal. -> [T, H*dv].
    """
    T, H = q_nope.shape[:2]
    out = q_nope.new_zeros(T, H, dv, dtype=torch.float32)
    for tok, slots, qpos in _requests(batch):
        slots, qpos = _on(slots, q_nope.device), _on(qpos, q_nope.device)
        kv = (pool.c_kv(layer, slots).float() @ w_kv_b.float().T).view(-1, H, dn + dv)
        k_nope, v = kv[..., :dn], kv[..., dn:]
        k_pe = pool.k_pe(layer, slots).float()
        scores = torch.einsum("thd,lhd->htl", q_nope[tok].float(), k_nope)
        scores = (scores + torch.einsum("thd,ld->htl", q_pe[tok].float(), k_pe)) * scale
        probs = _softmax_masked(scores, _allowed(qpos, slots.shape[0], None if topk is None else topk[tok]))
        out[tok] = torch.einsum("htl,lhd->thd", probs, v)
    return out.reshape(T, H * dv)


def mla_attention_absorbed(q_nope, q_pe, pool: PagedCache, layer, w_kv_b, topk, batch: StepBatch, scale, dn, dv):
    """Same result as mla_attention_mha, in latent space: q_lat = q_nope W_UK; o = softmax(...) c_kv W_UV.

    Decode form: scores against the cached 576-wide rows directly, no per-head K/V expansion.
    """
    T, H = q_nope.shape[:2]
    w = w_kv_b.float().view(H, dn + dv, -1)
    w_uk, w_uv = w[:, :dn], w[:, dn:]  # [H, dn, R], [H, dv, R]
    q_lat = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk)
    out_lat = q_lat.new_zeros(q_lat.shape)
    for tok, probs, c_kv in latent_probs(q_lat, q_pe, pool, layer, topk, batch, scale):
        out_lat[tok] = torch.einsum("htl,lr->thr", probs, c_kv)
    return torch.einsum("thr,hvr->thv", out_lat, w_uv).reshape(T, H * dv)


def latent_probs(q_lat, q_pe, pool: PagedCache, layer, topk, batch: StepBatch, scale):
    """The absorbed form's softmax per request: (token slice, probs [H, n, L] over the request's
    cached rows, those rows' latents c_kv [L, R] in fp32), scores s (q_lat . c_kv + q_pe . k_pe)
    restricted to causal & top-k."""
    for tok, slots, qpos in _requests(batch):
        slots, qpos = _on(slots, q_lat.device), _on(qpos, q_lat.device)
        c_kv, k_pe = pool.c_kv(layer, slots).float(), pool.k_pe(layer, slots).float()
        scores = torch.einsum("thr,lr->htl", q_lat[tok], c_kv)
        scores = (scores + torch.einsum("thd,ld->htl", q_pe[tok].float(), k_pe)) * scale
        yield tok, _softmax_masked(scores, _allowed(qpos, slots.shape[0], None if topk is None else topk[tok])), c_kv


def moe_route(x, gate_w, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor):
    """s = sigmoid(x Wg^T); choose top-k of s+bias within the best topk_group groups; w = s / sum * rsf.

    A group's score is the sum of its two largest biased scores. Weights use the UNBIASED s.
    Returns (weights [T, k] fp32, expert ids [T, k] int64), ids in descending biased score; exact ties
    (among groups, among experts) go to the lowest index (`topk_lowest_first`), as in the Triton router.
    """
    return moe_route_logits(x.float() @ gate_w.float().T, bias, top_k, n_group, topk_group,
                            norm_topk_prob, routed_scaling_factor)


def moe_route_logits(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor):
    """moe_route from router logits [T, E] (fp32) instead of x and the gate weight."""
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float()
    T, E = choice.shape
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
    group_idx = topk_lowest_first(group_scores, topk_group)
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
    expert_mask = group_mask[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)
    ids = topk_lowest_first(choice.masked_fill(~expert_mask, float("-inf")), top_k)
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def swiglu(x, w_gate, w_up, w_down):
    """y = (silu(x Wg^T) * (x Wu^T)) Wd^T."""
    x = x.float()
    return (F.silu(x @ w_gate.float().T) * (x @ w_up.float().T)) @ w_down.float().T


def moe_experts(x, ids, weights, w_gate, w_up, w_down, expert_offset=0):
    """y_t = sum over chosen experts e held here (offset <= e < offset+E) of w_te * swiglu_e(x_t).

    Experts outside this rank's range contribute nothing, so summing over EP ranks gives the full
    result; with an intermediate-dim (moe_tp) shard of the weights each rank returns a partial sum.
    """
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w_gate.shape[0]):
        tok, slot = torch.where(ids == expert_offset + e)
        if tok.numel() == 0:
            continue
        y = swiglu(x[tok], w_gate[e], w_up[e], w_down[e]) * weights[tok, slot, None].float()
        out.index_add_(0, tok, y)
    return out


# ----------------------------------------------------------------------------- sampling
# The one sampler; its semantics and their defence are in runtime/engine/sampling.py. The Triton
# twin (templates/sample.py.j2) computes the same integer hash and the same float steps, so for the
# same logits, parameters and seed both keep the same tokens and draw the same one.

def _mul32(a, c: int):
    """(a * c) mod 2^32 for int64 a in [0, 2^32): c split in 16-bit halves, so nothing overflows."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def hash32(x):
    """lowbias32 (C. Wellons): a bijective 32-bit integer mixer, on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sample_uniform(seed, step, vocab: int):
    """[B, vocab] fp32 in (0, 1), a pure function of (seed, step, token id): the sampler's noise.

    The stream key hashes the 64-bit seed's halves and the step (32 bits) in turn; token i gets
    h = hash32(hash32(key ^ i)) (two rounds: one leaves a hint of correlation between neighbouring
    ids) and u = (2 * (h >> 9) + 1) / 2^24, exact in fp32 and never 0 or 1.
    """
    key = hash32(((seed >> 32) & 0xFFFFFFFF) ^ 0x3C6EF372)
    key = hash32(key ^ (seed & 0xFFFFFFFF))
    key = hash32(key ^ (step & 0xFFFFFFFF))
    h = hash32(hash32(key[:, None] ^ torch.arange(vocab, device=seed.device)))
    return ((h >> 9) * 2 + 1).float() * 2.0 ** -24


def sample(logits, temperature, top_k, top_p, min_p, seed, step, return_kept=False):
    """Token ids [B] int64 from logits [B, V], every parameter a per-row [B] tensor.

    temperature <= 0: greedy, the lowest id among the maxima. Else, with the tokens in the order
    (logit descending, id ascending) and e_i = exp((x_i - max x) * (1 / T)) (p_i = e_i / sum e):
    top-k keeps the first k (k <= 0 or >= V: all); top-p keeps the smallest prefix of those whose
    mass reaches top_p of their mass (top_p >= 1: all); min-p keeps e_i >= min_p (p_i >= min_p * p_max,
    unchanged by renormalising). The draw is an exponential race: the kept token with the largest
    (x_i - max x) / T - log(-log u_i), u = sample_uniform(seed, step), i.e. a draw with probability
    proportional to e_i. With return_kept, also the kept mask [B, V] bool (greedy rows: the argmax).
    """
    x = logits.float()
    greedy = x.argmax(-1)  # first maximum: the lowest id
    sampled = temperature > 0
    if not (return_kept or bool(sampled.any())):
        return greedy
    kept = kept_tokens(x, temperature, top_k, top_p, min_p)
    inv_t = (1.0 / torch.where(sampled, temperature.float(), 1.0))[:, None]
    noise = torch.log(-torch.log(sample_uniform(seed, step, x.shape[1])))
    race = torch.where(kept, (x - x.max(-1, keepdim=True).values) * inv_t - noise, float("-inf"))
    tokens = torch.where(sampled, race.argmax(-1), greedy)
    return (tokens, kept) if return_kept else tokens


def kept_tokens(x, temperature, top_k, top_p, min_p):
    """`sample`'s kept mask [B, V] bool for fp32 logits x [B, V]: the tokens top-k, top-p and min-p
    leave (greedy rows: the argmax); the draw needs no noise to know it."""
    B, V = x.shape
    sampled = temperature > 0
    inv_t = (1.0 / torch.where(sampled, temperature.float(), 1.0))[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # ties: lower id first
    e = torch.exp((sorted_x - sorted_x[:, :1]) * inv_t)
    k = torch.where((top_k > 0) & (top_k < V), top_k, V)
    in_k = torch.arange(V, device=x.device) < k[:, None]
    e_k = torch.where(in_k, e, 0.0)
    mass_before = torch.cat([e_k.new_zeros(B, 1), e_k.cumsum(-1)[:, :-1]], -1)  # exclusive cumsum
    in_p = (mass_before < top_p.float()[:, None] * e_k.sum(-1, keepdim=True)) | (top_p >= 1)[:, None]
    kept_sorted = in_k & in_p & (e >= min_p.float()[:, None])
    kept = torch.zeros_like(kept_sorted).scatter(1, order, kept_sorted)
    return torch.where(sampled[:, None], kept, F.one_hot(x.argmax(-1), V).bool())


def sample_greedy(logits):
    """The sampler at its defaults (temperature 0: argmax, lowest id on ties): the IR's `sample.tokens`."""
    zeros = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    return sample(logits, zeros.float(), zeros, zeros + 1.0, zeros.float(), zeros, zeros)
