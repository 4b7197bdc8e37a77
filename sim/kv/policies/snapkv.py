"""`snapkv` (SnapKV, Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Once, right after prefill, each row (layer, KV head) keeps
- the observation window: the last `obs_window` prompt tokens, and
- the `budget` prompt tokens before the window with the highest *pooled* votes: the attention
  each received from the observation-window queries (summed over them and over the query heads
  of its GQA group), max-pooled (or average-pooled) over `kernel_size` neighbouring positions so
  the tokens around a heavy hitter survive with it.

Every row therefore keeps `budget + obs_window` prompt tokens (all of them when the prompt is not
longer). With `compression_rate` r instead of `budget`, a prompt of T tokens keeps ceil(T / r)
tokens per row (window included).

Decode-time compression (off by default, as published: decode tokens are never evicted). As the
compression papers run these baselines on long generations, `decode_compression` can also apply the
same selection during decode: `every_n` (every `decode_interval` decode steps) or `over_budget`
(whenever a request-head holds more than its budget + `obs_window` live tokens; with a rate the
budget is ceil(tokens so far / r)). Then every live token before the last `obs_window` (prompt or
generated) is a candidate, voted by the attention it has accumulated over all observed queries
(pooled as above), and each row keeps its budget of them plus the window.

Recompute after a preemption prefills prompt + generated tokens again. Only prompt tokens are
prompt: the prefill cut ranks the prompt tokens before the prompt's last `obs_window` ones, with the
budget of the prompt length, and keeps every generated token (they are subject to decode-time
compression only, when it is on).

Parameters: `budget` (C, default 256 when no rate is given), `compression_rate` (r >= 1;
excludes `budget`), `obs_window` (w, default 8), `kernel_size` (p, odd, default 7; 1 = no pooling),
`pooling` ("max" default, or "avg" as SnapKV's reference code), `decode_compression` ("off" default,
"every_n", "over_budget"), `decode_interval` (every_n: decode steps between compressions, default 32).

`pyramidkv` and `ada_snapkv` reuse this selection with other per-row budgets.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..policy import Decision, EvictionPolicy, FastModeProfile, PolicyError, check_positive_int, lowest_k_mask, register_policy

DECODE_COMPRESSION = ("off", "every_n", "over_budget")


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
    per_head_only = False

    def __init__(self, budget: int | None = None, compression_rate: float | None = None, obs_window: int = 8,
                 kernel_size: int = 7, pooling: str = "max", decode_compression: str = "off",
                 decode_interval: int = 32):
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
        if decode_compression not in DECODE_COMPRESSION:
            raise ValueError(f"decode_compression must be one of {DECODE_COMPRESSION}, got {decode_compression!r}")
        self.decode_compression = decode_compression
        self.decode_interval = check_positive_int("decode_interval", decode_interval)
        self._basis: int | None = None

    @property
    def default_trigger(self) -> str:
        # decode-time compression needs the manager to call compress after every decode step
        return "after_prefill" if self.decode_compression == "off" else "every_step"

    def fast_mode_profile(self) -> FastModeProfile | None:
        """Fast mode (sim.kv.fast). Prefill-only: the prompt cut keeps each row's budget plus the window
        by the importance model's window votes (no pooling), decode never evicts; the budgets are
        `budgets_for` (a rate's ceil(T / r), PyramidKV's per-layer schedule), shared among rows by
        `fast_cut_sharing` (Ada-KV). over_budget decode compression with one fixed budget: H2O-like, the
        lowest accumulated attention leaves once a row is over budget + window; every_n, and over_budget
        with a rate or per-row budgets: the same selection re-run during decode (sim.kv.fast.recut)."""
        w = self.obs_window
        uniform = self.budget is not None and type(self).budgets_for is SnapKV.budgets_for \
            and not self.fast_cut_sharing()
        if self.decode_compression == "over_budget" and uniform:
            return FastModeProfile(budget=self.budget + w, protect_recent=w, age_weight="young", obs_window=w)
        profile = FastModeProfile(budget=self.budget + w if uniform else None, protect_recent=w, age_weight="young",
                                  obs_window=w)
        if not uniform or self.decode_compression != "off":
            profile = replace(profile, cut_budgets=self.budgets_for, **self.fast_cut_sharing())
        if self.decode_compression == "off":
            return replace(profile, prompt_only=True)
        return replace(profile, budget=None, recut=self.decode_compression, recut_interval=self.decode_interval)

    def fast_cut_sharing(self) -> dict:
        """Fast mode: how the rows' budgets are shared among rows at the prompt cut, as FastModeProfile
        fields ({} = not at all)."""
        return {}

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

    def basis(self, state) -> int:
        """Tokens the budget is computed from: the prompt in a prefill cut, all tokens so far in decode."""
        return state.num_tokens if self._basis is None else self._basis

    def row_budgets(self, state, ctx) -> np.ndarray:
        """int [rows]: tokens each row keeps outside the window."""
        return self.budgets_for(self.basis(state), ctx)

    def budgets_for(self, num_tokens: int, ctx) -> np.ndarray:
        """int [ctx.rows]: tokens each row keeps outside the window when the basis is num_tokens."""
        return np.full(ctx.rows, self.mean_budget(num_tokens), dtype=np.int64)

    # ----- selection ----------------------------------------------------------------------------
    def candidates(self, state) -> np.ndarray:
        """Live tokens before the observation window (of the prompt in a prefill cut: tokens past the
        prompt, generated before a recompute, are not candidates)."""
        return state.live & (state.pos < self.basis(state) - self.obs_window)

    def votes(self, state) -> np.ndarray:
        """Pooled observation-window votes [rows, S] (0 outside the candidates)."""
        cand = self.candidates(state)
        return pool_by_position(state.score, state.pos, cand, self.kernel_size, self.pooling)

    def keep_mask(self, state, ctx, votes: np.ndarray, cand: np.ndarray) -> np.ndarray:
        """bool [rows, S]: candidates kept (top row-budget by vote)."""
        return lowest_k_mask(-votes, self.row_budgets(state, ctx), cand)

    def compress(self, state, ctx, reason, scores):
        if reason == "prefill":
            prompt = state.prompt_tokens if state.prompt_tokens is not None else state.num_tokens
            self._basis = min(int(prompt), state.num_tokens)
        elif reason == "decode" and self.decode_compression != "off":
            state.decode_compressions += 1
            steps = state.decode_compressions
            if self.decode_compression == "every_n" and steps % self.decode_interval:
                return None
            if self.decode_compression == "over_budget":
                limit = self.row_budgets(state, ctx) + self.obs_window
                if not (state.live_counts() > limit).any():
                    return None
            self._basis = None
        else:
            return None
        try:
            cand = self.candidates(state)
            evict = cand & ~self.keep_mask(state, ctx, self.votes(state), cand)
        finally:
            self._basis = None
        return Decision(evict=evict) if evict.any() else None
