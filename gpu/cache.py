"""Paged KV cache tensors, in vLLM's `shared` layout or KV-Compress's `per_head` layout.

- shared:   K, V pools [layers, num_blocks, block_size, kv_heads, head_dim]; a block holds
            block_size tokens of every layer and KV head; one block table per sequence.
- per_head: K, V pools [num_blocks, block_size, head_dim]; a block holds tokens of ONE
            (layer, KV head); block tables per (sequence, layer, KV head).

Slot id = block_id * block_size + offset. `live [num_blocks, block_size]` marks the slots that hold
a token attention may read; writes mark their slots live, `evict` / `free_blocks` clear them.
Keys are cached after RoPE, so tokens can be relocated (`copy_slots` / `move_slots`) freely.
Which blocks and slots are used is decided by the engine core (sim/), never here.

`PrecisionGroupKVCache` is the same surface over LeanKV's mixed-precision pages (`gpu.quant`): quantized K
and V at each page's precision group, for both layouts.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

import numpy as np

from kvsim.gpu.kernels.cache_ops import copy_slots, reshape_and_cache
from kvsim.gpu.kernels.paged_attention import PagedKV, paged_decode_attention
from kvsim.gpu.kernels.reference import gather_live, gather_table
from kvsim.gpu.quant import PRECISION_FORMATS, MixedPrecisionKVCache

LAYOUTS = ("shared", "per_head")


class CacheGeometry(NamedTuple):
    """What a paged cache holds: `layout` (shared: one block per token for all layers and KV heads;
    per_head: one block per (layer, KV head)), the model's layers, KV heads and head size, and the
    number of blocks."""
    layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int

    @classmethod
    def for_model(cls, config, layout: str, num_blocks: int) -> CacheGeometry:
        return cls(layout, config.layers, config.kv_heads, config.head_dim, num_blocks)

    def check(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class PagedKVCache:
    def __init__(self, geometry: CacheGeometry, block_size: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", backend: str | None = None):
        geometry.check()
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        layout, num_layers, num_kv_heads, head_dim, num_blocks = geometry
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
                  device: str | torch.device = "cpu", backend: str | None = None) -> PagedKVCache:
        return cls(CacheGeometry.for_model(config, layout, num_blocks), block_size, dtype, device, backend)

    @staticmethod
    def bytes_per_block(layout: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype = torch.float16) -> int:
        per_token = head_dim * (num_layers * num_kv_heads if layout == "shared" else 1)
        return 2 * block_size * per_token * torch.empty(0, dtype=dtype).element_size()

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def block_slots(self) -> int:
        """Slot ids per block (slot id = block * block_slots + offset)."""
        return self.block_size

    def set_live(self, block_ids: torch.Tensor, live: torch.Tensor | bool) -> None:
        # the executor passes host masks: a CPU value into a CUDA tensor is an error (found on an H100)
        self.live[torch.as_tensor(block_ids, dtype=torch.long, device=self.device)] = \
            live if isinstance(live, bool) else live.to(self.device)

    def block_live(self, block_ids: torch.Tensor) -> torch.Tensor:
        """[copies=1, k, block_slots] live masks of the blocks."""
        return self.live[torch.as_tensor(block_ids, dtype=torch.long, device=self.device)][None]

    def set_page_precisions(self, block_ids, precisions) -> None:
        """Full-precision pages only: nothing to record."""

    def decode_attention(self, layer: int, q: torch.Tensor, tables: torch.Tensor, scale: float,
                         want_scores: bool = False, group_max: bool = False,
                         slot_mask: torch.Tensor | None = None):
        """q [B, heads, D], tables [B, kv_heads, M] -> (out, None or (sum, sum of squares) [B, H, M*bs])."""
        if group_max:
            raise ValueError("the full-precision decode kernel reports sums over each GQA group, not maxima")
        kc, vc = self.layer_view(layer)
        return paged_decode_attention(q, PagedKV(kc, vc, self.live), tables, scale, want_scores=want_scores,
                                      backend=self.backend, slot_mask=slot_mask)

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

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor, src_precisions=None, dst_precisions=None) -> None:
        """Compaction move: dst receives src, src becomes empty (one precision: precision groups are ignored)."""
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


class PrecisionGroupKVCache:
    """LeanKV mixed-precision paged KV cache (`shared` or `per_head` layout).

    A block is a fixed-byte page at one precision group (the engine core's `page_precision`): `precision groups[0]`
    for its PRECISION_HIGH pages and `precision groups[1]` for PRECISION_LOW; quantized K and V with per-token scale and
    zero point (`gpu.quant`), so a page holds `capacity[t]` tokens and slot id = block *
    `block_slots` + offset with `block_slots` the largest capacity, as in the engine core.

    per_head: one page per block (block ids name the (layer, KV head)). shared: a block holds its
    tokens for every layer and KV head, stored as layers * kv_heads pages of the same precision group (page of
    (layer, head, block) = (layer * kv_heads + head) * num_blocks + block) that share the block's
    live mask. `live` is per page: [num_blocks * copies, block_slots].
    """

    def __init__(self, geometry: CacheGeometry, page_bytes: int, precisions: tuple[str, str] = ("K8V4", "K4V2"),
                 device: str | torch.device = "cpu", backend: str | None = None, block_size: int | None = None):
        """`block_size`: the full-precision tokens a page's bytes stand for (the engine core's block size)."""
        geometry.check()
        layout, num_layers, num_kv_heads, head_dim, num_blocks = geometry
        if len(precisions) != 2:
            raise ValueError(f"precision groups must name the high and the low precision group, got {precisions!r}")
        self.layout, self.backend = layout, backend
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.page_bytes, self.block_size = num_blocks, page_bytes, block_size
        self.copies = num_layers * num_kv_heads if layout == "shared" else 1
        self.pages = MixedPrecisionKVCache(num_blocks * self.copies, page_bytes, head_dim, precisions, device)
        self.device = self.pages.device
        self.capacity = tuple(self.pages.capacity)
        self.block_slots = self.pages.max_tokens
        self.live = self.pages.live

    @classmethod
    def for_model(cls, config, layout: str, num_blocks: int, block_size: int, full_bytes: int,
                  precisions: tuple[str, str] = ("K8V4", "K4V2"), device="cpu", backend=None) -> PrecisionGroupKVCache:
        """Pages of the bytes of one full-precision block of one (layer, KV head): block_size tokens x
        `full_bytes` (K + V bytes of one token of one head at the cache dtype)."""
        return cls(CacheGeometry.for_model(config, layout, num_blocks), block_size * full_bytes, precisions, device,
                   backend, block_size=block_size)

    @staticmethod
    def precision_capacity(precisions, page_bytes: int, head_dim: int) -> tuple[int, ...]:
        return tuple(PRECISION_FORMATS[t].tokens_per_page(page_bytes, head_dim) for t in precisions)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_slots

    # ----- page / slot addressing ----------------------------------------------------------------
    def _copy_index(self, layer: int) -> torch.Tensor:
        """[kv_heads] copy index of each head's pages in `layer` (0 for per_head)."""
        if self.layout == "per_head":
            return torch.zeros(self.num_kv_heads, dtype=torch.long, device=self.device)
        return layer * self.num_kv_heads + torch.arange(self.num_kv_heads, device=self.device)

    def _pages_of(self, layer: int, tables: torch.Tensor) -> torch.Tensor:
        """Block tables [B, H, M] of one layer -> page tables [B, H, M] (-1 kept)."""
        off = (self._copy_index(layer) * self.num_blocks)[None, :, None]
        return torch.where(tables >= 0, tables.long() + off, -1)

    def _all_copies(self, slots: torch.Tensor) -> torch.Tensor:
        """Block slot ids [N] -> page slot ids [copies * N] of every (layer, head) copy."""
        step = self.num_blocks * self.block_slots
        return (torch.arange(self.copies, device=self.device)[:, None] * step + slots.long()[None, :]).reshape(-1)

    @staticmethod
    def _cache_precision(precisions) -> torch.Tensor:
        """Engine-core precision groups (1 high, 2 low) -> indices into `precision groups`."""
        t = torch.as_tensor(np.asarray(precisions), dtype=torch.long)
        if ((t < 1) | (t > 2)).any():
            raise ValueError(f"a mixed-precision cache stores precision groups 1 (high) and 2 (low), got {sorted(set(t.tolist()))}")
        return t - 1

    # ----- executor surface ------------------------------------------------------------------------
    def _blocks(self, block_ids) -> torch.Tensor:
        return torch.as_tensor(block_ids, dtype=torch.long, device=self.device).reshape(-1)

    def set_live(self, block_ids, live) -> None:
        view = self.live.view(self.copies, self.num_blocks, self.block_slots)
        view[:, self._blocks(block_ids)] = live if isinstance(live, bool) else live.to(self.device)

    def block_live(self, block_ids) -> torch.Tensor:
        """[copies, k, block_slots] live masks of the blocks' pages."""
        return self.live.view(self.copies, self.num_blocks, self.block_slots)[:, self._blocks(block_ids)]

    def set_page_precisions(self, block_ids, precisions) -> None:
        """Record the engine core's precision group of each block (-1: not allocated)."""
        t = torch.as_tensor(np.asarray(precisions), dtype=torch.long)
        t = torch.where(t > 0, t - 1, -1).to(torch.int8).to(self.device)
        self.pages.page_precision.view(self.copies, self.num_blocks)[:, self._blocks(block_ids)] = t

    def free_blocks(self, block_ids) -> None:
        self.set_live(block_ids, False)

    def evict(self, slots) -> None:
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.device).reshape(-1)
        self.live.view(-1)[self._all_copies(slots)] = False

    def move_slots(self, src, dst, src_precisions, dst_precisions) -> None:
        """Moves in the engine core's slot ids; `src_precisions` / `dst_precisions` are its precision groups (1, 2) of the
        tokens before and after (a demotion re-quantizes at the low precision group)."""
        src = torch.as_tensor(src, dtype=torch.long, device=self.device).reshape(-1)
        dst = torch.as_tensor(dst, dtype=torch.long, device=self.device).reshape(-1)
        st, dt = self._cache_precision(src_precisions).to(self.device), self._cache_precision(dst_precisions).to(self.device)
        self.pages.move(self._all_copies(src), self._all_copies(dst), st.repeat(self.copies), dt.repeat(self.copies))

    def live_tokens(self) -> int:
        return int(self.live.sum()) // self.copies

    def stored_bytes(self) -> tuple[int, int]:
        """(bytes of the live tokens at their precision group, bytes of the pages holding a precision group), whole cache."""
        precision = self.pages.page_precision.long()
        per_token = torch.tensor([t.bytes_per_token(self.head_dim) for t in self.pages.precisions], device=self.device)
        live = self.live.sum(1)
        used = precision >= 0
        return int((live[used] * per_token[precision[used]]).sum()), int(used.sum()) * self.page_bytes

    # ----- model surface ---------------------------------------------------------------------------
    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key/value [T, kv_heads, D], quantized at each slot's page precision group; slot_mapping [T] (shared) or
        [T, kv_heads] (per_head, this layer), -1 = not cached."""
        T, H, D = key.shape
        slots = slot_mapping[:, None].expand(T, H) if slot_mapping.dim() == 1 else slot_mapping
        slots = slots.long().to(self.device)
        pages_off = (self._copy_index(layer) * self.num_blocks * self.block_slots)[None, :]
        keep = slots >= 0
        if keep.any():
            self.pages.write((slots + pages_off)[keep], key[keep].float(), value[keep].float())

    def gather(self, layer: int, block_tables: torch.Tensor, live: torch.Tensor | None = None):
        """block_tables [B, H, M] -> dequantized K, V [B, H, M*S, D] fp32 and live [B, H, M*S]
        (S = block_slots; from `live` if given, e.g. a snapshot taken before this step's writes)."""
        B, H, M = block_tables.shape
        pages = self._pages_of(layer, block_tables)
        slots = (pages.clamp(min=0)[..., None] * self.block_slots
                 + torch.arange(self.block_slots, device=self.device)).reshape(B, H, -1)
        live = self.live if live is None else live
        mask = (pages >= 0)[..., None].expand(B, H, M, self.block_slots).reshape(B, H, -1) & live.view(-1)[slots]
        keys = torch.zeros(B, H, M * self.block_slots, self.head_dim, device=self.device)
        values = torch.zeros_like(keys)
        if mask.any():
            keys[mask], values[mask] = self.pages.read(slots[mask])
        return keys, values, mask

    def decode_attention(self, layer: int, q: torch.Tensor, tables: torch.Tensor, scale: float,
                         want_scores: bool = False, group_max: bool = False,
                         slot_mask: torch.Tensor | None = None):
        """q [B, heads, D], tables [B, kv_heads, M] -> (out [B, heads, D], None or (sum, sum of squares
        or max over the GQA group) [B, H, M * block_slots]), K/V dequantized per page precision group."""
        if slot_mask is not None:
            raise ValueError("selective attention over mixed-precision pages is not supported")
        B, nh, D = q.shape
        H, M = tables.shape[1:]
        pages = self._pages_of(layer, tables).reshape(B * H, M)
        out, stats = self.pages.paged_decode_attention(q.reshape(B * H, nh // H, D), pages, scale,
                                                       want_scores=want_scores, backend=self.backend,
                                                       group_max=group_max)
        out = out.reshape(B, nh, D)
        if stats is not None:
            stats = tuple(x.reshape(B, H, -1) for x in stats)
        return out, stats
