"""One forward step's inputs (SGLang's `ForwardBatch`, trimmed to what the model needs).

The scheduler builds a `ForwardBatch` per step; every executor (the torch `ReferenceModel`, compiled
plans) reads only these tensors. Token-level tensors are laid out request by request: the first
`extend_lens[0]` tokens belong to request 0, and so on. KV slots are already allocated when the batch
is built: `out_cache_loc[t]` is where token t's KV goes and `req_to_token[row, pos]` maps any
position of a request to its slot (so attention never needs to know about pages).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MODES = ("extend", "decode", "idle")


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: on a GPU through pinned memory
    and a non-blocking copy (a copy from pageable memory would wait for the work already queued,
    which defeats queueing the next step while the current one runs)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type == "cuda":   # (a device tensor: a copy in stream order)
        return t.to(device)
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)   # (t.pin_memory() first asks
    staged.copy_(t)                                                  # CUDA whether t is pinned: slow)
    return staged.to(device, non_blocking=True)


def _i64(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64)


@dataclass
class ForwardBatch:
    """One forward step's inputs, SGLang-style. T = tokens in the step, B = requests."""

    mode: str  # "extend" (prefill/chunked/prefix-hit; also mixed) | "decode" | "idle"
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions (start at prefix_len for a prefix hit)
    req_pool_indices: torch.Tensor  # [B] int64 rows of req_to_token
    seq_lens: torch.Tensor  # [B] int64, total length after this step
    prefix_lens: torch.Tensor  # [B] int64, tokens already in the KV cache before this step
    extend_lens: torch.Tensor  # [B] int64, new tokens this step (decode: all 1); sum == T
    out_cache_loc: torch.Tensor  # [T] int64, KV slot for each new token
    req_to_token: torch.Tensor  # [max_reqs, max_context] int64, KV slot of (request row, position)
    # [T] int64 on the runner's device, or None: the token ids to run instead of input_ids (which
    # then only hold the count, placeholders where the host does not know the id): ids computed on
    # the device (speculative drafts) reach the next forward without a read-back to the host
    device_ids: torch.Tensor | None = None
    # whether the runner's device copy of req_to_token already holds every position below each
    # request's step (none was admitted with a prefix-cache hit since: the device wrote each
    # position's slot as it computed it), so that a speculative step need not copy the rows again
    rows_on_device: bool = False
    # [T] int64 on the runner's device, or None: each token's position and KV slot computed on the
    # device (a speculative chain step or verify after an acceptance the host has not read), in
    # place of positions and out_cache_loc, which then hold upper bounds (valid slots of the
    # request at the furthest position it may be at, for workspace sizes). A request's tokens are
    # consecutive: the runner takes its first token's position as its prefix length.
    device_positions: torch.Tensor | None = None
    device_loc: torch.Tensor | None = None

    def __post_init__(self):
        self.validate()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.numel())

    @classmethod
    def build(cls, mode: str, input_ids, req_pool_indices, prefix_lens, req_to_token) -> ForwardBatch:
        """Derive positions, lengths and out_cache_loc from per-request new tokens.

        `input_ids` is a list (one entry per request) of that request's new token ids; the slots of
        positions [prefix_len, prefix_len + extend_len) must already be written into `req_to_token`.
        """
        extend = np.fromiter((len(ids) for ids in input_ids), np.int64, len(input_ids))
        prefix = np.asarray(prefix_lens, dtype=np.int64).reshape(-1)
        rows = np.asarray(req_pool_indices, dtype=np.int64).reshape(-1)
        starts = np.cumsum(extend) - extend
        positions = np.arange(int(extend.sum()), dtype=np.int64) + np.repeat(prefix - starts, extend)
        locs = req_to_token.numpy()[np.repeat(rows, extend), positions]
        return cls(
            mode=mode,
            input_ids=_i64([int(t) for ids in input_ids for t in ids]),
            positions=torch.from_numpy(positions),
            req_pool_indices=torch.from_numpy(rows),
            seq_lens=torch.from_numpy(prefix + extend),
            prefix_lens=torch.from_numpy(prefix),
            extend_lens=torch.from_numpy(extend),
            out_cache_loc=torch.from_numpy(np.ascontiguousarray(locs, dtype=np.int64)),
            req_to_token=req_to_token,
        )

    @classmethod
    def idle(cls, req_to_token: torch.Tensor | None = None) -> ForwardBatch:
        """An empty step: DP-attention ranks with no work still join every collective."""
        empty = _i64([])
        table = req_to_token if req_to_token is not None else torch.zeros((0, 0), dtype=torch.int64)
        return cls("idle", empty, empty, empty, empty, empty, empty, empty, table)

    def token_ranges(self) -> list[tuple[int, int, int]]:
        """Per request: (index into the batch, first token index, one-past-last token index)."""
        ends = torch.cumsum(self.extend_lens, 0).tolist()
        starts = [0] + ends[:-1]
        return [(b, s, e) for b, (s, e) in enumerate(zip(starts, ends))]

    def validate(self) -> None:
        """Check the cross-tensor invariants; errors print the numbers that disagree."""
        if self.mode not in MODES:
            raise ValueError(f"ForwardBatch.mode must be one of {MODES}, got {self.mode!r}")
        T, B = self.num_tokens, self.batch_size
        for name in ("positions", "out_cache_loc", "device_ids", "device_positions", "device_loc"):
            if getattr(self, name) is not None and getattr(self, name).shape != (T,):
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected ({T},)")
        for name in ("seq_lens", "prefix_lens", "extend_lens"):
            if getattr(self, name).shape != (B,):
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected ({B},)")
        # host lists: a few torch calls per batch (the speculative loop builds several a cycle)
        extend, prefix, seq = self.extend_lens.tolist(), self.prefix_lens.tolist(), self.seq_lens.tolist()
        if sum(extend) != T:
            raise ValueError(f"sum(extend_lens)={sum(extend)} != T={T}")
        if any(p + e != n for p, e, n in zip(prefix, extend, seq)):
            raise ValueError(f"prefix_lens {prefix} + extend_lens {extend} != seq_lens {seq}")
        if self.mode == "decode" and any(e != 1 for e in extend):
            raise ValueError(f"decode batch needs extend_lens all 1, got {extend}")
        if (self.device_positions is None) != (self.device_loc is None):
            raise ValueError("device_positions and device_loc come together")
        if self.mode == "idle" and T:
            raise ValueError(f"idle batch must have no tokens, got T={T}")
