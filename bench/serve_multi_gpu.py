"""`glmc run --device cuda` over one and two GPUs gives the same greedy text (openai client).

    python -m bench.serve_multi_gpu --out results.json      # on a machine with >= 2 GPUs

A tiny checkpoint with every dim >= 16 (Triton's dot minimum on a GPU) and the tiny tokenizer is
served as tp1 on one GPU, then tp2 and dp2ep2 (both MoE lowerings) on two, started by glmc's own
launcher and (tp2) by torchrun; five chat requests go in concurrently, greedy. Each server is stopped
with SIGINT (Ctrl-C) or SIGTERM, and every process it started must be gone.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import ROOT, common

# tests/test_run_cli.py's `glmc run` in a session of its own: start, wait for the URL, stop, check the exit
GlmcRun = common.tests_module("test_run_cli").GlmcRun

QUESTIONS = ["What is 2+2?", "Name a colour.", "Tell me a joke about compilers.", "Hello!",
             "Why is the sky blue? Answer at length, please."]


class TorchrunGlmc(GlmcRun):
    """The same server, one process per rank started by torchrun (env:// rendezvous)."""

    def __init__(self, args, log, nproc):
        super().__init__(args, log)
        self.nproc = nproc

    def __enter__(self):
        import subprocess
        real = subprocess.Popen

        def popen(cmd, **kw):   # glmc run -> torchrun ... -m glmc.cli run
            i = cmd.index("glmc.cli")
            return real([cmd[0], "-m", "torch.distributed.run", f"--nproc-per-node={self.nproc}",
                         "--master-port=29533", "-m", *cmd[i:]], **kw)
        subprocess.Popen = popen
        try:
            return super().__enter__()
        finally:
            subprocess.Popen = real


def make_ckpt(root: Path) -> Path:
    path = root / "tiny16"
    common.tests_module("tiny_hf").save_tiny(path, "wide", seed=5, vocab_size=512, index_n_heads=16, qk_rope_head_dim=16,
              index_head_dim=32)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ROOT / "models" / "tiny" / f, path / f)
    return path


def ask_all(client, model) -> list[str]:
    def one(q):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                           max_tokens=16, temperature=0.0)
        return r.choices[0].message.content
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(one, QUESTIONS))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only", help="comma list of specs to run after tp1 (default: all)")
    args = ap.parse_args()
    os.environ["PYTHONSAFEPATH"] = "1"   # `-m glmc.cli` from the repo root: the installed glmc
    root = Path(tempfile.mkdtemp(prefix="glmc_serve_mgpu_"))
    ckpt = make_ckpt(root)
    runs = [("tp1", [], None, signal.SIGTERM), ("tp2", [], None, signal.SIGINT),
            ("dp2ep2", ["--moe-gather"], None, signal.SIGINT),
            ("dp2ep2", ["--moe-a2a"], None, signal.SIGTERM), ("tp2", [], 2, signal.SIGTERM)]
    if args.only:
        runs = runs[:1] + [r for r in runs[1:] if r[0] in args.only.split(",")]
    rows, want = [], None
    for parallel, extra, torchrun, sig in runs:
        base = ["--device", "cuda", "--parallel", parallel, "--weights", str(ckpt), "--port", "0",
                "--num-pages", "32", "--max-running", "8"]
        if extra:   # a MoE lowering is a compile option: compile the plan first
            import subprocess
            plan = root / f"plan-{parallel}{extra[0]}"
            subprocess.run([sys.executable, "-m", "glmc.cli", "compile", "--model", str(ckpt),
                            "--parallel", parallel, "--device", "cuda", "-o", str(plan), *extra],
                           check=True)
            base = [str(plan), *base]
        log = root / f"{parallel}{''.join(extra)}{'-torchrun' if torchrun else ''}.log"
        row = {"parallel": parallel, "options": extra, "launcher": "torchrun" if torchrun else "glmc",
               "stop_signal": signal.Signals(sig).name}
        t0 = time.perf_counter()
        try:
            srv = TorchrunGlmc(base, log, torchrun) if torchrun else GlmcRun(base, log)
            srv.stop_signal = sig
            with srv:
                row["start_s"] = round(time.perf_counter() - t0, 1)
                texts = ask_all(srv.client, srv.model)
                row.update(texts=texts, same_as_tp1=want is None or texts == want)
                want = want or texts
            row["clean_exit"] = True      # exit 0, "stopped serving", no process left behind
        except BaseException as e:  # noqa: BLE001  (reported; the next run still goes)
            row.update(error=f"{type(e).__name__}: {e}"[-2000:], clean_exit=False,
                       log_tail=log.read_text()[-2500:] if log.exists() else "")
            row.setdefault("same_as_tp1", False)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                  "rows": rows}, indent=1))
    print("SERVE MULTI-GPU:", " ".join(f"{r['parallel']}{''.join(r['options'])}/{r['launcher']}="
                                       f"{'PASS' if r['same_as_tp1'] else 'FAIL'}" for r in rows))


if __name__ == "__main__":
    main()
