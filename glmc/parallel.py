"""Parallelism specs: `tp{N}`, `tp{N}ep{M}`, `dp{N}ep{M}`, `dp{a}tp{b}ep{c}`.

The world is factored twice: attention as attn_dp x attn_tp, MoE as ep x moe_tp. `tp8` = attention
TP 8 and MoE TP 8; `tp8ep8` = attention TP 8, EP 8; `dp8ep8` = attention DP 8, EP 8 (world 8);
`dp4tp2ep8` = attention DP 4 x TP 2, EP 8. Validation errors print the numbers.
"""
from __future__ import annotations

import re

from .config import GlmConfig, Mesh

_SPEC = re.compile(r"^(?:dp(?P<dp>\d+))?(?:tp(?P<tp>\d+))?(?:ep(?P<ep>\d+))?$")


class ParallelError(ValueError):
    """An invalid parallel spec; the message shows the numbers."""


Parallel = Mesh   # a parsed spec is the mesh a plan carries (`glmc.config.Mesh`)


def parse_parallel(text: str, config: GlmConfig | None = None) -> Parallel:
    """Parse and (given a config) validate a spec; `dp` alone or `ep` alone are not specs."""
    m = _SPEC.match(text.strip().lower())
    if not m or not text.strip() or (m["dp"] and not m["ep"]) or (m["ep"] and not (m["tp"] or m["dp"])):
        raise ParallelError(f"parallel spec {text!r}: use tp{{N}}, tp{{N}}ep{{M}}, dp{{N}}ep{{M}} "
                            "or dp{a}tp{b}ep{c} (e.g. tp8, tp8ep8, dp8ep8, dp4tp2ep8)")
    dp, tp, ep = int(m["dp"] or 1), int(m["tp"] or 1), int(m["ep"] or 1)
    if min(dp, tp, ep) < 1:
        raise ParallelError(f"parallel spec {text!r}: sizes must be >= 1")
    world = dp * tp
    if world % ep:
        raise ParallelError(f"parallel spec {text!r}: ep {ep} does not divide world {world} "
                            f"(= attn_dp {dp} x attn_tp {tp})")
    par = Parallel(dp, tp, ep, world // ep, text.strip().lower())
    if dp > 1 and ep == 1:
        raise ParallelError(f"parallel spec {text!r}: attention DP {dp} needs EP > 1 (experts "
                            f"split over ranks that hold different tokens); use dp{dp}ep{world}")
    if config is not None:
        validate(par, config)
    return par


def validate(par: Parallel, c: GlmConfig) -> None:
    checks = [
        (c.num_attention_heads, par.attn_tp, "num_attention_heads", "attn_tp"),
        (c.vocab_size, par.attn_tp, "vocab_size (vocab-parallel embedding/lm_head)", "attn_tp"),
        (c.n_routed_experts, par.ep, "n_routed_experts", "ep"),
        (c.moe_intermediate_size, par.moe_tp, "moe_intermediate_size", "moe_tp"),
    ]
    if not par.token_split and par.attn_dp == 1:
        checks.append((c.intermediate_size, par.attn_tp, "intermediate_size (dense MLP)", "attn_tp"))
    if par.ep == 1:
        checks.append((c.moe_intermediate_size * c.n_shared_experts, par.moe_tp,
                       "shared expert intermediate size", "moe_tp"))
    for size, n, what, axis in checks:
        if size % n:
            raise ParallelError(f"parallel spec {par.name!r}: {what} = {size} is not divisible by "
                                f"{axis} = {n}")
