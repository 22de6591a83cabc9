"""Building engines: checkpoints (and the tiny default one), weights, runners, warm-up.

`build_engine(ckpt_dir)` serves an HF glm_moe_dsa checkpoint directory (config.json, safetensors,
tokenizer.json, tokenizer_config.json), on the host (torch target) or with `device="cuda"` on one
GPU (`gpu_runner.GpuRunner`: tp1, decode replayed from CUDA graphs); `build_tiny_engine()` serves
the tiny default model, whose random weights are made deterministically on first use. Slow steps
show progress bars (stderr).
"""
from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from glmc.runtime.engine.engine import Engine
from glmc.runtime.engine.sampling import SamplingParams
from glmc.runtime.engine.tokenizer import Tokenizer
from glmc.runtime.worker.model_runner import (
    DevicePlanRunner,
    PlanRunner,
    ReferenceRunner,
    context_limit,
)
from tqdm import tqdm as _tqdm

TINY_DIR = Path(str(resources.files("glmc.models") / "tiny"))
TINY_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY_SPEC = "glm_moe_dsa_tiny"        # the model: models/glm_moe_dsa_tiny.yaml, as the compiler sees it
TINY_SPECIAL = {"bos_token_id": 2, "pad_token_id": 0}   # ids in models/tiny/tokenizer.json
TINY_SEED = 0
TINY_STAMP = f"glmc tiny weights: seed {TINY_SEED}, init v1\n"  # bump when _tiny_init changes
TINY_NAME = "glmc-tiny"
DEVICES = ("cpu", "cuda")


def tqdm(*args, **kwargs):
    """A progress bar on stderr, off when $TQDM_DISABLE is set (read now, not at import: ranks
    other than 0 set it after tqdm was imported)."""
    return _tqdm(*args, disable=bool(os.environ.get("TQDM_DISABLE")), leave=False, **kwargs)


def default_cache_dir() -> Path:
    """$GLMC_CACHE, else ~/.cache/glmc."""
    return Path(os.environ.get("GLMC_CACHE") or Path.home() / ".cache" / "glmc")


def tiny_hf_config() -> dict:
    """config.json of the tiny default model: the config of models/glm_moe_dsa_tiny.yaml (what the
    compiler goldens use) under HF's names, plus the tokenizer's special ids."""
    from glmc.cli import _model_path
    from glmc.spec import load_spec
    c = load_spec(_model_path(TINY_SPEC)).config
    cfg = c.model_dump(mode="json", exclude_none=True)
    theta = cfg.pop("rope_theta")
    return {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", **cfg,
            "num_key_value_heads": c.num_attention_heads, "head_dim": c.qk_rope_head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "hidden_act": "silu",
            "attention_bias": False, "dtype": "float32", **TINY_SPECIAL}


def make_tiny_checkpoint(ckpt_dir: str | Path) -> Path:
    """Write the tiny GLM (models/glm_moe_dsa_tiny.yaml, same architecture as GLM-5, MTP layer
    included) as an HF checkpoint with deterministic random weights, plus the tiny tokenizer.
    Reuses an up-to-date directory."""
    from glmc.runtime.worker.checkpoint import expected_tensors
    from safetensors.torch import save_file

    from glmc.spec import config_from_hf

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_hf_config()
    config_text = json.dumps(config, indent=1) + "\n"
    fresh = all((ckpt_dir / f).exists() and (ckpt_dir / f).read_bytes() == (TINY_DIR / f).read_bytes()
                for f in TINY_FILES) and (ckpt_dir / "config.json").exists() and \
        (ckpt_dir / "config.json").read_text() == config_text
    stamp = ckpt_dir / "glmc_tiny.txt"
    if fresh and stamp.exists() and stamp.read_text() == TINY_STAMP:
        return ckpt_dir
    gen, tensors = torch.Generator().manual_seed(TINY_SEED), {}
    mtp = config["num_nextn_predict_layers"] > 0
    for name, shape in tqdm(sorted(expected_tensors(config_from_hf(config), mtp=mtp).items()),
                            desc="creating tiny weights", unit="tensor"):
        tensors[name] = _tiny_init(name, shape, gen)
    tmp = ckpt_dir / f"model.safetensors.tmp{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, ckpt_dir / "model.safetensors")  # atomic: concurrent builders agree
    for f in TINY_FILES:
        shutil.copyfile(TINY_DIR / f, ckpt_dir / f)
    (ckpt_dir / "config.json").write_text(config_text)
    stamp.write_text(TINY_STAMP)  # last: a half-written directory is never taken as fresh
    return ckpt_dir


def _tiny_init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Norm weights 1, biases small, embeddings N(0, 1), matrices with std 2/sqrt(fan_in): the
    activations stay O(1) and the logits are peaked enough that greedy decoding has clear winners."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if len(shape) == 1:
        return 0.01 * torch.randn(shape, generator=gen)
    scale = 1.0 if name.endswith("embed_tokens.weight") else 2.0 / math.sqrt(shape[1])
    return scale * torch.randn(shape, generator=gen)


def load_weights(ckpt_dir: Path, config) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (for the reference model, which is not sharded)."""
    from glmc.runtime.worker.checkpoint import (
        detect_mtp,
        expected_tensors,
        load_checkpoint,
    )

    expected = expected_tensors(config, **detect_mtp(ckpt_dir))
    with tqdm(total=len(expected), desc="loading weights", unit="tensor") as bar:
        weights = load_checkpoint(ckpt_dir, expected)  # no per-tensor hook: one jump at the end
        bar.update(len(weights))
    return weights


@dataclass
class PlanSource:
    """What every rank needs to run a compiled plan: its phase graphs, the model config, the
    parallel spec's name and world size, and the checkpoint to read its weights from."""

    ckpt_dir: Path
    graphs: dict
    config: object  # glmc.config.GlmConfig
    parallel: str
    world: int


def plan_source(ckpt_dir: str | Path, plan_dir: str | Path | None = None,
                parallel: str | None = None) -> PlanSource:
    """The plan in `plan_dir`, or (without one) the checkpoint's model compiled for `parallel`
    (default tp1) for the torch target."""
    from glmc.spec import load_spec

    ckpt_dir = Path(ckpt_dir)
    spec = load_spec(ckpt_dir)
    if plan_dir is not None:
        return _load_plan(ckpt_dir, Path(plan_dir), spec.config, parallel)
    from glmc.compiler import compile_phase, phases_of
    from glmc.config import Options
    from glmc.parallel import parse_parallel

    par = parse_parallel(parallel or "tp1", spec.config)
    graphs = {ph: compile_phase(spec, par, ph, Options(device="cpu"))
              for ph in tqdm(phases_of(spec), desc=f"compiling {par.name}", unit="phase")}
    return PlanSource(ckpt_dir, graphs, spec.config, par.name, par.world)


def _load_plan(ckpt_dir: Path, plan_dir: Path, config, parallel: str | None) -> PlanSource:
    from glmc.compiler import load_plan_graphs
    from glmc.config import GlmConfig

    meta, graphs = load_plan_graphs(plan_dir)
    planned = GlmConfig.model_validate(meta["config"])
    differ = [k for k in GlmConfig.model_fields if getattr(planned, k) != getattr(config, k)]
    if differ:
        k = differ[0]
        raise ValueError(f"{plan_dir} was compiled for another model than {ckpt_dir}: {k} = "
                         f"{getattr(planned, k)!r} in the plan, {getattr(config, k)!r} in "
                         f"config.json ({len(differ)} fields differ)")
    name = meta["parallel"]["spec"]
    if parallel is not None and parallel != name:
        raise ValueError(f"{plan_dir} is compiled for {name}, not {parallel}; drop --parallel or "
                         f"compile for {parallel}")
    return PlanSource(ckpt_dir, graphs, planned, name, int(meta["parallel"]["world"]))


def plan_runner(src: PlanSource, num_pages: int, max_context: int | None = None,
                comm=None) -> PlanRunner:
    """This rank's `PlanRunner`: its shard of the weights (read by the plan's ops) and KV pool."""
    from glmc.runtime.worker.comm import Coords
    from glmc.runtime.worker.shards import load_rank_weights

    coords = comm.coords if comm is not None else Coords(0, next(iter(src.graphs.values()))
                                                         .meta["mesh"])
    with tqdm(total=1, desc="loading weights", unit="shard") as bar:
        weights = load_rank_weights(src.ckpt_dir, src.config, list(src.graphs.values()), coords)
        bar.update()
    return PlanRunner.on_cpu(src.graphs, src.config, weights, num_pages, max_context, comm)


def build_engine(ckpt_dir: str | Path, plan_dir: str | Path | None = None,
                 parallel: str | None = None, *, runner: str = "plan", device: str = "cpu",
                 num_pages: int = 256, max_context: int | None = None, warmup: bool = True,
                 **engine_kwargs) -> Engine:
    """An engine (one process) over an HF glm_moe_dsa checkpoint directory (config.json,
    safetensors, tokenizer.json, tokenizer_config.json). `runner="plan"` (default) serves the plan
    in `plan_dir`, or the checkpoint's model compiled for `parallel` (default tp1);
    `runner="reference"` serves the fp32 reference model. `device="cuda"` serves a tp1 plan on
    one GPU (see `cuda_plan_runner`). Plans over several ranks need one process each:
    `glmc.runtime.engine.distributed.serve_parallel`."""
    ckpt_dir = Path(ckpt_dir)
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cuda":
        if runner != "plan":
            raise ValueError(f"device 'cuda' serves compiled plans (runner='plan'), not {runner!r}")
        require_cuda()
        max_running = engine_kwargs.get("max_running",
                                        inspect.signature(Engine).parameters["max_running"].default)
        model = cuda_plan_runner(cuda_plan_source(ckpt_dir, plan_dir, parallel, max_running),
                                 num_pages, max_context, max_running)
    elif runner == "reference":
        from glmc.spec import load_spec
        config = load_spec(ckpt_dir).config
        model = ReferenceRunner(config, load_weights(ckpt_dir, config), num_pages, max_context)
    elif runner == "plan":
        src = plan_source(ckpt_dir, plan_dir, parallel)
        if src.world != 1:
            raise ValueError(f"{src.parallel} runs {src.world} ranks, one process each: serve it "
                             "with `glmc run --parallel` (glmc.runtime.engine.distributed)")
        model = plan_runner(src, num_pages, max_context)
    else:
        raise ValueError(f"runner must be 'plan' or 'reference', got {runner!r}")
    engine = Engine(model, Tokenizer.from_dir(ckpt_dir), **engine_kwargs)
    if warmup:
        warm_up(engine)
    return engine


# -- one GPU ----------------------------------------------------------------------------------


def require_cuda() -> None:
    """Serving on CUDA needs a GPU that this torch sees; say what torch reports when it does not."""
    if not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch {torch.__version__} sees no CUDA device (built "
                         f"with CUDA {torch.version.cuda}); serve on the host with --device cpu")


def require_tp1(parallel: str | None) -> None:
    """One GPU runs one rank: only tp1 plans (the runner's ops do not shard)."""
    if parallel not in (None, "tp1"):
        raise ValueError(f"--device cuda serves tp1 only (one GPU, one rank), not --parallel "
                         f"{parallel}; serve {parallel} on the host with --device cpu")


def cuda_plan_source(ckpt_dir: Path, plan_dir: str | Path | None, parallel: str | None,
                     max_running: int) -> PlanSource:
    """The tp1 plan for the CUDA target: `plan_dir`'s if compiled with `--device cuda`, else the
    checkpoint's model compiled now (attention on the CUDA backends, CUDA-graph buckets up to
    `max_running`, the scheduler's largest decode batch)."""
    from glmc.compiler import compile_phase, phases_of
    from glmc.config import Options
    from glmc.parallel import parse_parallel
    from glmc.spec import load_spec

    require_tp1(parallel)
    if plan_dir is not None:
        src = plan_source(ckpt_dir, plan_dir, parallel)
        planned = json.loads((Path(plan_dir) / "plan.json").read_text())["options"]["device"]
        if planned != "cuda" or src.world != 1:
            raise ValueError(f"{plan_dir} is a {src.parallel} plan for device {planned!r}; --device "
                             "cuda serves tp1 plans compiled with `glmc compile --device cuda`")
        return src
    spec = load_spec(ckpt_dir)
    par = parse_parallel("tp1", spec.config)
    opts = Options(device="cuda", max_batch=max_running)
    graphs = {ph: compile_phase(spec, par, ph, opts)
              for ph in tqdm(phases_of(spec), desc="compiling tp1 (cuda)", unit="phase")}
    return PlanSource(ckpt_dir, graphs, spec.config, par.name, par.world)


def cuda_plan_runner(src: PlanSource, num_pages: int, max_context: int | None, max_running: int,
                     device: str = "cuda") -> DevicePlanRunner:
    """A `DevicePlanRunner` over a `GpuRunner` on `device`: the checkpoint's weights in the compute
    dtype (fp32 for an fp32 checkpoint, else bf16; the router fp32), a KV pool of `num_pages`
    pages plus the scratch page, one req_to_token row per running request plus the padding row,
    and (on a GPU) the decode graph captured for each bucket. `device="cpu"` runs the same code
    uncaptured (Triton under TRITON_INTERPRET=1): a dry run without a GPU."""
    from glmc.runtime.worker.cuda_executor import (
        GpuRunner,
        make_pool,
        to_device_weights,
    )

    from glmc.spec import load_spec

    c, t0 = src.config, time.perf_counter()
    fp32 = load_spec(src.ckpt_dir).dtypes.activation == "fp32"
    dtype = torch.float32 if fp32 else torch.bfloat16
    max_ctx = context_limit(c.max_position_embeddings, num_pages, max_context)
    with tqdm(total=1, desc="loading weights", unit="shard") as bar:
        weights = to_device_weights(_rank_weights(src, dtype), device, dtype)
        bar.update()
    gpu = GpuRunner(src.graphs, c, weights, make_pool(c, device, dtype, max_running, max_ctx,
                                                      num_pages + 1),
                    max_reqs=max_running, max_context=max_ctx)
    loaded = time.perf_counter() - t0
    captured = {}
    if torch.device(device).type == "cuda":
        with tqdm(total=len(gpu.buckets), desc="capturing CUDA graphs", unit="graph") as bar:
            captured = gpu.capture(progress=bar.update)
    print(f"glmc: {device} runner: weights {loaded:.1f} s, {len(captured)} decode graphs "
          f"{sorted(captured)} captured in {sum(captured.values()):.1f} s", file=sys.stderr,
          flush=True)
    return DevicePlanRunner(gpu, max_ctx)


def _rank_weights(src: PlanSource, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`plan_weights.load_rank_weights` for one rank, read in `dtype`: an fp32 host copy of a bf16
    checkpoint would double its host memory and its copy to the device."""
    from glmc.runtime.worker.checkpoint import (
        detect_mtp,
        expected_tensors,
        load_checkpoint,
    )
    from glmc.runtime.worker.comm import Coords
    from glmc.runtime.worker.shards import rank_shards

    graphs = list(src.graphs.values())
    shards = rank_shards(graphs, Coords(0, graphs[0].meta["mesh"]))
    expected = expected_tensors(src.config, **detect_mtp(src.ckpt_dir))
    return load_checkpoint(src.ckpt_dir, expected, shard=shards.get, dtype=dtype,
                           only={n for n in shards if n in expected})


def build_tiny_engine(cache_dir: str | Path | None = None, **kwargs) -> Engine:
    """The default tiny model: random weights made on first use under `cache_dir`
    (default $GLMC_CACHE/tiny or ~/.cache/glmc/tiny), tokenizer and chat template from models/tiny."""
    return build_engine(make_tiny_checkpoint(cache_dir or default_cache_dir() / "tiny"), **kwargs)


def warm_up(engine: Engine) -> None:
    """Run a short request per DP rank through every phase (prefill, decode), then forget them."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = list(range(min(8, engine.runner.vocab_size)))
    reqs = [engine.make_request(prompt, params) for _ in range(engine.runner.num_dp)]
    for req in reqs:
        engine.submit(req)
    with tqdm(total=params.max_tokens, desc="warm-up", unit="step") as bar:
        while not all(r.finished for r in reqs):
            engine.step()
            bar.n = min(len(r.output_ids) for r in reqs)
            bar.refresh()
    engine.flush_cache()
    engine.reset_metrics()
