"""Paged decode attention straight over LeanKV mixed-precision pages (`gpu.quant.MixedPrecisionKVCache`).

One program per page-table row (one sequence's KV head) and split serves the row's GQA group of
query heads, online softmax, q K^T and P V as tensor-core `tl.dot`s over the group padded to 16 rows
(split-KV as in `gpu.kernels.split_kv`; 16 slots per loop step, see `quant_tile`). Each slot's page carries its own precision group, so the bit widths of
K and V are per-row values of the tile, not compile-time constants: element d of a token sits in
byte `d * bits // 8` of the token's code row at bit `d * bits % 8` (codes are packed little end first),
which covers 2-, 4- and 8-bit codes with one load. Per-token fp16 scale and zero are read as byte
pairs and bit-cast, since the page byte layout does not keep them 2-byte aligned. A separate pass
writes per-slot attention statistics (sum and sum of squares, or max, over the query heads) when
asked, from each row's final log-sum-exp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsim.gpu.kernels import use_triton
from kvsim.gpu.kernels.split_kv import NUM_STAGES, _lse, combine, group_pad, num_sms, plan_splits

# Per-precision group layout table the kernel reads, one row per precision group: for K then for V the fields
# [bits, bytes per token's code row, code region start, scale region start, zero region start]
# (byte offsets within a page), then the precision group's token capacity.
KEY_FIELDS = tl.constexpr(0)
VALUE_FIELDS = tl.constexpr(5)
CAPACITY = tl.constexpr(10)
LAYOUT_COLUMNS = tl.constexpr(11)


def precision_layout(cache) -> torch.Tensor:
    """[num_precisions, LAYOUT_COLUMNS] int32 layout table of `cache`'s precision groups (see the column comment)."""
    rows = []
    for t in range(len(cache.precisions)):
        precision, cap, kb, vb, k_end, (k_scale, k_zero, v_scale, v_zero) = cache._regions(t)
        rows.append([precision.key_bits, kb, 0, k_scale, k_zero, precision.value_bits, vb, k_end, v_scale, v_zero, cap])
    return torch.tensor(rows, dtype=torch.int32, device=cache.device)


@triton.jit
def _load_fp16_pair(page_ptr, at, mask):
    lo = tl.load(page_ptr + at, mask=mask, other=0).to(tl.int32)
    hi = tl.load(page_ptr + at + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_tile(page_ptr, layout_ptr, precision, off, read, valid, FIELDS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Dequantized K (FIELDS=KEY_FIELDS) or V rows [TILE, HEAD_DIM] fp32 of the tile's slots: every slot
    of the pages is read (`read`; evicted ones too, as a paged kernel does), 0 where not `valid` (live)."""
    d = tl.arange(0, HEAD_DIM)
    fields = layout_ptr + precision * LAYOUT_COLUMNS + FIELDS
    bits = tl.load(fields, mask=read, other=8)
    width = tl.load(fields + 1, mask=read, other=0)
    base = tl.load(fields + 2, mask=read, other=0)
    bit_pos = d[None, :] * bits[:, None]
    byte = tl.load(page_ptr[:, None] + base[:, None] + off[:, None] * width[:, None] + (bit_pos >> 3),
                   mask=read[:, None], other=0).to(tl.int32)
    codes = (byte >> (bit_pos & 7)) & ((1 << bits[:, None]) - 1)
    scale = _load_fp16_pair(page_ptr, tl.load(fields + 3, mask=read, other=0) + off * 2, read)
    zero = _load_fp16_pair(page_ptr, tl.load(fields + 4, mask=read, other=0) + off * 2, read)
    return tl.where(valid[:, None], codes.to(tl.float32) * scale[:, None] + zero[:, None], 0.0)


@triton.jit
def _slots_tile(pages_ptr, precision_ptr, live_ptr, tbl_ptr, layout_ptr, r, start, n_slots,
                stride_p, stride_lp, stride_ls, stride_tr, stride_tm, MAX_TOKENS: tl.constexpr, TILE: tl.constexpr):
    """Slot positions start..start+TILE of row r: their page base pointers, precision groups, offsets, validity."""
    n = start + tl.arange(0, TILE)
    in_range = n < n_slots
    page = tl.load(tbl_ptr + r * stride_tr + (n // MAX_TOKENS) * stride_tm, mask=in_range, other=-1).to(tl.int64)
    off = n % MAX_TOKENS
    valid = in_range & (page >= 0)
    precision = tl.load(precision_ptr + page, mask=valid, other=-1).to(tl.int32)
    valid = valid & (precision >= 0)
    cap = tl.load(layout_ptr + precision * LAYOUT_COLUMNS + CAPACITY, mask=valid, other=0)
    read = valid & (off < cap)                   # every slot of a listed page is read ...
    valid = read & (tl.load(live_ptr + page * stride_lp + off * stride_ls, mask=read, other=0) != 0)
    return n, pages_ptr + page * stride_p, precision, off, valid, read   # ... only live ones are attended


@triton.jit
def _mixed_kv_tile(pages_ptr, precision_ptr, live_ptr, tbl_ptr, layout_ptr, r, start, end,
                   stride_p, stride_lp, stride_ls, stride_tr, stride_tm,
                   MAX_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr, WANT_V: tl.constexpr):
    """Dequantized K (and V) [TILE, HEAD_DIM] fp32 of slots start..start+TILE (< end) of row r."""
    n, page_ptr, precision, off, valid, read = _slots_tile(pages_ptr, precision_ptr, live_ptr, tbl_ptr, layout_ptr, r, start,
                                                      end, stride_p, stride_lp, stride_ls, stride_tr, stride_tm,
                                                      MAX_TOKENS, TILE)
    k = _dequant_tile(page_ptr, layout_ptr, precision, off, read, valid, KEY_FIELDS, HEAD_DIM)
    v = k
    if WANT_V:
        v = _dequant_tile(page_ptr, layout_ptr, precision, off, read, valid, VALUE_FIELDS, HEAD_DIM)
    return k, v, n, valid


# per-step integer arguments, not specialized (see paged_attention.PER_STEP_DECODE)
PER_STEP_MIXED_DECODE = ["n_slots", "split_len", "stride_tr", "stride_or", "stride_os", "stride_er", "stride_es"]
PER_STEP_MIXED_STATS = ["n_slots", "split_len", "stride_tr", "stride_er", "stride_sr"]

@triton.jit(do_not_specialize=PER_STEP_MIXED_DECODE)
def _mixed_decode_kernel(
    q_ptr, pages_ptr, precision_ptr, live_ptr, tbl_ptr, layout_ptr, out_ptr, lse_ptr, scale, n_slots, split_len,
    stride_qr, stride_qg, stride_qd,
    stride_p,
    stride_lp, stride_ls,
    stride_tr, stride_tm,
    stride_or, stride_os, stride_og, stride_od,
    stride_er, stride_es, stride_eg,
    MAX_TOKENS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (row, split): out [group, D] over the split's slots (normalized by its own
    denominator) and its log-sum-exp; q K^T and P V are tl.dots in q's dtype."""
    r = tl.program_id(0)
    sp = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    dot_ty = q_ptr.dtype.element_ty
    q = tl.load(q_ptr + r * stride_qr + g[:, None] * stride_qg + d[None, :] * stride_qd,
                mask=g_mask[:, None], other=0.0)
    begin = sp * split_len
    end = tl.minimum(n_slots, begin + split_len)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(begin, end, TILE):
        k, v, n, valid = _mixed_kv_tile(pages_ptr, precision_ptr, live_ptr, tbl_ptr, layout_ptr, r, start, end,
                                        stride_p, stride_lp, stride_ls, stride_tr, stride_tm,
                                        MAX_TOKENS, HEAD_DIM, TILE, True)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(dot_ty)))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(dot_ty), v.to(dot_ty))
        acc = acc * alpha[:, None] + pv
        m = m_new

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + r * stride_or + sp * stride_os + g[:, None] * stride_og + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    tl.store(lse_ptr + r * stride_er + sp * stride_es + g * stride_eg, _lse(m, denom), mask=g_mask)


@triton.jit(do_not_specialize=PER_STEP_MIXED_STATS)
def _mixed_stats_kernel(
    q_ptr, pages_ptr, precision_ptr, live_ptr, tbl_ptr, layout_ptr, lse_ptr, ssum_ptr, ssq_ptr, scale, n_slots,
    split_len,
    stride_qr, stride_qg, stride_qd,
    stride_p,
    stride_lp, stride_ls,
    stride_tr, stride_tm,
    stride_er, stride_eg,
    stride_sr, stride_sn,
    MAX_TOKENS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr, GROUP_MAX: tl.constexpr,
):
    """Program (row, split): per-slot sum over the group of p = exp(s - lse), and the sum of
    squares (or, with GROUP_MAX, the max)."""
    r = tl.program_id(0)
    sp = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    dot_ty = q_ptr.dtype.element_ty
    q = tl.load(q_ptr + r * stride_qr + g[:, None] * stride_qg + d[None, :] * stride_qd,
                mask=g_mask[:, None], other=0.0)
    lse = tl.load(lse_ptr + r * stride_er + g * stride_eg, mask=g_mask, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    begin = sp * split_len
    end = tl.minimum(n_slots, begin + split_len)
    for start in range(begin, end, TILE):
        k, _, n, valid = _mixed_kv_tile(pages_ptr, precision_ptr, live_ptr, tbl_ptr, layout_ptr, r, start, end,
                                        stride_p, stride_lp, stride_ls, stride_tr, stride_tm,
                                        MAX_TOKENS, HEAD_DIM, TILE, False)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(dot_ty)))
        p = tl.where(valid[None, :] & g_mask[:, None], tl.exp(s * scale - lse[:, None]), 0.0)
        dst = r * stride_sr + n * stride_sn
        tl.store(ssum_ptr + dst, tl.sum(p, axis=0), mask=n < end)
        if GROUP_MAX:
            tl.store(ssq_ptr + dst, tl.max(p, axis=0), mask=n < end)
        else:
            tl.store(ssq_ptr + dst, tl.sum(p * p, axis=0), mask=n < end)


QUANT_WARPS = 8     # at 4 warps sm_89's ptxas caps registers at 128 and spills (8 B of stack, head dim 128)


def quant_tile(head_dim: int) -> int:
    """Slots per loop step: 16, the tl.dot minimum. Dequantizing holds a tile's byte pointers, bit
    positions, codes and values at once; at 32 slots the kernel spills (sm_90: 255 registers + 208 B
    of stack at head dim 64; docs/gpu.md), at 16 it needs 120 registers and no stack."""
    return 16


def mixed_decode_attention_triton(cache, q, page_tables, scale, want_scores=False, group_max=False,
                                  num_splits=None):
    R, G, D = q.shape
    if D & (D - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim, got {D}")
    n_slots = page_tables.shape[1] * cache.max_tokens
    GP, tile = group_pad(G), quant_tile(D)
    plan = plan_splits(R, n_slots, tile, num_sms(q.device), num_splits)
    live_u8 = cache.live.view(torch.uint8)
    layout = precision_layout(cache)
    out = torch.empty(R, G, D, dtype=q.dtype, device=q.device)
    if plan.splits == 1:
        dst, lse = out[:, None], torch.empty(R, 1, G, dtype=torch.float32, device=q.device)
    else:
        dst = torch.empty(R, plan.splits, G, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(R, plan.splits, G, dtype=torch.float32, device=q.device)
    common = dict(MAX_TOKENS=cache.max_tokens, GROUP=G, GROUP_PAD=GP, HEAD_DIM=D, TILE=tile,
                  IEEE=q.dtype == torch.float32, num_warps=QUANT_WARPS, num_stages=NUM_STAGES)
    _mixed_decode_kernel[(R, plan.splits)](
        q, cache.pages, cache.page_precision, live_u8, page_tables, layout, dst, lse, float(scale), n_slots, plan.split_len,
        *q.stride(), cache.pages.stride(0), *live_u8.stride(), *page_tables.stride(), *dst.stride(), *lse.stride(),
        **common)
    lse = lse[:, 0] if plan.splits == 1 else combine(dst, lse, out)
    if not want_scores:
        return out, None
    ssum = torch.zeros(R, n_slots, dtype=torch.float32, device=q.device)
    ssq = torch.zeros_like(ssum)
    _mixed_stats_kernel[(R, plan.splits)](
        q, cache.pages, cache.page_precision, live_u8, page_tables, layout, lse, ssum, ssq, float(scale), n_slots,
        plan.split_len, *q.stride(), cache.pages.stride(0), *live_u8.stride(), *page_tables.stride(), *lse.stride(),
        *ssum.stride(), GROUP_MAX=group_max, **common)
    return out, (ssum, ssq)


def mixed_decode_attention_ref(cache, q, page_tables, scale, want_scores=False, group_max=False):
    """Torch twin: dequantize every live slot of the rows' pages with `cache.read`, then masked softmax."""
    R, G, D = q.shape
    pages = page_tables.long()
    slots = (pages.clamp(min=0)[..., None] * cache.max_tokens
             + torch.arange(cache.max_tokens, device=q.device)).reshape(R, -1)
    mask = (pages >= 0)[..., None].expand(-1, -1, cache.max_tokens).reshape(R, -1) & cache.live.view(-1)[slots]
    keys = torch.zeros(*slots.shape, D, device=q.device)
    values = torch.zeros_like(keys)
    if mask.any():
        keys[mask], values[mask] = cache.read(slots[mask])
    s = torch.einsum("rgd,rsd->rgs", q.float(), keys) * scale
    p = torch.softmax(s.masked_fill(~mask[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
    out = torch.einsum("rgs,rsd->rgd", p, values).to(q.dtype)
    if not want_scores:
        return out, None
    return out, (p.sum(1), p.amax(1) if group_max else (p * p).sum(1))


def mixed_decode_attention(cache, q: torch.Tensor, page_tables: torch.Tensor, scale: float,
                           want_scores: bool = False, backend: str | None = None, group_max: bool = False,
                           num_splits: int | None = None):
    """Decode attention over a `MixedPrecisionKVCache`'s pages, K/V dequantized on the fly.

    q [R, G, head_dim]: the G query heads (one GQA group) of each page-table row; page_tables
    [R, max_pages] page ids of one (sequence, KV head) each, -1 anywhere for no page (LeanKV grows
    high-precision group pages from one end of a row and low-precision group pages from the other). Returns (out [R, G,
    head_dim] in q's dtype, None or (sum, sum of squares) of the probabilities over the G heads,
    [R, max_pages * cache.max_tokens] fp32 in page-table slot order, 0 for dead slots). With
    `group_max` the second statistic is the max over the G heads instead (LeanKV's significance).
    `num_splits` (Triton only): split-KV programs per row, as in `gpu.kernels.paged_attention`.
    """
    if q.dim() != 3 or q.shape[-1] != cache.head_dim:
        raise ValueError(f"q must be [rows, group, head_dim={cache.head_dim}], got {tuple(q.shape)}")
    if page_tables.dim() != 2 or page_tables.shape[0] != q.shape[0]:
        raise ValueError(f"page_tables must be [rows={q.shape[0]}, max_pages], got {tuple(page_tables.shape)}")
    if page_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_tables must hold int32/int64 page ids, got {page_tables.dtype}")
    if page_tables.numel() and int(page_tables.max()) >= cache.num_pages:
        raise ValueError(f"page_tables name page {int(page_tables.max())}; the cache has {cache.num_pages} pages")
    if use_triton(q, backend):
        return mixed_decode_attention_triton(cache, q, page_tables, scale, want_scores, group_max, num_splits)
    return mixed_decode_attention_ref(cache, q, page_tables, scale, want_scores, group_max)
