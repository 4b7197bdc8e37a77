"""`pyramidkv` (PyramidKV, Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling").

SnapKV's one-shot selection after prefill (observation-window votes, pooled; see `snapkv`), with
per-layer budgets that shrink with depth: lower layers spread attention widely and get more tokens,
upper layers concentrate it and get fewer. For an average budget C over L layers the schedule is
PyramidKV's arithmetic sequence from 2C - C/beta at layer 0 down to C/beta at layer L-1, rounded
to integers by largest remainder so the layers keep exactly L * C tokens per KV head in total
(plus the observation window in every row).

Parameters: as `snapkv` (`budget` = the average C per layer, or `compression_rate`, `obs_window`,
`kernel_size`, `pooling`) plus `beta` (> 1, default 20: the last layer keeps C / beta).
Needs `kv.layout: per_head` (budgets differ per layer).
"""
from __future__ import annotations

import math

import numpy as np

from ..policy import register_policy
from .snapkv import SnapKV


def pyramid_budgets(mean_budget: int, num_layers: int, beta: float) -> np.ndarray:
    """int [num_layers]: non-increasing per-layer budgets summing to num_layers * mean_budget."""
    total = num_layers * mean_budget
    if num_layers == 1:
        return np.array([mean_budget], dtype=np.int64)
    low = mean_budget / beta
    high = 2 * mean_budget - low
    exact = high - (high - low) * np.arange(num_layers) / (num_layers - 1)
    out = np.floor(exact).astype(np.int64)
    rest = total - int(out.sum())
    out[np.argsort(-(exact - out), kind="stable")[:rest]] += 1
    return out


@register_policy("pyramidkv")
class PyramidKV(SnapKV):
    per_head_only = True

    def __init__(self, budget: int | None = None, compression_rate: float | None = None, obs_window: int = 8,
                 kernel_size: int = 7, pooling: str = "max", beta: float = 20.0, decode_compression: str = "off",
                 decode_interval: int = 32):
        super().__init__(budget, compression_rate, obs_window, kernel_size, pooling, decode_compression,
                         decode_interval)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta <= 1:
            raise ValueError(f"beta must be a number > 1 (last layer keeps budget / beta), got {beta!r}")
        self.beta = float(beta)

    def budgets_for(self, num_tokens: int, ctx) -> np.ndarray:
        layers = pyramid_budgets(self.mean_budget(num_tokens), ctx.num_layers, self.beta)
        return layers[ctx.row_layer]
