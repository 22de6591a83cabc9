"""The placements a parallel spec gives the model's activations (shared by the sharding passes).

TOK: tokens split over attention-DP ranks (T is per DP rank). ATT: what attention needs (all of
its DP rank's tokens on every attn_tp rank). RES: the residual stream; with TP attention and EP
MoE it is also split over attn_tp ranks, so MoE dispatches disjoint tokens. HEADS(d): heads split
on dim d. P_ATT / P_MOE: partial sums of row-parallel attention / expert outputs.
"""
from __future__ import annotations

from glmc.ir import Placement

from glmc.parallel import Parallel


class Layouts:
    def __init__(self, par: Parallel):
        self.par = par
        tok = {"attn_dp": "S(0)"} if par.attn_dp > 1 else {}
        self.TOK = Placement.of(tok)
        self.ATT = self.TOK
        self.RES = Placement.of({**tok, "attn_tp": "S(0)"}) if par.token_split else self.TOK
        self.GLOBAL = Placement()
        self.P_ATT = self.TOK.set("attn_tp", "P") if par.attn_tp > 1 else self.TOK
        self.P_MOE = Placement.of({a: "P" for a in ("ep", "moe_tp") if par.mesh[a] > 1})

    def heads(self, dim: int) -> Placement:
        return self.TOK.set("attn_tp", f"S({dim})") if self.par.attn_tp > 1 else self.TOK

    @property
    def pure_tp(self) -> bool:
        """Attention TP and MoE TP over one group, no DP, no EP (the article's `tp8`)."""
        return self.par.attn_dp == 1 and self.par.ep == 1

    def unpartial(self, p: Placement) -> Placement:
        """Where a partial sum must be reduced to before a non-linear op: the residual layout."""
        return self.RES if p.axes_with("P") else p
