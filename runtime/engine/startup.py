"""Start an engine over a compiled plan: the runner (`worker.loader`), tokenizer, warm-up.

`build_engine(plan, ckpt_dir)` is the one-process engine: the plan's runner from the checkpoint's
weights on `device`, the checkpoint's tokenizer and chat template, and a warm-up request through
every phase. Plans over several ranks need one process each (`engine.distributed.serve_model`).
`runner="reference"` serves the fp32 `ReferenceModel` instead of the plan (the numerical oracle).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from glmc.runtime.engine.engine import Engine
from glmc.runtime.engine.sampling import SamplingParams
from glmc.runtime.engine.tokenizer import Tokenizer
from glmc.runtime.worker.loader import load_runner, progress
from glmc.runtime.worker.model_runner import ReferenceRunner

from glmc.plan import Plan
from glmc.run_config import DEVICES, RunConfig, with_settings


def require_cuda() -> None:
    """Serving on CUDA needs a GPU that this torch sees; say what torch reports when it does not."""
    if not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch {torch.__version__} sees no CUDA device (built "
                         f"with CUDA {torch.version.cuda}); serve on the host with --device cpu")


def build_engine(plan: Plan, ckpt_dir: str | Path, run: RunConfig | None = None, *, runner: str = "plan",
                 **settings) -> Engine:
    """An engine in this process over `plan` (one rank) and the checkpoint's weights, with the
    settings of `run` (`glmc.run_config.RunConfig`; its fields may also come as keywords): the
    loader's (`load_runner`: on a GPU with `prefill_graphs`, prefill steps are replayed from CUDA
    graphs), the engine's, and `warmup`."""
    ckpt_dir = Path(ckpt_dir)
    run = with_settings(run, **settings)
    if run.device not in DEVICES:   # one process on one device: "cuda", not "cuda:N"
        raise ValueError(f"device must be one of {DEVICES}, got {run.device!r}")
    if plan.world != 1:
        raise ValueError(f"{plan.parallel} runs {plan.world} ranks, one process each: serve it "
                         "with `glmc run --parallel` (glmc.runtime.engine.distributed)")
    if runner == "reference":
        model = ReferenceRunner(plan.config, load_weights(ckpt_dir, plan.config), run.num_pages,
                                run.max_context)
    elif runner == "plan":
        if run.device == "cuda":
            require_cuda()
        model = load_runner(plan, ckpt_dir, run)
    else:
        raise ValueError(f"runner must be 'plan' or 'reference', got {runner!r}")
    engine = Engine(model, Tokenizer.from_dir(ckpt_dir), run)
    if run.warmup:
        warm_up(engine)
    return engine


def load_weights(ckpt_dir: Path, config) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (for the reference model, which is not sharded); a random
    checkpoint directory's made now (`random_weights`)."""
    from glmc.runtime.worker.checkpoint import (
        detect_mtp,
        expected_tensors,
        load_checkpoint,
    )
    from glmc.runtime.worker.random_weights import RandomWeights

    random = RandomWeights.in_dir(ckpt_dir, config)
    if random is not None:
        return {name: random[name] for name in progress(random, desc="making random weights",
                                                        unit="tensor")}
    expected = expected_tensors(config, **detect_mtp(ckpt_dir))
    with progress(total=1, desc="loading weights", unit="checkpoint") as bar:
        weights = load_checkpoint(ckpt_dir, expected)  # one call: no progress to show within it
        bar.update()
    return weights


def warm_up(engine: Engine) -> None:
    """Run a short request per DP rank through every phase (prefill, decode), then forget them.
    With a GPU plan, first compile the kernel variants serving hits (`warm_kernels`)."""
    if engine.runner.kernels is not None and engine.runner.num_dp == 1:
        warm_kernels(engine)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = list(range(min(8, engine.runner.vocab_size)))
    reqs = [engine.make_request(prompt, params) for _ in range(engine.runner.num_dp)]
    for req in reqs:
        engine.submit(req)
    with progress(total=params.max_tokens, desc="warm-up", unit="step") as bar:
        while not all(r.finished for r in reqs):
            engine.step()
            bar.n = min(len(r.output_ids) for r in reqs)
            bar.refresh()
    engine.flush_cache()
    engine.reset_metrics()


def warm_lengths(max_batch_tokens: int, max_prompt: int) -> list[int]:
    """Prompt lengths whose prefills reach the kernel variants serving can: Triton compiles a kernel
    again for each class of its integer arguments (== 1, multiple of 16, other) and the plan has
    tile classes by token count (MoE block_m, split counts), so: 1-3, 16 +- 1, and powers of two
    with their neighbours up to the largest chunk."""
    top = min(max_batch_tokens, max_prompt)
    out = {1, 2, 3, 15, 16, 17}
    n = 32
    while n <= 2 * top:
        out |= {n - 1, n, n + 1}
        n *= 2
    return sorted(v for v in out | {top} if 1 <= v <= top)


def warm_kernels(engine: Engine) -> None:
    """Compile every kernel variant a served request can hit before serving: prefills of every
    `warm_lengths` length alone (each then decodes two tokens), the same prompts again (prefix
    hits: prefills that start past 0) and all of them at once (mixed, chunked batches), with
    greedy and with top-k/top-p sampling and logprobs. Prints how many binaries it compiled."""
    t0 = time.perf_counter()
    before = engine.runner.kernels.num_compiled()
    top = min(engine.max_context - 4, engine.scheduler.ranks[0].max_batch_tokens)
    lengths = warm_lengths(engine.scheduler.ranks[0].max_batch_tokens, engine.max_context - 4)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    drawn = SamplingParams(max_tokens=3, temperature=0.7, top_k=20, top_p=0.9, min_p=0.01,
                           logprobs=True, top_logprobs=2, ignore_eos=True, seed=0)
    vocab = engine.runner.vocab_size

    def prompt(n, salt):
        return [(salt * 7919 + 31 * i) % vocab for i in range(n)]

    # prompts of different lengths must not share a prefix, or the prefix cache would cut their
    # prefills short (each length is its own salt)
    waves = [[(prompt(n, n), greedy)] for n in lengths]           # alone
    waves += [[(prompt(n, n)[:n - 1] + [0], drawn)] for n in lengths if n > 64]   # prefix hits
    waves += [[(prompt(n, n + top + 1), drawn if i % 2 else greedy) for i, n in enumerate(lengths)]]  # mixed
    with progress(total=len(waves), desc="compiling kernels", unit="wave") as bar:
        for wave in waves:
            reqs = [engine.make_request(p[:top], params) for p, params in wave]
            for r in reqs:
                engine.submit(r)
            while not all(r.finished for r in reqs):
                engine.step()
            while engine.step():   # read the last queued step
                pass
            bar.update()
    engine.flush_cache()
    print(f"glmc: compiled {engine.runner.kernels.num_compiled() - before} kernel binaries for "
          f"prompts of {lengths[0]}-{lengths[-1]} tokens in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)
