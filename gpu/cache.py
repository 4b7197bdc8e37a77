"""Paged KV cache tensors, in vLLM's `shared` layout or KV-Compress's `per_head` layout.

- shared:   K, V pools [layers, num_blocks, block_size, kv_heads, head_dim]; a block holds
            block_size tokens of every layer and KV head; one block table per sequence.
- per_head: K, V pools [num_blocks, block_size, head_dim]; a block holds tokens of ONE
            (layer, KV head); block tables per (sequence, layer, KV head).

Slot id = block_id * block_size + offset. `live [num_blocks, block_size]` marks the slots that hold
a token attention may read; writes mark their slots live, `evict` / `free_blocks` clear them.
Keys are cached after RoPE, so tokens can be relocated (`copy_slots` / `move_slots`) freely.
Which blocks and slots are used is decided by the engine core (sim/), never here.
"""
from __future__ import annotations

import torch

from gpu.kernels.cache_ops import copy_slots, reshape_and_cache
from gpu.kernels.reference import gather_live, gather_table

LAYOUTS = ("shared", "per_head")


class PagedKVCache:
    def __init__(self, layout: str, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 backend: str | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("num_blocks", num_blocks), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.layout, self.backend = layout, backend
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device, self.dtype = torch.device(device), dtype
        if layout == "shared":
            shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        else:
            shape = (num_blocks, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.live = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=self.device)

    @classmethod
    def for_model(cls, config, layout: str, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", backend: str | None = None) -> "PagedKVCache":
        return cls(layout, config.layers, config.kv_heads, config.head_dim, num_blocks, block_size, dtype, device,
                   backend)

    @staticmethod
    def bytes_per_block(layout: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype = torch.float16) -> int:
        per_token = head_dim * (num_layers * num_kv_heads if layout == "shared" else 1)
        return 2 * block_size * per_token * torch.empty(0, dtype=dtype).element_size()

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [num_blocks, block_size, kv_heads, head_dim] (strided) views."""
        if self.layout == "shared":
            return self.k[layer], self.v[layer]
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return self.k[:, :, None, :].expand(shape), self.v[:, :, None, :].expand(shape)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key/value [T, kv_heads, D]; slot_mapping [T] (shared) or [T, kv_heads] (per_head, this layer)."""
        if self.layout == "shared":
            kc, vc = self.k[layer], self.v[layer]
        else:
            kc, vc = self.k, self.v
        reshape_and_cache(key, value, kc, vc, slot_mapping, self.live, backend=self.backend)

    def gather(self, layer: int, block_tables: torch.Tensor, live: torch.Tensor | None = None):
        """block_tables [B, kv_heads, M] -> K, V [B, kv_heads, M*bs, D] and live [B, kv_heads, M*bs]
        (from `live` if given, e.g. a snapshot taken before this step's writes)."""
        kc, vc = self.layer_view(layer)
        live = self.live if live is None else live
        return gather_table(kc, block_tables), gather_table(vc, block_tables), gather_live(live, block_tables)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Sparse copy: dst slots receive src's K/V (all layers and heads for shared) and liveness."""
        copy_slots(self.k, self.v, self.live, self._slots(src), self._slots(dst), move=False, backend=self.backend)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Compaction move: dst receives src, src becomes empty."""
        copy_slots(self.k, self.v, self.live, self._slots(src), self._slots(dst), move=True, backend=self.backend)

    def evict(self, slots: torch.Tensor) -> None:
        """Mark slots evicted (masked from attention; data left in place)."""
        self.live.view(-1)[self._slots(slots)] = False

    def free_blocks(self, block_ids: torch.Tensor) -> None:
        self.live[torch.as_tensor(block_ids, dtype=torch.long, device=self.device)] = False

    def live_tokens(self) -> int:
        return int(self.live.sum())

    def _slots(self, slots) -> torch.Tensor:
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.device).reshape(-1)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            raise ValueError(f"slot ids must lie in [0, {self.num_slots}), got range "
                             f"[{int(slots.min())}, {int(slots.max())}]")
        return slots
