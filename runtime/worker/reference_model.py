"""`ReferenceModel`: GLM-5 (glm_moe_dsa) and DeepSeek-V3.2 (deepseek_v32) written directly as a
composition of `codegen/torch_ref` ops, for a `glmc.config.GlmConfig`.

It runs `ForwardBatch`es over the paged `KVPool` exactly as a serving engine would (extend with MHA-form
MLA, decode with the absorbed form, shared indexer layers reusing the previous full layer's top-k), in
fp32, with no compiler in between. Tests hold it to Hugging Face's `GlmMoeDsaForCausalLM` and
`DeepseekV32ForCausalLM`; compiled plans are then held to it.

HF quirks reproduced on purpose (transformers 5.24):
- q_a_layernorm / kv_a_layernorm use eps 1e-6 (HF constructs them without rms_norm_eps); the indexer
  k_norm is a LayerNorm with eps 1e-6; decoder norms use rms_norm_eps.
- MLA RoPE is interleaved, written back de-interleaved (see torch_ref.rope); the indexer's pairs are
  interleaved for GLM and the two halves for DeepSeek-V3.2 (`indexer_rope_interleave`). Yarn RoPE
  changes the frequencies, scales cos/sin and the softmax scale (`GlmConfig.rope_scaling`).
- Indexer and router top-k break exact ties by the lowest index (torch_ref.indexer_topk /
  moe_route_logits), in every implementation; HF's torch.topk breaks them arbitrarily.
- MoE routing masks dropped groups with -inf (HF 5.24 GlmMoeDsa; DeepSeek-V3's HF code uses 0.0).
- The MTP block (absent from HF) follows SGLang/vLLM: h = post-final-norm hidden of the main model.
"""
from __future__ import annotations

import torch
from glmc.codegen import torch_ref as ref
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.kv_cache import KVPool

from glmc.config import GlmConfig

HF_LATENT_NORM_EPS = 1e-6  # GlmMoeDsaRMSNorm default, used by q_a/kv_a layernorms in HF
HF_INDEXER_NORM_EPS = 1e-6  # GlmMoeDsaIndexer.k_norm = nn.LayerNorm(eps=1e-6)


class ReferenceModel:
    """Whole-model fp32 forward over a paged KV pool; weights are a dict of HF-named tensors."""

    def __init__(self, config: GlmConfig, weights: dict[str, torch.Tensor], pool: KVPool):
        self.c = c = config
        self.w, self.pool = weights, pool
        self.mtp_layer = c.num_hidden_layers
        self.has_mtp = f"model.layers.{self.mtp_layer}.eh_proj.weight" in weights
        self.scale = c.softmax_scale
        self.full_layers = c.full_indexer_layers()
        self.mlp_layer_types = c.layer_mlp_types()
        self.experts = {}  # layer -> stacked (gate [E,I,H], up [E,I,H], down [E,H,I]), built once
        num_layers = c.num_hidden_layers + (1 if self.has_mtp else 0)
        for i in range(num_layers):
            if self._is_sparse(i):
                self.experts[i] = tuple(
                    torch.stack([weights[f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"].float()
                                 for e in range(c.n_routed_experts)])
                    for p in ("gate", "up", "down")
                )
        full = {i for i in range(num_layers) if self._is_full(i)}
        if pool.num_layers < num_layers or not full <= pool.full_layers:
            raise ValueError(f"{pool} cannot hold {num_layers} layers with full indexer layers {sorted(full)}")

    def _is_full(self, i: int) -> bool:
        return i == self.mtp_layer or i in self.full_layers

    def _is_sparse(self, i: int) -> bool:
        return i == self.mtp_layer or self.mlp_layer_types[i] == "sparse"

    def _p(self, i: int, name: str) -> torch.Tensor:
        return self.w[f"model.layers.{i}.{name}"]

    # ---- one decoder block -------------------------------------------------------------------------
    def _indexer(self, i, x, q_lat, batch):
        """Top-k key positions [T, index_topk] of full layer i; writes its indexer keys."""
        c, p = self.c, "self_attn.indexer."
        q = (q_lat @ self._p(i, p + "wq_b.weight").T).view(-1, c.index_n_heads, c.index_head_dim)
        k = ref.layer_norm(x @ self._p(i, p + "wk.weight").T, self._p(i, p + "k_norm.weight"),
                           self._p(i, p + "k_norm.bias"), HF_INDEXER_NORM_EPS)
        q, k = self._rope_prefix(q, batch), self._rope_prefix(k, batch)
        ref.index_k_write(self.pool, i, batch.out_cache_loc, k)
        w = (x @ self._p(i, p + "weights_proj.weight").float().T) * c.index_n_heads**-0.5
        return ref.indexer_topk(q, w, self.pool, i, batch, c.index_topk)

    def _rope(self, x, batch, interleaved=True):
        """RoPE with the model's angles (rope_theta, yarn scaling) and the given pair layout."""
        return ref.rope(x, batch.positions, self.c.rope_theta, interleaved, self.c.rope_scaling_attr)

    def _rope_prefix(self, x, batch):
        """RoPE on the first qk_rope_head_dim dims (the indexer's rotated part), rest untouched."""
        r = self.c.qk_rope_head_dim
        roped = self._rope(x[..., :r], batch, self.c.indexer_rope_interleave)
        return torch.cat([roped, x[..., r:]], dim=-1)

    def _attention(self, i, x, batch, topk):
        """MLA + DSA of layer i on normed input x; returns (o_proj output, top-k for later layers)."""
        c, a = self.c, "self_attn."
        dn, dr, dv, R = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        q_lat = ref.rms_norm(x @ self._p(i, a + "q_a_proj.weight").T, self._p(i, a + "q_a_layernorm.weight"),
                             HF_LATENT_NORM_EPS)
        q = (q_lat @ self._p(i, a + "q_b_proj.weight").T).view(-1, c.num_attention_heads, dn + dr)
        kv = x @ self._p(i, a + "kv_a_proj_with_mqa.weight").T
        c_kv = ref.rms_norm(kv[:, :R], self._p(i, a + "kv_a_layernorm.weight"), HF_LATENT_NORM_EPS)
        q_pe, k_pe = self._rope(q[..., dn:], batch), self._rope(kv[:, R:], batch)
        ref.kv_write(self.pool, i, batch.out_cache_loc, c_kv, k_pe)
        if self._is_full(i):
            topk = self._indexer(i, x, q_lat, batch)
        elif topk is None:
            raise ValueError(f"layer {i} is a shared indexer layer but no earlier full layer produced top-k")
        attend = ref.mla_attention_absorbed if batch.mode == "decode" else ref.mla_attention_mha
        o = attend(q[..., :dn], q_pe, self.pool, i, self._p(i, a + "kv_b_proj.weight"), topk, batch,
                   self.scale, dn, dv)
        return o @ self._p(i, a + "o_proj.weight").T, topk

    def _mlp(self, i, x):
        """Dense SwiGLU, or routed experts + shared expert on sparse layers."""
        c, m = self.c, "mlp."
        if not self._is_sparse(i):
            return ref.swiglu(x, *(self._p(i, f"{m}{p}_proj.weight") for p in ("gate", "up", "down")))
        weights, ids = ref.moe_route(x, self._p(i, m + "gate.weight"), self._p(i, m + "gate.e_score_correction_bias"),
                                     c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob,
                                     c.routed_scaling_factor)
        shared = ref.swiglu(x, *(self._p(i, f"{m}shared_experts.{p}_proj.weight") for p in ("gate", "up", "down")))
        return ref.moe_experts(x, ids, weights, *self.experts[i]) + shared

    def _block(self, i, x, batch, topk):
        """Pre-norm decoder block: h = x + Attn(norm(x)); out = h + FFN(norm(h))."""
        eps = self.c.rms_norm_eps
        attn, topk = self._attention(i, ref.rms_norm(x, self._p(i, "input_layernorm.weight"), eps), batch, topk)
        normed, h = ref.add_rms_norm(attn, x, self._p(i, "post_attention_layernorm.weight"), eps)
        return h + self._mlp(i, normed), topk

    # ---- whole model -------------------------------------------------------------------------------
    def _logits(self, h, batch, head, return_all_logits):
        if not return_all_logits:
            h = h[torch.cumsum(batch.extend_lens, 0) - 1]  # last new token of each request
        return h @ head.T

    def _head(self):
        return self.w["model.embed_tokens.weight" if self.c.tie_word_embeddings else "lm_head.weight"]

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, return_all_logits=False, return_hidden=False):
        """Logits [B, V] of each request's last new token ([T, V] if return_all_logits); with
        return_hidden also the final (post-norm) hidden states [T, H] that feed lm_head and MTP."""
        if batch.mode == "idle":
            empty = torch.zeros(0, self.c.vocab_size)
            return (empty, torch.zeros(0, self.c.hidden_size)) if return_hidden else empty
        x = self.w["model.embed_tokens.weight"][batch.input_ids].float()
        topk = None
        for i in range(self.c.num_hidden_layers):
            x, topk = self._block(i, x, batch, topk)
        h = ref.rms_norm(x, self.w["model.norm.weight"], self.c.rms_norm_eps)
        logits = self._logits(h, batch, self._head(), return_all_logits)
        return (logits, h) if return_hidden else logits

    @torch.no_grad()
    def mtp_forward(self, hidden_last, next_ids, batch: ForwardBatch, return_all_logits=False, return_hidden=False):
        """MTP draft: eh_proj(cat[enorm(embed(next)), hnorm(h)]) -> block L=num_hidden_layers ->
        shared_head.norm -> head. Token t of `batch` (position p) pairs h_p with token p+1 and writes
        the MTP layer's KV at out_cache_loc[t]. Logits as in `forward` (and post-norm hidden if asked)."""
        if not self.has_mtp:
            raise ValueError(f"checkpoint has no MTP weights (model.layers.{self.mtp_layer}.eh_proj.weight)")
        n, eps = self.mtp_layer, self.c.rms_norm_eps
        embed = self.w.get(f"model.layers.{n}.embed_tokens.weight", self.w["model.embed_tokens.weight"])
        head = self.w.get(f"model.layers.{n}.shared_head.head.weight", self._head())
        e = ref.rms_norm(embed[next_ids].float(), self._p(n, "enorm.weight"), eps)
        h = ref.rms_norm(hidden_last, self._p(n, "hnorm.weight"), eps)
        x = torch.cat([e, h], dim=-1) @ self._p(n, "eh_proj.weight").T
        x, _ = self._block(n, x, batch, None)
        h = ref.rms_norm(x, self._p(n, "shared_head.norm.weight"), eps)
        logits = self._logits(h, batch, head, return_all_logits)
        return (logits, h) if return_hidden else logits
