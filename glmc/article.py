"""Cross-check of `glmc explain` against the figures of one published walk-through of GLM-5.3's
request path in SGLang.

The source (`SOURCE`) is a Chinese-language article, part one of a series: which operators and which
collectives a GLM-5.3 request goes through in SGLang, with each weight's size, the KV cache per
token and the communication bill per step of a tp8, tp8ep8 or dp8ep8 deployment. The repository
holds the figures it compares, quoted below as the article prints them (its units included), not
the article. `cross_check(d)` returns markdown rows: the article's figure, glmc's, and a note where
they differ (the article's arithmetic errors and unit slips included). Only for the GLM-5.3 shape,
at the default explain point (decode batch 32).
"""
from __future__ import annotations

# the article's title, and in English
SOURCE = ("GLM-5.3 推理全链路(一):一个请求在 SGLang 里经过哪些算子、哪些通信 (GLM-5.3 inference end to end, "
          "part 1: the operators and the collectives a request goes through in SGLang)")


def applies(d: dict) -> bool:
    return d["model"] == "glm-5.3" and d["comm"]["decode"]["point"]["B"] * \
        d["parallel"]["attn_dp"] == 32


def _layer(d, phase, kind):
    for layer, cells in sorted(d["comm"][phase]["per_layer"].items()):
        if layer != "-" and kind in cells:
            return cells[kind]["messages"]
    return []


def cross_check(d: dict) -> list[str]:
    p, m = d["params"], d["memory"]
    rows = [
        ("total parameters", "744B", f"{p['total'] / 1e9:.1f}B + MTP {p['mtp'] / 1e9:.1f}B",
         "744B excludes the MTP layer"),
        ("active parameters per token", "~40B", f"{p['active_per_token'] / 1e9:.1f}B", ""),
        ("KV elements per token per layer", "576", str(m["kv_elements_per_token_per_layer"]), ""),
        ("KV bytes per token (fp8, 78 layers)", "44.9KB", f"{m['kv_bytes_per_token']:,} B",
         "the article counts 576 B/layer; glmc allocates FlashMLA's 656 (+ 4 fp32 scales, bf16 RoPE part)"),
        ("indexer cache per token", "~2.8KB", f"{m['index_bytes_per_token']:,} B",
         "21 layers x (128 B key + 4 B scale)"),
        ("full / shared indexer layers", "21 / 57",
         f"{m['full_indexer_layers']} / {m['shared_indexer_layers']}", ""),
        ("decode FLOPs per token (b=1)", "83.3 GFLOP", f"{d['flops_per_token']['decode'] / 1e9:.1f} GFLOP",
         "the article's table omits the P.V product of sparse attention (+10.5G), the RoPE part of "
         "the scores, the shared expert (+5.7G), lm_head (+1.9G) and the indexer, and counts "
         "all 78 layers as MoE (75 are)"),
    ]
    if d["parallel"]["spec"] == "dp8ep8":
        gather = _layer(d, "decode", "all_gather")
        alt = d.get("moe_alternatives", {})
        disp = alt.get("a2a", {}).get("dispatch", {}).get("message_bytes", 0)
        comb = alt.get("a2a", {}).get("combine", {}).get("message_bytes", 0)
        g = alt.get("gather", {})
        n_g = g.get("reduce_scatter", {}).get("count", 0)
        rows += [
            ("DP all-gather per layer (batch 32)", "393KB", f"{gather[0]:,} B" if gather else "-",
             "32 x 6144 x 2 B"),
            ("DP gather + scatter per step", "156 x 393KB = 61MB (78 layers)",
             f"{2 * n_g} collectives over {n_g} MoE layers",
             "glmc replicates the 3 dense MLPs under DP attention, so only MoE layers gather"),
            ("EP dispatch per token (fp8)", "48KB", f"{d['ep_dispatch_bytes_per_token']:,} B",
             "payload; glmc also sends each row's fp32 weight and int32 expert id (+64 B/token)"),
            ("dispatch per step, 75 layers", "~113MB", f"{disp / 1e6:.1f} MB",
             "the article's 113 is MiB (117.96e6 B of payload = 112.5 MiB) labelled MB"),
            ("combine per step (bf16)", "~226MB", f"{comb / 1e6:.1f} MB", "likewise 225 MiB"),
            ("dp8ep8 decode MoE path", "DP gather + DeepEP dispatch/combine + scatter",
             "gather lowering OR dispatch/combine, chosen by cost",
             "the article adds both bills; they are alternative lowerings of one exchange"),
        ]
    if d["parallel"]["spec"] == "tp8ep8":
        rows.append(("o_proj reduction (tp8ep8)", "AllReduce", "reduce-scatter + deferred all-gather",
                     "same bytes, as the article's own section 4.7 describes"))
    rows += [
        ("dp+ep prefill of 8192 tokens, 75 layers", "90GB ... then '300GB over IB'", "-",
         "inconsistent: 1.2 GB/layer x 75 = 90 GB; the 300 GB (6 s over 50 GB/s IB) does not follow"),
        ("replicated A-projection per layer (fp8)", "~25MB", "16.1M params = 16.1 MB",
         "25 MB only with the indexer's 9.4M weights, which 57 shared layers do not have"),
    ]
    out = [f"Article: {SOURCE}", "", "| item | article | glmc | note |", "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {n} |" for a, b, c, n in rows]
    return out
