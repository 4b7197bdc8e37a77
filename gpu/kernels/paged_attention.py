"""Paged decode attention: one program per (sequence, KV head) serving all query heads of its GQA
group, 64 cached tokens per loop step, online softmax over live slots only. Like vLLM's paged
kernels it READS every slot of each block in the table (K and V of evicted slots are loaded, then
masked out of the softmax): holes cost their bytes, as the simulator's cost model charges them
(docs/kv-policies.md); a selection mask (below) narrows what is read. A second pass writes
per-slot attention statistics (sum and sum of squares of the probabilities over the group's query
heads) when asked. An optional slot mask [B, H, M * block_size] in block-table order narrows the
slots each (sequence, KV head) reads (Quest-style selection) on top of the live mask. Cache view
conventions: see `gpu.kernels.reference`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsim.gpu.kernels import use_triton
from kvsim.gpu.kernels.reference import paged_decode_attention_ref

TILE = 64


@triton.jit
def _scores_tile(q, k_ptr, tbl_ptr, live_ptr, sel_ptr, b, h, start, n_slots, scale,
                 stride_kb, stride_ks, stride_kh, stride_kd, stride_tb, stride_th, stride_tm,
                 stride_lb, stride_ls, stride_xb, stride_xh, stride_xn,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr, HAS_SELECT: tl.constexpr):
    n = start + tl.arange(0, TILE)
    d = tl.arange(0, HEAD_DIM)
    in_range = n < n_slots
    blk = tl.load(tbl_ptr + b * stride_tb + h * stride_th + (n // BLOCK_SIZE) * stride_tm, mask=in_range, other=-1)
    blk = blk.to(tl.int64)
    off = n % BLOCK_SIZE
    read = in_range & (blk >= 0)                 # every slot of a listed block is read...
    if HAS_SELECT:                               # ... or of the selected ones (Quest reads whole pages)
        read = read & (tl.load(sel_ptr + b * stride_xb + h * stride_xh + n * stride_xn, mask=read, other=0) != 0)
    valid = read & (tl.load(live_ptr + blk * stride_lb + off * stride_ls, mask=read, other=0) != 0)
    k = tl.load(k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks + h * stride_kh + d[None, :] * stride_kd,
                mask=read[:, None], other=0.0).to(tl.float32)
    k = tl.where(valid[:, None], k, 0.0)         # ... and only live slots attended (never-written slots may hold NaN)
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    return s, n, blk, off, valid, read


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tbl_ptr, nblk_ptr, live_ptr, sel_ptr, out_ptr, ssum_ptr, ssq_ptr, scale,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_th, stride_tm,
    stride_nb, stride_nh,
    stride_lb, stride_ls,
    stride_xb, stride_xh, stride_xn,
    stride_ob, stride_oh, stride_od,
    stride_sb, stride_sh, stride_sn,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr, WANT_SCORES: tl.constexpr, HAS_SELECT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    q_heads = h * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_mask[:, None], other=0.0).to(tl.float32)
    n_slots = tl.load(nblk_ptr + b * stride_nb + h * stride_nh) * BLOCK_SIZE

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(0, n_slots, TILE):
        s, n, blk, off, valid, read = _scores_tile(q, k_ptr, tbl_ptr, live_ptr, sel_ptr, b, h, start, n_slots, scale,
                                                   stride_kb, stride_ks, stride_kh, stride_kd,
                                                   stride_tb, stride_th, stride_tm, stride_lb, stride_ls,
                                                   stride_xb, stride_xh, stride_xn, BLOCK_SIZE, HEAD_DIM, TILE,
                                                   HAS_SELECT)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])
        v = tl.load(v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + h * stride_vh + d[None, :] * stride_vd,
                    mask=read[:, None], other=0.0).to(tl.float32)
        v = tl.where(valid[:, None], v, 0.0)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    denom_safe = tl.where(denom > 0, denom, 1.0)
    out = acc / denom_safe[:, None]
    tl.store(out_ptr + b * stride_ob + q_heads[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])

    if WANT_SCORES:
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        for start in range(0, n_slots, TILE):
            s, n, blk, off, valid, read = _scores_tile(q, k_ptr, tbl_ptr, live_ptr, sel_ptr, b, h, start, n_slots, scale,
                                                 stride_kb, stride_ks, stride_kh, stride_kd,
                                                 stride_tb, stride_th, stride_tm, stride_lb, stride_ls,
                                                 stride_xb, stride_xh, stride_xn, BLOCK_SIZE, HEAD_DIM, TILE,
                                                 HAS_SELECT)
            p = tl.exp(s - m_ref[:, None]) / denom_safe[:, None]
            p = tl.where(g_mask[:, None], p, 0.0)
            dst = b * stride_sb + h * stride_sh + n * stride_sn
            tl.store(ssum_ptr + dst, tl.sum(p, axis=0), mask=n < n_slots)
            tl.store(ssq_ptr + dst, tl.sum(p * p, axis=0), mask=n < n_slots)


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, live, scale, want_scores=False, slot_mask=None):
    B, nh, D = q.shape
    H, M = block_tables.shape[1:]
    bs = k_cache.shape[1]
    group = nh // H
    out = torch.empty_like(q)
    num_blocks = (block_tables >= 0).sum(-1).to(torch.int32)
    if want_scores:
        ssum = torch.zeros(B, H, M * bs, dtype=torch.float32, device=q.device)
        ssq = torch.zeros_like(ssum)
    else:
        ssum = ssq = torch.zeros(1, 1, 1, dtype=torch.float32, device=q.device)
    live_u8 = live.view(torch.uint8)
    sel_u8 = slot_mask.view(torch.uint8) if slot_mask is not None else live_u8.new_zeros(1, 1, 1)
    _paged_decode_kernel[(B, H)](
        q, k_cache, v_cache, block_tables, num_blocks, live_u8, sel_u8, out, ssum, ssq, float(scale),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *num_blocks.stride(),
        *live_u8.stride(), *sel_u8.stride(), *out.stride(), *ssum.stride(),
        BLOCK_SIZE=bs, GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=D, TILE=TILE,
        WANT_SCORES=want_scores, HAS_SELECT=slot_mask is not None,
    )
    return out, ((ssum, ssq) if want_scores else None)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, live: torch.Tensor, scale: float,
                           want_scores: bool = False, backend: str | None = None,
                           slot_mask: torch.Tensor | None = None):
    """q [B, heads, D]; caches [NB, bs, H, D] (any strides); block_tables [B, H, M] (-1 padded);
    live [NB, bs] bool; slot_mask None or bool [B, H, M * bs] (block-table order): only slots both
    live and selected are attended. Returns (out [B, heads, D], None or (sum, sum_sq) [B, H, M * bs] fp32)."""
    if q.shape[1] % block_tables.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({block_tables.shape[1]})")
    if slot_mask is not None:
        B, H, M = block_tables.shape
        if tuple(slot_mask.shape) != (B, H, M * k_cache.shape[1]) or slot_mask.dtype != torch.bool:
            raise ValueError(f"slot_mask must be bool [{B}, {H}, {M * k_cache.shape[1]}], got "
                             f"{slot_mask.dtype} {list(slot_mask.shape)}")
    fn = paged_decode_attention_triton if use_triton(q, backend) else paged_decode_attention_ref
    return fn(q, k_cache, v_cache, block_tables, live, scale, want_scores, slot_mask)
