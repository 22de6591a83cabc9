"""Every glmc Triton kernel at GLM-5.3 shapes on a GPU, checked against codegen/torch_ref.py.

    python -m bench.gpu_kernels --out results.json            # CUDA, GLM-5.3 shapes
    python -m bench.gpu_kernels --tiny --out /tmp/t.json      # CPU interpreter dry run, tiny shapes

Outputs are allocated poisoned (NaN / -777; the KV pool NaN) before the checked run. References run on
the CPU in fp32 from the same (bf16) inputs, since torch_ref builds some index tensors on the CPU.
Times are medians of CUDA-graph replays (do_bench_cudagraph, L2 not flushed; falls back to do_bench);
GB/s counts the bytes a kernel must move (inputs once, outputs once). A table is printed last and the
JSON (rows + environment + measured copy bandwidth) is rewritten after every row.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


GLM = dict(hidden=6144, q_lora=2048, heads=64, dn=192, dv=256, R=512, DR=64, HI=32, DI=128, topk=2048,
           experts=256, top_k=8, vocab=154880, max_ctx=8192, batches=(1, 32, 128), tokens=(1, 128, 8192),
           prefill=(512, 7680), splits_sweep=True)
TINY = dict(hidden=48, q_lora=40, heads=4, dn=16, dv=8, R=32, DR=8, HI=4, DI=16, topk=16, experts=16, top_k=4,
            vocab=50, max_ctx=64, batches=(1, 3), tokens=(1, 5), prefill=(6, 20), splits_sweep=False)


class Bench:
    """Runs cases, keeps rows, prints them and rewrites the JSON after each one."""

    def __init__(self, args):
        self.args, self.rows, self.t0 = args, [], time.time()
        self.dev = torch.device("cpu" if args.tiny else "cuda")
        self.dt = torch.float32 if args.tiny else torch.bfloat16
        self.d = SimpleNamespace(**(TINY if args.tiny else GLM))
        self.env = {"torch": torch.__version__, "triton": triton.__version__,
                    "device": "cpu-interpreter" if args.tiny else torch.cuda.get_device_name()}

    def rand(self, *shape, scale=1.0, dtype=None):
        return (torch.randn(*shape) * scale).to(self.dev, dtype or self.dt)

    def time_us(self, fn):
        if self.args.tiny:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6, "wall-interp"
        fn()
        torch.cuda.synchronize()
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3, "graph"
        except Exception:  # a wrapper that syncs cannot be captured
            return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3, "eager"

    def add(self, kernel, shape, got, want, fn, nbytes, note=""):
        if time.time() - self.t0 > self.args.budget:
            print(f"skip {kernel} {shape}: over the {self.args.budget}s budget", flush=True)
            return
        err = (got.double().cpu() - want.double().cpu()).nan_to_num(float("inf"))
        rel = float(err.norm() / want.double().norm().clamp_min(1e-30))
        us, how = self.time_us(fn)
        row = dict(kernel=kernel, shape=shape, max_err=float(err.abs().max()), rel_err=rel, time_us=us,
                   gbps=nbytes / us / 1e3, timing=how, note=note)
        self.rows.append(row)
        print(f"{kernel:20s} {shape:34s} max_err {row['max_err']:.2e} rel {rel:.1e} {us:9.1f} us"
              f" {row['gbps']:8.1f} GB/s {how} {note}", flush=True)
        Path(self.args.out).write_text(json.dumps({"env": self.env, "rows": self.rows}, indent=1))


_EMPTY = None


@contextmanager
def poisoned():
    """torch.empty returns NaN / -777 filled tensors: an output the kernel forgot to write shows up."""
    def empty(*a, **k):
        t = _EMPTY(*a, **k)
        return t.fill_(float("nan") if t.is_floating_point() else -777)
    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = _EMPTY


def cpu(t):
    return t.detach().float().cpu()


def bench_norms_router_rope(b):
    d, dev = b.d, b.dev
    w = b.rand(d.hidden)
    for T in d.tokens:
        x, res = b.rand(T, d.hidden), b.rand(T, d.hidden)
        with poisoned():
            normed, new_res = tt.add_rms_norm(x, res, w, 1e-5)
        ref_n, ref_r = ref.add_rms_norm(cpu(x), cpu(res), cpu(w), 1e-5)
        b.add("add_rms_norm", f"T={T} D={d.hidden}", torch.cat([normed, new_res]), torch.cat([ref_n, ref_r]),
              lambda: tt.add_rms_norm(x, res, w, 1e-5), 4 * T * d.hidden * x.element_size())
    for T in d.tokens[1:]:
        x = b.rand(T, d.hidden)
        with poisoned():
            got = tt.rms_norm(x, w, 1e-5)
        b.add("rms_norm", f"T={T} D={d.hidden}", got, ref.rms_norm(cpu(x), cpu(w), 1e-5),
              lambda: tt.rms_norm(x, w, 1e-5), 2 * T * d.hidden * x.element_size())
    for T in d.tokens[1:]:
        for n_group, topk_group in ((1, 1), (8 if d.experts >= 64 else 4, 4 if d.experts >= 64 else 2)):
            logits, bias = b.rand(T, d.experts, dtype=torch.float32, scale=2), b.rand(d.experts, dtype=torch.float32, scale=0.1)
            args = (d.top_k, n_group, topk_group, True, 2.5)
            with poisoned():
                w_, ids = tt.moe_route_logits(logits, bias, *args)
            ref_w, ref_ids = ref.moe_route(cpu(logits), torch.eye(d.experts), cpu(bias), *args)
            o, ro = ids.cpu().argsort(-1), ref_ids.argsort(-1)
            same = float((ids.cpu().gather(1, o) == ref_ids.gather(1, ro)).all(-1).float().mean())
            b.add("moe_router", f"T={T} E={d.experts} k={d.top_k} g={n_group}/{topk_group}", w_.cpu().gather(1, o),
                  ref_w.gather(1, ro), lambda: tt.moe_route_logits(logits, bias, *args),
                  T * d.experts * 4 + T * d.top_k * 12, f"same ids {same:.4f}")
    for T in d.tokens[1:]:
        q = b.rand(T, d.heads, d.dn + d.DR)
        pos = torch.randint(0, 1 << 20, (T,)).to(dev)
        with poisoned():
            got = tt.rope(q[..., d.dn:], pos, 8e6)
        b.add("rope(q_pe)", f"T={T} H={d.heads} dr={d.DR}", got, ref.rope(cpu(q)[..., d.dn:], pos.cpu(), 8e6),
              lambda: tt.rope(q[..., d.dn:], pos, 8e6), 2 * T * d.heads * d.DR * q.element_size())


def bench_qkv(b):
    d, dev = b.d, b.dev
    for T in d.tokens:
        pool = KVPool(1, {0}, -(-2 * T // PAGE_SIZE), d.R, d.DR, d.DI, dtype=b.dt, device=dev)
        pool.kv[0].fill_(float("nan"))
        pool.index_k[0].fill_(float("nan"))
        q_a, kv_a, ik = b.rand(T, d.q_lora), b.rand(T, d.R + d.DR), b.rand(T, d.DI)
        qw, kvw, kw, kb = b.rand(d.q_lora), b.rand(d.R), b.rand(d.DI), b.rand(d.DI)
        pos, loc = torch.randint(0, 1 << 16, (T,)).to(dev), torch.randperm(pool.num_slots)[:T].to(dev)
        args = (q_a, kv_a, pos, loc, pool.kv[0], qw, kvw, 1e-5, 8e6)
        kw_args = dict(index_k=ik, index_cache=pool.index_k[0], k_norm_w=kw, k_norm_b=kb)
        with poisoned():
            c_q = tt.qkv_norm_rope_write(*args, **kw_args)
        p = pos.cpu()
        k = ref.layer_norm(cpu(ik), cpu(kw), cpu(kb), 1e-6)
        want = torch.cat([ref.rms_norm(cpu(q_a), cpu(qw), 1e-5), ref.rms_norm(cpu(kv_a)[:, :d.R], cpu(kvw), 1e-5),
                          ref.rope(cpu(kv_a)[:, d.R:], p, 8e6), ref.rope(k[:, :d.DR], p, 8e6), k[:, d.DR:]], -1)
        got = torch.cat([cpu(c_q), cpu(pool.kv[0][loc]), cpu(pool.index_k[0][loc])], -1)
        nbytes = T * (2 * d.q_lora + 2 * (d.R + d.DR) + 2 * d.DI) * q_a.element_size()
        b.add("qkv_norm_rope_write", f"T={T} q{d.q_lora} kv{d.R}+{d.DR} ik{d.DI}", got, want,
              lambda: tt.qkv_norm_rope_write(*args, **kw_args), nbytes)


def make_batch(b, mode, prefix, extend, width):
    """Requests with the given lengths over scattered slots; -> (batch, num_slots)."""
    total = sum(p + e for p, e in zip(prefix, extend))
    slots, used = torch.randperm(total), 0
    table = torch.full((len(prefix), width), -1, dtype=torch.int64)
    for i, (p, e) in enumerate(zip(prefix, extend)):
        table[i, : p + e] = slots[used: used + p + e]
        used += p + e
    return ForwardBatch.build(mode, [[1] * e for e in extend], list(range(len(prefix))), prefix, table), total


def decode_cases(b):
    """(name, batch) for ragged decode batches and one prefill chunk over a long prefix."""
    d = b.d
    for B in d.batches:
        lens = torch.randint(d.topk + 1, d.max_ctx + 1, (B,)).tolist()
        yield f"decode B={B} ctx<={d.max_ctx}", make_batch(b, "decode", [n - 1 for n in lens], [1] * B, d.max_ctx)
    n, p = d.prefill
    yield f"prefill T={n} prefix={p}", make_batch(b, "extend", [p], [n], p + n)


def bench_indexer(b):
    d, dev = b.d, b.dev
    for name, (batch, num_slots) in decode_cases(b):
        T, max_len = batch.num_tokens, int(batch.seq_lens.max())
        cache = b.rand(num_slots, d.DI)
        q, w = b.rand(T, d.HI, d.DI), b.rand(T, d.HI, dtype=torch.float32, scale=d.HI ** -0.5)
        rows, pos = tt.token_rows(batch, dev)
        r2t = batch.req_to_token.to(dev)
        with poisoned():
            scores = tt.indexer_scores(q, w, cache, r2t, rows, pos, max_len)
            got = tt.topk_select(scores, pos + 1, d.topk)
        want = ref.indexer_topk(cpu(q), cpu(w), SimpleNamespace(index_keys=lambda l, s: cpu(cache)[s]), 0, batch, d.topk)
        overlap = min(len(set(g[g >= 0].tolist()) & set(r[r >= 0].tolist())) / max(1, int((r >= 0).sum()))
                      for g, r in zip(got.cpu(), want))
        t = int(torch.randint(0, T, ()))  # one token's scores against an fp32 recomputation
        keys = cpu(cache)[batch.req_to_token[int(rows[t]), : int(pos[t]) + 1]]
        s_ref = torch.relu(cpu(q)[t] @ keys.T * d.DI ** -0.5).T @ cpu(w)[t]
        lens = int(batch.seq_lens.sum()) if T == batch.batch_size else T * max_len
        b.add("indexer_scores", name, scores[t, : int(pos[t]) + 1], s_ref,
              lambda: tt.indexer_scores(q, w, cache, r2t, rows, pos, max_len),
              lens * (d.DI * cache.element_size() + 4), f"topk overlap min {overlap:.4f}")
        b.add("topk_select", name + f" k={d.topk}", torch.tensor([overlap]), torch.ones(1), lambda: tt.topk_select(
            scores, pos + 1, d.topk), T * max_len * 4 + T * d.topk * 8, "max_err = 1 - min overlap with ref")


# (block_h, block_n, num_warps, num_stages, key_major) variants that compile without spills on sm_90
MLA_TILES = [dict(block_h=h, block_n=n, num_warps=w, num_stages=st, key_major=km) for h, n, w, st, km in (
    (16, 32, 4, 2, False), (16, 32, 4, 3, False), (32, 32, 8, 2, False), (32, 32, 8, 2, True),
    (16, 32, 8, 2, True), (64, 32, 8, 1, True), (64, 16, 8, 2, True))]


def absorbed(q_nope, q_pe, pool, layer, w_kv_b, topk, batch, scale, dn, dv, **tiles):
    """tt.mla_attention_absorbed with torch_ref's (pool, batch) arguments."""
    rows, pos = tt.token_rows(batch, q_nope.device)
    return tt.mla_attention_absorbed(q_nope, q_pe, pool.kv[layer], w_kv_b, topk, batch.req_to_token.to(q_nope.device),
                                     rows, pos, scale, dn, dv, **tiles)


def bench_mla(b):
    d, dev = b.d, b.dev
    scale = (d.dn + d.DR) ** -0.5
    for name, (batch, num_slots) in decode_cases(b):
        T = batch.num_tokens
        pool = KVPool(1, set(), -(-num_slots // PAGE_SIZE), d.R, d.DR, d.DI, dtype=b.dt, device=dev)
        pool.kv[0].normal_()
        topk = torch.stack([torch.randperm(int(p) + 1)[: d.topk] for p in batch.positions])
        topk = torch.cat([topk, torch.full((T, d.topk - topk.shape[1]), -1)], 1) if topk.shape[1] < d.topk else topk
        q_nope, q_pe = b.rand(T, d.heads, d.dn), b.rand(T, d.heads, d.DR)
        w_kv_b = b.rand(d.heads * (d.dn + d.dv), d.R, scale=0.05)
        args = (q_nope, q_pe, pool, 0, w_kv_b, topk.to(dev), batch, scale, d.dn, d.dv)
        cpool = SimpleNamespace(c_kv=lambda l, s: cpu(pool.kv[0][s.to(dev)][:, : d.R]),
                                k_pe=lambda l, s: cpu(pool.kv[0][s.to(dev)][:, d.R:]))
        want = ref.mla_attention_absorbed(cpu(q_nope), cpu(q_pe), cpool, 0, cpu(w_kv_b), topk, batch, scale, d.dn, d.dv)
        q_lat = b.rand(T, d.heads, d.R)
        rows, pos = tt.token_rows(batch, dev)
        r2t, tk = batch.req_to_token.to(dev), topk.to(dev)
        slots = tt.topk_slots(tk, r2t, rows, pos)  # once per full layer; shared layers reuse it
        nbytes = T * (d.topk * (d.R + d.DR) + d.heads * (2 * d.R + d.DR)) * q_lat.element_size()
        for tile in (MLA_TILES if d.splits_sweep and not name.startswith("prefill") else [{}]):
            with poisoned():
                got = absorbed(*args, **tile)
            b.add("sparse_mla_decode", f"{name} H={d.heads} K={d.topk}", got, want, lambda: tt.sparse_mla_latent(
                q_lat, q_pe, pool.kv[0], r2t, rows, pos, tk, scale, slots=slots, **tile), nbytes,
                f"tiles {tile or 'default'}")
    # dense causal (context <= index_topk: no indexer) over one prefill chunk
    n = d.prefill[0] // 2
    batch, num_slots = make_batch(b, "extend", [d.topk - n], [n], d.topk)
    pool = KVPool(1, set(), -(-num_slots // PAGE_SIZE), d.R, d.DR, d.DI, dtype=b.dt, device=dev)
    pool.kv[0].normal_()
    q_nope, q_pe = b.rand(n, d.heads, d.dn), b.rand(n, d.heads, d.DR)
    w_kv_b = b.rand(d.heads * (d.dn + d.dv), d.R, scale=0.05)
    args = (q_nope, q_pe, pool, 0, w_kv_b, None, batch, scale, d.dn, d.dv)
    with poisoned():
        got = absorbed(*args)
    cpool = SimpleNamespace(c_kv=lambda l, s: cpu(pool.kv[0][s.to(dev)][:, : d.R]),
                            k_pe=lambda l, s: cpu(pool.kv[0][s.to(dev)][:, d.R:]))
    want = ref.mla_attention_absorbed(cpu(q_nope), cpu(q_pe), cpool, 0, cpu(w_kv_b), None, batch, scale, d.dn, d.dv)
    rows, pos = tt.token_rows(batch, dev)
    r2t, q_lat = batch.req_to_token.to(dev), b.rand(n, d.heads, d.R)
    keys = int((batch.positions + 1).sum())
    b.add("sparse_mla(dense)", f"prefill T={n} ctx={d.topk} H={d.heads}", got, want, lambda: tt.sparse_mla_latent(
        q_lat, q_pe, pool.kv[0], r2t, rows, pos, None, scale, num_keys=d.topk),
        (keys * (d.R + d.DR) + n * d.heads * (2 * d.R + d.DR)) * q_lat.element_size(), "absorbed form, causal")


def bench_sample(b):
    d, dev = b.d, b.dev
    configs = {"plain T=1": (1.0, -1, 1.0, 0.0), "top_p .95": (0.8, -1, 0.95, 0.0),
               "k50 p.9 minp.02": (0.8, 50 if d.vocab > 100 else 5, 0.9, 0.02)}
    for B in d.batches:
        logits = b.rand(B, d.vocab, dtype=torch.float32, scale=3)
        seed, step = torch.arange(B, device=dev) * 7919, torch.full((B,), 3, device=dev)
        for cname, (t, k, p, m) in configs.items():
            params = [torch.full((B,), v, device=dev) for v in (t, k, p, m)]
            params[1] = params[1].long()
            with poisoned():
                tokens, kept = tt.sample(logits, *params, seed, step, return_kept=True)
            want_tokens, want_kept = ref.sample(cpu(logits), *[x.cpu() for x in params], seed.cpu(), step.cpu(),
                                                return_kept=True)
            same = bool(torch.equal(tokens.cpu(), want_tokens))
            b.add("sample", f"B={B} V={d.vocab} {cname}", kept.float(), want_kept.float(),
                  lambda: tt.sample(logits, *params, seed, step), B * d.vocab * 4, f"same tokens as torch {same}")


def copy_bandwidth(b):
    """Device-to-device copy GB/s (bytes read + written): the roofline the GB/s column is read against."""
    if b.args.tiny:
        return None
    x = torch.empty(1 << 29, dtype=torch.float32, device=b.dev)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() * 4 / ms / 1e6


def main():
    global torch, triton, tt, ref, KVPool, PAGE_SIZE, ForwardBatch, _EMPTY
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds after which remaining rows are skipped")
    ap.add_argument("--only", default="", help="comma list of: norms,qkv,indexer,mla,sample")
    args = ap.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton
    import triton.testing
    from glmc.codegen import torch_ref as ref
    from glmc.codegen import triton_launch as tt
    from glmc.runtime.worker.forward_batch import ForwardBatch
    from glmc.runtime.worker.kv_cache import PAGE_SIZE, KVPool
    _EMPTY = torch.empty
    torch.manual_seed(0)
    b = Bench(args)
    b.env["copy_gbps"] = copy_bandwidth(b)
    print(b.env, flush=True)
    steps = {"norms": bench_norms_router_rope, "qkv": bench_qkv, "indexer": bench_indexer, "mla": bench_mla,
             "sample": bench_sample}
    for key, step in steps.items():
        if not args.only or key in args.only.split(","):
            try:
                step(b)
            except Exception:  # one broken kernel must not cost the other rows of a device run
                traceback.print_exc()
                b.env.setdefault("failed", []).append(key)
    print(f"\n{'kernel':20s} {'shape':34s} {'max_err':>9s} {'rel_err':>8s} {'time_us':>9s} {'GB/s':>8s}  note")
    for r in b.rows:
        print(f"{r['kernel']:20s} {r['shape']:34s} {r['max_err']:9.2e} {r['rel_err']:8.1e} {r['time_us']:9.1f}"
              f" {r['gbps']:8.1f}  {r['note']}")


if __name__ == "__main__":
    main()
