"""Start an engine over a compiled plan: the runner (`worker.loader`), tokenizer, warm-up.

`build_engine(plan, ckpt_dir)` is the one-process engine: the plan's runner from the checkpoint's
weights on `device`, the checkpoint's tokenizer and chat template, and a warm-up request through
every phase. Plans over several ranks need one process each (`engine.distributed.serve_model`).
`runner="reference"` serves the fp32 `ReferenceModel` instead of the plan (the numerical oracle).
"""
from __future__ import annotations

from pathlib import Path

import torch
from glmc.runtime.engine.engine import Engine
from glmc.runtime.engine.sampling import SamplingParams
from glmc.runtime.engine.tokenizer import Tokenizer
from glmc.runtime.worker.loader import load_runner, progress
from glmc.runtime.worker.model_runner import ReferenceRunner

from glmc.plan import Plan

DEVICES = ("cpu", "cuda")


def require_cuda() -> None:
    """Serving on CUDA needs a GPU that this torch sees; say what torch reports when it does not."""
    if not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch {torch.__version__} sees no CUDA device (built "
                         f"with CUDA {torch.version.cuda}); serve on the host with --device cpu")


def build_engine(plan: Plan, ckpt_dir: str | Path, *, runner: str = "plan", device: str = "cpu",
                 num_pages: int = 256, max_context: int | None = None, warmup: bool = True,
                 **engine_kwargs) -> Engine:
    """An engine in this process over `plan` (one rank) and the checkpoint's weights."""
    ckpt_dir = Path(ckpt_dir)
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if plan.world != 1:
        raise ValueError(f"{plan.parallel} runs {plan.world} ranks, one process each: serve it "
                         "with `glmc run --parallel` (glmc.runtime.engine.distributed)")
    if runner == "reference":
        model = ReferenceRunner(plan.config, load_weights(ckpt_dir, plan.config), num_pages,
                                max_context)
    elif runner == "plan":
        if device == "cuda":
            require_cuda()
        max_running = engine_kwargs.get("max_running", 32)
        model = load_runner(plan, ckpt_dir, device=device, num_pages=num_pages,
                            max_context=max_context, max_running=max_running)
    else:
        raise ValueError(f"runner must be 'plan' or 'reference', got {runner!r}")
    engine = Engine(model, Tokenizer.from_dir(ckpt_dir), **engine_kwargs)
    if warmup:
        warm_up(engine)
    return engine


def load_weights(ckpt_dir: Path, config) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (for the reference model, which is not sharded)."""
    from glmc.runtime.worker.checkpoint import (
        detect_mtp,
        expected_tensors,
        load_checkpoint,
    )

    expected = expected_tensors(config, **detect_mtp(ckpt_dir))
    with progress(total=len(expected), desc="loading weights", unit="tensor") as bar:
        weights = load_checkpoint(ckpt_dir, expected)  # no per-tensor hook: one jump at the end
        bar.update(len(weights))
    return weights


def warm_up(engine: Engine) -> None:
    """Run a short request per DP rank through every phase (prefill, decode), then forget them."""
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
