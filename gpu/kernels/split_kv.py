"""Split-KV (flash-decoding) machinery shared by the decode-attention kernels.

A decode kernel runs one program per (row, split): a row is one (sequence, KV head) serving its GQA
group of query heads, a split one contiguous range of the row's block-table slots. With one split
the program writes the normalized output itself; with several, each writes its partial output
(normalized by its own softmax denominator) and log-sum-exp, and `_combine_kernel` merges them:
out = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse). Either way the row's final
log-sum-exp comes out, which the attention-statistics pass divides by (p = exp(s - lse)).

Tiles: the query group is padded to 16 rows (the tensor-core MMA minimum) so that q K^T and P V are
`tl.dot`s; TILE cached tokens per loop step, chosen per head dim so a K or V tile stays at 16 KiB
of fp16/bf16 (64 tokens at head dim 128, 128 at 64).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

MMA_ROWS = 16                 # smallest M of an mma.sync / wgmma tile: the query group is padded to it
MIN_SPLIT_SLOTS = 256         # a split walks at least this many slots (shorter ones cost more to combine)
NUM_WARPS = 4
NUM_STAGES = 2              # software-pipelined K/V tiles in shared memory: 2 x 32 KiB fits every target


def group_pad(group: int) -> int:
    return max(MMA_ROWS, triton.next_power_of_2(group))


def tile_for(head_dim: int) -> int:
    """Cached tokens per loop step: 8192 elements per K (or V) tile, at least 16 (tl.dot's minimum)."""
    return max(16, min(128, 8192 // head_dim))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter gains nothing from splits)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


class SplitPlan(NamedTuple):
    splits: int          # programs per row
    split_len: int       # slots per split, a multiple of the tile


def sm_balance(programs: int, sms: int) -> float:
    """Share of the SMs' time a launch of equal memory-bound programs keeps busy: all SMs need a
    program, and the busiest SM runs ceil(programs / sms) of them while the mean is programs / sms.
    (A resident program streams its SM's share of HBM bandwidth: one program per SM already has
    two 32 KiB K/V tiles in flight, more than bandwidth x latency per SM.)"""
    if programs >= sms:
        return programs / sms / math.ceil(programs / sms)
    return programs / sms


def plan_splits(rows: int, max_slots: int, tile: int, sms: int, num_splits: int | None = None) -> SplitPlan:
    """Splits per row: the fewest that keep `sm_balance` within 5% of its best over 1 .. (one split
    per MIN_SPLIT_SLOTS slots); `num_splits` forces a count. At most one tile per split."""
    tiles = max(1, math.ceil(max_slots / tile))
    if num_splits is None:
        candidates = range(1, max(1, max_slots // MIN_SPLIT_SLOTS) + 1)
        best = max(sm_balance(rows * s, sms) for s in candidates)
        num_splits = next(s for s in candidates if sm_balance(rows * s, sms) >= 0.95 * best)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_splits = min(num_splits, tiles)
    tiles_per_split = math.ceil(tiles / num_splits)
    return SplitPlan(math.ceil(tiles / tiles_per_split), tiles_per_split * tile)


@triton.jit
def _lse(m, denom):
    """Log-sum-exp m + log(denom) of an online softmax; -inf where nothing was attended."""
    return tl.where(denom > 0, m + tl.log(tl.where(denom > 0, denom, 1.0)), float("-inf"))


# per-step integer arguments, not specialized (see paged_attention.PER_STEP_DECODE)
PER_STEP_COMBINE = ["num_splits", "stride_pr", "stride_ps", "stride_xr", "stride_xs"]

@triton.jit(do_not_specialize=PER_STEP_COMBINE)
def _combine_kernel(part_ptr, plse_ptr, out_ptr, lse_ptr, num_splits,
                    stride_pr, stride_ps, stride_pg, stride_pd,
                    stride_xr, stride_xs, stride_xg,
                    stride_or, stride_og, stride_od,
                    stride_lr, stride_lg,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Merge one row's split outputs [splits, group, D] (fp32) into out [group, D] and its lse."""
    r = tl.program_id(0)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(plse_ptr + r * stride_xr + s * stride_xs + g * stride_xg, mask=g_mask,
                                  other=float("-inf")))
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for s in range(0, num_splits):
        w = tl.exp(tl.load(plse_ptr + r * stride_xr + s * stride_xs + g * stride_xg, mask=g_mask,
                           other=float("-inf")) - m_ref)
        part = tl.load(part_ptr + r * stride_pr + s * stride_ps + g[:, None] * stride_pg + d[None, :] * stride_pd,
                       mask=g_mask[:, None], other=0.0)
        total += w
        acc += w[:, None] * part
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + r * stride_or + g[:, None] * stride_og + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    tl.store(lse_ptr + r * stride_lr + g * stride_lg, _lse(m, total), mask=g_mask)


def combine(part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """part [R, S, G, D] fp32 and part_lse [R, S, G] -> writes out [R, G, D]; returns lse [R, G] fp32."""
    R, S, G, D = part.shape
    lse = torch.empty(R, G, dtype=torch.float32, device=part.device)
    _combine_kernel[(R,)](part, part_lse, out, lse, S, *part.stride(), *part_lse.stride(), *out.stride(),
                          *lse.stride(), GROUP=G, GROUP_PAD=triton.next_power_of_2(G), HEAD_DIM=D,
                          num_warps=NUM_WARPS)
    return lse


def combine_ref(part: torch.Tensor, part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of `combine`: (out [R, G, D] fp32, lse [R, G])."""
    lse = torch.logsumexp(part_lse, dim=1)
    w = torch.exp(part_lse - torch.where(lse.isinf(), 0.0, lse)[:, None]).nan_to_num(0.0)
    return (w[..., None] * part).sum(1), lse
