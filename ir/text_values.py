"""Values in the IR text (attributes and graph metadata), printed and read back exactly.

    {eps=1e-05, group=[attn_tp], weight=.post_attention_layernorm.weight}          (attributes)
    #! indexer = {full_layers: [0..2, 6..74 step 4], shared_from: {3..5: 2, 7..9: 6}}  (metadata)

JSON's values (null, true/false, numbers as Python prints them, strings, lists, dicts with string
keys) with three changes that keep lines short and readable:
- a string that reads as a name prints bare (`fp8`, `model.norm.weight`, `.mlp.experts`, dict keys
  like `full_layers`); anything else, and the words `true false null inf nan`, prints JSON-quoted;
- evenly spaced non-negative integers print as a range where that is shorter: `0..2` is 0, 1, 2 and
  `6..74 step 4` is 6, 10, ..., 74, in lists and as dict keys (`{3..5: 2}` is `{"3": 2, "4": 2,
  "5": 2}`: keys are strings, as in JSON, and those that are decimal numbers print as numbers);
- `format_lines` breaks a value wider than the line into one entry per line (metadata only).
Lists read back as lists (ops freeze them to tuples). A dict's entries print sorted (decimal keys in
numeric order, first), so dict order is not kept: graphs compare metadata as JSON does.
"""
from __future__ import annotations

import json
import re

WIDTH = 120
_BARE = re.compile(r"^[A-Za-z_.][A-Za-z0-9_.\-]*$")
_RESERVED = {"true": True, "false": False, "null": None}
_NUMBER_WORDS = ("inf", "nan")
_INT = re.compile(r"^-?[0-9]+$")
_FLOAT = re.compile(r"^-?([0-9]+\.[0-9]+(e[+-]?[0-9]+)?|[0-9]+e[+-]?[0-9]+|inf)$|^nan$")
_RANGE = re.compile(r"^([0-9]+)\.\.([0-9]+)$")
_PUNCTUATION = set("[]{},=:")
_TOKEN = re.compile(r'\s*("(?:[^"\\]|\\.)*"|[\[\]{},=:]|[^\s\[\]{},=:"]+)')


def format_value(value) -> str:
    """One value on one line."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        bare = _BARE.match(value) and value not in _RESERVED and value not in _NUMBER_WORDS
        return value if bare else json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in _entries(value)) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_items(value)) + "]"
    raise TypeError(f"cannot print {type(value).__name__} {value!r} in the IR")


def format_lines(value, head: str, width: int = WIDTH, indent: int = 0) -> list[str]:
    """`head + value`, on one line if it fits in `width`, else a container's entries one per line
    (nested ones likewise), indented two spaces a level."""
    lead = " " * indent + head
    flat = lead + format_value(value)
    if len(flat) <= width or not value or not isinstance(value, dict | list | tuple):
        return [flat]
    if isinstance(value, dict):
        parts = [format_lines(v, f"{k}: ", width, indent + 2) for k, v in _entries(value)]
        opening, close = "{", "}"
    else:
        parts = [[" " * (indent + 2) + item] for item in _items(value)]
        opening, close = "[", "]"
    for part in parts[:-1]:
        part[-1] += ","
    return [lead + opening, *(line for part in parts for line in part), " " * indent + close]


def format_layers(layers) -> str:
    """A set of layer numbers: `0..2, 6..74 step 4`."""
    return ", ".join(text for _, text in _int_runs(sorted(layers)))


def _int_runs(nums: list[int]) -> list[tuple[int, str]]:
    """(first, text) of greedy runs of evenly spaced increasing ints, each written as a range
    where that is shorter than the list."""
    out, i = [], 0
    while i < len(nums):
        j = i + 1
        step = nums[j] - nums[i] if j < len(nums) else 0
        while step > 0 and j < len(nums) and nums[j] - nums[j - 1] == step:
            j += 1
        span = f"{nums[i]}..{nums[j - 1]}" + (f" step {step}" if step != 1 else "")
        if j - i < 3 or len(span) >= len(", ".join(map(str, nums[i:j]))):
            j, span = i + 1, str(nums[i])
        out.append((nums[i], span))
        i = j
    return out


def _items(seq) -> list[str]:
    if seq and all(type(x) is int and x >= 0 for x in seq):
        return [text for _, text in _int_runs(list(seq))]
    return [format_value(x) for x in seq]


def _is_decimal(key) -> bool:
    return isinstance(key, str) and key.isascii() and key.isdigit() and str(int(key)) == key


def _entries(d: dict) -> list[tuple[str, object]]:
    """(key text, value), sorted: decimal keys with equal values grouped into ranges, then names."""
    d = {str(k) if type(k) is int else k: v for k, v in d.items()}  # JSON's keys are strings
    by_value: dict[str, list[int]] = {}
    for k in sorted((k for k in d if _is_decimal(k)), key=int):
        by_value.setdefault(format_value(d[k]), []).append(int(k))
    numeric = sorted((first, text, d[str(keys[0])]) for keys in by_value.values()
                     for first, text in _int_runs(keys))
    named = sorted(k for k in d if not _is_decimal(k))
    return [(text, v) for _, text, v in numeric] + [(format_value(k), d[k]) for k in named]


# -- reading ------------------------------------------------------------------------------------
class _Reader:
    """Tokens of a value (or of `k=v, ...` attributes), read front to back."""

    def __init__(self, text: str):
        self.toks, pos = [], 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m:
                if text[pos:].strip():
                    raise ValueError(f"cannot read {text[pos:]!r}")
                break
            self.toks.append(m.group(1))
            pos = m.end()
        self.i = 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise ValueError(f"expected {want or 'a value'}, got {tok or 'the end'!r}")
        self.i += 1
        return tok

    def entries(self, close: str | None):
        """Yields once per entry of a container whose opening bracket was taken (None: of the whole
        text); eats the commas between entries and the closing bracket."""
        first = True
        while self.peek() != close:
            if not first:
                self.take(",")
            first = False
            yield
        if close is not None:
            self.take(close)

    def ints(self, tok: str) -> list[int] | None:
        """The ints of a range (`a..b`, `a..b step s`) or of a non-negative int; None otherwise."""
        if _INT.match(tok) and tok[0] != "-":
            return [int(tok)]
        m = _RANGE.match(tok)
        if not m:
            return None
        step = 1
        if self.peek() == "step":
            self.take()
            step = int(self.take())
        return list(range(int(m[1]), int(m[2]) + 1, step))

    def value(self, tok: str | None = None):
        """The value that starts with `tok` (already taken) or with the next token."""
        tok = self.take() if tok is None else tok
        if tok == "[":
            out = []
            for _ in self.entries("]"):
                item = self.take()
                out += self.ints(item) if _RANGE.match(item) else [self.value(item)]
            return out
        if tok == "{":
            out = {}
            for _ in self.entries("}"):
                key = self.take()
                ints = self.ints(key)
                keys = [str(i) for i in ints] if ints is not None else \
                    [json.loads(key) if key.startswith('"') else key]
                self.take(":")
                out.update(dict.fromkeys(keys, self.value()))
            return out
        return _scalar(tok)


def _scalar(tok: str):
    if tok.startswith('"'):
        return json.loads(tok)
    if tok in _RESERVED:
        return _RESERVED[tok]
    if _INT.match(tok):
        return int(tok)
    if _FLOAT.match(tok):
        return float(tok)
    if tok in _PUNCTUATION or _RANGE.match(tok):
        raise ValueError(f"unexpected {tok!r}")
    return tok


def read_value(text: str):
    """The value `text` holds (the inverse of `format_value`, and of `format_lines` joined)."""
    r = _Reader(text)
    out = r.value()
    if r.peek() is not None:
        raise ValueError(f"unexpected {r.peek()!r} after the value")
    return out


def read_attrs(text: str) -> dict:
    """`k=v, k=v` -> {k: v}."""
    r, out = _Reader(text), {}
    for _ in r.entries(None):
        key = r.take()
        r.take("=")
        out[key] = r.value()
    return out


def read_layers(text: str) -> list[int]:
    """The inverse of `format_layers`."""
    layers = read_value(f"[{text}]")
    if not layers or not all(type(x) is int for x in layers):
        raise ValueError(f"not a set of layers: {text!r}")
    return layers
