"""The `glmc` command: compile, explain, diff, export-onnx, run."""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from glmc.run_config import DEVICES, RunConfig

# a plan's phases: glmc.passes.PHASES (a test keeps them equal), without importing the compiler here
PHASES = ("prefill", "decode", "mtp_draft", "mtp_verify")
DEFAULT_MODEL = "glm_moe_dsa_tiny"  # small, random weights: what `glmc run` serves by default
CARD_MODEL = "glm_moe_dsa"          # GLM-5.3: what `glmc compile` and `glmc diff` compile by default

QUANTIZE_HELP = ("fp8: store the linear weights block-FP8 (e4m3, a fp32 scale per 128x128 block, as GLM-5 "
                 "FP8 checkpoints ship them), quantising an unquantised checkpoint on load")
KV_DTYPE_HELP = ("KV and indexer caches: fp8 (FlashMLA's 656-byte latent rows, 132-byte indexer keys, "
                 "quantised by the KV-write kernel on the CUDA target) or bf16 (unquantised, in the compute "
                 "dtype); default: what the checkpoint's config gives (fp8 for bf16 and FP8 checkpoints, as "
                 "GLM-5.3's card; fp32 checkpoints keep fp32). The torch target computes in fp32 either way")


class _HelpWithDefaults(argparse.HelpFormatter):
    """Help that ends each option's text with its default, unless it takes no value (a flag), has
    no default (None) or the text already says what it is."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if action.nargs == 0 or action.default is None or action.default == argparse.SUPPRESS \
                or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def _model_path(arg: str | None) -> str:
    """A model file, a checkpoint dir, or the name of a packaged model (default: the tiny one)."""
    from glmc.spec import model_path
    return model_path(arg or DEFAULT_MODEL)


def cmd_compile(a) -> int:
    from glmc.launches import launch_texts
    from glmc.compiler import compile_plan
    from glmc.config import Options
    from glmc.explain import explain_plan
    from glmc.parallel import parse_parallel
    from glmc.passes import PASS_NAMES
    from glmc.report import render
    from glmc.spec import kv_dtyped, load_spec, quantized
    spec = kv_dtyped(quantized(load_spec(_model_path(a.model or CARD_MODEL)), a.quantize), a.kv_dtype)
    par = parse_parallel(a.parallel, spec.config)
    dump = None
    if a.dump_after:
        dump = [x.strip() for x in a.dump_after.split(",")]
        bad = [x for x in dump if x != "all" and x not in PASS_NAMES]
        if bad:
            raise ValueError(f"--dump-after: unknown pass {bad}; passes: {', '.join(PASS_NAMES)}")
    opts = Options(moe_a2a=a.moe_a2a, moe_routing=a.moe_routing, topk_broadcast=a.topk_broadcast,
                   device=a.device, p2p_collectives=not a.no_p2p)
    plan = compile_plan(spec, par, opts, dump)
    out = Path(a.output or f"build/{spec.name}-{par.name}")
    launches = launch_texts(plan) if plan.target == "cuda" else {}
    plan.save(out, {"report.md": render(explain_plan(plan, launches=launches)), **launches})
    kernels = f", kernels/ ({len(plan.kernels)} Triton kernels), launch/" if plan.kernels else ""
    print(f"wrote {out}/ ({', '.join(f'{ph}.ir' for ph in plan.graphs)}, plan.json{kernels}, report.md)")
    return 0


def cmd_explain(a) -> int:
    from glmc.calibration import load
    from glmc.explain import explain
    from glmc.report import render
    d = explain(a.plan, batch=a.batch, context=a.context,
                calibration=load(a.calibration) if a.calibration else None)
    print(json.dumps(d, indent=1, sort_keys=True) if a.json else render(d), end="" if not a.json else "\n")
    return 0


def cmd_diff(a) -> int:
    from glmc.diff import diff_main
    return diff_main(a.a, a.b, a.model or CARD_MODEL, a.phase)


def cmd_export_onnx(a) -> int:
    from glmc.onnx_export import export
    for path in export(a.plan, a.output):
        print(f"wrote {path}")
    return 0


def cmd_plan(a) -> int:
    """Search parallel specs, MoE lowerings, MTP drafts and KV dtypes for a workload on N GPUs."""
    from glmc.calibration import load
    from glmc.plan_report import explain_recipes, render_explain, render_svg, render_table
    from glmc.plan_search import (DEFAULT_CALIBRATION, DEFAULT_GPU_MEMORY_GB, compile_choice, parse_numbers,
                                  parse_slo, parse_workload, search)
    from glmc.spec import load_spec
    workload, slo = parse_workload(a.workload), parse_slo(a.slo)
    concurrency = parse_numbers(a.concurrency, "--concurrency")
    cal = load(a.calibration or DEFAULT_CALIBRATION)
    if a.gpu_memory_gb is not None:
        memory = (int(a.gpu_memory_gb * 1e9), "--gpu-memory-gb")
    elif cal.get("gpu_memory_bytes"):
        memory = (int(cal["gpu_memory_bytes"]), f"from {cal['path']}")
    else:
        memory = (DEFAULT_GPU_MEMORY_GB * 10**9, "the default of --gpu-memory-gb: an H200; the calibration has none")
    result = search(load_spec(_model_path(a.model or CARD_MODEL)), cal, a.gpus, workload, concurrency, slo,
                    memory, a.accept, tuple(a.kv_dtype.split(",")),
                    only=a.specs.split(",") if a.specs else None, prefill_chunk=a.prefill_chunk)
    if a.explain:
        result["explain"] = explain_recipes(result)
    out = Path(a.output or "build/plan")
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_search.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "pareto.svg").write_text(render_svg(result))
    print(render_table(result) + (render_explain(result["explain"]) if a.explain else ""), end="")
    print(f"wrote {out}/plan_search.json (every priced row, the dropped ones with their reason), {out}/pareto.svg")
    if result["best"] and not a.no_compile:
        plan_dir, serve = compile_choice(load_spec(_model_path(a.model or CARD_MODEL)), result["best"], out / "plan",
                                         result["prefill_chunk"])
        print(f"wrote {plan_dir}/ (the best plan, compiled); serve it with: {serve}")
    return 0


def cmd_run(a) -> int:
    """Serve a model over the OpenAI API: the tiny default, a checkpoint, or a compiled plan."""
    from glmc.api import plan_for
    from glmc.runtime.serving.launch import ServeConfig, serve_model
    from glmc.runtime.serving.server import ServerOptions
    from glmc.runtime.worker.launch import RankFailed
    from glmc.tiny import (RANDOM_NAME, SMALL_DIR, SMALL_NAME, TINY_NAME, default_cache_dir, make_random_glm,
                           make_tiny_checkpoint)
    run = run_config_of(a)   # before anything slow: the settings, then a GPU torch can see
    if a.device == "cuda":
        from glmc.runtime.engine.startup import require_cuda
        require_cuda()
    weights = a.weights or SMALL_NAME
    if weights == SMALL_NAME:     # the trained small model, shipped with glmc
        ckpt = SMALL_DIR
    elif weights == TINY_NAME:    # random weights, made on first use (tests)
        ckpt = make_tiny_checkpoint(Path(a.cache_dir or default_cache_dir()) / "tiny")
    elif weights == RANDOM_NAME:  # GLM-5.3 at full size, random weights made by each rank
        ckpt = make_random_glm(Path(a.cache_dir or default_cache_dir()) / RANDOM_NAME)
    else:
        ckpt = Path(weights)
        if not (ckpt / "config.json").exists():
            raise ValueError(f"--weights {ckpt}: not a checkpoint directory (no config.json)")
    plan = plan_for(ckpt, a.plan, a.parallel, run)
    if run.speculative_num_steps and not plan.has_mtp:
        raise ValueError(f"--speculative-num-steps needs a checkpoint with an MTP layer "
                         f"(num_nextn_predict_layers > 0 and its weights): {ckpt} has none")
    name = a.served_model_name or (weights if weights in (SMALL_NAME, TINY_NAME, RANDOM_NAME) else ckpt.name)
    server = ServerOptions(max_body_bytes=int(a.max_body_mb * 2**20),
                           shutdown_timeout_s=a.shutdown_timeout, profile_dir=a.profile_dir)
    try:
        serve_model(ServeConfig(plan, str(ckpt), run, name, a.host, a.port, a.log_level, server=server))
    except RankFailed as e:
        print(f"glmc run: error: {e}", file=sys.stderr)
        return 1
    return 0


def run_config_of(a):
    """`glmc run`'s flags as the one `RunConfig` (validated: a bad value names its field)."""
    return RunConfig(device=a.device, num_pages=a.num_pages, max_context=a.max_context,
                     max_running=a.max_running, max_batch_tokens=a.max_batch_tokens,
                     mixed_prefill_tokens=a.mixed_prefill_tokens, max_waiting=a.max_waiting,
                     enable_prefix_cache=not a.no_prefix_cache,
                     overlap=False if a.no_overlap or a.speculative_num_steps else None,
                     speculative_num_steps=a.speculative_num_steps, prefill_graphs=not a.no_prefill_graphs,
                     warmup=not a.no_warmup, quantize=a.quantize, kv_dtype=a.kv_dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="glmc", description="GLM-5.x graph compiler and runtime")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=_HelpWithDefaults)
    c = sub.add_parser("compile", help="compile a model for a parallel spec into a plan directory")
    c.add_argument("--model", help="model YAML, HF checkpoint dir, or packaged name "
                   f"({CARD_MODEL}, {DEFAULT_MODEL}; default {CARD_MODEL}, GLM-5.3)")
    c.add_argument("--parallel", default="tp1", help="tp{N} | tp{N}ep{M} | dp{N}ep{M} | dp{a}tp{b}ep{c}")
    c.add_argument("-o", "--output", help="plan directory (default build/<model>-<parallel>)")
    c.add_argument("--dump-after", help="comma-separated pass names, or 'all'")
    c.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    c.add_argument("--topk-broadcast", action="store_true", help="broadcast top-k from attn_tp rank 0")
    c.add_argument("--no-p2p", action="store_true", help="every all-reduce / reduce-scatter through NCCL "
                   "(default: small ones run glmc's one-shot peer-memory kernel)")
    c.add_argument("--quantize", choices=("fp8",), help=QUANTIZE_HELP)
    c.add_argument("--kv-dtype", choices=("fp8", "bf16"), help=KV_DTYPE_HELP)
    g = c.add_mutually_exclusive_group()
    g.add_argument("--moe-a2a", dest="moe_a2a", action="store_true", default=None,
                   help="force the all-to-all (dispatch/combine) MoE lowering")
    g.add_argument("--moe-gather", dest="moe_a2a", action="store_false",
                   help="force the all-gather / reduce-scatter MoE lowering")
    c.add_argument("--moe-routing", choices=("gather", "recompute"),
                   help="the gather lowering's routing: all-gather the router's weights and ids, or recompute "
                        "the router on the gathered tokens (default: by cost, recompute for decode steps)")
    c.set_defaults(fn=cmd_compile)
    e = sub.add_parser("explain", help="parameters, memory, FLOPs and communication of a plan")
    e.add_argument("plan")
    e.add_argument("--json", action="store_true")
    e.add_argument("--batch", type=int, default=32, help="decode batch (all DP ranks)")
    e.add_argument("--context", type=int, default=4096, help="context length (prefill prompt)")
    e.add_argument("--calibration", help="calibration JSON (bench/calibrate.py): adds the predicted "
                   "decode step time and a TPOT table over batches per rank")
    e.set_defaults(fn=cmd_explain)
    d = sub.add_parser("diff", help="IR diff of two plans, or of two parallel specs of one model")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--model", help=f"with two parallel specs: the model (default {CARD_MODEL}, GLM-5.3)")
    d.add_argument("--phase", default="decode", choices=PHASES, help="the phase whose IR is compared")
    d.set_defaults(fn=cmd_diff)
    x = sub.add_parser("export-onnx", help="write the plan's IR as ONNX graphs")
    x.add_argument("plan")
    x.add_argument("-o", "--output", help="directory (default: the plan directory)")
    x.set_defaults(fn=cmd_export_onnx)
    pl = sub.add_parser("plan", help="the best parallel spec, MoE lowering, MTP drafts and KV dtype for a "
                        "workload on N GPUs, from the calibrated cost model (Pareto table, JSON, SVG)")
    pl.add_argument("--model", help=f"model YAML, HF checkpoint dir, or packaged name (default {CARD_MODEL}, GLM-5.3)")
    pl.add_argument("--gpus", type=int, required=True, help="GPUs of one host")
    pl.add_argument("--calibration", help="calibration JSON (bench/calibrate.py; default: the checkout's "
                    "bench/results/calibration_nvidia-h200-x2_2026-11-30.json)")
    pl.add_argument("--workload", required=True, help="in=<prompt tokens>,out=<output tokens>, e.g. in=8192,out=1024")
    pl.add_argument("--concurrency", default="1,4,16,64,256", help="requests in flight over all GPUs, comma-separated")
    pl.add_argument("--slo", help="tpot_ms=<ms>,ttft_ms=<ms>: the best plan is the most tok/s per GPU within it")
    pl.add_argument("--accept", type=float, help="MTP: per-draft acceptance rate in [0, 1] (default: glmc-small's "
                    "measured accept lengths, said as an assumption)")
    pl.add_argument("--kv-dtype", default="fp8,bf16", help="KV dtypes to price, comma-separated")
    pl.add_argument("--specs", help="only these parallel specs, comma-separated (default: every valid one)")
    pl.add_argument("--gpu-memory-gb", type=float, help="memory per GPU in GB (default: the calibration's, "
                    "else 141, an H200)")
    pl.add_argument("-o", "--output", help="directory for plan_search.json, pareto.svg and plan/, the best "
                    "plan compiled (default build/plan)")
    pl.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill step, as glmc run "
                    "--max-batch-tokens (default: the plan's chunk, 8192)")
    pl.add_argument("--no-compile", action="store_true", help="only search: do not compile the best plan")
    pl.add_argument("--explain", action="store_true", help="compare the pick with SGLang's latency and "
                    "throughput recipes, term by term (also under \"explain\" in plan_search.json)")
    pl.set_defaults(fn=cmd_plan)
    r = sub.add_parser("run", help="serve a model over an OpenAI-compatible HTTP API "
                       "(default: glmc-small, the trained small model, compiled for tp1)")
    r.add_argument("plan", nargs="?", help="plan directory from `glmc compile` (default: compile "
                   "the model of --weights for --parallel)")
    r.add_argument("--weights", help="HF checkpoint dir (config.json, safetensors, tokenizer.json, "
                   "tokenizer_config.json) or a packaged model: glmc-small (the default: trained, "
                   "7.5M parameters, it writes Python), glmc-tiny (random weights, for tests) or "
                   "glm-5.3-random (GLM-5.3 at full size, 753B parameters with the MTP layer, random "
                   "block-FP8 weights each rank makes on its device at start-up: no checkpoint, "
                   "glmc-small's tokenizer; weights of 110 GiB per GPU under dp8ep8, 95 under tp8ep8: "
                   "for benchmarks)")
    r.add_argument("--parallel", help="parallel spec, one process per rank (default tp1, or the "
                   "plan's)")
    r.add_argument("--device", choices=DEVICES, default=RunConfig.device, help="cpu: the torch "
                   "target; cuda: the CUDA target (Triton kernels, decode replayed from CUDA "
                   "graphs), one GPU per rank")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on")
    r.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    r.add_argument("--num-pages", type=int, default=RunConfig.num_pages, help="KV pages of 64 tokens per DP rank")
    r.add_argument("--max-running", type=int, default=RunConfig.max_running, help="running requests per DP rank")
    r.add_argument("--max-batch-tokens", type=int, default=RunConfig.max_batch_tokens, help="tokens per step and DP rank "
                   "(the chunked-prefill size)")
    r.add_argument("--mixed-prefill-tokens", type=int, help="prefill tokens a step may carry while "
                   "requests decode (default: a quarter of --max-batch-tokens), so running streams "
                   "never wait behind a full-size chunk")
    r.add_argument("--max-waiting", type=int, default=RunConfig.max_waiting, help="queued requests before 503s")
    r.add_argument("--max-context", type=int, help="longest sequence (default: the model's, "
                   "capped by the KV pool)")
    r.add_argument("--served-model-name", help="the API's model id (default: glmc-small, "
                   "glmc-tiny or the checkpoint directory's name)")
    r.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body in MiB; "
                   "larger ones get 413")
    r.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight "
                   "requests get to finish after SIGINT/SIGTERM before they are aborted (a second "
                   "signal exits at once)")
    r.add_argument("--no-prefix-cache", action="store_true", help="compute every prompt in full "
                   "(default: reuse the KV pages of prompt prefixes seen before)")
    r.add_argument("--quantize", choices=("fp8",), help=QUANTIZE_HELP)
    r.add_argument("--kv-dtype", choices=("fp8", "bf16"), help=KV_DTYPE_HELP)
    r.add_argument("--no-warmup", action="store_true", help="skip the warm-up (on a GPU it compiles "
                   "every kernel variant serving hits; without it first requests wait for compiles)")
    r.add_argument("--no-prefill-graphs", action="store_true", help="run prefill and mixed steps "
                   "eagerly (default on one GPU: replayed from CUDA graphs captured at start-up per "
                   "token count up to --max-batch-tokens, which costs start-up time and memory)")
    r.add_argument("--no-overlap", action="store_true", help="read each step's tokens before "
                   "scheduling the next (default: the host prepares step N+1 while the device "
                   "runs step N, where the runner supports it)")
    r.add_argument("--speculative-num-steps", type=int, default=RunConfig.speculative_num_steps, metavar="N", help="MTP "
                   "speculative decoding: draft N tokens per step with the model's MTP layer and "
                   "verify them in one forward (0: off); greedy output equals plain decoding's, "
                   "sampled output follows the same distribution (standard speculative sampling); "
                   "runs without overlap; on --device cuda verify and draft replay CUDA graphs)")
    r.add_argument("--profile-dir", help="enable POST /start_profile {\"num_steps\": N}: "
                   "torch.profiler traces of the next N engine steps are written here")
    r.add_argument("--cache-dir", help="where glmc-tiny's weights are made (default "
                   "$GLMC_CACHE or ~/.cache/glmc)")
    r.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="uvicorn's log level")
    r.set_defaults(fn=cmd_run)
    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except (ValueError, OSError) as err:
        print(f"glmc {a.cmd}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (or, while `glmc run` starts up, SIGTERM)
        print(f"glmc {a.cmd}: interrupted", file=sys.stderr)
        _forget_interrupt()
        return 130


def _forget_interrupt() -> None:
    """Keep exit status 130 after a handled KeyboardInterrupt. CPython notes an interrupt that
    escapes an `exec` of source text (dataclasses and typing run one per class they make, so one
    lands there when Ctrl-C comes during an import) and, under `python -m glmc.cli`, kills the
    finished process with SIGINT instead of exiting with the status it was given, even when the
    interrupt was handled further up; every later `exec` of source text clears that note."""
    exec("")


if __name__ == "__main__":
    sys.exit(main())
