"""IR types: symbolic dims, tensor types and per-mesh-axis placements.

A dim is an int or a symbol times a rational (`T`, `T*8`, `T/8`): `T` tokens in the step on one
attention-DP rank, `B` requests, `S` KV length. A placement maps mesh axes (size > 1 only) to
`R` (replicated), `S(d)` (sharded on tensor dim d) or `P` (partial sum); axes absent are `R`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction

SYMBOLS = ("T", "B", "S")


@dataclass(frozen=True, order=True)
class Dim:
    """`coeff * sym` (sym None means a plain integer `coeff`)."""
    sym: str | None
    coeff: Fraction

    @staticmethod
    def of(value: "int | str | Dim") -> "Dim":
        if isinstance(value, Dim):
            return value
        if isinstance(value, int):
            return Dim(None, Fraction(value))
        return parse_dim(value)

    def __mul__(self, k: int | Fraction) -> "Dim":
        return Dim(self.sym, self.coeff * k)

    def __truediv__(self, k: int) -> "Dim":
        if self.sym is None and self.coeff % k:
            raise ValueError(f"{self} is not divisible by {k}")
        return Dim(self.sym, self.coeff / k)

    def eval(self, env: dict[str, int]) -> int:
        """Value with the symbol bound; a fractional token count is padded up."""
        c = self.coeff                      # integer arithmetic: Fraction's is the compiler's hot spot
        if self.sym is None:
            return c.numerator // c.denominator
        return -(-env[self.sym] * c.numerator // c.denominator)

    def __str__(self) -> str:
        if self.sym is None:
            return str(int(self.coeff))
        n, d = self.coeff.numerator, self.coeff.denominator
        return self.sym + (f"*{n}" if n != 1 else "") + (f"/{d}" if d != 1 else "")


_DIM_RE = re.compile(r"^(?:(\d+)|([A-Z])(?:\*(\d+))?(?:/(\d+))?)$")


def parse_dim(text: str) -> Dim:
    m = _DIM_RE.match(text.strip())
    if not m:
        raise ValueError(f"bad dim {text!r}")
    if m.group(1):
        return Dim(None, Fraction(int(m.group(1))))
    return Dim(m.group(2), Fraction(int(m.group(3) or 1), int(m.group(4) or 1)))


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "i64": 8, "i32": 4}
FP8_SCALE_GROUP = 128   # an FP8 activation row carries one fp32 scale per 128 values (glmc.target.FP8_BLOCK)


def fp8_row_bytes(cols: int) -> int:
    """Bytes of one FP8 activation row as it travels: e4m3 values + an fp32 scale per 128 columns."""
    return cols + 4 * -(-cols // FP8_SCALE_GROUP)


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: str

    @staticmethod
    def of(shape, dtype: str) -> "TensorType":
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
        return TensorType(tuple(Dim.of(d) for d in shape), dtype)

    def numel(self, env: dict[str, int]) -> int:
        return math.prod(d.eval(env) for d in self.shape)

    def nbytes(self, env: dict[str, int]) -> int:
        return self.numel(env) * DTYPE_BYTES[self.dtype]

    def payload_bytes(self, env: dict[str, int]) -> int:
        """What a transfer of it moves: nbytes, with an fp8 tensor's per-row scales (fp8_row_bytes)."""
        if self.dtype != "fp8":
            return self.nbytes(env)
        return math.prod(d.eval(env) for d in self.shape[:-1]) * fp8_row_bytes(self.shape[-1].eval(env))

    def with_dim(self, i: int, dim: Dim) -> "TensorType":
        shape = list(self.shape)
        shape[i] = dim
        return TensorType(tuple(shape), self.dtype)

    def __str__(self) -> str:
        return "[" + ", ".join(map(str, self.shape)) + "] " + self.dtype


class Axis(str, Enum):
    """Mesh axes, in print order. attn_dp x attn_tp = world = ep x moe_tp."""
    ATTN_DP = "attn_dp"
    ATTN_TP = "attn_tp"
    EP = "ep"
    MOE_TP = "moe_tp"


AXIS_ORDER = [a.value for a in Axis]


@dataclass(frozen=True)
class Placement:
    """Per-axis placement; `items` holds only non-replicated axes, sorted."""
    items: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def of(mapping: dict[str, str]) -> "Placement":
        for axis, p in mapping.items():
            if axis not in AXIS_ORDER:
                raise ValueError(f"unknown mesh axis {axis!r}; known: {AXIS_ORDER}")
            if not re.match(r"^(R|P|S\(\d\))$", p):
                raise ValueError(f"bad placement {p!r} on {axis}; use R, P or S(d)")
        kept = {a: p for a, p in mapping.items() if p != "R"}
        return Placement(tuple(sorted(kept.items(), key=lambda kv: AXIS_ORDER.index(kv[0]))))

    def get(self, axis: str) -> str:
        return dict(self.items).get(axis, "R")

    def set(self, axis: str, p: str) -> "Placement":
        d = dict(self.items)
        d[axis] = p
        return Placement.of(d)

    def axes_with(self, p: str) -> list[str]:
        return [a for a, q in self.items if q == p]

    @property
    def is_replicated(self) -> bool:
        return not self.items

    def __str__(self) -> str:
        if not self.items:
            return "R"
        return "{" + ", ".join(f"{a}={p}" for a, p in self.items) + "}"


REPLICATED = Placement()
