"""Train glmc's small GLM: a 7.5M-parameter `glm_moe_dsa` checkpoint with every GLM-5.3 feature active.

    python tools/train_small.py --out models/small --minutes 4     # one GPU, bf16 autocast (< 6 min in all)
    python tools/train_small.py --smoke                            # CPU, tiny size, 8 steps, into a temp dir

One command builds the corpus, trains the tokenizer, trains the model and writes a Hugging Face
checkpoint that transformers (`GlmMoeDsaForCausalLM`) and glmc (`glmc run --weights DIR`) load. It
needs torch, transformers (>= 5.17), tokenizers and safetensors, not glmc (the GPU image lacks
glmc's dependencies). Seeds are fixed. Training stops after `--minutes` of wall clock or `--epochs`
(default 8) passes over the training tokens, whichever comes first, and the LR schedule follows the nearer of
the two, so the number of steps depends on the machine's speed unless `--steps N` fixes it.

Corpus: the `.py` sources of the Python standard library of the interpreter running this script
(`sysconfig.get_paths()["stdlib"]`) without site-packages, test suites (`test/`, `tests/`,
`idlelib/idle_test/`) and files over 200 KB, sorted by relative path. It is on every machine with
Python (no download), public (PSF licence), and real, varied text: code, docstrings, comments
(~11 MB, ~3.2M tokens). Files whose relative path hashes to 0 mod 50 (sha256, ~2%) are held out:
they score the final model, and their first ~64 KB go to `heldout.txt`, so held-out checks never
depend on the stdlib version of the machine that runs them (the checkpoint is trained on one Python,
tested on another). Files at 1 mod 50 (another ~2%) are the validation split: their loss, measured
every ~30 s, picks the weights that are saved (the corpus is small enough to overfit on a fast GPU).

Tokenizer: byte-level BPE (HF `tokenizers`) trained on the training files, 4096 tokens: common
identifiers, keywords and indentation runs become single tokens (~3.5 characters per token) while
embedding + lm_head stay ~28% of the parameters. GLM's control tokens (ids 0..19), eos ids and chat
template come from `models/tiny/make_tokenizer.py` (`train_bpe`, `write_tokenizer`).

Model (`SIZES["small"]`): hidden 256, 4 decoder layers (layer 0 dense, 1-3 MoE: 16 routed experts,
top-4 in n_group 4 / topk_group 2, routed_scaling_factor 2.5, sigmoid router with correction bias, 1
shared expert), MLA with 4 heads (q_lora 128, kv_lora 128, nope 64, rope 32, v 64), DSA indexer
8 heads x 64 with index_topk 64 (sparse from 65 tokens on), indexer layers F S F S (transformers'
`index_topk_freq` 2 / `index_skip_topk_offset` 1, GLM-5.3's own mechanism: shared layers reuse the
previous full layer's top-k and own no indexer), untied lm_head (as GLM-5.3), one MTP layer at
`model.layers.4.*`. Every dim is a power of two >= 16, so the GPU kernels run it too.

Training (AdamW, peak LR 2e-3, 2% warm-up then cosine to 10%, 32 windows of 512 tokens per step drawn
at random from the packed token stream, files separated by <|endoftext|>; bf16 autocast on CUDA,
fp32 on CPU), per step:
- LM loss: transformers' `GlmMoeDsaForCausalLM`, next-token cross-entropy.
- MTP loss (weight 0.3, DeepSeek-V3's lambda): `MtpLayer` predicts token t+2 from the main model's
  final (post-norm) hidden h_t and token t+1, exactly the reference numerics: eh_proj(cat[enorm(
  embed(x_{t+1})), hnorm(h_t)]) -> one decoder block (MLA + its own full indexer + MoE) ->
  shared_head.norm -> the main lm_head. Its gradient also reaches the main model (as DeepSeek-V3).
  `--mtp-depths D` (default 1) trains the one layer at D depths that share it, as GLM-5 trains its
  MTP layer at 3: depth k >= 1 predicts token t+k+2 from depth k-1's shared_head.norm output at t
  and token t+k+1 (DeepSeek-V3's sequential MTP, each depth a causal pass of its own), the hidden
  state glmc's draft chain feeds back at its steps 1.. (the `lm.head` operand of `mtp_draft`, as
  SGLang and vLLM recycle it); loss 0.3 x the mean over depths (DeepSeek-V3's lambda / D). On the
  H200 (2026-12-04) D = 3 ran at half D = 1's speed: `--minutes 6` trained 7.1 epochs, held-out LM
  perplexity 7.90 (D = 1: 8 epochs in 3.5 min, 6.90), and the accept lengths stayed those of D = 1
  (1.838 / 2.496 / 3.056 at N = 1 / 2 / 3), so the shipped checkpoint keeps D = 1.
- Indexer KL: transformers runs the DSA indexer under `torch.no_grad` (top-k is not differentiable),
  so the LM loss never trains it. As DeepSeek-V3.2 does, each full layer's indexer is trained with
  KL(p || softmax(I)), where I are its index scores (recomputed here with gradients, on detached
  inputs: only the indexer learns from it) and p the main attention's dense distribution (summed over
  heads, L1-normalised; detached) averaged over the layers that use this indexer's top-k (the full
  layer and its shared followers). At 512 tokens the dense distribution is cheap, so p is always the
  dense one (DeepSeek's warm-up objective), not only over the selected keys. The first 10% of the
  run also attends densely (DeepSeek's dense warm-up), the rest with top-64 sparse attention.
- Router balance without an auxiliary loss (DeepSeek-V3): after each step every MoE layer's
  e_score_correction_bias moves by 1e-3 * sign(mean load - expert load).

Outputs in --out: config.json (GlmMoeDsaForCausalLM, glm_moe_dsa, bf16), model.safetensors (bf16,
GLM-5.3's tensor names, per-expert weights, the MTP layer under model.layers.4; the router
correction biases stay fp32 as in GLM/DeepSeek checkpoints), tokenizer.json, tokenizer_config.json,
heldout.txt and train_log.json (losses, held-out loss/perplexity of the LM and MTP heads, expert
load, parameter count, steps, tokens, device, minutes, date, and an fp32 "probe": both losses on the
first windows of heldout.txt computed from the saved files, which tests/test_small_model.py compares
against glmc).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import importlib.util
import json
import math
import platform
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

REPO = Path(__file__).resolve().parents[1]
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
MAX_FILE_BYTES = 200_000
HELDOUT_MODULUS = 50            # sha256(relative path) % 50: 0 held out, 1 validation (~2% each)
HELDOUT_TEXT_CHARS = 64 * 1024
EOT = "<|endoftext|>"
MTP_WEIGHT = 0.3
MTP_DEPTHS = 1                  # training depths sharing the MTP layer (GLM-5: 3; see the docstring)
BIAS_RATE = 1e-3                # DeepSeek-V3's bias update speed gamma
DENSE_WARMUP = 0.1              # fraction of the run with dense attention
WARMUP = 0.02                   # fraction of the run with a linear LR warm-up
PROBE_WINDOWS = 4               # heldout.txt windows of the fp32 probe in train_log.json
LOG_EVERY_S = 10.0
VALIDATE_EVERY_S = 30.0


def _load_make_tokenizer():
    """models/tiny/make_tokenizer.py, imported by path (glmc need not be installed)."""
    spec = importlib.util.spec_from_file_location("glmc_make_tokenizer", REPO / "models/tiny/make_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_tokenizer = _load_make_tokenizer()


@dataclass(frozen=True)
class Size:
    """Model shape (HF config names in `model_config`) and the run's batch shape and learning rate."""
    hidden: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    dense_inter: int
    moe_inter: int
    experts: int
    top_k: int
    index_heads: int
    index_dim: int
    index_topk: int
    vocab: int
    seq_len: int
    batch: int
    lr: float
    train_chars: int | None     # training text cap (None: the whole corpus)


SIZES = {
    "small": Size(hidden=256, heads=4, q_lora=128, kv_lora=128, nope=64, rope=32, v=64, dense_inter=512,
                  moe_inter=64, experts=16, top_k=4, index_heads=8, index_dim=64, index_topk=64,
                  vocab=4096, seq_len=512, batch=32, lr=2e-3, train_chars=None),
    "smoke": Size(hidden=64, heads=2, q_lora=32, kv_lora=32, nope=16, rope=16, v=16, dense_inter=128,
                  moe_inter=16, experts=8, top_k=2, index_heads=4, index_dim=32, index_topk=16,
                  vocab=512, seq_len=64, batch=4, lr=3e-3, train_chars=300_000),
}


# ---- corpus -----------------------------------------------------------------------------------

def stdlib_sources() -> list[tuple[str, str]]:
    """(relative path, text) of the stdlib's .py files, sorted by path, without tests and big files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if EXCLUDED_DIRS & set(rel.split("/")[:-1]) or not path.is_file():
            continue
        if path.stat().st_size <= MAX_FILE_BYTES:
            out.append((rel, path.read_bytes().decode("utf-8", errors="replace")))
    return sorted(out)


def split_of(rel: str) -> str:
    """"heldout" (sha256 of the path = 0 mod 50), "validation" (= 1: picks the checkpoint) or "train"."""
    return {0: "heldout", 1: "validation"}.get(int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_MODULUS,
                                               "train")


def split_corpus(sources, train_chars: int | None) -> dict[str, list[str]]:
    """Texts per split; `train_chars` keeps the first training files up to that many characters."""
    splits = {"train": [], "validation": [], "heldout": []}
    for rel, text in sources:
        splits[split_of(rel)].append(text)
    if train_chars is not None:
        sizes = torch.tensor([len(t) for t in splits["train"]]).cumsum(0)
        splits["train"] = splits["train"][: max(1, int((sizes <= train_chars).sum()))]
    return splits


def heldout_text(docs: list[str]) -> str:
    """The first ~64 KB of the held-out files, each followed by <|endoftext|>, cut at a line end."""
    text = "".join(doc + EOT for doc in docs)
    if len(text) <= HELDOUT_TEXT_CHARS:
        return text
    return text[: text.rindex("\n", 0, HELDOUT_TEXT_CHARS) + 1]


def encode(tok, texts: list[str]) -> torch.Tensor:
    """One token stream: each text's ids followed by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    return torch.tensor([i for enc in tok.encode_batch(texts) for i in [*enc.ids, eot]], dtype=torch.long)


# ---- model ------------------------------------------------------------------------------------

def model_config(size: Size, layers: int, tok) -> GlmMoeDsaConfig:
    """GLM-5.3's architecture at `size`: see the module docstring."""
    ids = {t: tok.token_to_id(t) for t in make_tokenizer.SPECIAL_TOKENS}
    return GlmMoeDsaConfig(
        vocab_size=-(-tok.get_vocab_size() // 64) * 64, hidden_size=size.hidden,
        intermediate_size=size.dense_inter, moe_intermediate_size=size.moe_inter,
        num_hidden_layers=layers, num_attention_heads=size.heads, num_key_value_heads=size.heads,
        q_lora_rank=size.q_lora, kv_lora_rank=size.kv_lora, qk_nope_head_dim=size.nope,
        qk_rope_head_dim=size.rope, v_head_dim=size.v, n_routed_experts=size.experts,
        num_experts_per_tok=size.top_k, n_shared_experts=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
        index_topk=size.index_topk, index_n_heads=size.index_heads, index_head_dim=size.index_dim,
        index_topk_freq=2, index_skip_topk_offset=1, num_nextn_predict_layers=1,
        tie_word_embeddings=False, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        # no pad_token_id: nn.Embedding(padding_idx) would pin <|endoftext|>'s embedding at zero
        bos_token_id=ids["[gMASK]"], pad_token_id=None,
        eos_token_id=[tok.token_to_id(t) for t in make_tokenizer.EOS_TOKENS],
        architectures=["GlmMoeDsaForCausalLM"])


def causal_mask(n: int, attn_implementation: str, device) -> torch.Tensor:
    """[1, 1, n, n] causal mask as transformers builds it: bool (True = attend) for sdpa, additive for eager."""
    keep = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]
    if attn_implementation == "sdpa":
        return keep
    return torch.zeros(keep.shape, device=device).masked_fill(~keep, torch.finfo(torch.float32).min)


class MtpLayer(hf.GlmMoeDsaDecoderLayer):
    """GLM's MTP layer, named as checkpoints name it under model.layers.{N}: a decoder block at index N
    (MLA with a full indexer, MoE) plus enorm, hnorm, eh_proj and shared_head.norm; the embedding
    and lm_head are the main model's."""

    def __init__(self, config: GlmMoeDsaConfig):
        n, h, eps = config.num_hidden_layers, config.hidden_size, config.rms_norm_eps
        block = GlmMoeDsaConfig.from_dict({**config.to_dict(), "num_hidden_layers": n + 1,
                                           "indexer_types": [*config.indexer_types, "full"],
                                           "mlp_layer_types": [*config.mlp_layer_types, "sparse"],
                                           "layer_types": None})
        block._attn_implementation = config._attn_implementation
        block._experts_implementation = config._experts_implementation
        super().__init__(block, n)
        self.enorm, self.hnorm = hf.GlmMoeDsaRMSNorm(h, eps), hf.GlmMoeDsaRMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = hf.GlmMoeDsaRMSNorm(h, eps)
        self.attn_implementation = config._attn_implementation

    def draft(self, model: GlmMoeDsaForCausalLM, hidden: torch.Tensor,
              next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal pass: ([B, T, V] logits of the token after `next_ids` at each position t, [B, T, H]
        the shared_head.norm output that feeds the next depth) from a post-norm hidden h_t [B, T, H]
        (the main model's, or the previous depth's) and the token one further (`next_ids` [B, T]);
        positions 0..T-1 as the main model's."""
        embed = self.enorm(model.model.embed_tokens(next_ids))
        x = self.eh_proj(torch.cat([embed, self.hnorm(hidden)], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None]
        x, _ = self(x, attention_mask=causal_mask(x.shape[1], self.attn_implementation, x.device),
                    position_ids=positions, position_embeddings=model.model.rotary_emb(x, positions))
        out = self.shared_head.norm(x)
        return model.lm_head(out), out


def build_model(config: GlmMoeDsaConfig, seed: int, device) -> tuple[GlmMoeDsaForCausalLM, MtpLayer]:
    """transformers' model and the MTP layer, both with transformers' initialisation (std 0.02)."""
    torch.manual_seed(seed)
    # sdpa: fused attention under the top-k mask. Eager experts: F.linear per expert, which autocast
    # runs in bf16; transformers' default grouped_mm bypasses autocast (it would run on the fp32 weights)
    config._attn_implementation, config._experts_implementation = "sdpa", "eager"
    model = GlmMoeDsaForCausalLM(config)
    mtp = MtpLayer(model.config)
    mtp.apply(model._init_weights)
    return model.to(device), mtp.to(device)


def count_parameters(model, mtp) -> dict[str, int]:
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    return {"total": n(model) + n(mtp), "main": n(model), "mtp": n(mtp), "embed_and_lm_head": embed}


# ---- the indexer's and the router's training signals -------------------------------------------

def mla_probs(attn: hf.GlmMoeDsaAttention, x: torch.Tensor, pos_emb) -> torch.Tensor:
    """The layer's dense causal attention distribution [B, S, S] (softmax over all earlier keys,
    summed over heads, L1-normalised): transformers' MLA scores without the top-k mask."""
    b, s, _ = x.shape
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(b, s, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    k_pass = attn.kv_a_layernorm(kv_pass).view(b, 1, s, attn.kv_lora_rank)
    q_rot, k_rot = hf.apply_rotary_pos_emb_interleave(q_rot, k_rot.view(b, 1, s, -1), *pos_emb)
    keys, _ = attn.expand_kv(k_pass, k_rot)
    scores = torch.cat([q_pass, q_rot], dim=-1) @ keys.transpose(-1, -2) * attn.scaling
    future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    probs = scores.float().masked_fill(future, float("-inf")).softmax(-1).sum(1)
    return probs / probs.sum(-1, keepdim=True)


def index_scores(attn: hf.GlmMoeDsaAttention, x: torch.Tensor, pos_emb) -> torch.Tensor:
    """I(t, s) = sum_h w_h(t) ReLU(q_h(t).k(s) / sqrt(D)) [B, S, S]: `GlmMoeDsaIndexer.forward`'s
    scores (before the mask and top-k), with gradients for the indexer's weights only."""
    idx, b, s = attn.indexer, x.shape[0], x.shape[1]
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = idx.wq_b(q_resid).view(b, s, idx.n_heads, idx.head_dim)
    k = idx.k_norm(idx.wk(x)).unsqueeze(2)
    rest = idx.head_dim - idx.qk_rope_head_dim
    q_rot, q_pass = torch.split(q, [idx.qk_rope_head_dim, rest], dim=-1)
    k_rot, k_pass = torch.split(k, [idx.qk_rope_head_dim, rest], dim=-1)
    q_rot, k_rot = hf.apply_rotary_pos_emb_interleave(q_rot, k_rot, *pos_emb, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = F.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()) * idx.softmax_scale)
    weights = idx.weights_proj(x).float() * idx.n_heads ** -0.5
    return torch.einsum("bsh,bsht->bst", weights, scores)


class IndexerDistillation:
    """KL(dense attention || softmax(index scores)) for every indexer (see the module docstring).

    A forward pre-hook on each attention module keeps its (normed) input and RoPE of the current
    forward; `loss()` then needs no second pass through the model. `groups` maps each full layer's
    attention module to the modules that use its top-k (itself first)."""

    def __init__(self, model: GlmMoeDsaForCausalLM, mtp: MtpLayer):
        attns = [layer.self_attn for layer in model.model.layers]
        self.groups = []
        for attn, kind in zip(attns, model.config.indexer_types):
            if kind == "full":
                self.groups.append([attn])
            else:
                self.groups[-1].append(attn)
        self.groups.append([mtp.self_attn])
        self.inputs, self.active = {}, False
        for attn in [*attns, mtp.self_attn]:
            attn.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, module, args, kwargs):
        if self.active and module not in self.inputs:   # the MTP layer's depth 0, not its later depths
            self.inputs[module] = (kwargs["hidden_states"].detach(), kwargs["position_embeddings"])

    def loss(self) -> torch.Tensor:
        total = 0.0
        for group in self.groups:
            with torch.no_grad():
                target = sum(mla_probs(a, *self.inputs[a]) for a in group) / len(group)
            scores = index_scores(group[0], *self.inputs[group[0]])
            keep = torch.ones_like(target, dtype=torch.bool).tril()
            log_q = scores.masked_fill(~keep, float("-inf")).log_softmax(-1).masked_fill(~keep, 0.0)
            total = total + (target * (target.clamp_min(1e-30).log() - log_q)).sum(-1).mean()
        self.inputs.clear()
        return total / len(self.groups)

    @torch.no_grad()
    def recall(self, k: int) -> dict[str, dict[str, float]]:
        """Per indexer: the share of its layers' dense attention mass on its top-k keys, and (for
        scale) on the k most recent keys, averaged over the queries that see more than k keys."""
        out = {}
        for group in self.groups:
            target = sum(mla_probs(a, *self.inputs[a]) for a in group) / len(group)
            n = target.shape[-1]
            causal = torch.ones(n, n, dtype=torch.bool, device=target.device).tril()
            scores = index_scores(group[0], *self.inputs[group[0]]).masked_fill(~causal, float("-inf"))
            chosen = target.gather(-1, scores.topk(k, dim=-1).indices).sum(-1)[:, k:]
            recent = (target * causal.triu(1 - k)).sum(-1)[:, k:]
            name = "mtp" if group[0] is self.groups[-1][0] else str(group[0].layer_idx)
            out[name] = {"topk": round(chosen.mean().item(), 4), "recent": round(recent.mean().item(), 4)}
        self.inputs.clear()
        return out

    def set_dense(self, dense: bool, index_topk: int) -> None:
        """Dense attention (top-k over every key) during the warm-up, else the model's index_topk."""
        for group in self.groups:
            group[0].indexer.index_topk = 1 << 30 if dense else index_topk


class RouterBalance:
    """Aux-loss-free balancing (DeepSeek-V3): counts each router's expert choices by a forward hook;
    `update()` moves e_score_correction_bias by rate * sign(mean load - load) and resets the counts."""

    def __init__(self, model: GlmMoeDsaForCausalLM, mtp: MtpLayer):
        n = model.config.num_hidden_layers
        layers = [*model.model.layers, mtp]
        self.routers = {i if i < n else "mtp": layer.mlp.gate for i, layer in enumerate(layers)
                        if isinstance(layer.mlp, hf.GlmMoeDsaMoE)}
        self.counts = {}
        for name, gate in self.routers.items():
            gate.register_forward_hook(lambda m, args, out, name=name: self._count(name, m, out[2]))

    def _count(self, name, gate, chosen: torch.Tensor) -> None:
        counts = torch.bincount(chosen.flatten(), minlength=gate.num_experts)
        self.counts[name] = self.counts.get(name, 0) + counts

    @torch.no_grad()
    def update(self, rate: float) -> None:
        for name, gate in self.routers.items():
            load = self.counts[name].float()
            gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        self.counts.clear()

    def report(self) -> dict:
        """Per MoE layer: each expert's share of the routed tokens, and max/min over the mean."""
        out = {}
        for name, counts in self.counts.items():
            share = counts.float() / counts.sum()
            mean = 1.0 / share.numel()
            out[str(name)] = {"max_over_mean": round(share.max().item() / mean, 3),
                              "min_over_mean": round(share.min().item() / mean, 3),
                              "share": [round(v, 4) for v in share.tolist()]}
        self.counts.clear()
        return out


# ---- training ---------------------------------------------------------------------------------

def losses(model, mtp, windows: torch.Tensor, depths: int = 1) -> tuple[torch.Tensor, torch.Tensor,
                                                                        torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the LM (token t+1) over windows [B, S+1], and of the MTP head at each of
    `depths` depths (depth k: token t+k+2, from depth k-1's output; module docstring), and their
    argmax hits per token: (lm, mtp [depths], lm top-1, mtp top-1 [depths])."""
    x, y = windows[:, :-1], windows[:, 1:]
    hidden = model.model(input_ids=x, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden).float()
    lm = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    mtp_losses, mtp_hits = [], []
    for k in range(depths):
        draft, hidden = mtp.draft(model, hidden[:, :-1], x[:, k + 1:])
        draft, target = draft.float(), y[:, k + 1:]
        mtp_losses.append(F.cross_entropy(draft.flatten(0, 1), target.flatten()))
        mtp_hits.append((draft.argmax(-1) == target).float().mean())
    return lm, torch.stack(mtp_losses), (logits.argmax(-1) == y).float().mean(), torch.stack(mtp_hits)


def lr_at(progress: float, peak: float) -> float:
    """Linear warm-up over the first 2% of the run, then cosine down to 10% of the peak."""
    if progress < WARMUP:
        return peak * progress / WARMUP
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - WARMUP) / (1 - WARMUP))))
    return peak * (0.1 + 0.9 * cosine)


def optimizer(model, mtp, lr: float) -> torch.optim.AdamW:
    params = [*model.parameters(), *mtp.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def autocast(device) -> contextlib.AbstractContextManager:
    dev = torch.device(device)
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()


def train(model, mtp, distill: IndexerDistillation, balance: RouterBalance, ids: torch.Tensor,
          val_ids: torch.Tensor, size: Size, args, device) -> dict:
    """The training loop: `--steps` steps, or until `--minutes` of wall clock or `--epochs` passes over
    the training tokens, whichever comes first (the LR schedule follows the nearer one). A line every
    ~10 s, the validation loss every ~30 s; ends with the weights of the lowest validation loss."""
    opt = optimizer(model, mtp, size.lr)
    gen = torch.Generator().manual_seed(args.seed)
    span, ids = torch.arange(size.seq_len + 1, device=device), ids.to(device)
    tokens_per_step = size.batch * size.seq_len
    start = last_log = last_val = time.time()
    step, history, curve, best = 0, [], [], None
    model.train(), mtp.train()
    while True:
        elapsed = time.time() - start
        progress = step / args.steps if args.steps else max(
            elapsed / (60 * args.minutes), step * tokens_per_step / (args.epochs * ids.numel()))
        if progress >= 1:
            break
        distill.set_dense(progress < DENSE_WARMUP, model.config.index_topk)
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, size.lr)
        offsets = torch.randint(0, ids.numel() - size.seq_len - 1, (size.batch,), generator=gen)
        distill.active = True
        with autocast(device):
            lm, mtp_loss, _, _ = losses(model, mtp, ids[offsets.to(device)[:, None] + span], args.mtp_depths)
            kl = distill.loss()
        distill.active = False
        opt.zero_grad(set_to_none=True)
        (lm + MTP_WEIGHT * mtp_loss.mean() + kl).backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *mtp.parameters()], 1.0)
        opt.step()
        balance.update(BIAS_RATE)
        history.append(torch.cat([torch.stack([lm, kl]), mtp_loss]).detach())   # lm, kl, mtp per depth
        step += 1
        if time.time() - last_log >= LOG_EVERY_S or step == 1:
            last_log = time.time()
            _log_progress(step, last_log - start, history, tokens_per_step, opt, progress < DENSE_WARMUP)
        if time.time() - last_val >= VALIDATE_EVERY_S:
            best = _validate(model, mtp, distill, balance, val_ids, size, device, step, curve, best)
            last_val = time.time()
    _log_progress(step, time.time() - start, history, tokens_per_step, opt, False)
    best = _validate(model, mtp, distill, balance, val_ids, size, device, step, curve, best)
    model.load_state_dict(best["state"][0]), mtp.load_state_dict(best["state"][1])
    tail = torch.stack(history).float().cpu()
    last = tail[-max(1, min(50, len(history) // 10)):].mean(0)
    return {"steps": step, "tokens": step * tokens_per_step, "minutes": (time.time() - start) / 60,
            "loss_first": tail[0, 0].item(), "loss_last": last[0].item(), "mtp_loss_last": last[2].item(),
            "mtp_depth_loss_last": last[2:].tolist(), "indexer_kl_last": last[1].item(),
            "selected_step": best["step"], "validation": curve}


def _validate(model, mtp, distill, balance, ids, size, device, step, curve, best) -> dict:
    """LM loss on the validation files (sparse attention, also during the dense warm-up); keeps a
    CPU copy of the weights when it is the lowest yet."""
    distill.set_dense(False, model.config.index_topk)
    loss = evaluate(model, mtp, ids, size.seq_len, size.batch, device, max_windows=64)["lm_loss"]
    balance.counts.clear()  # validation tokens do not steer the router biases
    model.train(), mtp.train()
    curve.append({"step": step, "lm_loss": round(loss, 4)})
    if best is None or loss < best["lm_loss"]:
        state = [{k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()} for m in (model, mtp)]
        best = {"step": step, "lm_loss": loss, "state": state}
    print(f"validation at step {step}: LM loss {loss:.3f}{' (lowest yet)' if best['step'] == step else ''}",
          flush=True)
    return best


def _log_progress(step, elapsed, history, tokens_per_step, opt, dense) -> None:
    lm, kl, *mtp_loss = history[-1].tolist()
    rate = step * tokens_per_step / max(elapsed, 1e-9)
    mtp = " / ".join(f"{v:.3f}" for v in mtp_loss)
    print(f"step {step:5d} | {elapsed:6.1f} s | loss {lm:.3f} | mtp {mtp} | indexer kl {kl:.4f} | "
          f"lr {opt.param_groups[0]['lr']:.2e} | {rate / 1e3:.1f}k tok/s{' | dense warm-up' if dense else ''}",
          flush=True)


@torch.no_grad()
def evaluate(model, mtp, ids: torch.Tensor, seq_len: int, batch: int, device, max_windows=256,
             depths: int = 1) -> dict:
    """LM and MTP loss (and argmax accuracy) over non-overlapping windows of `ids`; mtp_* are depth 0's,
    `mtp_depths` every depth's."""
    model.eval(), mtp.eval()
    n = min(max_windows, (ids.numel() - 1) // seq_len)
    windows = ids[: n * seq_len + 1].to(device).unfold(0, seq_len + 1, seq_len)
    sums = torch.zeros(2 + 2 * depths)
    for lo in range(0, n, batch):
        chunk = windows[lo: lo + batch]
        with autocast(device):
            lm, mtp_loss, lm_top1, mtp_top1 = losses(model, mtp, chunk, depths)
        sums += torch.cat([torch.stack([lm, lm_top1]), mtp_loss, mtp_top1]).float().cpu() * len(chunk)
    lm, lm_top1, *mtp = (sums / n).tolist()
    mtp_loss, mtp_top1 = mtp[:depths], mtp[depths:]
    return {"lm_loss": lm, "lm_ppl": math.exp(lm), "mtp_loss": mtp_loss[0], "mtp_ppl": math.exp(mtp_loss[0]),
            "lm_top1": lm_top1, "mtp_top1": mtp_top1[0], "windows": n, "tokens": n * seq_len,
            "mtp_depths": [{"loss": a, "top1": b} for a, b in zip(mtp_loss, mtp_top1)]}


@torch.no_grad()
def indexer_recall(model, mtp, distill: IndexerDistillation, ids: torch.Tensor, size: Size, device) -> dict:
    """`IndexerDistillation.recall` on one batch of windows of `ids`."""
    model.eval(), mtp.eval()
    windows = ids[: size.batch * size.seq_len + 1].to(device).unfold(0, size.seq_len + 1, size.seq_len)
    distill.active = True
    with autocast(device):
        losses(model, mtp, windows)
    distill.active = False
    return distill.recall(model.config.index_topk)


# ---- checkpoint -------------------------------------------------------------------------------

def checkpoint_tensors(model, mtp) -> dict[str, torch.Tensor]:
    """GLM-5.3 checkpoint names -> bf16 tensors (router correction biases fp32), experts per expert."""
    n = model.config.num_hidden_layers
    named = {**model.state_dict(), **{f"model.layers.{n}.{k}": v for k, v in mtp.state_dict().items()}}
    out = {}
    for name, t in named.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            stem, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"], out[f"{stem}{e}.up_proj.weight"] = t[e, :inter], t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):   # [E, H, I]
            stem = name[: -len("down_proj")]
            out |= {f"{stem}{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
        else:
            out[name] = t
    keep_fp32 = lambda k: k.endswith("e_score_correction_bias")  # noqa: E731
    return {k: v.detach().to("cpu", torch.float32 if keep_fp32(k) else torch.bfloat16).contiguous()
            for k, v in sorted(out.items())}


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names -> transformers' fused experts (inverse of `checkpoint_tensors`)."""
    out, experts = {}, {}
    for name, t in tensors.items():
        head, sep, tail = name.partition("mlp.experts.")
        if not sep:
            out[name] = t
            continue
        e, proj = tail.split(".")[:2]
        experts.setdefault(head, {}).setdefault(proj, {})[int(e)] = t
    for head, projs in experts.items():
        stack = lambda p: torch.stack([projs[p][e] for e in sorted(projs[p])])  # noqa: E731
        out[f"{head}mlp.experts.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        out[f"{head}mlp.experts.down_proj"] = stack("down_proj")
    return out


def save_checkpoint(out: Path, model, mtp) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(model, mtp), str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.update(dtype="bfloat16", torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_small(ckpt_dir, device="cpu") -> tuple[GlmMoeDsaForCausalLM, MtpLayer]:
    """The saved checkpoint in fp32 (eager attention): transformers' model, and the MTP layer from
    the model.layers.{N}.* tensors transformers leaves unused."""
    ckpt_dir = Path(ckpt_dir)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # it lists the MTP tensors as unused
    try:
        model = GlmMoeDsaForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32, attn_implementation="eager",
                                                     experts_implementation="eager")
    finally:
        transformers.logging.set_verbosity(verbosity)
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    with safe_open(ckpt_dir / "model.safetensors", "pt") as f:
        tensors = {k[len(prefix):]: f.get_tensor(k).float() for k in f.keys() if k.startswith(prefix)}
    mtp = MtpLayer(model.config)
    mtp.load_state_dict(fuse_experts(tensors), strict=True)
    return model.to(device).eval(), mtp.to(device).eval()


def probe_windows(ckpt_dir, windows: int = PROBE_WINDOWS, seq_len: int | None = None) -> torch.Tensor:
    """The first `windows` non-overlapping windows [W, seq_len + 1] of heldout.txt's tokens."""
    from tokenizers import Tokenizer
    ckpt_dir = Path(ckpt_dir)
    seq_len = seq_len or json.loads((ckpt_dir / "train_log.json").read_text())["size"]["seq_len"]
    tok = Tokenizer.from_file(str(ckpt_dir / "tokenizer.json"))
    ids = torch.tensor(tok.encode((ckpt_dir / "heldout.txt").read_text(encoding="utf-8")).ids)
    return ids[: windows * seq_len + 1].unfold(0, seq_len + 1, seq_len)


@torch.no_grad()
def probe(ckpt_dir, device, seq_len: int, depths: int = 1) -> dict:
    """fp32 LM and MTP loss (depth 0, and each depth's) on heldout.txt's first windows, from the
    files just written."""
    model, mtp = load_small(ckpt_dir, device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        windows = probe_windows(ckpt_dir, seq_len=seq_len).to(device)
        lm, mtp_loss, _, _ = losses(model, mtp, windows, depths)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return {"windows": len(windows), "seq_len": seq_len, "tokens": windows[:, 1:].numel(),
            "lm_loss": lm.item(), "mtp_loss": mtp_loss[0].item(), "mtp_depth_loss": mtp_loss.tolist()}


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="checkpoint directory (default models/small; --smoke: a new temp dir)")
    p.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget of the training loop")
    p.add_argument("--epochs", type=float, default=8.0, help="at most this many passes over the training tokens")
    p.add_argument("--steps", type=int, help="train exactly this many steps instead (--smoke: 8; 0: time/epochs)")
    p.add_argument("--smoke", action="store_true", help="tiny model, small corpus, 8 steps (CPU tests)")
    p.add_argument("--batch", type=int, default=0, help="override the size's batch (sequences per step)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtp-depths", type=int, default=MTP_DEPTHS,
                   help="training depths of the one MTP layer (GLM-5: 3; DeepSeek-V3: 1)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 8 if args.smoke else 0
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="small_smoke_")) if args.smoke else REPO / "models" / "small"
    return args


def prepare_data(size: Size, out: Path):
    """Corpus splits -> the tokenizer (written to `out` with heldout.txt) and each split's token stream."""
    splits = split_corpus(stdlib_sources(), size.train_chars)
    root = sysconfig.get_paths()["stdlib"]
    if sum(map(len, splits["train"])) < (size.train_chars or 10 * 10**6) // 2 or not all(splits.values()):
        raise SystemExit(f"{root} holds too few .py sources: " + str({k: len(v) for k, v in splits.items()}))
    print(f"corpus: {len(splits['train'])} training files ({sum(map(len, splits['train'])) / 1e6:.1f} M chars), "
          f"{len(splits['validation'])} validation, {len(splits['heldout'])} held out; from {root}", flush=True)
    tok = make_tokenizer.train_bpe(splits["train"], size.vocab)
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer.write_tokenizer(tok, out)
    (out / "heldout.txt").write_text(heldout_text(splits["heldout"]), encoding="utf-8")
    ids = {name: encode(tok, texts) for name, texts in splits.items()}
    files = {name: len(texts) for name, texts in splits.items()}
    return tok, ids, files


def main(argv=None) -> dict:
    args = parse_args(argv)
    size = SIZES["smoke" if args.smoke else "small"]
    if args.batch:
        size = Size(**{**asdict(size), "batch": args.batch})
    t0 = time.time()
    tok, ids, files = prepare_data(size, args.out)
    t_data = time.time() - t0
    print(f"tokenizer: {tok.get_vocab_size()} tokens; tokens per split: "
          f"{ {k: v.numel() for k, v in ids.items()} } ({t_data:.0f} s)", flush=True)
    config = model_config(size, 4, tok)
    model, mtp = build_model(config, args.seed, args.device)
    params = count_parameters(model, mtp)
    print(f"parameters: {params['total'] / 1e6:.2f} M ({params['main'] / 1e6:.2f} M main model, "
          f"{params['mtp'] / 1e6:.2f} M MTP layer, {params['embed_and_lm_head'] / 1e6:.2f} M embedding + lm_head); "
          f"indexer layers {config.indexer_types}", flush=True)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    distill, balance = IndexerDistillation(model, mtp), RouterBalance(model, mtp)
    run = train(model, mtp, distill, balance, ids["train"], ids["validation"], size, args, args.device)
    heldout = evaluate(model, mtp, ids["heldout"], size.seq_len, size.batch, args.device,
                       max_windows=32 if args.smoke else 256, depths=args.mtp_depths)
    expert_load = balance.report()  # counted over the held-out windows
    heldout["indexer_recall"] = indexer_recall(model, mtp, distill, ids["heldout"], size, args.device)
    save_checkpoint(args.out, model, mtp)
    log = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["tools/train_small.py", *(argv if argv is not None else sys.argv[1:])]),
           "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__},
           "seed": args.seed, "mtp_depths": args.mtp_depths, "size": asdict(size), "parameters": params,
           "corpus": {"files": files, "tokens": {k: v.numel() for k, v in ids.items()},
                      "tokenizer_vocab": tok.get_vocab_size(), "data_seconds": round(t_data, 1)},
           "train": {**run, "epochs": run["tokens"] / ids["train"].numel()},
           "heldout": heldout, "expert_load": expert_load}
    log["probe"] = probe(args.out, args.device, size.seq_len, args.mtp_depths)
    (args.out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    _summary(log)
    print(f"wrote {args.out}: {', '.join(sorted(f.name for f in args.out.iterdir()))}")
    return log


def _summary(log: dict) -> None:
    h, r = log["heldout"], log["train"]
    print(f"trained {r['steps']} steps, {r['tokens'] / 1e6:.1f} M tokens ({r['epochs']:.1f} epochs) in "
          f"{r['minutes']:.1f} min: train loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}; weights of step "
          f"{r['selected_step']} (lowest validation loss)", flush=True)
    print(f"held-out ({h['tokens']} tokens): LM loss {h['lm_loss']:.3f} (ppl {h['lm_ppl']:.2f}, top-1 "
          f"{h['lm_top1']:.1%}); MTP loss {h['mtp_loss']:.3f} (ppl {h['mtp_ppl']:.2f}, top-1 {h['mtp_top1']:.1%})"
          + "".join(f"; depth {k} {d['loss']:.3f} ({d['top1']:.1%})" for k, d in enumerate(h["mtp_depths"]) if k))
    for name, recall in h["indexer_recall"].items():
        print(f"indexer {name}: top-{log['size']['index_topk']} keys hold {recall['topk']:.1%} of the dense "
              f"attention (the {log['size']['index_topk']} most recent keys: {recall['recent']:.1%})")
    for name, load in log["expert_load"].items():
        print(f"expert load, layer {name}: max/mean {load['max_over_mean']:.2f}, min/mean {load['min_over_mean']:.2f}")
    print(f"probe (fp32, from the saved files): {log['probe']}")


if __name__ == "__main__":
    main()
