"""expand-layers: the YAML op program -> one IR graph for a phase.

Assumes: a validated ModelSpec. Guarantees: for prefill / decode / mtp_verify, prologue +
num_hidden_layers decoder layers + epilogue; for mtp_draft, the MTP prologue + one decoder layer
(index num_hidden_layers, MoE, full indexer) + MTP epilogue. Each statement is kept where all its
`when` tags hold; values are named `L<i>.<name>`; types are not inferred yet. Layer 2 of GLM-5.3
owns an indexer, layer 3 (shared) reuses its top-k:

Example (GLM-5.3, tp1, decode):

    %L2.topk = idx.topk(%L2.iq, %L2.iw, %L2.icache) {head_dim=128, heads=32, k=2048} : ?  # L2
    %L3.topk = idx.reuse(%L2.topk) : ?  # L3
"""
from __future__ import annotations

from glmc.ir import Graph, Op

from glmc.spec import Statement

from .base import Pass, PassContext, PassError
from .expr import evaluate


class ExpandLayers(Pass):
    name = "expand-layers"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        spec, cfg = ctx.spec, ctx.spec.config
        prog = spec.program
        ops: list[Op] = []
        env = _Env(ctx)
        if ctx.phase == "mtp_draft":
            mtp = cfg.num_hidden_layers
            env.emit(ops, prog.mtp_prologue, layer=mtp, tags={"moe", "full"}, prefix=f"L{mtp}.")
            env.layer(ops, mtp, {"moe", "full"})
            env.emit(ops, prog.mtp_epilogue, layer=mtp, tags={"moe", "full"}, prefix=f"L{mtp}.")
        else:
            env.emit(ops, prog.prologue, layer=None, tags=set(), prefix="")
            for i, (idx, mlp) in enumerate(zip(cfg.layer_indexer_types(), cfg.layer_mlp_types())):
                env.layer(ops, i, {idx, "moe" if mlp == "sparse" else "dense"})
            env.emit(ops, prog.epilogue, layer=None, tags=set(), prefix="")
        return graph.with_ops(ops, phase=ctx.phase, model=spec.name, parallel=ctx.parallel.name,
                              mesh=ctx.parallel.mesh)


class _Env:
    """Name scopes while expanding: program names -> IR values, per layer."""

    def __init__(self, ctx: PassContext):
        self.ctx = ctx
        self.cfg = ctx.spec.config
        self.names: dict[str, str] = {}     # program name -> current IR value
        # config fields by HF name, plus what the program needs derived: rope_scaling as the rope
        # ops' `scaling` attribute (None for a plain RoPE), the yarn-aware softmax scale
        self.fields = {**self.cfg.model_dump(), "softmax_scale": self.cfg.softmax_scale,
                       "rope_scaling": self.cfg.rope_scaling_attr}

    def layer(self, ops: list[Op], i: int, tags: set[str]) -> None:
        self.emit(ops, self.ctx.spec.program.layer, layer=i, tags=tags, prefix=f"L{i}.")
        self.names["x"] = self.names.pop("x_out")
        if "full" in tags:
            self.names["topk_prev"] = self.names["topk"]

    def emit(self, ops: list[Op], stmts, layer, tags: set[str], prefix: str) -> None:
        tags = tags | {self.ctx.phase}
        for st in stmts:
            if not set(st.when) <= tags:
                continue
            try:
                ops.append(self._op(st, layer, prefix))
            except (KeyError, ValueError) as e:
                where = f"layer {layer}, " if layer is not None else ""
                raise PassError(f"expand-layers: {where}statement {st.op} -> {st.out}: {e}") from e

    def _op(self, st: Statement, layer, prefix: str) -> Op:
        args = [self.names[a] for a in st.args]
        outs = (st.out,) if isinstance(st.out, str) else st.out
        results = [prefix + o for o in outs]
        attrs = {k: self._attr(v, layer) for k, v in st.attrs.items()}
        attrs = {k: v for k, v in attrs.items() if v is not None}  # an optional attr left unset
        for o, r in zip(outs, results):
            self.names[o] = r
        return Op.make(st.op, results, args, attrs, layer)

    def _attr(self, v, layer):
        if isinstance(v, list):
            return tuple(self._attr(x, layer) for x in v)
        if not isinstance(v, str):
            return v
        if v.startswith("="):
            self.fields["L"] = layer if layer is not None else -1
            return evaluate(v[1:], self.fields)
        if v.startswith("$"):
            return getattr(self.ctx.spec.dtypes, v[1:])
        if "{L}" in v:
            return v.replace("{L}", f"model.layers.{layer}")
        return v
