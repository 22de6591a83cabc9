"""The arena a step's allocations are replayed on, and the registry of per-op models.

`Arena` counts live bytes (optionally rounded as the CUDA caching allocator books blocks), `Val` is a
runtime tensor (its storage, element bytes, whether it is dense), `Target` what the allocations
depend on beyond the graph, `Step` one op's view of them. `MODELS[kind](op, args, step)` replays an
op's allocations (`op_memory.py`, `moe_memory.py`); `generic` stands in for kinds without one.
"""
from __future__ import annotations

from dataclasses import dataclass

from glmc.ir import Op
from glmc.ir.types import DTYPE_BYTES
from glmc.target import H200_SMS

@dataclass(frozen=True)
class Target:
    """What the step's allocations depend on beyond the graph: the compute dtype's bytes, FP8
    weights / KV, the device's SM count, and the step's shape (`tokens` T, `requests` B, `max_len`:
    the indexer's score width before rounding: the runner's max_context in decode, the longest
    sequence of a prefill)."""
    act: int
    fp8_weights: bool
    kv_fp8: bool
    tokens: int
    requests: int
    max_len: int
    num_sms: int = H200_SMS


@dataclass
class Val:
    """A runtime tensor: its storage (`buf`, shared by views) and element bytes; `dense` when it is
    a contiguous tensor (a reshape of it is a view)."""
    buf: int
    elem: int
    dense: bool = True
    cols: int = 0      # top-k positions: k (attention reads the width of the top-k it gets)


class Arena:
    """Live bytes of the step's allocations; `rounding` 512 books them as the CUDA caching
    allocator does (a block per allocation, rounded up), 1 counts tensor bytes."""

    def __init__(self, rounding: int = 1):
        self.rounding, self.live, self.peak = rounding, 0, 0
        self._bytes: dict[int, int] = {}
        self._next = 0

    def alloc(self, nbytes: int) -> int:
        self._next += 1
        if nbytes > 0:
            nbytes = -(-nbytes // self.rounding) * self.rounding
            self._bytes[self._next] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return self._next

    def free(self, *bufs: int) -> None:
        for b in bufs:
            self.live -= self._bytes.pop(b, 0)

    def bytes_of(self, buf: int) -> int:
        return self._bytes.get(buf, 0)

    def new(self, numel: int, elem: int) -> Val:
        return Val(self.alloc(numel * elem), elem)


class Step:
    """One op's view of the step: the arena, the target, the graph (operand types), its config,
    the IR env (T, B) and the step's inputs (`feeds`: name -> Val)."""

    def __init__(self, arena: Arena, target: Target, graph, cfg, feeds: dict):
        self.arena, self.t, self.graph, self.cfg, self.feeds = arena, target, graph, cfg, feeds
        self.env = {"T": target.tokens, "B": target.requests}
        self.memo: dict[str, tuple] = {}   # value -> bufs held with it (its FP8 quantisation: cuda_target.quantized)

    def type_of(self, value: str):
        return self.graph.type_of(value)

    def rows(self, op: Op, i: int = 0) -> int:
        return op.types[i].shape[0].eval(self.env)

    def numel(self, op: Op, i: int = 0) -> int:
        return op.types[i].numel(self.env)

    def tmp(self, numel: int, elem: int) -> int:
        return self.arena.alloc(numel * elem)

    def free(self, *bufs) -> None:
        self.arena.free(*bufs)


MODELS: dict = {}


def model(*kinds):
    def put(fn):
        for k in kinds:
            MODELS[k] = fn
        return fn
    return put


def generic(op: Op, args, s: Step):
    """An op with no model: each tensor result allocated at its IR numel, activations at the
    compute dtype, the rest at their IR width."""
    out = tuple(s.arena.new(s.numel(op, i), s.t.act if t.dtype in ("fp32", "bf16", "fp16") else DTYPE_BYTES[t.dtype])
                for i, t in enumerate(op.types))
    return out if len(out) > 1 else out[0]
