"""`streaming` (StreamingLLM): keep the first `sink` tokens and a sliding window of the last `window`.

By default a prompt longer than sink + window is cut to them right after prefill. `evict_per_step`
(k) skips that cut: each decode step evicts at most the k oldest tokens outside the sinks and the
window, so a long prompt shrinks by k - 1 tokens a step (k = 1: it keeps its length, the oldest
non-sink token leaving as each new one arrives). Token-level mode only (fast mode's ring tracks one
window size for all requests).
"""
from __future__ import annotations

import numpy as np

from ..policy import Decision, EvictionPolicy, FastModeProfile, check_positive_int, lowest_k_mask, register_policy


@register_policy("streaming")
class Streaming(EvictionPolicy):
    needs_scores = False
    default_trigger = "every_step"
    parameter_help = {
        "sink": "oldest tokens (attention sinks) never evicted",
        "window": "newest tokens kept (the sliding window)",
        "evict_per_step": "k: no prompt cut after prefill; each decode step evicts at most the k oldest tokens "
                          "outside the sinks and the window (token mode only); empty: cut the prompt at once",
    }

    def __init__(self, sink: int = 4, window: int = 252, evict_per_step: int | None = None):
        self.sink = check_positive_int("sink", sink, minimum=0)
        self.window = check_positive_int("window", window)
        self.evict_per_step = None if evict_per_step is None else check_positive_int("evict_per_step", evict_per_step)

    def compress(self, state, ctx, reason, scores):
        pos = state.pos
        drop = state.live & (pos >= self.sink) & (pos < state.num_tokens - self.window)
        if self.evict_per_step is not None:
            if reason == "prefill":
                return None                      # no prompt cut
            drop = lowest_k_mask(pos.astype(np.float64), np.full(state.rows, self.evict_per_step), drop)
        return Decision(evict=drop) if drop.any() else None

    def fast_mode_profile(self) -> FastModeProfile:
        return FastModeProfile(budget=self.sink + self.window, protect_recent=self.window, protect_first=self.sink,
                               age_weight="oldest", per_step=self.evict_per_step or 1,
                               prompt_cut=self.evict_per_step is None)
