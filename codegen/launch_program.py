"""A CUDA plan's launch program: what one step of a phase launches, in order, recorded from the code
that runs it.

A step of the CUDA target is decided at run time by `cuda_target.IMPLS` and the launchers it calls.
This module records that decision instead of describing it a second time: `Recorder` watches an
executor (anything with the CUDA executor's `kernels`, `comm` and `impls` attributes: the runtime's
`CudaExecutor`; codegen imports no runtime, so `glmc.launches.meta_executor` builds one) while it runs,
at its seams (the kernel library, a TorchDispatchMode, the `Comm`, the op table for the IR op of
each launch), and writes one `Launch` per

- Triton kernel launch (`kind="triton"`): each `lib(ctx)[grid](*args)` of the executor's
  `KernelLibrary`; `name` is the plan's kernel (`kernels/<name>.py`), `grid` the grid, `args` the
  tensor arguments;
- cuBLAS GEMM (`"gemm"`): an aten mm / addmm / bmm / baddbmm, seen by a TorchDispatchMode;
- other torch op that launches a kernel (`"torch"`, the aten op's name): the same mode, less views
  and allocations, which launch nothing;
- collective (`"collective"`): a call of the executor's `Comm` (`name` its kind, `group` its mesh
  axes, `nbytes` the message in the cost model's convention); the torch ops inside it are the
  backend's (gloo's copies) and are not recorded. A collective the peer-memory kernel runs is that
  kernel's Triton launch.

Each launch names the IR op it ran for (`op`: its first result, `op_kind`, `layer`; launches
outside any op, such as the step's `step_inputs`, have op None). Every tensor storage a launch
reads or writes is a `Buffer` (an id, dtype, shape and bytes of its first view, the first and last
launch that uses it), so liveness, and from it memory, can be read off the program.

`trace(executor, phase, tokens)` records the body a CUDA graph of that phase captures (the decode
body per bucket of `tokens` requests; a prefill graph of `tokens` tokens) on an executor whose
tensors carry no data (the meta device: GLM-5.3's shapes, nothing allocated, no kernel run), after
one warm-up run as capture does. An op that cannot run without data is recorded as far as it ran,
listed in `Program.untraced` with the reason (and the ops its stand-in results, empty tensors of
its IR types, feed), never guessed; a lone rank's MoE all-to-all (`LoneComm` refuses it) stands
in by its shape, which is all a meta tensor has. The same recorder on an executor with real
tensors (the CPU under TRITON_INTERPRET=1) records what a real step launches, which is how
tests/test_launch_program.py shows the two are one program.

`Program.text()` is the plan directory's `launch/<phase>.txt`: one line per launch (kind, name,
grid, each argument's dtype and shape), the decoder layers folded as the IR folds them (identical
layers once, `layers 3..75 step 4 { ... }`); `counts(text)` reads the launches per layer and per
step back from it.
"""
from __future__ import annotations

import contextlib
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glmc.ir.text_values import format_layers, read_layers
from glmc.target import H200_SMS

KINDS = ("triton", "gemm", "torch", "collective")
GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})
# aten ops that launch no kernel: allocations and metadata (views are `func.is_view`)
NO_KERNEL = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like",
                       "lift_fresh", "detach", "alias", "_unsafe_view", "set_", "resize_", "sym_size",
                       "sym_stride", "sym_numel", "is_same_size", "_local_scalar_dense",
                       "scalar_tensor"})   # a Python scalar operand wrapped as a 0-dim tensor
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all_equal", "all_to_all")
IR_DTYPES = {"fp32": torch.float32, "fp8": torch.float8_e4m3fn, "i32": torch.int32, "i64": torch.int64,
             "u8": torch.uint8}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.float8_e4m3fn: "fp8", torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8",
                torch.bool: "bool"}


@dataclass(frozen=True)
class Buffer:
    """One tensor storage of a step: dtype and shape of its first view, its bytes, and the first
    and last launch (indices into `Program.launches`) that use it."""
    id: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class Launch:
    """One launch: `kind` (KINDS), `name` (kernel, aten op or collective kind), `grid` (Triton),
    `args` ((buffer id, dtype, shape) per tensor argument), the IR op it ran for, and for a
    collective its `group` (mesh axes) and `nbytes`."""
    kind: str
    name: str
    args: tuple = ()
    grid: tuple = ()
    op: str | None = None
    op_kind: str | None = None
    layer: int | None = None
    group: tuple = ()
    nbytes: int = 0

    def line(self) -> str:
        """The text form: `triton rms_norm_0 grid=(1,) bf16[1,6144] bf16[6144] -> ... # norm.rms`."""
        parts = [self.kind, self.name]
        if self.grid:
            parts.append("grid=(" + ",".join(map(str, self.grid)) + ")")
        if self.group:
            parts.append(f"group=[{','.join(self.group)}] bytes={self.nbytes}")
        parts += [f"{dtype}[{','.join(map(str, shape))}]" for _, dtype, shape in self.args]
        return " ".join(parts) + (f"  # {self.op_kind}" if self.op_kind else "")


@dataclass
class Program:
    """The launches of one step, in order, the buffers they use, and the ops not traced."""
    phase: str
    tokens: int
    launches: list[Launch] = field(default_factory=list)
    buffers: list[Buffer] = field(default_factory=list)
    untraced: list[tuple[str, int | None, str]] = field(default_factory=list)   # (op kind, layer, why)
    header: dict = field(default_factory=dict)
    # a sampled trace (`trace(sample=True)`): op result -> (the result of the op of its layer class's
    # first layer, which ran in its place and whose launches it makes; the op's own layer)
    aliases: dict[str, tuple[str, int]] = field(default_factory=dict)

    def per_layer(self) -> Counter:
        """Launches per decoder layer (None: outside the layers)."""
        out = Counter(x.layer for x in self.launches)
        made = Counter(x.op for x in self.launches)
        for same, layer in self.aliases.values():
            out[layer] += made[same]
        return out

    def op_launches(self) -> dict[str, list[Launch]]:
        """The launches each IR op makes, by the op's first result (a sampled trace's stood-in
        layers make their class representative's); ops that launch nothing are absent."""
        out: dict[str, list[Launch]] = {}
        for x in self.launches:
            if x.op is not None:
                out.setdefault(x.op, []).append(x)
        for op, (same, _) in self.aliases.items():
            if same in out:
                out[op] = out[same]
        return out

    def step_launches(self) -> list[Launch]:
        """The launches outside every op (the step's own: its inputs into the device table)."""
        return [x for x in self.launches if x.op is None]

    def text(self) -> str:
        """The folded text form (module docstring); `counts` reads it back."""
        if self.aliases:
            raise ValueError(f"{self.phase}: a sampled trace has no text form (trace without sample=True)")
        head = [f"# {self.phase}: {self.tokens} {'requests' if self.phase != 'prefill' else 'tokens'}, "
                f"{len(self.launches)} launches, {len(self.buffers)} buffers"
                + "".join(f", {k} {v}" for k, v in self.header.items())]
        missing: dict[tuple[str, str], list] = {}
        for kind, layer, why in self.untraced:
            missing.setdefault((kind, re.sub(r"\bL[0-9]+\.", "L.", why)), []).append(layer)
        head += [f"# not traced: {kind} (layers {format_layers([x for x in layers if x is not None])}): {why}"
                 for (kind, why), layers in missing.items()]
        return "\n".join(head + fold_lines(self.launches)) + "\n"


def fold_lines(launches: list[Launch]) -> list[str]:
    """Launch lines, each class of decoder layers whose lines are identical printed once inside
    `layers <set> {` ... `}` (ir/fold.py's classes: in order of their first layer); launches
    outside the layers stand as they are, where they ran."""
    out, i = [], 0
    while i < len(launches):
        if launches[i].layer is None:
            out.append(launches[i].line())
            i += 1
            continue
        j = i
        while j < len(launches) and launches[j].layer is not None:
            j += 1
        classes: dict[tuple[str, ...], list[int]] = {}
        k = i
        while k < j:    # a layer's launches are contiguous: the ops run layer by layer
            layer, body = launches[k].layer, []
            while k < j and launches[k].layer == layer:
                body.append(launches[k].line())
                k += 1
            classes.setdefault(tuple(body), []).append(layer)
        for body, layers in classes.items():
            out += [f"layers {format_layers(layers)} {{", *("  " + b for b in body), "}"]
        i = j
    return out


_LAYERS = re.compile(r"^layers (.*) \{$")


def counts(text: str) -> dict:
    """Launches of a program's text by kind: {"step": {kind: n}, "layers": {layer: {kind: n}},
    "outside": {kind: n}} (the folded blocks expanded)."""
    step, outside, layers, block = Counter(), Counter(), {}, None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LAYERS.match(line)
        if m:
            block = read_layers(m.group(1))
            continue
        if line == "}":
            block = None
            continue
        kind = line.split()[0]
        if block is None:
            outside[kind] += 1
            step[kind] += 1
            continue
        for layer in block:
            layers.setdefault(layer, Counter())[kind] += 1
            step[kind] += 1
    return {"step": dict(step), "layers": {k: dict(v) for k, v in sorted(layers.items())},
            "outside": dict(outside)}


# ----------------------------------------------------------------------------- recording
def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


class Recorder:
    """Records the launches of what runs while it watches an executor (module docstring).
    `with Recorder().watching(executor) as rec: ...`; then `rec.program(phase, tokens)`."""

    def __init__(self, kernel_names: dict[str, str] | None = None, stand_in: bool = False,
                 skip: frozenset = frozenset()):
        self.kernel_names = dict(kernel_names or {})    # repr(ctx) -> plan kernel name
        self.stand_in = stand_in   # an op that fails on data-less tensors: listed, its results stood in for
        self.skip = skip           # layers whose ops do not run: their results stood in for, nothing recorded
        self.launches: list[Launch] = []
        self.untraced: list[tuple[str, int | None, str]] = []   # (op kind, layer, why)
        self._stand_ins: set[int] = set()
        self._op = None
        self._quiet = 0            # inside a kernel or a collective: its own aten ops are not launches
        self._ids: dict = {}       # storage address -> buffer id
        self._held: list = []      # storages seen (kept alive: a freed one's address may come back)
        self._first: dict = {}     # buffer id -> (dtype, shape, nbytes, first launch)
        self._last: dict = {}

    # -- buffers and launches
    def _arg(self, t: torch.Tensor) -> tuple:
        s = t.untyped_storage()
        key = s._cdata            # the storage's address: unique while `_held` keeps it alive
        bid = self._ids.get(key)
        dtype = _DTYPE_NAMES.get(t.dtype) or str(t.dtype).removeprefix("torch.")
        if bid is None:
            bid = self._ids[key] = len(self._ids)
            self._held.append(s)
            self._first[bid] = (dtype, tuple(t.shape), s.nbytes(), len(self.launches))
        self._last[bid] = len(self.launches)
        return bid, dtype, tuple(t.shape)

    def add(self, kind: str, name: str, tensors=(), **kw) -> None:
        op = self._op
        args = tuple(self._arg(t) for t in tensors)
        self.launches.append(Launch(kind, name, args, op=op.results[0] if op else None,
                                    op_kind=op.kind if op else None, layer=op.layer if op else None, **kw))

    def program(self, phase: str, tokens: int, **header) -> Program:
        bufs = [Buffer(b, d, s, n, f, self._last[b]) for b, (d, s, n, f) in sorted(self._first.items())]
        return Program(phase, tokens, list(self.launches), bufs, list(self.untraced), header)

    @contextlib.contextmanager
    def quiet(self):
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    # -- the seams
    @contextlib.contextmanager
    def watching(self, executor):
        """Swap the executor's kernel library, op table and collectives for recording ones, and
        record aten ops, for the duration."""
        saved = executor.kernels, executor.impls
        executor.kernels = _Library(executor.kernels, self)
        executor.impls = {kind: self._op_of(fn) for kind, fn in executor.impls.items()}
        comm = executor.comm
        try:
            for name in COLLECTIVES:
                setattr(comm, name, self._collective(getattr(comm, name), name))
            with _Aten(self):
                yield self
        finally:
            executor.kernels, executor.impls = saved
            for name in COLLECTIVES:
                comm.__dict__.pop(name, None)

    def _op_of(self, fn):
        def run(op, args, ctx):
            if op.layer in self.skip:
                return self._placeholders(op, args, ctx)
            outer, self._op = self._op, op
            try:
                return fn(op, args, ctx)
            except Exception as e:
                if not self.stand_in or not any(t.device.type == "meta" for t in _tensors(args)):
                    raise
                after = any(id(t) in self._stand_ins for t in _tensors(args))
                why = "its operands come from an op not traced" if after else f"{type(e).__name__}: {e}"
                self.untraced.append((op.kind, op.layer, why))
                return self._placeholders(op, args, ctx)
            finally:
                self._op = outer
        return run

    def _placeholders(self, op, args, ctx):
        """Tensors of `op`'s IR types (T solved from an operand's rows, its type's first dim a
        multiple of T; activations in the compute dtype) in place of the results of an op that
        could not run without data."""
        dims = [(ctx.type_of(v).shape[0], a.shape[0]) for v, a in zip(op.operands, args) if isinstance(a, torch.Tensor)]
        env = {"T": next((rows * d.coeff.denominator // d.coeff.numerator for d, rows in dims if d.sym == "T"), 0),
               "S": getattr(ctx, "max_len", 0)}
        device = next(_tensors(args)).device
        out = tuple(torch.empty([d.eval(env) for d in t.shape],
                                dtype=ctx.ex.dtype if t.dtype == "bf16" else IR_DTYPES[t.dtype], device=device)
                    for t in op.types)
        self._stand_ins.update(id(t) for t in out)
        self._held.extend(out)    # ids stay unique
        return out if len(out) > 1 else out[0]

    def _collective(self, fn, name):
        comm = fn.__self__

        def run(*args, **kw):
            x, axes = args[0], args[1]
            kind = args[2] if name.startswith("all_to_all") else name
            sent = comm.counts[kind]["message_bytes"] if kind in comm.counts else 0
            with self.quiet():
                try:
                    out = fn(*args, **kw)
                except NotImplementedError:
                    # a lone rank's all-to-all (`LoneComm`): on tensors without data what the peers
                    # send is no matter, only its shape, which is the input's (equal chunks)
                    if not (self.stand_in and name == "all_to_all_equal" and x.device.type == "meta"):
                        raise
                    out = torch.empty_like(x)
                    comm.count(kind, args[3])
            nbytes = comm.counts[kind]["message_bytes"] - sent
            self.add("collective", kind, [*_tensors([x]), *_tensors([out])], group=tuple(axes), nbytes=nbytes)
            return out
        return run


class _Aten(TorchDispatchMode):
    """Every aten op that launches a kernel, as a "gemm" or "torch" launch."""

    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.rec._quiet or func.is_view or name in NO_KERNEL:
            return out
        tensors = list(_tensors(list(args) + list((kwargs or {}).values()))) + list(_tensors([out]))
        self.rec.add("gemm" if name in GEMM_OPS else "torch", name, tensors)
        return out


class _Library:
    """A KernelLibrary that records each launch and runs it only when its tensors hold data."""

    def __init__(self, lib, rec: Recorder):
        self.lib, self.rec = lib, rec

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def __call__(self, ctx):
        return _Kernel(self, ctx)


class _Kernel:
    def __init__(self, library: _Library, ctx):
        self.library, self.ctx = library, ctx

    def __getitem__(self, grid):
        lib, rec, ctx = self.library.lib, self.library.rec, self.ctx

        def launch(*args, **kw):
            key = repr(ctx)
            lib.path(ctx)      # a context the plan did not render raises KernelNotInPlan, as it runs
            name = rec.kernel_names.get(key, ctx.template)
            tensors = list(_tensors(args))
            rec.add("triton", name, tensors, grid=tuple(int(g) for g in grid))
            if not any(t.device.type == "meta" for t in tensors):
                with rec.quiet():
                    lib(ctx)[grid](*args, **kw)
        return launch


# ----------------------------------------------------------------------------- tracing
def static_inputs(executor, phase: str, tokens: int, requests: int | None = None) -> dict:
    """The static inputs a captured graph of `tokens` tokens reads, filled outside it: `packed`
    (`CudaExecutor.host_vectors`' layout: ids, positions, KV slots, rows, then per DP rank its
    padding; every token a padding token, as at capture), prefill's `last` (each request's last
    token: `requests`, by default min(tokens, max_reqs) as its graph holds), mtp_draft's `hidden`."""
    dev = executor.r2t.device
    packed = torch.zeros(4 + executor.dp_rows, tokens, dtype=torch.int64, device=dev)
    packed[2].fill_(executor.scratch), packed[3].fill_(executor.pad_row)
    last = (torch.zeros(requests or min(tokens, executor.pad_row), dtype=torch.int64, device=dev)
            if phase == "prefill" else None)
    hidden = (torch.zeros(tokens, executor.config.hidden_size, dtype=executor.dtype, device=dev)
              if phase == "mtp_draft" else None)
    return {"packed": packed, "last": last, "hidden": hidden}


def run_body(executor, phase: str, inputs: dict, max_len: int | None = None) -> None:
    """The body a CUDA graph of `phase` over `static_inputs` captures (`CudaExecutor._capture_one`):
    the per-token phases' `run_tokens`; prefill's body, its attention sized for the graph's longest
    sequence (`max_len`: an eager step's longest instead)."""
    if phase == "prefill":
        executor.prefill_body(inputs["packed"], inputs["last"], max_len or executor.prefill_max_len)
    else:
        executor.run_tokens(phase, inputs["packed"], inputs["hidden"], max_len=max_len)


def trace(executor, phase: str, tokens: int, num_sms: int = H200_SMS, warm: bool = True,
          requests: int | None = None, max_len: int | None = None, sample: bool = False) -> Program:
    """The launch program of one graph of `phase` at `tokens` tokens (decode: requests) on
    `executor` (a `CudaExecutor`; on the meta device nothing runs), grids sized for `num_sms` SMs
    where its device is not a GPU (`requests`, `max_len`: an eager prefill's instead of its graph's).
    `warm`: the body runs once first, its launches dropped, as capture warms up: what the target
    makes once and keeps (weights re-laid out for the absorbed MLA and the fused gate_up, RoPE
    frequencies) is then made, and the program holds what every step launches (an executor that
    ran a step of any phase is warm).
    `sample`: only the first layer of each class of identical layers (ir/fold.py) runs; the others'
    results are stood in for (empty tensors of their IR types) and `Program.aliases` maps their ops
    to the ones that ran: the same launch counts per op and per layer for a fraction of the work
    (GLM-5.3: 7 of 78 layers; a test holds the two equal), no text form and no buffers of the layers
    left out."""
    from glmc.codegen.triton_render import assume_sms

    names = {v: k for k, v in executor.plan.kernel_contexts.items()}
    skip, aliases = (executor.derived(("layer classes", phase), lambda: _layer_classes(executor.graphs[phase]))
                     if sample else (frozenset(), {}))
    with torch.no_grad(), assume_sms(num_sms):
        inputs = static_inputs(executor, phase, tokens, requests)
        for _ in range(2 if warm else 1):
            with Recorder(names, stand_in=True, skip=skip).watching(executor) as rec:   # on meta nothing launches
                run_body(executor, phase, inputs, max_len)
    graph_len = executor.prefill_max_len if phase == "prefill" else executor.max_context
    program = rec.program(phase, tokens, max_len=max_len or graph_len, sms=num_sms)
    program.aliases = aliases
    return program


def _layer_classes(graph) -> tuple[frozenset, dict[str, tuple[str, int]]]:
    """(the layers a sampled trace leaves out, {op result: its class representative's}): every
    layer of a class (`ir.fold.fold`) but the first; nothing if the layers do not fold."""
    from glmc.ir.fold import absolute, fold

    blocks = fold([op for op in graph.ops if op.layer is not None])
    skip, aliases = set(), {}
    for layers, body in blocks or ():
        first = [absolute(op, layers[0]).results[0] for op in body]
        for layer in layers[1:]:
            skip.add(layer)
            aliases.update((absolute(op, layer).results[0], (same, layer)) for op, same in zip(body, first))
    return frozenset(skip), aliases


def split(text: str) -> dict[int, str]:
    """The programs of one `launch/<phase>.txt` (one per token count, each from its `# <phase>:`
    header line on) by token count."""
    out, key = {}, None
    for line in text.splitlines(keepends=True):
        m = _HEADER.match(line)
        if m:
            key = int(m.group(1))
            out[key] = ""
        if key is not None:
            out[key] += line
    return out


_HEADER = re.compile(r"^# [a-z_]+: ([0-9]+) (?:requests|tokens),")
