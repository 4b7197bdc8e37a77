"""`h2o` (Heavy-Hitter Oracle): keep `budget` tokens per row — the `recent` newest tokens plus the
heavy hitters with the largest accumulated attention.

After prefill the prompt is cut to the budget at once; each decode step then evicts the excess
(one token per row per step once at the budget, since each step adds one). Under memory pressure
(`reclaim`) it evicts the lowest-scored non-recent tokens, below the budget if it must.

`evict_per_step` (k, default unset) is H2O as the original H2O implementation runs it (SpvLLM's
instead cuts at the first decode step: the default cut with `obs_window: 1`, shared layout):
no prompt cut; each decode step evicts at most k tokens per row while the row is over the budget,
so a prompt longer than the budget keeps its length (k = 1: one in, one out) instead of dropping to
the budget at once. Fast mode supports k = 1.
"""
from __future__ import annotations

import numpy as np

from ..policy import Decision, EvictionPolicy, FastModeProfile, check_positive_int, lowest_k_mask, register_policy


@register_policy("h2o")
class H2O(EvictionPolicy):
    gqa_reduce = "sum"
    default_trigger = "every_step"
    parameter_help = {
        "recent": "newest tokens always kept, part of the budget; empty: half the budget",
        "obs_window": "last prompt queries whose attention scores the prompt",
        "evict_per_step": "k: no prompt cut; each decode step evicts at most k tokens per row while over the "
                          "budget (original H2O); empty: cut the prompt to the budget at once",
    }

    def __init__(self, budget: int = 256, recent: int | None = None, obs_window: int = 8,
                 evict_per_step: int | None = None):
        self.budget = check_positive_int("budget", budget, minimum=2)
        self.evict_per_step = None if evict_per_step is None else check_positive_int("evict_per_step", evict_per_step)
        self.recent = self.budget // 2 if recent is None else check_positive_int("recent", recent, minimum=0)
        if self.recent >= self.budget:
            raise ValueError(f"recent ({self.recent}) must be smaller than budget ({self.budget})")
        self.obs_window = check_positive_int("obs_window", obs_window)

    def _candidates(self, state) -> np.ndarray:
        return state.live & (state.pos < state.num_tokens - self.recent)

    def compress(self, state, ctx, reason, scores):
        over = state.live_counts() - self.budget
        if self.evict_per_step is not None:
            if reason == "prefill":
                return None                      # no prompt cut
            over = np.minimum(over, self.evict_per_step)
        if (over <= 0).all():
            return None
        return Decision(evict=lowest_k_mask(state.score, over, self._candidates(state)))

    def reclaim(self, state, ctx, num_tokens):
        cand = self._candidates(state)
        per_row = -(-int(num_tokens) // state.rows)
        mask = lowest_k_mask(state.score, np.full(state.rows, per_row), cand)
        return Decision(evict=mask) if mask.any() else None

    def fast_mode_profile(self) -> FastModeProfile:
        return FastModeProfile(budget=self.budget, protect_recent=self.recent, age_weight="young",
                               per_step=self.evict_per_step or 1, obs_window=self.obs_window,
                               prompt_cut=self.evict_per_step is None)
