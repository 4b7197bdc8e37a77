"""Cache write (`reshape_and_cache`: one program per token writes all its KV heads as one [heads,
head_dim] tile) and slot copy/move (sparse copy, compaction) kernels."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsim.gpu.kernels import use_triton
from kvsim.gpu.kernels.reference import copy_slots_ref, reshape_and_cache_ref


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, live_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_st, stride_sh,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Program t: token t's K and V [heads, D] as one tile, each head to its slot (one slot for all
    heads in the shared layout, one per head in the per-head layout)."""
    t = tl.program_id(0)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM)
    slot = tl.load(slot_ptr + t * stride_st + h * stride_sh, mask=h < NUM_HEADS, other=-1).to(tl.int64)
    keep = slot >= 0
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    dst = blk[:, None] * stride_cb + off[:, None] * stride_cs + h[:, None] * stride_ch + d[None, :] * stride_cd
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=keep[:, None])
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=keep[:, None])
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=keep[:, None])
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=keep[:, None])
    tl.store(live_ptr + slot, tl.full([HEADS_PAD], 1, tl.uint8), mask=keep)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, live: torch.Tensor, backend: str | None = None) -> None:
    """Write K/V [T, H, D] to their slots and mark the slots live (slots < 0 are skipped).

    Shared layout: caches [NB, bs, H, D] (one layer) and slot_mapping [T].
    Per-head layout: pools [NB, bs, D] and slot_mapping [T, H] (the layer's slice).
    """
    T, H, D = key.shape
    if slot_mapping.shape not in ((T,), (T, H)):
        raise ValueError(f"slot_mapping must be [{T}] (shared) or [{T}, {H}] (per_head), got {tuple(slot_mapping.shape)}")
    if not use_triton(key, backend):
        return reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping, live)
    if T == 0:
        return None
    if slot_mapping.dim() == 1:
        slots = slot_mapping[:, None].expand(T, H)
        kc, vc = k_cache, v_cache
    else:
        slots = slot_mapping
        kc, vc = k_cache[:, :, None, :].expand(-1, -1, H, -1), v_cache[:, :, None, :].expand(-1, -1, H, -1)
    if kc.stride() != vc.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    live_u8 = live.view(torch.uint8)
    heads_pad = triton.next_power_of_2(H)
    _reshape_and_cache_kernel[(T,)](
        key, value, kc, vc, slots, live_u8, *key.stride(), *value.stride(), *kc.stride(), *slots.stride(),
        NUM_HEADS=H, HEADS_PAD=heads_pad, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=D,
        num_warps=max(1, min(8, heads_pad * D // 256)),     # 8 elements per thread: 16-byte bf16 accesses
    )


@triton.jit
def _copy_slots_kernel(
    k_ptr, v_ptr, live_ptr, src_ptr, dst_ptr, stride_kp, stride_ks, stride_vp, stride_vs,
    ROW: tl.constexpr, TILE: tl.constexpr, MOVE: tl.constexpr,
):
    i = tl.program_id(0)
    part = tl.program_id(1)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    for start in range(0, ROW, TILE):
        col = start + tl.arange(0, TILE)
        mask = col < ROW
        k = tl.load(k_ptr + part * stride_kp + src * stride_ks + col, mask=mask)
        tl.store(k_ptr + part * stride_kp + dst * stride_ks + col, k, mask=mask)
        v = tl.load(v_ptr + part * stride_vp + src * stride_vs + col, mask=mask)
        tl.store(v_ptr + part * stride_vp + dst * stride_vs + col, v, mask=mask)
    if part == 0:
        tl.store(live_ptr + dst, tl.load(live_ptr + src))
        if MOVE:
            tl.store(live_ptr + src, 0)


def copy_slots(k_pool: torch.Tensor, v_pool: torch.Tensor, live: torch.Tensor, src: torch.Tensor,
               dst: torch.Tensor, move: bool = False, backend: str | None = None) -> None:
    """Copy slots src[i] -> dst[i] in K and V pools, all layers and heads at once.

    Pools are viewed as [parts, num_slots, row]: shared [L, NB, bs, H, D] -> [L, NB*bs, H*D];
    per-head [NB, bs, D] -> [1, NB*bs, D]. dst takes src's liveness; `move` marks src empty
    (compaction). Destinations must be distinct and disjoint from the sources.
    """
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src and dst must be 1-D of equal length, got {tuple(src.shape)} and {tuple(dst.shape)}")
    if src.numel() == 0:
        return
    num_slots = live.numel()
    for name, slots in (("src", src), ("dst", dst)):
        if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
            raise ValueError(f"{name} slots must lie in [0, {num_slots}), got range "
                             f"[{int(slots.min())}, {int(slots.max())}]")
    if torch.unique(dst).numel() != dst.numel() or bool(torch.isin(dst, src).any()):
        raise ValueError("dst slots must be distinct and disjoint from src slots")
    parts = k_pool.shape[0] if k_pool.dim() == 5 else 1
    views = [p.view(parts, num_slots, -1) for p in (k_pool, v_pool)]
    if not use_triton(k_pool, backend):
        return copy_slots_ref(views, live, src, dst, move)
    row = views[0].shape[-1]
    _copy_slots_kernel[(src.numel(), parts)](
        views[0], views[1], live.view(torch.uint8), src.contiguous(), dst.contiguous(),
        views[0].stride(0), views[0].stride(1), views[1].stride(0), views[1].stride(1),
        ROW=row, TILE=min(1024, triton.next_power_of_2(row)), MOVE=move,
    )
