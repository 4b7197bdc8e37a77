"""`ada_snapkv` (Ada-KV on SnapKV, Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by
Adaptive Budget Allocation for Efficient LLM Inference").

SnapKV's one-shot selection after prefill (observation-window votes, pooled; see `snapkv`), but
the budget belongs to the layer, not to the head: a layer with H KV heads keeps the `budget * H`
(head, token) pairs with the highest votes over all its heads jointly, so concentrated heads give
tokens to spread ones and heads keep different counts. As in Ada-KV, each head first keeps its own
top `floor * budget` tokens so no head is starved. Every row also keeps its observation window.

Parameters: as `snapkv` (`budget` C per head on average, or `compression_rate`, `obs_window`,
`kernel_size`, `pooling`) plus `floor` (fraction of C guaranteed to each head, in [0, 1],
default 0.2; 0 = pure competition, 1 = plain snapkv). Needs `kv.layout: per_head`.
"""
from __future__ import annotations

import math

import numpy as np

from ..policy import lowest_k_mask, register_policy
from .snapkv import SnapKV


@register_policy("ada_snapkv")
class AdaSnapKV(SnapKV):
    per_head_only = True

    def __init__(self, budget: int | None = None, compression_rate: float | None = None, obs_window: int = 8,
                 kernel_size: int = 7, pooling: str = "max", floor: float = 0.2, decode_compression: str = "off",
                 decode_interval: int = 32):
        super().__init__(budget, compression_rate, obs_window, kernel_size, pooling, decode_compression,
                         decode_interval)
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not math.isfinite(floor) \
                or not 0 <= floor <= 1:
            raise ValueError(f"floor must be a fraction in [0, 1], got {floor!r}")
        self.floor = float(floor)

    def fast_cut_sharing(self) -> dict:
        # fast mode: the simulated rows (a stratified sample of all heads) compete jointly, floor kept
        return {"cut_sharing": "layer", "floor": self.floor}

    def keep_mask(self, state, ctx, votes, cand):
        budget = self.mean_budget(self.basis(state))
        guaranteed = lowest_k_mask(-votes, np.full(state.rows, int(self.floor * budget)), cand)
        # the rest of each layer's budget goes to the best remaining (head, token) pairs of the layer
        layers, heads = ctx.num_layers, ctx.num_kv_heads
        left = budget * heads - guaranteed.reshape(layers, -1).sum(axis=1)
        joint = lowest_k_mask(-votes.reshape(layers, -1), left, (cand & ~guaranteed).reshape(layers, -1))
        return guaranteed | joint.reshape(state.rows, -1)
