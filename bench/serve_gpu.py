"""Serving on one GPU, end to end: a GLM-5.3-width slice checkpoint, `glmc run --device cuda`, and
bench/serve_bench.py against it. One command on the device (bench/serve_gpu.sh wraps it):

    python3 bench/serve_gpu.py --out-dir $OUT --budget 420      # CUDA (the H200)
    python bench/serve_gpu.py --cpu --out-dir /tmp/sg            # CPU dry run: narrow widths, fp32,
                                                                 # the same runner uncaptured, interpreted

1. Checkpoint: config.json of the 2-layer slice (bench/gpu_plan_check.py's GLM53 + SLICE: hidden 6144,
   64 heads, q_lora 2048, kv_lora 512, nope/rope/v 192/64/256, 256 experts top-8 + shared, moe_inter
   2048, layer 0 dense, layer 1 MoE, both full DSA indexers 32 x 128, index_topk 2048, vocab 154880),
   random bf16 weights drawn on the GPU and streamed to one safetensors file, and models/tiny's
   tokenizer (vocab 512). The router correction bias is zero (HF's init; a random one crowds every
   token onto a few experts), and lm_head rows >= the tokenizer's vocab are zero, so greedy picks
   tokens the tokenizer can print (every streamed chunk carries text) while the lm_head GEMV still
   reads all 154880 rows.
2. `glmc run --weights <slice> --device cuda --port 0` in its own session (log: server.log).
3. serve_bench runs (each its own JSON; a run that outlasts the budget is stopped and reported):
   a warm-up workload (Triton compiles prefill kernels per shape on first use), the main one, and a
   single-stream one. The server's /metrics is saved after them; then SIGTERM.
4. bench/gpu_prefill_check.py --out prefill_check.json, if that file exists and time is left.
summary.json says what ran, how long each stage took, and why anything stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_plan_check as pc  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# (name, serve_bench arguments): the warm-up also compiles the prefill kernels' shapes
RUNS = (("warm", "--num-requests 32 --concurrency 16 --min-tokens 32 --max-tokens 64 --seed 1"),
        ("c32", "--num-requests 128 --concurrency 32 --min-tokens 32 --max-tokens 128 --seed 0"),
        ("c1", "--num-requests 12 --concurrency 1 --min-tokens 64 --max-tokens 64 --seed 2"))


def now():
    return time.perf_counter()


# ----------------------------------------------------------------------------- checkpoint
def slice_config(narrow: bool, dtype_name: str) -> dict:
    # narrow: vocab 512, the tokenizer's (the engine refuses a tokenizer larger than the model)
    cfg = {**pc.GLM53, **pc.SLICE, **(dict(pc.NARROW, vocab_size=512) if narrow else {})}
    for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
        cfg.pop(k)
    cfg.update(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", dtype=dtype_name,
               num_nextn_predict_layers=0, hidden_act="silu", attention_bias=False,
               head_dim=cfg["qk_rope_head_dim"])
    return cfg


def _init(name, shape, dtype, device, gen, printable):
    """bench/gpu_plan_check.randomize_on_device_'s scales; zero router bias; lm_head rows past the
    tokenizer's vocab zero."""
    import torch
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    if len(shape) == 1:
        return t.normal_(1.0, 0.2, generator=gen)
    t.normal_(0.0, 1.0 if name.endswith("embed_tokens.weight") else shape[-1] ** -0.5, generator=gen)
    if name == "lm_head.weight":
        t[printable:].zero_()
    return t


def write_checkpoint(d: Path, narrow: bool, device: str) -> dict:
    """config.json, model.safetensors (streamed: one tensor on the host at a time), tokenizer."""
    import torch
    from glmc.runtime.worker.checkpoint import expected_tensors

    from glmc.spec import config_from_hf
    dtype, dname = (torch.float32, "float32") if narrow else (torch.bfloat16, "bfloat16")
    d.mkdir(parents=True, exist_ok=True)
    if (d / "written.json").exists():  # a warm machine's earlier call wrote it
        return {**json.loads((d / "written.json").read_text()), "reused": True}
    cfg = slice_config(narrow, dname)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in TOKENIZER_FILES:
        (d / f).write_bytes((ROOT / "models" / "tiny" / f).read_bytes())
    printable = len(json.loads((d / "tokenizer.json").read_text())["model"]["vocab"])
    shapes = sorted(expected_tensors(config_from_hf(cfg)).items())
    code, size = ("F32", 4) if narrow else ("BF16", 2)
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes:
        n = size * int(torch.tensor(shape).prod())
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    gen = torch.Generator(device=device).manual_seed(0)
    with open(d / "model.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for name, shape in shapes:
            t = _init(name, shape, dtype, device, gen, printable)
            f.write(t.cpu().contiguous().view(torch.uint8).numpy())
    done = {"tensors": len(shapes), "bytes": off, "tokenizer_vocab": printable}
    (d / "written.json").write_text(json.dumps(done))
    return done


# ----------------------------------------------------------------------------- server
def start_server(ckpt: Path, out: Path, cpu: bool, deadline: float) -> tuple[subprocess.Popen, str]:
    args = ["--weights", str(ckpt), "--port", "0", "--log-level", "warning", "--num-pages", "1024",
            "--max-context", "2048", "--max-running", "32", "--max-batch-tokens", "2048"]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-cpu", *args] if cpu else \
        [sys.executable, "-m", "glmc.cli", "run", "--device", "cuda", *args]
    log = out / "server.log"
    # cwd outside the repo: there `glmc` is the installed package, not the repo's glmc/ folder
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, cwd="/tmp",
                            env={**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"})
    while not (m := re.search(r"serving \S+ at (http://\S+/v1)", log.read_text())):
        if proc.poll() is not None:
            raise RuntimeError(f"glmc run exited ({proc.returncode}) before serving: "
                               f"{log.read_text()[-1500:]}")
        if now() > deadline:
            stop_server(proc)
            raise TimeoutError("glmc run did not start before the budget's start-up share was spent")
        time.sleep(0.5)
    return proc, m.group(1)


def stop_server(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def serve_cpu(argv) -> None:
    """The dry run's server: `glmc run --device cuda`'s engine, with the GpuRunner on the host."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from glmc.runtime.engine.engine import Engine
    from glmc.runtime.engine.startup import warm_up
    from glmc.runtime.engine.tokenizer import Tokenizer
    from glmc.runtime.serving.server import serve
    from glmc.runtime.worker.loader import load_runner

    from glmc.api import plan_for
    ap = argparse.ArgumentParser()
    for k in ("--weights", "--port", "--log-level", "--num-pages", "--max-context", "--max-running",
              "--max-batch-tokens"):
        ap.add_argument(k)
    a = ap.parse_args(argv)
    running = int(a.max_running)
    runner = load_runner(plan_for(a.weights, device="cuda", max_running=running), a.weights,
                         device="cpu", num_pages=int(a.num_pages), max_context=int(a.max_context),
                         max_running=running)
    engine = Engine(runner, Tokenizer.from_dir(a.weights), max_running=running,
                    max_batch_tokens=int(a.max_batch_tokens))
    warm_up(engine)
    serve(engine, Path(a.weights).name, "127.0.0.1", int(a.port), a.log_level)


# ----------------------------------------------------------------------------- main
def run_bench(name, args, url, out, cpu, timeout) -> dict:
    path = out / f"serve_{name}.json"
    cmd = [sys.executable, str(ROOT / "bench" / "serve_bench.py"), "--url", url, "--out", str(path),
           "--note", f"bench/serve_gpu.py run {name}", *args.split()]
    if cpu:
        cmd += ["--device", "cpu dry run (GpuRunner uncaptured, narrow slice)"]
    t = now()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1, timeout))
        res = {"rc": p.returncode, "stdout": p.stdout[-2500:], "stderr": p.stderr[-1500:]}
    except subprocess.TimeoutExpired:
        res = {"rc": None, "error": f"stopped after {timeout:.0f} s (budget)"}
    res["seconds"] = round(now() - t, 1)
    if path.exists():
        res["summary"] = json.loads(path.read_text())["summary"]
    print(f"[{name}] {json.dumps({k: v for k, v in res.items() if k != 'summary'})[:3000]}", flush=True)
    return res


def short_requests(url, n=5, max_tokens=6) -> dict:
    """n concurrent short streamed chats (decode batches 1..n: several graph buckets' padding)."""
    import asyncio

    import httpx

    async def one(client, i):
        body = {"model": "x", "messages": [{"role": "user", "content": f"hi {i} " * (i + 1)}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        text = ""
        body["model"] = (await client.get("/models")).json()["data"][0]["id"]
        async with client.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
        return text

    async def all_():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(*[one(client, i) for i in range(n)])
    t = now()
    texts = asyncio.run(all_())
    return {"texts": texts, "seconds": round(now() - t, 1)}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-cpu":
        return serve_cpu(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out-dir", default="/tmp/serve_gpu")
    ap.add_argument("--ckpt-dir", default="/tmp/glmc_slice")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for everything")
    a = ap.parse_args()
    t0, out = now(), Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if a.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    pc.import_glmc()
    import torch
    dev = "cpu" if a.cpu else "cuda"
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "commit": os.environ.get("GLMC_COMMIT", "unknown"),
            "device": "cpu" if a.cpu else torch.cuda.get_device_name(), "stages": {}, "runs": {}}
    save = lambda: (out / "summary.json").write_text(json.dumps(info, indent=1))  # noqa: E731
    proc = None
    try:
        t = now()
        info["checkpoint"] = write_checkpoint(Path(a.ckpt_dir), a.cpu, dev)
        info["stages"]["checkpoint_s"] = round(now() - t, 1)
        save()
        if dev == "cuda":
            torch.cuda.empty_cache()
        t = now()
        proc, url = start_server(Path(a.ckpt_dir), out, a.cpu, t0 + a.budget * 0.6)
        info["stages"]["server_start_s"] = round(now() - t, 1)
        save()
        if a.cpu:  # interpreted Triton takes minutes per serve_bench prompt: a few short ones instead
            info["runs"]["cpu_short"] = short_requests(url)
        for name, args in (() if a.cpu else RUNS):
            left = t0 + a.budget * 0.85 - now()
            if left < 10:
                info["runs"][name] = {"error": "not run: budget spent"}
                continue
            info["runs"][name] = run_bench(name, args, url, out, a.cpu, left)
            save()
        import httpx
        (out / "metrics.txt").write_text(httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text)
    except Exception as e:  # reported; what was measured is kept
        import traceback
        traceback.print_exc()
        info["error"] = f"{type(e).__name__}: {e}"[:3000]
    finally:
        if proc is not None:
            info["server_rc"] = stop_server(proc)
        save()
    check = ROOT / "bench" / "gpu_prefill_check.py"
    left = t0 + a.budget - now() - 5
    if check.exists() and not a.cpu and left > 30 and not os.environ.get("SKIP_PREFILL_CHECK"):
        t = now()
        try:
            p = subprocess.run([sys.executable, str(check), "--out", str(out / "prefill_check.json"),
                                "--budget", str(max(20, int(left - 45)))],
                               capture_output=True, text=True, timeout=left)
            info["prefill_check"] = {"rc": p.returncode, "tail": (p.stdout + p.stderr)[-3000:]}
        except subprocess.TimeoutExpired as e:
            info["prefill_check"] = {"rc": None, "error": f"stopped after {left:.0f} s (budget)",
                                     "tail": str(e.stdout or "")[-2000:]}
        info["prefill_check"]["seconds"] = round(now() - t, 1)
    else:
        info["prefill_check"] = {"skipped": f"exists={check.exists()} cpu={a.cpu} left_s={left:.0f}"}
    info["stages"]["total_s"] = round(now() - t0, 1)
    save()
    print(json.dumps({k: v for k, v in info.items() if k != "runs"}, indent=1)[:4000])
    for name, r in info["runs"].items():
        print(name, json.dumps(r.get("summary", r.get("error")))[:1500])


if __name__ == "__main__":
    main()
