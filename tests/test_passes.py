"""Per-pass checks, FileCheck-style on the printed IR: each pass's contract from its docstring."""
import re

import pytest
from glmc.ir import Graph, print_graph
from glmc.passes import PIPELINE, PassContext

from glmc.compiler import CompileError
from glmc.config import Options
from glmc.parallel import parse_parallel
from tests.compile_util import FULL, TINY, graph, ir, spec


def after(name: str, model: str, par: str, phase: str, **opts) -> Graph:
    """The graph right after pass `name`."""
    s = spec(model)
    ctx = PassContext(s, parse_parallel(par, s.config), phase, Options(**opts))
    g = Graph([])
    for p in PIPELINE:
        g = p.run(g, ctx)
        if p.name == name:
            return g
    raise KeyError(name)


def lines(text: str, pattern: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(pattern, line)]


def test_expand_layers_variants():
    g = after("expand-layers", FULL, "tp1", "decode")
    text = print_graph(g, fold=False)
    assert len(lines(text, r"= idx\.topk\(")) == 21
    assert len(lines(text, r"= idx\.reuse\(")) == 57
    assert len(lines(text, r"= moe\.experts\(")) == 75
    assert len(lines(text, r"= mlp\.swiglu\(.*parallel=dense")) == 3
    assert lines(text, r"%L3\.topk = idx\.reuse\(%L2\.topk\) : \?")
    # shared layers own no indexer weights
    assert not lines(text, r"model\.layers\.3\.self_attn\.indexer")
    mtp = print_graph(after("expand-layers", FULL, "tp1", "mtp_draft"), fold=False)
    assert lines(mtp, r"%L78\.x = linear\(%L78\.eh\) .*eh_proj")


def test_infer_shapes_types_every_value():
    text = print_graph(after("infer-shapes", FULL, "tp1", "decode"), fold=False)
    assert " : ?" not in text
    assert lines(text, r"%L0\.a = mla\.a_proj.* : \[T, 2784\] bf16")
    assert lines(text, r"%L0\.kv = mem\.kv_write.* : \[S, 576\] fp8")
    assert lines(text, r"%L3\.a = mla\.a_proj.* : \[T, 2624\] bf16")


def test_no_communication_at_tp1():
    text = ir(FULL, "tp1", "decode")
    assert not lines(text, r"comm\.|moe\.dispatch|moe\.combine|allreduce|reduce_scatter|@ \{")


def test_tp8_ledger_two_allreduces_per_layer():
    text = ir(FULL, "tp8", "decode")
    # layer i's input norm reduces layer i-1's FFN; its post-attention norm reduces o_proj
    for layer in (1, 3, 77):
        assert len(lines(text, rf"fused\.allreduce_add_rms.*# L{layer}$")) == 2, layer
    assert len(lines(text, r"fused\.allreduce_add_rms.*# L0$")) == 1
    assert lines(text, r"%xf, %L77\.x_out = fused\.allreduce_add_rms\(%L77\.ffn, %L77\.h\)")
    assert lines(text, r"%x\.ar = comm\.all_reduce\(%x\) \{group=\[attn_tp\], p2p_max_bytes=\d+, size=8\}")
    assert lines(text, r"%logits\.ag = comm\.all_gather\(%logits\) \{dim=1, group=\[attn_tp\]")
    assert lines(text, r"%L0\.q = linear\(.*tp=8.* : \[T, 2048\] bf16 @ \{attn_tp=S\(1\)\}")


def test_tp8ep8_reduce_scatter_then_all_gather_and_ep():
    text = ir(FULL, "tp8ep8", "prefill")
    assert lines(text, r"%L5\.hn, %L5\.h = fused\.reduce_scatter_add_rms\(%L5\.o, %L4\.x_out\)")
    assert lines(text, r"%L5\.xn\.ag = comm\.all_gather\(%L5\.xn\) \{group=\[attn_tp\], p2p_max_bytes=\d+, size=8\} "
                       r": \[T, 6144\]")
    assert lines(text, r"moe\.dispatch\(%L5\.hn, %L5\.route_w, %L5\.route_ids\) \{dtype=fp8")


def test_dp8ep8_attention_is_local_and_moe_lowerings():
    gather = ir(FULL, "dp8ep8", "decode", moe_a2a=False)
    layer5 = lines(gather, r"# L5$")
    # the tokens gathered, the router run again on them (its weights and ids not gathered)
    assert [l.split(" = ")[1].split("(")[0] for l in layer5 if "comm." in l] == \
        ["comm.all_gather", "comm.reduce_scatter"]
    assert lines(gather, r"%L5\.hn\.ag = comm\.all_gather\(%L5\.hn\) \{group=\[attn_dp\], p2p_max_bytes=\d+, size=8\} "
                        r": \[T\*8, 6144\] bf16 @ R")
    assert lines(gather, r"%L5\.route_w\.all, %L5\.route_ids\.all = moe\.topk\(%L5\.router\.all\).* : \[T\*8, 8\] fp32 @ R")
    assert lines(gather, r"%L5\.routed = moe\.experts\(%L5\.hn\.ag, %L5\.route_w\.all, %L5\.route_ids\.all\)")
    assert not lines(gather, r"moe\.gate\(%L5\.hn\)")
    a2a = ir(FULL, "dp8ep8", "decode", moe_a2a=True)
    assert not lines(a2a, r"comm\.")
    assert lines(a2a, r"%L5\.routed\.cb = moe\.combine\(%L5\.routed, %L5\.hn\).* : \[T, 6144\] bf16 @ \{attn_dp=S\(0\)\}")
    assert lines(a2a, r"%L5\.routed = moe\.experts\(%L5\.routed\.dx.*out_dtype=bf16.* : \[T\*8, 6144\] bf16 @ \{ep=S\(0\)\}")


def test_lower_moe_picks_by_cost_and_refuses_a2a_with_moe_tp():
    assert graph(FULL, "dp8ep8", "prefill").meta["moe_lowering"]["choice"] == "a2a"
    assert graph(FULL, "dp2ep2", "prefill").meta["moe_lowering"]["choice"] == "gather"
    # the gather form's routing: recomputed on a decode step's gathered tokens, gathered for an 8K chunk
    assert graph(FULL, "dp2ep2", "prefill").meta["moe_lowering"]["routing"] == "gather"
    assert graph(FULL, "dp2ep2", "decode").meta["moe_lowering"]["routing"] == "recompute"
    assert lines(ir(FULL, "dp2ep2", "prefill"), r"%L5\.route_ids\.ag = comm\.all_gather\(%L5\.route_ids\)")
    # --moe-routing forces either way
    assert lines(ir(FULL, "dp2ep2", "decode", moe_routing="gather"), r"%L5\.route_ids\.ag = comm\.all_gather")
    assert lines(ir(FULL, "dp2ep2", "prefill", moe_routing="recompute"), r"%L5\.router\.all = moe\.gate\(%L5\.hn\.ag\)")
    with pytest.raises(CompileError, match="moe_routing 'nearest': gather or recompute"):
        graph(FULL, "dp2ep2", "decode", moe_routing="nearest")
    with pytest.raises(CompileError, match=r"lower-moe.*moe_tp 2 \(world 8 / ep 4\)"):
        graph(FULL, "tp8ep4", "decode", moe_a2a=True)


def test_fusions_and_deferred_reduction():
    text = ir(FULL, "tp8", "decode")
    # the MoE partial sum of layer 3 is reduced inside layer 4's input norm
    assert lines(text, r"%L4\.xn, %L3\.x_out = fused\.allreduce_add_rms\(%L3\.ffn, %L3\.h\).*# L4$")
    assert len(lines(text, r"fused\.qkv_a_norm_rope_write_index\(")) == 21
    assert len(lines(text, r"fused\.qkv_a_norm_rope_write\(")) == 57
    assert not lines(text, r"mem\.kv_write|mem\.index_k_write")
    # left alone: layer 0's input norm (no add before it), shared + routed (both partial)
    assert [l.split(" = ")[0] for l in lines(text, r"= norm\.rms\(")] == ["%L0.xn"]
    assert len(lines(text, r"%L\d+\.ffn = elt\.add\(%L\d+\.shared, %L\d+\.routed\)")) == 75


def test_share_indexer():
    g = graph(FULL, "tp1", "decode")
    text = print_graph(g, fold=False)
    assert not lines(text, r"idx\.reuse")
    assert lines(text, r"%L5\.attn = attn\.mla_absorbed\(%L5\.q_nope, %L5\.q_pe_a, %L5\.kv, %L2\.topk, %positions\)")
    assert g.meta["indexer"]["full_layers"][:4] == [0, 1, 2, 6]
    assert g.meta["indexer"]["shared_from"]["77"] == 74


@pytest.mark.parametrize("phase", ["prefill", "decode", "mtp_draft", "mtp_verify"])
def test_query_ropes_fold_into_their_readers_on_cuda_only(phase):
    """Every query RoPE of a CUDA plan is turned by its reader (the indexer on full layers, the
    attention on every layer), in every phase; a CPU plan keeps its rope ops."""
    cuda, cpu = ir(TINY, "tp8", phase), ir(TINY, "tp8", phase, device="cpu")
    attn, topk = lines(cuda, r"= attn\."), lines(cuda, r"= idx\.topk\(")
    assert not lines(cuda, r"rope\.apply") and attn and topk
    assert all(re.search(r", %(L\d+\.)?positions\) \{", l) for l in attn + topk)   # mtp_draft: its own input
    assert len(lines(cpu, r"rope\.apply")) == len(attn) + len(topk)


def test_mla_form_and_backend_per_phase():
    assert lines(ir(TINY, "tp1", "prefill"), r"attn\.mla_mha\(.*backend=triton_sparse_prefill")
    assert lines(ir(TINY, "tp1", "decode"), r"attn\.mla_absorbed\(.*backend=triton_sparse_mla_decode")
    assert lines(ir(TINY, "tp1", "decode", device="cpu"), r"attn\.mla_absorbed\(.*backend=torch")


def test_buckets_and_memory_plan():
    d = graph(FULL, "dp8ep8", "decode").meta    # max_batch is per DP rank: the same buckets as tp1's
    assert d["cuda_graph_buckets"] == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    assert graph(FULL, "dp8ep8", "decode", max_batch=32).meta["cuda_graph_buckets"][-1] == 32
    v = graph(FULL, "tp8", "mtp_verify").meta["cuda_graph_buckets"]
    assert v[:3] == [6, 12, 24] and v[-1] == 128 * 6
    assert graph(FULL, "tp8", "prefill").meta["cuda_graph_buckets"] == []
    mem = d["memory"]
    assert mem["kv_bytes_per_token"] == (512 + 4 * 4 + 64 * 2) * 78   # FlashMLA fp8 rows
    assert mem["index_bytes_per_token"] == (128 + 4) * 21 and mem["index_layers"] == 21


def test_failing_pass_is_named_with_those_before():
    with pytest.raises(CompileError, match=r"pass lower-moe failed \(passes before it: expand-layers, "
                                           r"infer-shapes, propagate-sharding, insert-collectives\)"):
        graph(FULL, "tp8ep4", "prefill", moe_a2a=True)


def test_topk_broadcast_option():
    text = ir(TINY, "tp8", "decode", topk_broadcast=True)
    assert lines(text, r"%L0\.topk\.bc = comm\.broadcast\(%L0\.topk\)")
    assert lines(text, r"attn\.mla_absorbed\(%L1\.q_nope, %L1\.q_pe_a, %L1\.kv, %L0\.topk\.bc, %positions\)")
    assert not lines(ir(TINY, "dp8ep8", "decode", topk_broadcast=True), r"comm\.broadcast")


def test_select_collective_backend_thresholds_by_group_size():
    """Small collectives take the one-shot peer-memory kernel: all-reduces and dim-0 reduce-scatters
    and all-gathers over > 1 rank carry p2p_max_bytes (4 MiB, the channel's capacity, at 2 ranks; an
    all-reduce's crossing with NCCL at 8, below GLM-5.3's [32, 6144] bf16 decode message); nothing
    else does, nor a cpu plan, nor --no-p2p."""
    def marked(g):
        return {(op.kind, op.attr("p2p_max_bytes")) for op in g.ops if op.attr("p2p_max_bytes") is not None}
    tp2 = marked(graph(FULL, "tp2", "decode"))
    assert tp2 == {("comm.all_reduce", 4 * 2**20), ("fused.allreduce_add_rms", 4 * 2**20)}
    tp8 = marked(graph(FULL, "tp8", "decode"))
    assert {k for k, _ in tp8} == {"comm.all_reduce", "fused.allreduce_add_rms"}
    (limit,) = {v for _, v in tp8}
    assert 8 * 6144 * 2 < limit < 32 * 6144 * 2
    g = graph(FULL, "tp8ep8", "decode")
    kinds = {k for k, _ in marked(g)}
    assert {"fused.reduce_scatter_add_rms", "comm.all_gather"} <= kinds
    for op in g.ops:                 # the vocab-parallel logits gather (dim 1) stays NCCL's
        if op.kind == "comm.all_gather":
            assert (op.attr("p2p_max_bytes") is None) == bool(op.attr("dim", 0)), op.where()
    assert not marked(graph(FULL, "tp8", "decode", device="cpu"))
    assert not marked(graph(FULL, "tp8", "decode", p2p_collectives=False))
    assert not marked(graph(FULL, "tp1", "decode"))


def test_a_query_rope_stays_where_its_reader_could_not_turn_it():
    """fuse-query-rope's rule folds a query RoPE into its reader only when the reader is its one
    user and its positions are the step's input: a rope with a second reader, or one turned by
    other positions, stays."""
    from dataclasses import replace

    from glmc.ir.dialect import ROPE_READERS
    from glmc.passes.fuse_query_rope import fold_query_rope
    g = graph(TINY, "tp1", "decode", device="cpu")   # the cpu plan keeps its ropes

    def reader_of_rope(g):
        return next(op for op in g.ops if op.kind in ROPE_READERS
                    and g.producer(op.operands[ROPE_READERS[op.kind][0]]).kind == "rope.apply")
    op = reader_of_rope(g)
    assert fold_query_rope(op, g) is not None
    twice = g.with_ops([*g.ops, replace(op, results=tuple(r + ".again" for r in op.results))])
    assert fold_query_rope(reader_of_rope(twice), twice) is None
    rope = g.producer(op.operands[ROPE_READERS[op.kind][0]])
    other = rope.operands[0]   # any value that is not the step's positions input
    moved = g.with_ops([replace(o, operands=(o.operands[0], other)) if o is rope else o for o in g.ops])
    assert fold_query_rope(reader_of_rope(moved), moved) is None
