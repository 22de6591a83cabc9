"""Live tensor bytes over a region of code: the CPU measurement of what a step allocates.

`LiveBytes()` is a `TorchDispatchMode`: while it is active, every aten op's outputs whose storage is
new (not the storage of one of the op's inputs, not already counted) are counted at their storage's
bytes until the storage dies (a weakref finalizer), so views count once and a tensor held past the
region stays counted. It keeps the running total (`live`), its maximum (`peak`); in
`allocator=True` mode each storage is rounded up as the CUDA caching allocator rounds a block (512
bytes); `device="cuda"` counts only storages on that device type (not the pinned host buffers a
GPU step stages its inputs through). Allocations inside an aten kernel (cuBLAS or sort workspaces) and by Triton kernels
themselves are not tensors and are not seen; under TRITON_INTERPRET=1 the interpreter's host copies
of a CPU tensor are the tensor itself (no new storage). The interpreter does keep every launch's
argument storages in reference cycles (its recursive `_to_cpu` / `_from_cpu` closures over a dict
of storages) until the garbage collector runs, which on a GPU would have been freed when the code
dropped them; so while a tracker is active automatic collection is off and the young generation is
collected after every interpreted launch (cheap: those cycles are in it).

`traced_ops(runner, tracker)` wraps the runner's op table for the duration of a `with` block so that
`tracker.regions` gets, per IR op evaluated, (op, live bytes at its start, peak during it, live at
its end): which op holds what, and which one's workspace made the peak.

    with LiveBytes() as mem, traced_ops(runner, mem):
        runner.forward("decode", batch)
    mem.peak                  # bytes above what was live before the `with`
    mem.regions[-1]           # Region(op=..., start=..., peak=..., end=...)

Used by tests/test_memory_accounting.py (the plan-memory pass's step model against the CPU run)
and bench/memory_check.py (the same attribution on the GPU, beside torch.cuda's own counters).
"""
from __future__ import annotations

import gc
import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BLOCK = 512   # the CUDA caching allocator's block size: every allocation is rounded up to it


def allocator_bytes(nbytes: int) -> int:
    """What the CUDA caching allocator books for an allocation of `nbytes` (> 0)."""
    return -(-nbytes // BLOCK) * BLOCK


@dataclass
class Region:
    """One op's evaluation: live bytes when it started and ended, and the peak in between."""
    op: object
    start: int
    peak: int
    end: int


class LiveBytes(TorchDispatchMode):
    def __init__(self, allocator: bool = False, device: str | None = None):
        super().__init__()
        self.allocator, self.device = allocator, device
        self.live = self.peak = 0
        self.regions: list[Region] = []
        self._counted: dict[int, int] = {}    # id(storage) -> bytes counted
        self._open: list[Region] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage(), inputs)
        return out

    def _count(self, storage, inputs: set) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if key in inputs or key in self._counted or not nbytes:
            return
        if self.device is not None and storage.device.type != self.device:
            return
        nbytes = allocator_bytes(nbytes) if self.allocator else nbytes
        self._counted[key] = nbytes
        weakref.finalize(storage, self._release, key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        for region in self._open:
            region.peak = max(region.peak, self.live)

    def _release(self, key: int) -> None:
        self.live -= self._counted.pop(key)

    def __enter__(self):
        self._gc_was_on = gc.isenabled()
        gc.disable()
        self._unpatch = _collect_after_interpreted_launches()
        return super().__enter__()

    def __exit__(self, *exc):
        self._unpatch()
        if self._gc_was_on:
            gc.enable()
        return super().__exit__(*exc)

    @contextmanager
    def region(self, op):
        """Record (live at start, peak, live at end) of the block as `op`'s region."""
        r = Region(op, self.live, self.live, self.live)
        self._open.append(r)
        try:
            yield r
        finally:
            self._open.remove(r)
            r.end = self.live
            self.regions.append(r)


def _collect_after_interpreted_launches():
    """Under TRITON_INTERPRET=1: collect the young generation after each launch (module docstring);
    -> a function that undoes it."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return lambda: None
    from triton.runtime.interpreter import GridExecutor
    launch = GridExecutor.__call__

    def launch_then_collect(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            gc.collect(0)
    GridExecutor.__call__ = launch_then_collect

    def undo():
        GridExecutor.__call__ = launch
    return undo


@contextmanager
def traced_ops(runner, tracker: LiveBytes):
    """Evaluate `runner`'s ops (a PlanExecutor or CudaExecutor: its `impls` table) each inside a
    `tracker.region(op)`; the table is restored on exit."""
    table = runner.impls

    def traced(impl):
        def run(op, args, ctx):
            with tracker.region(op):
                return impl(op, args, ctx)
        return run
    runner.impls = {kind: traced(impl) for kind, impl in table.items()}
    try:
        yield tracker
    finally:
        runner.impls = table


def measure(runner, call) -> LiveBytes:
    """`call()` (a forward of `runner`) under a fresh `LiveBytes` counting the runner's device
    (its KV pool's), with the runner's ops traced."""
    with LiveBytes(device=runner.pool.device.type) as mem, traced_ops(runner, mem):
        call()
    return mem
