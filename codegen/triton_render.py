"""Triton kernel sources: the Jinja2 environment, rendering, writing into a plan and loading.

Each kernel is one template, ``codegen/templates/<kernel>.py.j2``, holding one ``@triton.jit``
function; ``render`` turns (kernel, ctx) into source, ``write_kernels`` writes sources into a plan
directory so users can read exactly what runs, ``load_kernel`` imports one, ``kernel_for`` caches.
Shared sizing helpers (``next_pow2``, warps, SM count, dot dtypes) live here too.
"""
from __future__ import annotations

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

TEMPLATE_DIR = Path(__file__).parent / "templates"
_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
    undefined=jinja2.StrictUndefined,  # a context field the template names but lacks is an error
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block shapes must be powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


# torch dtype -> (Triton dot operand type, dot precision). fp32 asks for exact IEEE products so the
# GPU agrees with the fp32 reference; bf16/fp16 operands always accumulate in fp32.
_DOT = {
    torch.float32: ("tl.float32", "ieee"),
    torch.bfloat16: ("tl.bfloat16", "tf32"),
    torch.float16: ("tl.float16", "tf32"),
}


def _warps(elements: int, per_warp: int = 512, cap: int = 8) -> int:
    """Warps for a tile of `elements`: enough to keep each thread's share small, at most `cap`."""
    return max(1, min(cap, next_pow2(max(1, elements // per_warp))))


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; a small stand-in on CPU (the interpreter is serial)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


# ----------------------------------------------------------------------------- render / write / load
def render(kernel: str, ctx) -> str:
    """Source of `kernel` specialised by `ctx` (a *Ctx whose template is `kernel`)."""
    if ctx.template != kernel:
        raise ValueError(f"render: context {type(ctx).__name__} is for {ctx.template!r}, not {kernel!r}")
    return _ENV.get_template(f"{kernel}.py.j2").render(ctx_repr=repr(ctx), **dataclasses.asdict(ctx))


def write_kernels(plan_dir, kernels: Mapping[str, object]) -> dict[str, Path]:
    """Write each named context's rendered kernel to `plan_dir/kernels/<name>.py`; returns the paths."""
    out = Path(plan_dir) / "kernels"
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, ctx in kernels.items():
        paths[name] = out / f"{name}.py"
        paths[name].write_text(render(ctx.template, ctx))
    return paths


def load_kernel(path) -> ModuleType:
    """Import a rendered kernel module from `path` (Triton reads the jit source back from the file)."""
    path = Path(path).resolve()
    name = f"glmc_kernels.{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_KERNELS: dict = {}
_KERNEL_DIR: list[Path] = []


def _kernel_dir() -> Path:
    """Where launch wrappers cache rendered sources: $GLMC_KERNEL_DIR, else one temp dir per process."""
    if not _KERNEL_DIR:
        env = os.environ.get("GLMC_KERNEL_DIR")
        _KERNEL_DIR.append(Path(env) if env else Path(tempfile.mkdtemp(prefix="glmc_kernels_")))
        _KERNEL_DIR[0].mkdir(parents=True, exist_ok=True)
    return _KERNEL_DIR[0]


def kernel_for(ctx):
    """The @triton.jit function for ctx: rendered, written (content-addressed) and imported once."""
    fn = _KERNELS.get(ctx)
    if fn is None:
        src = render(ctx.template, ctx)
        path = _kernel_dir() / f"{ctx.template}_{hashlib.sha1(src.encode()).hexdigest()[:12]}.py"
        if not path.exists():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(src)
            tmp.replace(path)  # atomic: concurrent processes never import a half-written file
        fn = _KERNELS[ctx] = getattr(load_kernel(path), f"{ctx.template}_kernel")
    return fn


