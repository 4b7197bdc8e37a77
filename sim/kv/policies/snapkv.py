"""`snapkv` (SnapKV, Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Once, right after prefill, each row (layer, KV head) keeps
- the observation window: the last `obs_window` prompt tokens, and
- the `budget` prompt tokens before the window with the highest *pooled* votes: the attention
  each received from the observation-window queries (summed over them and over the query heads
  of its GQA group), max-pooled (or average-pooled) over `kernel_size` neighbouring positions so
  the tokens around a heavy hitter survive with it.

Every row therefore keeps `budget + obs_window` prompt tokens (all of them when the prompt is not
longer). Decode tokens are never evicted. With `compression_rate` r instead of `budget`, a prompt
of T tokens keeps ceil(T / r) tokens per row (window included).

Parameters: `budget` (C, default 256 when no rate is given), `compression_rate` (r >= 1;
excludes `budget`), `obs_window` (w, default 8), `kernel_size` (p, odd, default 7; 1 = no pooling),
`pooling` ("max" default, or "avg" as SnapKV's reference code).

`pyramidkv` and `ada_snapkv` reuse this selection with other per-row budgets.
"""
from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..policy import Decision, EvictionPolicy, PolicyError, check_positive_int, lowest_k_mask, register_policy


def check_rate(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or value < 1:
        raise ValueError(f"{name} must be a number >= 1 (kept = tokens / rate), got {value!r}")
    return float(value)


def pool_by_position(values: np.ndarray, pos: np.ndarray, mask: np.ndarray, kernel: int, how: str) -> np.ndarray:
    """Pool `values` [rows, S] over `kernel` neighbouring masked slots in position order (zero padding
    for "avg", -inf for "max", as torch's pooling); returns [rows, S] with 0 outside `mask`."""
    if kernel == 1:
        return np.where(mask, values, 0).astype(np.float32)
    order = np.argsort(np.where(mask, pos, np.iinfo(np.int64).max), axis=1, kind="stable")
    fill = -np.inf if how == "max" else 0.0
    v = np.where(np.take_along_axis(mask, order, 1), np.take_along_axis(values, order, 1), fill)
    half = kernel // 2
    windows = sliding_window_view(np.pad(v, ((0, 0), (half, half)), constant_values=fill), kernel, axis=1)
    pooled = windows.max(axis=-1) if how == "max" else windows.sum(axis=-1) / kernel
    out = np.empty_like(pooled)
    np.put_along_axis(out, order, pooled, axis=1)
    return np.where(mask, out, 0).astype(np.float32)


@register_policy("snapkv")
class SnapKV(EvictionPolicy):
    gqa_reduce = "sum"
    default_trigger = "after_prefill"
    per_head_only = False

    def __init__(self, budget: int | None = None, compression_rate: float | None = None, obs_window: int = 8,
                 kernel_size: int = 7, pooling: str = "max"):
        if budget is not None and compression_rate is not None:
            raise ValueError("give budget or compression_rate, not both")
        self.budget = None if compression_rate is not None else \
            check_positive_int("budget", 256 if budget is None else budget)
        self.compression_rate = None if compression_rate is None else check_rate("compression_rate",
                                                                                 compression_rate)
        self.obs_window = check_positive_int("obs_window", obs_window)
        self.kernel_size = check_positive_int("kernel_size", kernel_size)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (centred pooling window), got {kernel_size}")
        if pooling not in ("max", "avg"):
            raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")
        self.pooling = pooling

    def on_admit(self, state, ctx):
        if self.per_head_only and ctx.layout != "per_head":
            raise PolicyError(f"KV policy {self.name!r} needs kv.layout 'per_head' (its budgets differ "
                              f"per layer/head), got {ctx.layout!r}")

    # ----- budgets ------------------------------------------------------------------------------
    def mean_budget(self, num_tokens: int) -> int:
        """C: prompt tokens kept per row besides the observation window (average over rows)."""
        if self.budget is not None:
            return self.budget
        return max(0, math.ceil(num_tokens / self.compression_rate) - min(self.obs_window, num_tokens))

    def row_budgets(self, state, ctx) -> np.ndarray:
        """int [rows]: tokens each row keeps outside the window."""
        return np.full(state.rows, self.mean_budget(state.num_tokens), dtype=np.int64)

    # ----- selection ----------------------------------------------------------------------------
    def candidates(self, state) -> np.ndarray:
        """Live prompt tokens before the observation window."""
        return state.live & (state.pos < state.num_tokens - self.obs_window)

    def votes(self, state) -> np.ndarray:
        """Pooled observation-window votes [rows, S] (0 outside the candidates)."""
        cand = self.candidates(state)
        return pool_by_position(state.score, state.pos, cand, self.kernel_size, self.pooling)

    def keep_mask(self, state, ctx, votes: np.ndarray, cand: np.ndarray) -> np.ndarray:
        """bool [rows, S]: candidates kept (top row-budget by vote)."""
        return lowest_k_mask(-votes, self.row_budgets(state, ctx), cand)

    def compress(self, state, ctx, reason, scores):
        if reason != "prefill":
            return None
        cand = self.candidates(state)
        evict = cand & ~self.keep_mask(state, ctx, self.votes(state), cand)
        return Decision(evict=evict) if evict.any() else None
