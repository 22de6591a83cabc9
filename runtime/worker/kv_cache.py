"""Paged KV memory for MLA + the DSA indexer (device tensors only; slot allocation lives elsewhere).

Per layer, `kv[layer]` holds one row per slot: the normalised latent `c_kv` (kv_lora_rank) followed by
the RoPE'd shared key `k_pe` (qk_rope_head_dim): 576 elements for GLM-5, shared by all heads. Layers
whose indexer is "full" also own `index_k[layer]` (index_head_dim per slot), paged in lockstep with
`kv` (slot s addresses both), so a prefix-cache hit covers both caches. "Shared" indexer layers reuse
the previous full layer's top-k and own no indexer cache.

Storage (`kv_format`): "native" rows in `dtype` (kv_lora + rope wide; the torch target's fp32, the
CUDA target's bf16); "fp8" the FlashMLA / DeepGEMM layouts of `codegen.fp8_ref` (the CUDA target
under a plan whose `dtypes.kv_cache` is fp8): `kv[layer]` uint8 [slots, 656] (512 e4m3 + 4 fp32
scales + 64 bf16 k_pe), `index_k[layer]` uint8 [pages, 64 x 132] (a page's e4m3 keys, then its fp32
scales); "fp8-emulated": native fp32 rows holding the values an fp8 pool would give back (the
torch-target oracle of an FP8-KV plan). Writes and reads go through `write_kv`, `write_index_k`,
`c_kv`, `k_pe`, `index_keys`, which (de)quantise as the format says.

Slot = page * PAGE_SIZE + offset. The scheduler's page allocator (`runtime/engine/pages.py`) hands out pages;
this class never allocates or frees slots.
"""
from __future__ import annotations

import torch
from glmc.codegen import fp8_ref

PAGE_SIZE = fp8_ref.KV_PAGE  # FlashMLA's page size; must match runtime/engine/pages.py
KV_FORMATS = ("native", "fp8", "fp8-emulated")


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
        kv_format: str = "native",
        index_format: str | None = None,
    ):
        bad = sorted(i for i in full_layers if not 0 <= i < num_layers)
        if bad:
            raise ValueError(f"full_layers {bad} outside 0..{num_layers - 1}")
        index_format = kv_format if index_format is None else index_format
        for what, fmt in (("kv_format", kv_format), ("index_format", index_format)):
            if fmt not in KV_FORMATS:
                raise ValueError(f"{what} {fmt!r}: known {', '.join(KV_FORMATS)}")
        self.kv_format, self.index_format = kv_format, index_format
        self.num_layers, self.num_pages = num_layers, num_pages
        self.full_layers = frozenset(full_layers)
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.index_head_dim, self.dtype, self.device = index_head_dim, dtype, torch.device(device)
        num_slots = num_pages * PAGE_SIZE
        width = kv_lora_rank + qk_rope_head_dim
        # zeros, not empty: a stale slot read by a buggy gather shows up as a wrong number, not NaN luck.
        if kv_format == "fp8":
            width = fp8_ref.kv_fp8_row_bytes(kv_lora_rank, qk_rope_head_dim)
        self.kv = [torch.zeros(num_slots, width, dtype=torch.uint8 if kv_format == "fp8" else dtype, device=device)
                   for _ in range(num_layers)]
        if index_format == "fp8":
            page = PAGE_SIZE * fp8_ref.index_fp8_row_bytes(index_head_dim)
            self.index_k = {i: torch.zeros(num_pages, page, dtype=torch.uint8, device=device)
                            for i in sorted(full_layers)}
        else:
            self.index_k = {i: torch.zeros(num_slots, index_head_dim, dtype=dtype, device=device)
                            for i in sorted(full_layers)}

    @classmethod
    def for_plan(cls, plan, num_pages: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", fp8: str = "none") -> KVPool:
        """The one KV-pool sizer: a layer per decoder layer, plus the MTP layer's exactly when the
        plan runs MTP phases; indexer caches on the full-indexer layers (and the MTP layer).
        `fp8`: what becomes of the caches the plan stores fp8 (`plan.dtypes.kv_cache`,
        `index_cache`): "store" (the CUDA target), "emulate" (fp32 rows with fp8 values: the
        torch-target oracle) or "none" (plain rows in `dtype`: the torch target's default)."""
        c = plan.config
        fmt = {"store": "fp8", "emulate": "fp8-emulated", "none": "native"}[fp8]
        kv_fmt, index_fmt = (fmt if d == "fp8" else "native" for d in (plan.dtypes.kv_cache, plan.dtypes.index_cache))
        return cls(plan.num_kv_layers(), plan.full_indexer_layers(), num_pages, c.kv_lora_rank,
                   c.qk_rope_head_dim, c.index_head_dim, dtype, device, kv_fmt, index_fmt)

    @property
    def num_slots(self) -> int:
        return self.num_pages * PAGE_SIZE

    @property
    def fp8(self) -> bool:
        """The latent cache holds FlashMLA FP8 rows (uint8 tensors)."""
        return self.kv_format == "fp8"

    @property
    def index_fp8(self) -> bool:
        """The indexer cache holds FP8 pages (uint8 tensors)."""
        return self.index_format == "fp8"

    def write_kv(self, layer: int, loc: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """kv[layer][loc] = [c_kv | k_pe], quantised as the format says."""
        if self.fp8:
            self.kv[layer][loc] = fp8_ref.kv_fp8_pack(c_kv.float(), k_pe.float())
            return
        if self.kv_format == "fp8-emulated":
            c_kv, k_pe = fp8_ref.kv_fp8_round(c_kv.float(), k_pe.float())
        self.kv[layer][loc] = torch.cat([c_kv, k_pe], dim=-1).to(self.dtype)

    def write_index_k(self, layer: int, loc: torch.Tensor, k: torch.Tensor) -> None:
        """index_k[layer][loc] = k (full layers), quantised as the format says."""
        if self.index_fp8:
            keys, scales = fp8_ref.index_fp8_views(self.index_k[layer], self.index_head_dim)
            q, s = fp8_ref.quantize_token_groups(k.float(), group=self.index_head_dim)
            keys[loc // PAGE_SIZE, loc % PAGE_SIZE] = q
            scales[loc // PAGE_SIZE, loc % PAGE_SIZE] = s[:, 0]
            return
        if self.index_format == "fp8-emulated":
            k = fp8_ref.index_fp8_round(k.float())
        self.index_k[layer][loc] = k.to(self.dtype)

    def c_kv(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Latent rows [n, kv_lora_rank] of `slots` (dequantised to fp32 from an FP8 pool)."""
        if self.fp8:
            return fp8_ref.kv_fp8_unpack(self.kv[layer][slots], self.kv_lora_rank)[0]
        return self.kv[layer][slots, : self.kv_lora_rank]

    def k_pe(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """RoPE'd key rows [n, qk_rope_head_dim] of `slots`."""
        if self.fp8:
            return fp8_ref.kv_fp8_unpack(self.kv[layer][slots], self.kv_lora_rank)[1]
        return self.kv[layer][slots, self.kv_lora_rank :]

    def index_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Indexer keys [n, index_head_dim] of `slots` (dequantised to fp32 from an FP8 pool)."""
        if self.index_fp8:
            keys, scales = fp8_ref.index_fp8_views(self.index_k[layer], self.index_head_dim)
            page, off = slots // PAGE_SIZE, slots % PAGE_SIZE
            return keys[page, off].float() * scales[page, off][:, None]
        return self.index_k[layer][slots]

    def randomize_(self, generator: torch.Generator | None = None) -> None:
        """Every slot of every cache holds N(0, 1) values, through the writers (so an FP8 pool holds
        valid e4m3 rows and scales): benchmarks that attend over a long context without prefilling it."""
        slots = torch.arange(self.num_slots, device=self.device)
        normal = lambda n: torch.randn(self.num_slots, n, generator=generator, device=self.device)  # noqa: E731
        for layer in range(self.num_layers):
            self.write_kv(layer, slots, normal(self.kv_lora_rank), normal(self.qk_rope_head_dim))
        for layer in self.full_layers:
            self.write_index_k(layer, slots, normal(self.index_head_dim))

    def bytes_per_token_per_layer(self) -> tuple[int, int]:
        """(latent-cache bytes, indexer-cache bytes) one token occupies in one layer, from the
        tensors allocated: 656 / 132 in FP8, 1152 / 256 in bf16 at GLM-5 shapes."""
        kv = self.kv[0][0].nbytes
        index = next(iter(self.index_k.values()), None)
        idx = 0 if index is None else index[0].nbytes // (PAGE_SIZE if self.index_fp8 else 1)
        return kv, idx

    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies over all layers (latent KV + indexer keys)."""
        kv, idx = self.bytes_per_token_per_layer()
        return kv * self.num_layers + idx * len(self.full_layers)

    def __repr__(self) -> str:
        return (
            f"KVPool(layers={self.num_layers}, full={sorted(self.full_layers)}, pages={self.num_pages}x{PAGE_SIZE},"
            f" kv={self.kv_lora_rank}+{self.qk_rope_head_dim}, index_k={self.index_head_dim}, {self.dtype},"
            f" {self.kv_format}/{self.index_format})"
        )
