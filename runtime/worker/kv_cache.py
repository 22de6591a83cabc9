"""Paged KV memory for MLA + the DSA indexer (device tensors only; slot allocation lives elsewhere).

Per layer, `kv[layer]` holds one row per slot: the normalised latent `c_kv` (kv_lora_rank) followed by
the RoPE'd shared key `k_pe` (qk_rope_head_dim): 576 elements for GLM-5, shared by all heads. Layers
whose indexer is "full" also own `index_k[layer]` (index_head_dim per slot), paged in lockstep with
`kv` (slot s addresses both), so a prefix-cache hit covers both caches. "Shared" indexer layers reuse
the previous full layer's top-k and own no indexer cache.

Slot = page * PAGE_SIZE + offset. The scheduler's page allocator (`runtime/engine/pages.py`) hands out pages;
this class never allocates or frees slots.
"""
from __future__ import annotations

import torch

PAGE_SIZE = 64  # FlashMLA's page size; must match runtime/engine/pages.py


class KVPool:
    """Paged latent-KV cache (`kv`) and indexer-key cache (`index_k`, full layers only)."""

    def __init__(
        self,
        num_layers: int,
        full_layers: set[int],
        num_pages: int,
        kv_lora_rank: int = 512,
        qk_rope_head_dim: int = 64,
        index_head_dim: int = 128,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        bad = sorted(i for i in full_layers if not 0 <= i < num_layers)
        if bad:
            raise ValueError(f"full_layers {bad} outside 0..{num_layers - 1}")
        self.num_layers, self.num_pages = num_layers, num_pages
        self.full_layers = frozenset(full_layers)
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.index_head_dim, self.dtype, self.device = index_head_dim, dtype, torch.device(device)
        num_slots = num_pages * PAGE_SIZE
        width = kv_lora_rank + qk_rope_head_dim
        # zeros, not empty: a stale slot read by a buggy gather shows up as a wrong number, not NaN luck.
        self.kv = [torch.zeros(num_slots, width, dtype=dtype, device=device) for _ in range(num_layers)]
        self.index_k = {
            i: torch.zeros(num_slots, index_head_dim, dtype=dtype, device=device) for i in sorted(full_layers)
        }

    @classmethod
    def for_plan(cls, plan, num_pages: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> KVPool:
        """The one KV-pool sizer: a layer per decoder layer, plus the MTP layer's exactly when the
        plan runs MTP phases; indexer caches on the full-indexer layers (and the MTP layer)."""
        c = plan.config
        return cls(plan.num_kv_layers(), plan.full_indexer_layers(), num_pages, c.kv_lora_rank,
                   c.qk_rope_head_dim, c.index_head_dim, dtype, device)

    @property
    def num_slots(self) -> int:
        return self.num_pages * PAGE_SIZE

    def c_kv(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Latent rows [n, kv_lora_rank] of `slots`."""
        return self.kv[layer][slots, : self.kv_lora_rank]

    def k_pe(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """RoPE'd key rows [n, qk_rope_head_dim] of `slots`."""
        return self.kv[layer][slots, self.kv_lora_rank :]

    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies over all layers (latent KV + indexer keys)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_layer = (self.kv_lora_rank + self.qk_rope_head_dim) * self.num_layers
        return elem * (per_layer + self.index_head_dim * len(self.full_layers))

    def __repr__(self) -> str:
        return (
            f"KVPool(layers={self.num_layers}, full={sorted(self.full_layers)}, pages={self.num_pages}x{PAGE_SIZE},"
            f" kv={self.kv_lora_rank}+{self.qk_rope_head_dim}, index_k={self.index_head_dim}, {self.dtype})"
        )
