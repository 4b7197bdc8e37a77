"""Plain-torch twins of the Triton kernels (the CPU path and the tests' ground truth).

Cache views used by every kernel: `k_cache`/`v_cache` are 4-D `[num_blocks, block_size, kv_heads,
head_dim]` tensors of any strides (the per-head layout passes its `[num_blocks, block_size,
head_dim]` pool expanded over heads with stride 0, since its block ids already name the head);
`block_tables` is `[B, kv_heads, max_blocks]` (-1 padded; a shared table is expanded over heads);
`live` is the `[num_blocks, block_size]` bool slot mask. Slot id = block_id * block_size + offset.
"""
from __future__ import annotations

import torch


def gather_table(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache [NB, bs, H, D], block_tables [B, H, M] -> [B, H, M * bs, D] in block-table order."""
    B, H, M = block_tables.shape
    bs = cache.shape[1]
    blk = block_tables.clamp(min=0).long()[..., None]
    off = torch.arange(bs, device=cache.device)[None, None, None, :]
    head = torch.arange(H, device=cache.device)[None, :, None, None]
    return cache[blk, off, head].reshape(B, H, M * bs, cache.shape[-1])


def gather_live(live: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """live [NB, bs], block_tables [B, H, M] -> [B, H, M * bs] bool (padding entries are dead)."""
    B, H, M = block_tables.shape
    bs = live.shape[1]
    blk = block_tables.clamp(min=0).long()[..., None]
    off = torch.arange(bs, device=live.device)[None, None, None, :]
    return (live[blk, off] & (block_tables >= 0)[..., None]).reshape(B, H, M * bs)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, live: torch.Tensor, scale: float,
                               want_scores: bool = False, slot_mask: torch.Tensor | None = None):
    """One query per sequence over its live cached slots (those of `slot_mask` [B, H, M * bs] too, if given).

    q [B, heads, D] -> out [B, heads, D] (q's dtype) and, with `want_scores`, (sum, sum of squares)
    of the attention probabilities over the query heads of each KV head's group, [B, H, M * bs] fp32.
    """
    B, nh, D = q.shape
    H = block_tables.shape[1]
    keys = gather_table(k_cache, block_tables).float()
    values = gather_table(v_cache, block_tables).float()
    mask = gather_live(live, block_tables)
    if slot_mask is not None:
        mask = mask & slot_mask
    qg = q.float().view(B, H, nh // H, D)
    s = torch.einsum("bhgd,bhsd->bhgs", qg, keys) * scale
    s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhgs,bhsd->bhgd", p, values).reshape(B, nh, D).to(q.dtype)
    if not want_scores:
        return out, None
    return out, (p.sum(2), (p * p).sum(2))


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, live: torch.Tensor) -> None:
    """Write K/V [T, H, D] into the cache and mark their slots live; slots < 0 are skipped.

    Shared: caches [NB, bs, H, D], slot_mapping [T]. Per-head: pools [NB, bs, D], slot_mapping [T, H].
    """
    D = key.shape[-1]
    if slot_mapping.dim() == 1:
        rows_k, rows_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
        slots, src_k, src_v = slot_mapping, key, value
    else:
        rows_k, rows_v = k_cache.view(-1, D), v_cache.view(-1, D)
        slots, src_k, src_v = slot_mapping.reshape(-1), key.reshape(-1, D), value.reshape(-1, D)
    keep = slots >= 0
    slots = slots[keep].long()
    rows_k[slots] = src_k[keep].to(rows_k.dtype)
    rows_v[slots] = src_v[keep].to(rows_v.dtype)
    live.view(-1)[slots] = True


def copy_slots_ref(pools: list[torch.Tensor], live: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                   move: bool) -> None:
    """pools: tensors viewed as [P, num_slots, row]; dst slots get src's rows and liveness; a move
    also marks src empty."""
    src, dst = src.long(), dst.long()
    for pool in pools:
        pool[:, dst] = pool[:, src]
    flat = live.view(-1)
    was_live = flat[src].clone()
    if move:
        flat[src] = False
    flat[dst] = was_live
