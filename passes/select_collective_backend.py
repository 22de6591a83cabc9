"""select-collective-backend: which collectives may run over peer memory instead of NCCL.

Assumes: fusions ran (fuse-add-norm). Guarantees: for device cuda with `Options.p2p_collectives`,
every all-reduce, every dim-0 reduce-scatter or all-gather of a [rows, width] tensor, and the a2a
MoE exchange, over more than one rank (`comm.all_reduce`, `comm.reduce_scatter`, `comm.all_gather`,
`fused.allreduce_add_rms`, `fused.reduce_scatter_add_rms`, `moe.dispatch`, `moe.combine`) carries
`p2p_max_bytes`: a call whose message (`costs.comm_of`: an all-gather's output, a reduction's input,
the exchange's whole fixed-capacity buffer) is at most that many bytes runs the one-shot
peer-memory kernel (`codegen/templates/p2p_allreduce.py.j2`, the residual add and RMSNorm in the
same launch for the fused forms), a larger one NCCL. The threshold is where the one-shot's
and NCCL's latency models cross for the group size (`costs.p2p_max_bytes`: 4 MiB, the channel's
capacity, at 2 ranks, and for reduce-scatters, all-gathers and the exchange at any size; 214 KiB
for an all-reduce over 8), so decode steps take the kernel and long prefill chunks NCCL.
Broadcasts, cpu plans and `--no-p2p` plans are unchanged.

Example (GLM-5.3, tp8, decode):

    %L0.hn, %L0.h = fused.allreduce_add_rms(%L0.o, %x.ar) {eps=1e-05, group=[attn_tp], size=8, ...} : ...
 -> %L0.hn, %L0.h = fused.allreduce_add_rms(%L0.o, %x.ar) {eps=1e-05, group=[attn_tp], p2p_max_bytes=218768, size=8, ...} : ...
"""
from __future__ import annotations

from glmc.ir import Graph, Op

from .base import Pass, PassContext
from .costs import p2p_max_bytes
from .rewrite import Rewrite, apply_patterns

P2P_KINDS = {"comm.all_reduce": "all_reduce", "fused.allreduce_add_rms": "all_reduce",
             "comm.reduce_scatter": "reduce_scatter", "fused.reduce_scatter_add_rms": "reduce_scatter",
             "comm.all_gather": "all_gather", "moe.dispatch": "all_to_all", "moe.combine": "all_to_all"}


def _p2p(op: Op, graph: Graph):
    # collective -> collective {p2p_max_bytes=N} where the one-shot kernel can run it
    kind = P2P_KINDS.get(op.kind)
    if kind is None or op.attr("p2p_max_bytes") is not None or int(op.attr("size", 1)) < 2:
        return None
    shape = graph.type_of(op.operands[0]).shape
    if len(shape) != 2 or shape[1].sym or int(op.attr("dim", 0)) != 0:
        return None
    return Rewrite([op.with_attrs(p2p_max_bytes=p2p_max_bytes(kind, int(op.attr("size"))))])


class SelectCollectiveBackend(Pass):
    name = "select-collective-backend"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        if ctx.options.device != "cuda" or not ctx.options.p2p_collectives:
            return graph
        return apply_patterns(graph, [("p2p collective", _p2p)])
