"""bucket-cuda-graphs: the batch sizes whose decode / MTP steps are captured as CUDA graphs.

Assumes: a phase; `Options.max_batch` is the requests one DP rank runs at once (`glmc run
--max-running`, per DP rank). Guarantees: `meta.cuda_graph_buckets` (per DP rank) — decode and
mtp_draft: powers of two and their midpoints up to max_batch; mtp_verify: each decode bucket x the
verify tokens per request (draft tokens); prefill: none (eager or piecewise).

Example (GLM-5.3, tp1, decode, max_batch=32):

 -> #! cuda_graph_buckets = [1, 2, 4, 8, 12, 16, 24, 32]

Every DP rank of dp8ep8 runs up to max_batch requests, so it gets the same buckets:

Example (GLM-5.3, dp8ep8, decode, max_batch=32):

 -> #! cuda_graph_buckets = [1, 2, 4, 8, 12, 16, 24, 32]
"""
from __future__ import annotations

from glmc.ir import Graph

from .base import Pass, PassContext


def decode_buckets(max_batch: int) -> list[int]:
    out, b = [1, 2, 4], 8
    while b <= max_batch:
        out += [b, b + b // 2]
        b *= 2
    return sorted(x for x in set(out) if x <= max_batch)


class BucketCudaGraphs(Pass):
    name = "bucket-cuda-graphs"

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        buckets = decode_buckets(max(1, ctx.options.max_batch))
        if ctx.phase == "prefill":
            buckets = []
        elif ctx.phase == "mtp_verify":
            buckets = [b * ctx.options.mtp_draft_tokens for b in buckets]
        return graph.with_ops(graph.ops, cuda_graph_buckets=buckets)
