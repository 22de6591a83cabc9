"""Sparse prefill attention (codegen/triton_prefill.py) at GLM-5.3 shapes on a GPU, checked against torch_ref.

    python -m bench.gpu_prefill_check --out prefill.json            # CUDA, GLM-5.3 shapes, bf16
    python -m bench.gpu_prefill_check --cpu --out /tmp/prefill.json  # tiny shapes, CPU, Triton interpreter

Shapes: 64 heads, dn 192, dr 64, dv 256, kv_lora 512, index_topk 2048, prompts of 3000 and 700 tokens in
one ragged batch (top-k and dense causal), and a 700-token chunk after a 2300-token prefix (prefix hit /
chunked prefill). Top-k rows are random causal picks (k = min(2048, visible keys), -1 padded), since only
the attention is under test. Inputs are bf16; the reference is torch_ref.mla_attention_mha in fp32 on the
same (bf16-valued) inputs, on the GPU with TF32 off (--ref-device cpu to move it). The kernel's output is
allocated NaN-poisoned. Times are medians of CUDA-event timings: the whole wrapper, and its three steps
(prefill_keys: key plan; expand: kv_b GEMM over the compact keys; kernel). TFLOP/s counts useful work:
allowed (query, key) pairs x heads x 2 (dn + dr + dv). The first case also sweeps kernel tiles and times
the absorbed latent kernel (cuda_target's current route for attn.mla_mha) for comparison. A table is
printed last; the JSON (env + rows) is rewritten after every row. Exit status 1 if a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
GLM = dict(heads=64, dn=192, dr=64, dv=256, R=512, topk=2048, prompts=(3000, 700), chunk=(2300, 700), reps=20)
TINY = dict(heads=4, dn=24, dr=8, dv=32, R=32, topk=16, prompts=(30, 7), chunk=(23, 7), reps=1)
# (block_m, block_n, num_warps, num_stages): FA2-like tiles for head dim 256 that fit sm_90's shared memory
TILES = [(64, 64, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2), (64, 128, 8, 1), (128, 64, 8, 2), (128, 32, 8, 2),
         (32, 64, 4, 2)]
REL_TOL = 2e-2  # bf16 inputs and kv_b expansion vs an fp32 reference: expect ~4e-3


def time_ms(fn, reps, cuda):
    """Median ms of `reps` CUDA-event-timed calls after 3 warm-ups (CPU: one wall-clock call)."""
    fn()
    if not cuda:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@contextmanager
def poisoned():
    """torch.empty returns NaN / -777 filled tensors: an output the kernel forgot to write shows up."""
    real = torch.empty

    def empty(*a, **k):
        t = real(*a, **k)
        return t.fill_(float("nan") if t.is_floating_point() else -777)
    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def make_batch(prefix, extend):
    """One extend batch over scattered KV slots (page 0 left unused); -> (batch, num_slots)."""
    total = sum(p + e for p, e in zip(prefix, extend))
    slots, used = torch.randperm(total) + PAGE_SIZE, 0
    width = max(p + e for p, e in zip(prefix, extend))
    table = torch.full((len(prefix), width), -1, dtype=torch.int64)
    for i, (p, e) in enumerate(zip(prefix, extend)):
        table[i, : p + e] = slots[used: used + p + e]
        used += p + e
    return ForwardBatch.build("extend", [[1] * e for e in extend], list(range(len(prefix))), prefix, table), \
        total + PAGE_SIZE


def random_topk(batch, k, dev):
    """[T, k] random causal positions per token (all of them while pos < k), -1 padded."""
    pos = batch.positions.to(dev)
    width = int(batch.seq_lens.max())
    scores = torch.rand(batch.num_tokens, width, device=dev)
    scores = scores.masked_fill(torch.arange(width, device=dev)[None, :] > pos[:, None], float("-inf"))
    picked = scores.topk(min(k, width), dim=-1).indices
    picked = picked.masked_fill(picked > pos[:, None], -1)
    return torch.cat([picked, picked.new_full((picked.shape[0], k - picked.shape[1]), -1)], 1)


def allowed_pairs(batch, topk):
    if topk is None:
        return int((batch.positions + 1).sum())
    return int(((topk >= 0) & (topk <= batch.positions.to(topk.device)[:, None])).sum())


class Check:
    """Builds one case's inputs, checks and times the kernel, keeps the rows and the JSON."""

    def __init__(self, args):
        self.args, self.rows, self.failed, self.t0 = args, [], False, time.time()
        self.cuda = not args.cpu
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        self.ref_dev = torch.device(args.ref_device or ("cuda" if self.cuda else "cpu"))
        self.d = SimpleNamespace(**(TINY if args.cpu else GLM))
        self.env = {"torch": torch.__version__, "triton": triton.__version__,
                    "device": torch.cuda.get_device_name() if self.cuda else "cpu-interpreter", "shapes": vars(self.d)}

    def add(self, row):
        self.rows.append(row)
        ok = row.get("ok", True)
        self.failed |= ok is False
        verdict = {True: "ok", False: "FAIL", None: "n/a"}[ok]
        print(f"{row['case']:40s} {row['what']:26s} rel {row.get('rel_err', float('nan')):.1e} "
              f"{row['ms']:9.3f} ms {row.get('tflops', 0):7.1f} TF/s {verdict}", flush=True)
        Path(self.args.out).write_text(json.dumps({"env": self.env, "rows": self.rows}, indent=1))

    def inputs(self, prefix, extend, sparse):
        d, dev = self.d, self.dev
        batch, num_slots = make_batch(prefix, extend)
        pool = KVPool(1, set(), -(-num_slots // PAGE_SIZE), d.R, d.dr, 128, dtype=torch.bfloat16, device=dev)
        pool.kv[0].normal_()
        T = batch.num_tokens
        q_nope = torch.randn(T, d.heads, d.dn, device=dev).bfloat16()
        q_pe = torch.randn(T, d.heads, d.dr, device=dev).bfloat16()
        w = (torch.randn(d.heads * (d.dn + d.dv), d.R, device=dev) * d.R ** -0.5).bfloat16()
        topk = random_topk(batch, d.topk, dev) if sparse else None
        return batch, pool, q_nope, q_pe, w, topk

    def reference(self, batch, pool, q_nope, q_pe, w, topk):
        d, rd = self.d, self.ref_dev
        kv32 = pool.kv[0].to(rd, torch.float32)
        rpool = SimpleNamespace(c_kv=lambda l, s: kv32[s.to(rd), : d.R], k_pe=lambda l, s: kv32[s.to(rd), d.R:])
        f = lambda x: x.to(rd, torch.float32)  # noqa: E731
        return ref.mla_attention_mha(f(q_nope), f(q_pe), rpool, 0, f(w), None if topk is None else topk.to(rd),
                                     batch, self.scale, d.dn, d.dv)

    @property
    def scale(self):
        return (self.d.dn + self.d.dr) ** -0.5

    def errors(self, got, want):
        err = (got.double().cpu() - want.double().cpu()).nan_to_num(float("inf"))
        rel = float(err.norm() / want.double().cpu().norm().clamp_min(1e-30))
        return dict(max_err=float(err.abs().max()), rel_err=rel, ok=rel < REL_TOL)

    def case(self, name, prefix, extend, sparse, sweep):
        d, dev = self.d, self.dev
        batch, pool, q_nope, q_pe, w, topk = self.inputs(prefix, extend, sparse)
        args = (q_nope, q_pe, pool, 0, w, topk, batch, self.scale, d.dn, d.dv)
        reqs = tp.Requests(batch.req_pool_indices, batch.extend_lens, batch.seq_lens, batch.positions)
        mha = (q_nope, q_pe, pool.kv[0], w, topk, reqs, batch.req_to_token, self.scale, d.dn, d.dv)
        want = self.reference(batch, pool, q_nope, q_pe, w, topk)
        flops = allowed_pairs(batch, topk) * d.heads * 2 * (d.dn + d.dr + d.dv)
        with poisoned():
            got = tp.mla_attention_mha(*mha)
        base = dict(case=name, T=batch.num_tokens, keys=int(batch.seq_lens.sum()), topk=d.topk if sparse else None)
        ms = time_ms(lambda: tp.mla_attention_mha(*mha), d.reps, self.cuda)
        self.add(dict(base, what="wrapper (default tiles)", ms=ms, tflops=flops / ms / 1e9, **self.errors(got, want)))
        keys = tp.prefill_keys(reqs, batch.req_to_token, topk, 64, 64, dev)
        kv, k_pe = tp.expand_keys(pool.kv[0], w, keys.slots, d.R)
        ms = time_ms(lambda: tp.prefill_keys(reqs, batch.req_to_token, topk, 64, 64, dev), d.reps, self.cuda)
        self.add(dict(base, what="  step: prefill_keys", ms=ms, compact_keys=keys.slots.numel()))
        self.add(dict(base, what="  step: expand (kv_b GEMM)", ms=time_ms(
            lambda: tp.expand_keys(pool.kv[0], w, keys.slots, d.R), d.reps, self.cuda)))
        pos = batch.positions.to(dev)
        for bm, bn, nw, ns in (TILES if sweep else TILES[:1]):
            if time.time() - self.t0 > self.args.budget:
                print(f"skip tiles {bm}x{bn}: over the {self.args.budget}s budget", flush=True)
                break
            try:
                kk = keys if (bm, bn) == (64, 64) else tp.prefill_keys(reqs, batch.req_to_token, topk, bm, bn, dev)
                fn = lambda: tp.sparse_mla_prefill(q_nope, q_pe, kv, k_pe, kk, pos, self.scale, d.dv,  # noqa: E731
                                                   num_warps=nw, num_stages=ns)
                got = fn()
                ms = time_ms(fn, d.reps, self.cuda)
                self.add(dict(base, what=f"  kernel {bm}x{bn} w{nw} s{ns}", ms=ms, tflops=flops / ms / 1e9,
                              tiles=[bm, bn, nw, ns], **self.errors(got, want)))
            except Exception as e:  # a tile that does not compile (shared memory) must not cost the others
                traceback.print_exc()
                self.rows.append(dict(base, what=f"  kernel {bm}x{bn} w{nw} s{ns}", error=repr(e)[:300]))
        if sweep:
            self.absorbed(base, args, want, flops)

    def absorbed(self, base, args, want, flops):
        """cuda_target's current route for attn.mla_mha: the absorbed latent kernel (W_UK/W_UV in torch)."""
        try:
            q_nope, q_pe, pool, layer, w, topk, batch, scale, dn, dv = args
            rows, pos = tt.token_rows(batch, q_nope.device)
            targs = (q_nope, q_pe, pool.kv[layer], w, topk, batch.req_to_token.to(q_nope.device), rows, pos, scale,
                     dn, dv)
            got = tt.mla_attention_absorbed(*targs)
            ms = time_ms(lambda: tt.mla_attention_absorbed(*targs), self.d.reps, self.cuda)
            errs = self.errors(got, want)
            if not self.cuda:  # the interpreter's tl.dot multiplies bf16 raw bits: not a real result
                errs["ok"] = None
            self.add(dict(base, what="absorbed (current route)", ms=ms, tflops=flops / ms / 1e9, **errs))
        except Exception as e:
            traceback.print_exc()
            self.rows.append(dict(base, what="absorbed (current route)", error=repr(e)[:300]))


def main():
    global torch, triton, tp, tt, ref, KVPool, PAGE_SIZE, ForwardBatch
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--ref-device", default=None, help="where torch_ref runs (default: the kernel's device)")
    ap.add_argument("--no-sweep", action="store_true", help="default tiles only")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds after which tile variants are skipped")
    args = ap.parse_args()
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton
    from glmc.codegen import torch_ref as ref
    from glmc.codegen import triton_prefill as tp
    from glmc.codegen import triton_launch as tt
    from glmc.runtime.worker.forward_batch import ForwardBatch
    from glmc.runtime.worker.kv_cache import PAGE_SIZE, KVPool
    if not args.cpu:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    c = Check(args)
    print(c.env, flush=True)
    (p0, p1), (prefix, chunk) = c.d.prompts, c.d.chunk
    cases = [(f"prompts {p0}+{p1}, top-k {c.d.topk}", [0, 0], [p0, p1], True, not args.no_sweep),
             (f"prompts {p0}+{p1}, dense causal", [0, 0], [p0, p1], False, False),
             (f"chunk {chunk} after prefix {prefix}, top-k", [prefix], [chunk], True, False)]
    for case in cases:
        try:
            c.case(*case)
        except Exception:  # one broken case must not cost the others
            traceback.print_exc()
            c.failed = True
            c.env.setdefault("failed", []).append(case[0])
    print(f"\n{'case':40s} {'what':26s} {'max_err':>9s} {'rel_err':>8s} {'ms':>9s} {'TF/s':>7s}")
    for r in c.rows:
        print(f"{r['case']:40s} {r['what']:26s} {r.get('max_err', float('nan')):9.2e} "
              f"{r.get('rel_err', float('nan')):8.1e} {r.get('ms', float('nan')):9.3f} {r.get('tflops', 0):7.1f}"
              f"  {r.get('error', '')}")
    Path(args.out).write_text(json.dumps({"env": c.env, "rows": c.rows}, indent=1))
    sys.exit(1 if c.failed else 0)


if __name__ == "__main__":
    main()
