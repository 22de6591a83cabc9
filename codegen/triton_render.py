"""Triton kernel sources: the Jinja2 environment, rendering, writing into a plan and loading.

Each kernel is one template, ``codegen/templates/<kernel>.py.j2``, holding one ``@triton.jit``
function; ``render`` turns (kernel, ctx) into source, ``load_kernel`` imports one, and a
``KernelLibrary`` maps contexts to kernels: a plan's rendered files (what the runtime runs) or
rendered on demand (``JIT``: kernel tests and benchmarks).
Shared sizing helpers (``next_pow2``, warps, SM count, dot dtypes and FP8 dot accumulation) live
here too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Mapping

import jinja2
import torch

from glmc.target import next_pow2  # noqa: F401  (re-exported)

TEMPLATE_DIR = Path(__file__).parent / "templates"
_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
    undefined=jinja2.StrictUndefined,  # a context field the template names but lacks is an error
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)




# torch dtype -> (Triton dot operand type, dot precision). fp32 asks for exact IEEE products so the
# GPU agrees with the fp32 reference; bf16/fp16 operands always accumulate in fp32.
_DOT = {
    torch.float32: ("tl.float32", "ieee"),
    torch.bfloat16: ("tl.bfloat16", "tf32"),
    torch.float16: ("tl.float16", "tf32"),
}

# FP8 x FP8 -> fp32 dots: how many K products a tensor-core accumulation may sum before its result is
# added to an fp32 register (Triton's `max_num_imprecise_acc`). Hopper's FP8 wgmma keeps only about
# 14 bits of its running sum, even within one instruction; the FP8 kernels dot one 128-wide K block
# at a time and add each block's result to an fp32 accumulator (DeepSeek-V3's promotion interval).
# bench/fp8_accumulation.py on an H200 (2026-12-05; prefill GEMMs of GLM-5.3 at 2048 rows), outputs
# outside one bf16 ulp of the exact product / time against 128: 128: 0.75% / 1.0; 64: 0.22% /
# 1.04-1.22; 32: 0.022% / 1.28-1.50; 0 (mma.sync on fp16-converted operands): none / 2.3-2.6. The
# op checks bound the accumulation instead (op_compare.FP8_ACC_REL); decode tiles under 64 rows
# never reach wgmma. Other GPUs and the interpreter accumulate in fp32 whatever it says.
FP8_DOT_PROMOTE = 128


def fp8_promote(promote) -> int:
    """A valid `max_num_imprecise_acc` for a 128-wide FP8 dot: 0 (Triton then leaves wgmma for
    mma.sync on operands converted to fp16) or 32 (one wgmma's K), 64 or 128."""
    if int(promote) not in (0, 32, 64, 128):
        raise ValueError(f"FP8 dot promote {promote}: one of 0, 32, 64, 128 (K products per tensor-core sum)")
    return int(promote)


def _warps(elements: int, per_warp: int = 512, cap: int = 8) -> int:
    """Warps for a tile of `elements`: enough to keep each thread's share small, at most `cap`."""
    return max(1, min(cap, next_pow2(max(1, elements // per_warp))))


_ASSUMED_SMS: list[int] = []


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill; a small stand-in on CPU (the interpreter is serial), or
    what `assume_sms` says for a device that is not a GPU (a launch program traced for one)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _ASSUMED_SMS[-1] if _ASSUMED_SMS else 2


@contextlib.contextmanager
def assume_sms(n: int):
    """Within it, launches on a device other than a GPU size their grids and splits for `n` SMs."""
    _ASSUMED_SMS.append(int(n))
    try:
        yield
    finally:
        _ASSUMED_SMS.pop()




# ----------------------------------------------------------------------------- render / load / libraries
def _binaries(fn) -> int:
    """Binaries Triton compiled for one jitted kernel, over every device (its per-device caches)."""
    return sum(len(c[0]) for c in getattr(fn, "device_caches", {}).values())


def render(kernel: str, ctx) -> str:
    """Source of `kernel` specialised by `ctx` (a *Ctx whose template is `kernel`)."""
    if ctx.template != kernel:
        raise ValueError(f"render: context {type(ctx).__name__} is for {ctx.template!r}, not {kernel!r}")
    return _ENV.get_template(f"{kernel}.py.j2").render(ctx_repr=repr(ctx), **dataclasses.asdict(ctx))


def load_kernel(path) -> ModuleType:
    """Import a rendered kernel module from `path` (Triton reads the jit source back from the file)."""
    path = Path(path).resolve()
    name = f"glmc_kernels.{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class KernelNotInPlan(LookupError):
    """A launch asked for a kernel the plan did not render (the plan is stale or the kernel set
    misses a variant); the message names the context and the plan."""


class KernelLibrary:
    """Where the launch wrappers get their @triton.jit functions: `lib(ctx)`.

    `KernelLibrary()` (the module's `JIT`; kernel tests and benchmarks) renders a context's template
    on first use into a content-addressed cache directory ($GLMC_KERNEL_DIR, else one temp dir per
    process) and imports it. `KernelLibrary.from_plan(plan)` (the runtime) holds exactly the plan's
    kernels/*.py, keyed by the context each was rendered from, imported from the plan directory
    when the plan was loaded from one (so the file a user reads is the file that runs); a context
    the plan lacks raises `KernelNotInPlan`, unless `jit_extra` (benchmarks sweeping tiles).
    """

    def __init__(self, files: Mapping[str, Path] | None = None, where: str = "", jit_extra: bool = True):
        self._files = dict(files or {})       # repr(ctx) -> kernel file
        self._where, self._jit_extra = where, jit_extra
        self._fns: dict = {}

    @classmethod
    def from_plan(cls, plan, jit_extra: bool = False) -> "KernelLibrary":
        """The plan's kernels (`plan.kernels` sources, `plan.kernel_contexts` their contexts)."""
        if not plan.kernels:
            raise KernelNotInPlan(f"plan of {plan.model} ({plan.parallel}) holds no kernels: it was compiled "
                                  f"for device {plan.target!r}; compile it with `glmc compile --device cuda`")
        plan_dir = plan.directory   # loaded from a directory: its files; compiled in memory: the cache
        files = {plan.kernel_contexts[name]: Path(plan_dir) / "kernels" / f"{name}.py" if plan_dir else
                 _cached(name, src) for name, src in plan.kernels.items()}
        where = f"plan {plan_dir}" if plan_dir else f"the in-memory plan of {plan.model} ({plan.parallel})"
        return cls(files, where, jit_extra)

    def num_compiled(self) -> int:
        """Binaries Triton has compiled so far for the kernels launched through this library (one
        per specialisation: a kernel launched with new constexprs or new integer-argument classes
        compiles again). 0 under TRITON_INTERPRET. A server that counts a change while serving was
        caught by a compile; `startup.warm_up` compiles what serving hits."""
        return sum(_binaries(fn) for fn in self._fns.values())   # per step: no paths (reprs) here

    def compiled_by_kernel(self) -> dict[str, int]:
        """`num_compiled` per kernel file (its stem, e.g. sparse_mla_decode_3)."""
        return {self.path(ctx).stem: _binaries(fn) for ctx, fn in self._fns.items()}

    def loaded(self) -> list[Path]:
        """The files of the kernels launched (imported) so far."""
        return [self.path(ctx) for ctx in self._fns]

    def path(self, ctx) -> Path:
        """The file `ctx`'s kernel is imported from."""
        key = repr(ctx)
        if key in self._files:
            return self._files[key]
        if self._files and not self._jit_extra:
            raise KernelNotInPlan(f"{self._where} has no kernel for {key} (it holds {len(self._files)}); "
                                  "recompile the plan with this glmc (`glmc compile --device cuda`)")
        return _cached(ctx.template, render(ctx.template, ctx))

    def __call__(self, ctx):
        fn = self._fns.get(ctx)
        if fn is None:
            fn = self._fns[ctx] = getattr(load_kernel(self.path(ctx)), f"{ctx.template}_kernel")
        return fn


_KERNEL_DIR: list[Path] = []


def _kernel_dir() -> Path:
    """The JIT cache: $GLMC_KERNEL_DIR, else one temp dir per process."""
    if not _KERNEL_DIR:
        env = os.environ.get("GLMC_KERNEL_DIR")
        _KERNEL_DIR.append(Path(env) if env else Path(tempfile.mkdtemp(prefix="glmc_kernels_")))
        _KERNEL_DIR[0].mkdir(parents=True, exist_ok=True)
    return _KERNEL_DIR[0]


def _cached(name: str, src: str) -> Path:
    """`src` written once under the cache dir, named by its content (atomic: concurrent processes
    never import a half-written file)."""
    path = _kernel_dir() / f"{name}_{hashlib.sha1(src.encode()).hexdigest()[:12]}.py"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(src)
        tmp.replace(path)
    return path


JIT = KernelLibrary()
