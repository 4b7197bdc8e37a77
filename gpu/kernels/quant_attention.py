"""Paged decode attention straight over LeanKV mixed-precision pages (`gpu.quant.MixedPrecisionKVCache`).

One program per page-table row (one sequence's KV head) serves the row's GQA group of query heads,
64 slots per loop step, online softmax. Each slot's page carries its own tier, so the bit widths of
K and V are per-row values of the tile, not compile-time constants: element d of a token sits in
byte `d * bits // 8` of the token's code row at bit `d * bits % 8` (codes are packed little end first),
which covers 2-, 4- and 8-bit codes with one load. Per-token fp16 scale and zero are read as byte
pairs and bit-cast, since the page byte layout does not keep them 2-byte aligned. A second pass
writes per-slot attention statistics (sum and sum of squares over the query heads) when asked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsim.gpu.kernels import use_triton

TILE = 64
# Per-tier layout table the kernel reads, one row per tier: for K then for V the fields
# [bits, bytes per token's code row, code region start, scale region start, zero region start]
# (byte offsets within a page), then the tier's token capacity.
KEY_FIELDS = tl.constexpr(0)
VALUE_FIELDS = tl.constexpr(5)
CAPACITY = tl.constexpr(10)
LAYOUT_COLUMNS = tl.constexpr(11)


def tier_layout(cache) -> torch.Tensor:
    """[num_tiers, LAYOUT_COLUMNS] int32 layout table of `cache`'s tiers (see the column comment)."""
    rows = []
    for t in range(len(cache.tiers)):
        tier, cap, kb, vb, k_end, (k_scale, k_zero, v_scale, v_zero) = cache._regions(t)
        rows.append([tier.key_bits, kb, 0, k_scale, k_zero, tier.value_bits, vb, k_end, v_scale, v_zero, cap])
    return torch.tensor(rows, dtype=torch.int32, device=cache.device)


@triton.jit
def _load_fp16_pair(page_ptr, at, mask):
    lo = tl.load(page_ptr + at, mask=mask, other=0).to(tl.int32)
    hi = tl.load(page_ptr + at + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_tile(page_ptr, layout_ptr, tier, off, read, valid, FIELDS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Dequantized K (FIELDS=KEY_FIELDS) or V rows [TILE, HEAD_DIM] fp32 of the tile's slots: every slot
    of the pages is read (`read`; evicted ones too, as a paged kernel does), 0 where not `valid` (live)."""
    d = tl.arange(0, HEAD_DIM)
    fields = layout_ptr + tier * LAYOUT_COLUMNS + FIELDS
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
def _slots_tile(pages_ptr, tier_ptr, live_ptr, tbl_ptr, layout_ptr, r, start, n_slots,
                stride_p, stride_lp, stride_ls, stride_tr, stride_tm, MAX_TOKENS: tl.constexpr, TILE: tl.constexpr):
    """Slot positions start..start+TILE of row r: their page base pointers, tiers, offsets, validity."""
    n = start + tl.arange(0, TILE)
    in_range = n < n_slots
    page = tl.load(tbl_ptr + r * stride_tr + (n // MAX_TOKENS) * stride_tm, mask=in_range, other=-1).to(tl.int64)
    off = n % MAX_TOKENS
    valid = in_range & (page >= 0)
    tier = tl.load(tier_ptr + page, mask=valid, other=-1).to(tl.int32)
    valid = valid & (tier >= 0)
    cap = tl.load(layout_ptr + tier * LAYOUT_COLUMNS + CAPACITY, mask=valid, other=0)
    read = valid & (off < cap)                   # every slot of a listed page is read ...
    valid = read & (tl.load(live_ptr + page * stride_lp + off * stride_ls, mask=read, other=0) != 0)
    return n, pages_ptr + page * stride_p, tier, off, valid, read   # ... only live ones are attended


@triton.jit
def _mixed_scores_tile(q, pages_ptr, tier_ptr, live_ptr, tbl_ptr, layout_ptr, r, start, n_slots, scale,
                       stride_p, stride_lp, stride_ls, stride_tr, stride_tm,
                       MAX_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr):
    n, page_ptr, tier, off, valid, read = _slots_tile(pages_ptr, tier_ptr, live_ptr, tbl_ptr, layout_ptr, r, start,
                                                      n_slots, stride_p, stride_lp, stride_ls, stride_tr, stride_tm,
                                                      MAX_TOKENS, TILE)
    k = _dequant_tile(page_ptr, layout_ptr, tier, off, read, valid, KEY_FIELDS, HEAD_DIM)
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    return s, n, page_ptr, tier, off, valid, read


@triton.jit
def _mixed_decode_kernel(
    q_ptr, pages_ptr, tier_ptr, live_ptr, tbl_ptr, layout_ptr, out_ptr, ssum_ptr, ssq_ptr, scale, n_slots,
    stride_qr, stride_qg, stride_qd,
    stride_p,
    stride_lp, stride_ls,
    stride_tr, stride_tm,
    stride_or, stride_og, stride_od,
    stride_sr, stride_sn,
    MAX_TOKENS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, TILE: tl.constexpr, WANT_SCORES: tl.constexpr, GROUP_MAX: tl.constexpr,
):
    r = tl.program_id(0)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    q = tl.load(q_ptr + r * stride_qr + g[:, None] * stride_qg + d[None, :] * stride_qd,
                mask=g_mask[:, None], other=0.0).to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(0, n_slots, TILE):
        s, n, page_ptr, tier, off, valid, read = _mixed_scores_tile(
            q, pages_ptr, tier_ptr, live_ptr, tbl_ptr, layout_ptr, r, start, n_slots, scale,
            stride_p, stride_lp, stride_ls, stride_tr, stride_tm, MAX_TOKENS, HEAD_DIM, TILE)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])
        v = _dequant_tile(page_ptr, layout_ptr, tier, off, read, valid, VALUE_FIELDS, HEAD_DIM)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    denom_safe = tl.where(denom > 0, denom, 1.0)
    out = acc / denom_safe[:, None]
    tl.store(out_ptr + r * stride_or + g[:, None] * stride_og + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])

    if WANT_SCORES:
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        for start in range(0, n_slots, TILE):
            s, n, page_ptr, tier, off, valid, read = _mixed_scores_tile(
                q, pages_ptr, tier_ptr, live_ptr, tbl_ptr, layout_ptr, r, start, n_slots, scale,
                stride_p, stride_lp, stride_ls, stride_tr, stride_tm, MAX_TOKENS, HEAD_DIM, TILE)
            p = tl.exp(s - m_ref[:, None]) / denom_safe[:, None]
            p = tl.where(g_mask[:, None], p, 0.0)
            dst = r * stride_sr + n * stride_sn
            tl.store(ssum_ptr + dst, tl.sum(p, axis=0), mask=n < n_slots)
            if GROUP_MAX:
                tl.store(ssq_ptr + dst, tl.max(p, axis=0), mask=n < n_slots)
            else:
                tl.store(ssq_ptr + dst, tl.sum(p * p, axis=0), mask=n < n_slots)


def mixed_decode_attention_triton(cache, q, page_tables, scale, want_scores=False, group_max=False):
    R, G, D = q.shape
    if D & (D - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim, got {D}")
    n_slots = page_tables.shape[1] * cache.max_tokens
    out = torch.empty_like(q)
    if want_scores:
        ssum = torch.zeros(R, n_slots, dtype=torch.float32, device=q.device)
        ssq = torch.zeros_like(ssum)
    else:
        ssum = ssq = torch.zeros(1, 1, dtype=torch.float32, device=q.device)
    live_u8 = cache.live.view(torch.uint8)
    _mixed_decode_kernel[(R,)](
        q, cache.pages, cache.page_tier, live_u8, page_tables, tier_layout(cache), out, ssum, ssq,
        float(scale), n_slots,
        *q.stride(), cache.pages.stride(0), *live_u8.stride(), *page_tables.stride(), *out.stride(), *ssum.stride(),
        MAX_TOKENS=cache.max_tokens, GROUP=G, GROUP_PAD=triton.next_power_of_2(G), HEAD_DIM=D, TILE=TILE,
        WANT_SCORES=want_scores, GROUP_MAX=group_max,
    )
    return out, ((ssum, ssq) if want_scores else None)


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
                           want_scores: bool = False, backend: str | None = None, group_max: bool = False):
    """Decode attention over a `MixedPrecisionKVCache`'s pages, K/V dequantized on the fly.

    q [R, G, head_dim]: the G query heads (one GQA group) of each page-table row; page_tables
    [R, max_pages] page ids of one (sequence, KV head) each, -1 anywhere for no page (LeanKV grows
    high-tier pages from one end of a row and low-tier pages from the other). Returns (out [R, G,
    head_dim] in q's dtype, None or (sum, sum of squares) of the probabilities over the G heads,
    [R, max_pages * cache.max_tokens] fp32 in page-table slot order, 0 for dead slots). With
    `group_max` the second statistic is the max over the G heads instead (LeanKV's significance).
    """
    if q.dim() != 3 or q.shape[-1] != cache.head_dim:
        raise ValueError(f"q must be [rows, group, head_dim={cache.head_dim}], got {tuple(q.shape)}")
    if page_tables.dim() != 2 or page_tables.shape[0] != q.shape[0]:
        raise ValueError(f"page_tables must be [rows={q.shape[0]}, max_pages], got {tuple(page_tables.shape)}")
    if page_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_tables must hold int32/int64 page ids, got {page_tables.dtype}")
    if page_tables.numel() and int(page_tables.max()) >= cache.num_pages:
        raise ValueError(f"page_tables name page {int(page_tables.max())}; the cache has {cache.num_pages} pages")
    fn = mixed_decode_attention_triton if use_triton(q, backend) else mixed_decode_attention_ref
    return fn(cache, q, page_tables, scale, want_scores, group_max)
