"""Paged decode attention: one program per (sequence, KV head, split) serving all query heads of
its GQA group, TILE cached tokens per loop step, online softmax over live slots only, q K^T and
P V as tensor-core `tl.dot`s over the group padded to 16 rows. When sequences x KV heads cannot fill
the GPU, each row's block table is split across programs and a reduction kernel merges the
partial results (flash-decoding; `gpu.kernels.split_kv`).

Like vLLM's paged kernels it READS every slot of each block in the table (K and V of evicted slots
are loaded, then masked out of the softmax): holes cost their bytes, as the simulator's cost model
charges them (docs/kv-policies.md); a selection mask (below) narrows what is read. A separate pass
writes per-slot attention statistics (sum and sum of squares of the probabilities over the group's
query heads) when asked, from the row's final log-sum-exp. An optional slot mask [B, H, M *
block_size] in block-table order narrows the slots each (sequence, KV head) reads (Quest-style
selection) on top of the live mask. Cache view conventions: see `gpu.kernels.reference`."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvsim.gpu.kernels import use_triton
from kvsim.gpu.kernels.reference import paged_decode_attention_ref
from kvsim.gpu.kernels.split_kv import NUM_STAGES, NUM_WARPS, _lse, combine, group_pad, num_sms, plan_splits, tile_for


class PagedKV(NamedTuple):
    """One layer's paged cache as the decode kernels read it: K and V [NB, bs, H, D] (any strides) and
    the live mask [NB, bs] bool."""
    k: torch.Tensor
    v: torch.Tensor
    live: torch.Tensor


@triton.jit
def _kv_tile(k_ptr, v_ptr, tbl_ptr, live_ptr, sel_ptr, b, h, start, end,
             stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
             stride_tb, stride_th, stride_tm, stride_lb, stride_ls, stride_xb, stride_xh, stride_xn,
             BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr, HAS_SELECT: tl.constexpr,
             WANT_V: tl.constexpr):
    """K (and V) [TILE, HEAD_DIM] of slots start..start+TILE (< end) in the cache dtype, 0 where not
    live; the slot positions and their validity."""
    n = start + tl.arange(0, TILE)
    d = tl.arange(0, HEAD_DIM)
    in_range = n < end
    blk = tl.load(tbl_ptr + b * stride_tb + h * stride_th + (n // BLOCK_SIZE) * stride_tm, mask=in_range, other=-1)
    blk = blk.to(tl.int64)
    off = n % BLOCK_SIZE
    read = in_range & (blk >= 0)                 # every slot of a listed block is read...
    if HAS_SELECT:                               # ... or of the selected ones (Quest reads whole pages)
        read = read & (tl.load(sel_ptr + b * stride_xb + h * stride_xh + n * stride_xn, mask=read, other=0) != 0)
    valid = read & (tl.load(live_ptr + blk * stride_lb + off * stride_ls, mask=read, other=0) != 0)
    k = tl.load(k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks + h * stride_kh + d[None, :] * stride_kd,
                mask=read[:, None], other=0.0)
    k = tl.where(valid[:, None], k, 0.0)         # ... and only live slots attended (never-written slots may hold NaN)
    v = k
    if WANT_V:
        v = tl.load(v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + h * stride_vh
                    + d[None, :] * stride_vd, mask=read[:, None], other=0.0)
        v = tl.where(valid[:, None], v, 0.0)
    return k, v, n, valid


@triton.jit
def _load_group(q_ptr, b, h, stride_qb, stride_qh, stride_qg, stride_qd, dot_ty,
                GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    return tl.load(q_ptr + b * stride_qb + h * stride_qh + g[:, None] * stride_qg + d[None, :] * stride_qd,
                   mask=(g < GROUP)[:, None], other=0.0).to(dot_ty)


# Integer arguments that change from step to step (split length, strides of the per-step block tables,
# slot masks, split outputs and scores): Triton would specialize each on divisibility by 16 (and on 1)
# and compile a new variant, ~0.7 s on an H100, whenever one changes class mid-replay.
PER_STEP_DECODE = ["split_len", "stride_tb", "stride_th", "stride_xb", "stride_xh", "stride_ob", "stride_oh",
                   "stride_os", "stride_eb", "stride_eh", "stride_es"]
PER_STEP_STATS = ["split_len", "stride_tb", "stride_th", "stride_xb", "stride_xh", "stride_eb", "stride_eh",
                  "stride_sb", "stride_sh"]

@triton.jit(do_not_specialize=PER_STEP_DECODE)
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tbl_ptr, nblk_ptr, live_ptr, sel_ptr, out_ptr, lse_ptr, scale, split_len,
    stride_qb, stride_qh, stride_qg, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_th, stride_tm,
    stride_nb, stride_nh,
    stride_lb, stride_ls,
    stride_xb, stride_xh, stride_xn,
    stride_ob, stride_oh, stride_os, stride_og, stride_od,
    stride_eb, stride_eh, stride_es, stride_eg,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr, HAS_SELECT: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (b, h, split): out [group, D] over the split's slots, normalized by its own softmax
    denominator, and its log-sum-exp (the final ones when there is a single split)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    dot_ty = k_ptr.dtype.element_ty
    q = _load_group(q_ptr, b, h, stride_qb, stride_qh, stride_qg, stride_qd, dot_ty, GROUP, GROUP_PAD, HEAD_DIM)
    n_slots = tl.load(nblk_ptr + b * stride_nb + h * stride_nh) * BLOCK_SIZE
    begin = sp * split_len
    end = tl.minimum(n_slots, begin + split_len)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(begin, end, TILE):
        k, v, n, valid = _kv_tile(k_ptr, v_ptr, tbl_ptr, live_ptr, sel_ptr, b, h, start, end,
                                  stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
                                  stride_vd, stride_tb, stride_th, stride_tm, stride_lb, stride_ls,
                                  stride_xb, stride_xh, stride_xn, BLOCK_SIZE, HEAD_DIM, TILE, HAS_SELECT, True)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(dot_ty), v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    g_mask = g < GROUP
    tl.store(out_ptr + b * stride_ob + h * stride_oh + sp * stride_os + g[:, None] * stride_og + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    tl.store(lse_ptr + b * stride_eb + h * stride_eh + sp * stride_es + g * stride_eg, _lse(m, denom), mask=g_mask)


@triton.jit(do_not_specialize=PER_STEP_STATS)
def _paged_stats_kernel(
    q_ptr, k_ptr, tbl_ptr, nblk_ptr, live_ptr, sel_ptr, lse_ptr, ssum_ptr, ssq_ptr, scale, split_len,
    stride_qb, stride_qh, stride_qg, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_tb, stride_th, stride_tm,
    stride_nb, stride_nh,
    stride_lb, stride_ls,
    stride_xb, stride_xh, stride_xn,
    stride_eb, stride_eh, stride_eg,
    stride_sb, stride_sh, stride_sn,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr, HAS_SELECT: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (b, h, split): per-slot sum and sum of squares over the group of p = exp(s - lse)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    dot_ty = k_ptr.dtype.element_ty
    q = _load_group(q_ptr, b, h, stride_qb, stride_qh, stride_qg, stride_qd, dot_ty, GROUP, GROUP_PAD, HEAD_DIM)
    lse = tl.load(lse_ptr + b * stride_eb + h * stride_eh + g * stride_eg, mask=g < GROUP, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), 0.0, lse)   # rows with nothing live: every p is 0 anyway
    n_slots = tl.load(nblk_ptr + b * stride_nb + h * stride_nh) * BLOCK_SIZE
    begin = sp * split_len
    end = tl.minimum(n_slots, begin + split_len)
    for start in range(begin, end, TILE):
        k, _, n, valid = _kv_tile(k_ptr, k_ptr, tbl_ptr, live_ptr, sel_ptr, b, h, start, end,
                                  stride_kb, stride_ks, stride_kh, stride_kd, stride_kb, stride_ks, stride_kh,
                                  stride_kd, stride_tb, stride_th, stride_tm, stride_lb, stride_ls,
                                  stride_xb, stride_xh, stride_xn, BLOCK_SIZE, HEAD_DIM, TILE, HAS_SELECT, False)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        p = tl.where(valid[None, :] & (g < GROUP)[:, None], tl.exp(s * scale - lse[:, None]), 0.0)
        dst = b * stride_sb + h * stride_sh + n * stride_sn
        tl.store(ssum_ptr + dst, tl.sum(p, axis=0), mask=n < end)
        tl.store(ssq_ptr + dst, tl.sum(p * p, axis=0), mask=n < end)


def paged_decode_attention_triton(q, kv: PagedKV, block_tables, scale, want_scores=False, slot_mask=None,
                                  num_splits=None):
    k_cache, v_cache, live = kv
    B, nh, D = q.shape
    H, M = block_tables.shape[1:]
    bs = k_cache.shape[1]
    group = nh // H
    GP, tile = group_pad(group), tile_for(D)
    plan = plan_splits(B * H, M * bs, tile, num_sms(q.device), num_splits)
    num_blocks = (block_tables >= 0).sum(-1).to(torch.int32)
    live_u8 = live.view(torch.uint8)
    sel_u8 = slot_mask.view(torch.uint8) if slot_mask is not None else live_u8.new_zeros(1, 1, 1)
    qg = q.unflatten(1, (H, group))
    out = torch.empty(B, H, group, D, dtype=q.dtype, device=q.device)
    if plan.splits == 1:
        dst, lse = out[:, :, None], torch.empty(B, H, 1, group, dtype=torch.float32, device=q.device)
    else:
        dst = torch.empty(B, H, plan.splits, group, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, plan.splits, group, dtype=torch.float32, device=q.device)
    common = dict(BLOCK_SIZE=bs, GROUP=group, GROUP_PAD=GP, HEAD_DIM=D, TILE=tile,
                  HAS_SELECT=slot_mask is not None, IEEE=k_cache.dtype == torch.float32, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _paged_decode_kernel[(B, H, plan.splits)](
        qg, k_cache, v_cache, block_tables, num_blocks, live_u8, sel_u8, dst, lse, float(scale), plan.split_len,
        *qg.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *num_blocks.stride(),
        *live_u8.stride(), *sel_u8.stride(), *dst.stride(), *lse.stride(), **common)
    if plan.splits == 1:
        lse = lse[:, :, 0]
    else:
        lse = combine(dst.flatten(0, 1), lse.flatten(0, 1), out.view(B * H, group, D)).view(B, H, group)
    if not want_scores:
        return out.view(B, nh, D), None
    ssum = torch.zeros(B, H, M * bs, dtype=torch.float32, device=q.device)
    ssq = torch.zeros_like(ssum)
    _paged_stats_kernel[(B, H, plan.splits)](
        qg, k_cache, block_tables, num_blocks, live_u8, sel_u8, lse, ssum, ssq, float(scale), plan.split_len,
        *qg.stride(), *k_cache.stride(), *block_tables.stride(), *num_blocks.stride(), *live_u8.stride(),
        *sel_u8.stride(), *lse.stride(), *ssum.stride(), **common)
    return out.view(B, nh, D), (ssum, ssq)


def paged_decode_attention(q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, scale: float,
                           want_scores: bool = False, backend: str | None = None,
                           slot_mask: torch.Tensor | None = None, num_splits: int | None = None):
    """q [B, heads, D]; kv: the layer's PagedKV (caches [NB, bs, H, D], any strides; live [NB, bs]
    bool); block_tables [B, H, M] (-1 padded); slot_mask None or bool [B, H, M * bs] (block-table order): only slots both
    live and selected are attended. `num_splits` (Triton only) forces the number of split-KV programs
    per (sequence, KV head); None picks it from the GPU's SM count (1 off CUDA). Returns (out [B,
    heads, D], None or (sum, sum_sq) [B, H, M * bs] fp32)."""
    if q.shape[1] % block_tables.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({block_tables.shape[1]})")
    if slot_mask is not None:
        B, H, M = block_tables.shape
        if tuple(slot_mask.shape) != (B, H, M * kv.k.shape[1]) or slot_mask.dtype != torch.bool:
            raise ValueError(f"slot_mask must be bool [{B}, {H}, {M * kv.k.shape[1]}], got "
                             f"{slot_mask.dtype} {list(slot_mask.shape)}")
    if use_triton(q, backend):
        return paged_decode_attention_triton(q, kv, block_tables, scale, want_scores, slot_mask, num_splits)
    return paged_decode_attention_ref(q, kv.k, kv.v, block_tables, kv.live, scale, want_scores, slot_mask)
