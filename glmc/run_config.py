"""The run settings: one frozen, validated value from `glmc run` to the loader and the engine.

`RunConfig` holds every setting a served plan runs with (the device, the KV pool, the scheduler's
limits, CUDA-graph capture, speculative decoding, the plan's dtypes when it is compiled on demand),
each with its one default. `glmc run` builds it from its flags (whose help shows these defaults),
`glmc.api.plan_for` / `build_engine`, `runtime.engine.startup.build_engine`,
`runtime.worker.loader.load_runner` and `runtime.engine.engine.Engine` read it, and the multi-rank
server pickles it to every rank inside `ServeConfig`. It imports nothing of glmc, so every stage
may read it.

The functions that take a RunConfig also take its fields as keywords (`load_runner(plan, ckpt,
num_pages=8)`): `with_settings(run, **settings)` is that one conversion, validated like the
constructor, and an unknown name fails as a TypeError that names it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DEVICES = ("cpu", "cuda")
KV_DTYPES = ("fp8", "bf16")
QUANTIZE = ("fp8",)
KV_FP8 = ("store", "emulate", "none")


@dataclass(frozen=True)
class RunConfig:
    """How a plan is served; see the module docstring. Counts are per DP rank."""

    device: str = "cpu"
    """cpu: the torch target; cuda (or cuda:N): the CUDA target, one GPU per rank. A CUDA plan
    loaded on cpu runs the same code uncaptured (Triton under TRITON_INTERPRET=1: a dry run)."""
    num_pages: int = 256
    """KV pages of 64 tokens the scheduler may hand out (the pool has one scratch page more)."""
    max_context: int | None = None
    """The longest sequence; None: the model's, capped by the KV pool."""
    max_running: int = 32
    """Requests in one step: the scheduler's largest batch, the executor's req_to_token rows and,
    for a plan compiled on demand for cuda, the largest decode CUDA-graph bucket."""
    max_batch_tokens: int = 256
    """Tokens in one step (the chunked-prefill size); on one GPU also the largest prefill graph."""
    mixed_prefill_tokens: int | None = None
    """Prefill tokens a step may carry while requests decode; None: a quarter of max_batch_tokens."""
    max_waiting: int = 256
    """Queued requests before the engine refuses more (the server's 503)."""
    enable_prefix_cache: bool = True
    """Reuse the KV pages of prompt prefixes seen before (a radix tree over pages)."""
    overlap: bool | None = None
    """Prepare step N+1 on the host while the device runs step N; None: where the runner can."""
    speculative_num_steps: int = 0
    """MTP speculative decoding: draft this many tokens per step and verify them in one forward
    (0: off). Needs a plan with MTP phases and runs without overlap."""
    capture: bool = True
    """On a GPU, capture the decode graph of every bucket (and the MTP graphs when speculating)."""
    prefill_graphs: bool = True
    """One-rank CUDA plans: also capture prefill graphs up to max_batch_tokens tokens."""
    warmup: bool = True
    """Run a request through every phase before serving (on a GPU, compile every kernel variant)."""
    kv_fp8: str | None = None
    """What becomes of the caches the plan stores fp8: store (FP8 pools), emulate (fp32 pools whose
    values are rounded through FP8: the CUDA target's oracle) or none; None: store on the CUDA
    target, none on the torch target."""
    quantize: str | None = None
    """fp8: a plan compiled on demand stores the linear weights block-FP8 (a plan directory must
    have been compiled so); None: as the checkpoint."""
    kv_dtype: str | None = None
    """fp8 or bf16: the KV and indexer caches' dtype of a plan compiled on demand (a plan directory
    must have been compiled so); None: what the checkpoint's config gives."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> RunConfig:
        """Raise ValueError naming the first field out of range; else return self."""
        for name in ("num_pages", "max_running", "max_batch_tokens", "max_waiting"):
            _at_least(name, getattr(self, name), 1)
        for name in ("max_context", "mixed_prefill_tokens"):
            if getattr(self, name) is not None:
                _at_least(name, getattr(self, name), 1)
        _at_least("speculative_num_steps", self.speculative_num_steps, 0)
        if not isinstance(self.device, str) or self.device.partition(":")[0] not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES} (or cuda:N), got {self.device!r}")
        for name, allowed in (("kv_fp8", KV_FP8), ("quantize", QUANTIZE), ("kv_dtype", KV_DTYPES)):
            if getattr(self, name) not in (None, *allowed):
                raise ValueError(f"{name} must be one of {allowed} or None, got {getattr(self, name)!r}")
        if self.speculative_num_steps and self.overlap:
            raise ValueError(f"overlap: speculative decoding runs without overlap (overlap=True with "
                             f"speculative_num_steps={self.speculative_num_steps})")
        return self


def with_settings(run: RunConfig | None = None, **settings) -> RunConfig:
    """`run` (default: every default) with the named fields replaced, validated."""
    return dataclasses.replace(run or RunConfig(), **settings)


def _at_least(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
