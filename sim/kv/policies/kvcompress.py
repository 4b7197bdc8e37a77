"""`kvcompress` (KV-Compress, Rehg 2024, "KV-Compress: Paged KV-Cache Compression with Variable
Compression Rates per Attention Head").

Variable per-head, per-layer eviction in whole blocks. Each token's metric is its squared
attention summed over the observed queries (the prefill observation window, then every decode
query; the query heads of a GQA group are summed onto their KV head first). Within each row
(layer, KV head) the evictable tokens — live, older than the protected `protect_recent` newest
positions — are sorted by metric and cut into groups of `block_size` (the layout's page size); a
group's key is its largest metric. Across all rows of the request, the groups with the smallest
keys go first, so a row whose attention is concentrated gives up many blocks and a spread row
few. Evicting exactly `block_size` tokens of a row frees one of its pages once the slot strategy
compacts survivors (use `kv.slot_strategy: compact`, as KV-Compress does).

Target: the request's cache holds at most `num_tokens / compression_rate` tokens per row (on
average over rows) or `max_cache_tokens` per row (the smaller when both are given; default rate
2). Compression runs right after prefill and, under memory pressure (`reclaim`, before the
scheduler would preempt), again for the current length: reclaim evicts the blocks asked for but
never below the target, so a request already at its target is preempted instead.

Parameters: `compression_rate` (r >= 1), `max_cache_tokens` (per row), `protect_recent`
(default 8), `obs_window` (prefill observation queries, default 8).

Cost of a compression (`op_cost`), per row with n live tokens, e entries in its block table, w the
observation window, g query heads per KV head, d the head dim, h the (layer, KV head) pairs a row
stands for, b the bytes of one token of the row:
- metric aggregation (after prefill only: decode queries' squared attention is a by-product of
  their attention kernel): the w window queries' scores against every key are recomputed
  (FlashAttention does not keep probabilities): reads the keys, n b / 2 bytes, 2 w g d h n FLOPs;
- sort of the n metrics (float32 key + int32 index, ceil(log2 n) passes, read and written each):
  16 n ceil(log2 n) bytes, n ceil(log2 n) comparisons;
- block-table rewrite: e int32 entries read and written, 8 e bytes.
"""
from __future__ import annotations

import math

import numpy as np

from ..policy import Decision, EvictionPolicy, FastModeProfile, check_positive_int, register_policy
from .snapkv import check_rate


def block_eviction_mask(metric: np.ndarray, candidates: np.ndarray, block_size: int, num_blocks: int) -> np.ndarray:
    """bool [rows, S]: evict `num_blocks` groups of `block_size` candidates, chosen across rows by the
    smallest largest-metric (each row gives up its lowest-metric tokens first)."""
    rows, S = metric.shape
    out = np.zeros((rows, S), dtype=bool)
    full_groups = candidates.sum(axis=1) // block_size
    most = int(full_groups.max()) if rows else 0
    if num_blocks <= 0 or most == 0:
        return out
    keyed = np.where(candidates, metric, np.inf)
    order = np.argsort(keyed, axis=1, kind="stable")
    ranked = np.take_along_axis(keyed, order, axis=1)
    group_key = ranked[:, block_size - 1:most * block_size:block_size]       # [rows, most]
    group_key = np.where(np.arange(most)[None, :] < full_groups[:, None], group_key, np.inf)
    flat = np.argsort(group_key.ravel(), kind="stable")[:min(num_blocks, int(full_groups.sum()))]
    per_row = np.bincount(flat // most, minlength=rows)
    np.put_along_axis(out, order, np.arange(S)[None, :] < (per_row * block_size)[:, None], axis=1)
    return out


@register_policy("kvcompress")
class KVCompress(EvictionPolicy):
    gqa_reduce = "sum"
    default_trigger = "after_prefill+pressure"

    def __init__(self, compression_rate: float | None = None, max_cache_tokens: int | None = None,
                 protect_recent: int = 8, obs_window: int = 8):
        if compression_rate is None and max_cache_tokens is None:
            compression_rate = 2.0
        self.compression_rate = None if compression_rate is None else check_rate("compression_rate",
                                                                                 compression_rate)
        self.max_cache_tokens = None if max_cache_tokens is None else \
            check_positive_int("max_cache_tokens", max_cache_tokens)
        self.protect_recent = check_positive_int("protect_recent", protect_recent, minimum=0)
        self.obs_window = check_positive_int("obs_window", obs_window)

    def observe(self, state, ctx, scores, phase):
        if scores is not None:
            super().observe(state, ctx, np.square(scores, dtype=np.float32), phase)

    def target_tokens(self, state) -> int:
        """Token-rows the request may keep (sum over rows)."""
        return self.target_per_row(state.num_tokens) * state.rows

    def target_per_row(self, num_tokens: int) -> int:
        """Tokens a row keeps on average after a compression of a num_tokens-long sequence."""
        per_row = math.inf
        if self.compression_rate is not None:
            per_row = math.ceil(num_tokens / self.compression_rate)
        if self.max_cache_tokens is not None:
            per_row = min(per_row, self.max_cache_tokens)
        return int(per_row)

    def fast_mode_profile(self) -> FastModeProfile:
        """Fast mode (sim.kv.fast): the prompt cut evicts, over all simulated rows jointly, the groups
        of block_size lowest-scored candidates with the smallest largest score until the request is at
        its target (the importance model's accumulated attention stands for the squared-attention
        metric); decode never evicts; under memory pressure whole blocks go down to the target again
        (`reclaim_target`)."""
        w = self.protect_recent
        return FastModeProfile(
            budget=None, protect_recent=w, age_weight="young", obs_window=self.obs_window, prompt_only=True,
            cut_sharing="blocks", reclaim_target=self.target_per_row,
            cut_budgets=lambda n, ctx: np.full(ctx.rows, max(self.target_per_row(n) - min(w, n), 0), np.int64))

    def _evict(self, state, ctx, token_rows: int) -> Decision | None:
        if token_rows <= 0:
            return None
        cand = state.live & (state.pos < state.num_tokens - self.protect_recent)
        mask = block_eviction_mask(state.score, cand, ctx.block_size, -(-token_rows // ctx.block_size))
        return Decision(evict=mask) if mask.any() else None

    def op_cost(self, state, ctx, reason):
        n = state.live_counts().astype(np.float64)
        passes = np.ceil(np.log2(np.maximum(n, 2)))
        entries = -(-n // ctx.block_size)
        nbytes = float((16 * n * passes).sum() + (8 * entries).sum())
        flops = float((n * passes).sum())
        if reason == "prefill":
            w = min(self.obs_window, state.num_tokens)
            nbytes += float(n.sum()) * ctx.bytes_per_token_row / 2
            flops += 2.0 * w * ctx.group_size * ctx.head_dim * ctx.heads_per_row * float(n.sum())
        return nbytes, flops

    def compress(self, state, ctx, reason, scores):
        return self._evict(state, ctx, int(state.live.sum()) - self.target_tokens(state))

    def reclaim(self, state, ctx, num_tokens):
        excess = int(state.live.sum()) - self.target_tokens(state)
        # whole blocks only, and not below the target
        return self._evict(state, ctx, min(int(num_tokens), excess // ctx.block_size * ctx.block_size))
