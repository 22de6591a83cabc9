"""Compiler passes, in pipeline order. Each module holds one pass and its contract."""
from .base import PHASES, Options, Pass, PassContext, PassError
from .bucket_cuda_graphs import BucketCudaGraphs
from .estimate_cost import EstimateCost
from .expand_layers import ExpandLayers
from .fuse_add_norm import FuseAddNorm
from .fuse_qkv_norm_rope import FuseQKVNormRope
from .fuse_query_rope import FuseQueryRope
from .infer_shapes import InferShapes
from .insert_collectives import InsertCollectives
from .lower_moe import LowerMoE
from .plan_memory import PlanMemory
from .propagate_sharding import PropagateSharding
from .select_attention_backend import SelectAttentionBackend
from .select_collective_backend import SelectCollectiveBackend
from .select_mla_form import SelectMLAForm
from .share_indexer import ShareIndexer

PIPELINE: list[Pass] = [
    ExpandLayers(), InferShapes(), PropagateSharding(), InsertCollectives(), LowerMoE(),
    FuseAddNorm(), FuseQKVNormRope(), FuseQueryRope(), ShareIndexer(), SelectMLAForm(),
    SelectAttentionBackend(), SelectCollectiveBackend(), BucketCudaGraphs(), PlanMemory(), EstimateCost(),
]
PASS_NAMES = [p.name for p in PIPELINE]

__all__ = ["Options", "Pass", "PassContext", "PassError", "PHASES", "PIPELINE", "PASS_NAMES"]
