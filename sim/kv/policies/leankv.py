"""`leankv` (LeanKV, Zhang et al. 2024, "Unifying KV Cache Compression for Large Language Models
with LeanKV"): three precision tiers per (request, KV head) instead of a fixed budget.

A token's significance is the mean attention it receives from the later queries observed so far
(the prefill observation window, then each decode query), taking the max over the query heads of
its GQA group. With thresholds alpha_h > alpha_l:
- after prefill, token i (1-based position) outside the recent window goes to the high tier if its
  significance > alpha_h / i, to the low tier if it is in (alpha_l / i, alpha_h / i], and is pruned
  otherwise; the newest `window` tokens keep the precision they were written at (high);
- each decode step, the token(s) leaving the window are placed by the same test with N (the
  sequence length) in place of i. For every token entering a tier, that tier's least significant
  placed token is demoted (high -> low) or pruned (low -> gone) if its significance is at or below
  the tier's threshold alpha / N; demoted tokens enter the low tier and can push it in turn.
A head whose attention is concentrated keeps few tokens, a spread head many: no fixed budget.

The tiers' storage formats (keys at higher precision than values, K8V4 high and K4V2 low by
default) are the KV layout's (`kv.high_tier`, `kv.low_tier`); the policy only assigns tiers.

Parameters: `alpha_h` (default 1.0), `alpha_l` (default 0.1, < alpha_h), `window` (W, default 64),
`obs_window` (prefill observation queries, default 8).
"""
from __future__ import annotations

import math

import numpy as np

from ..policy import Decision, EvictionPolicy, FastModeProfile, check_positive_int, lowest_k_mask, register_policy
from ..state import TIER_HIGH, TIER_LOW

OBSERVED = "leankv_queries"     # per slot: queries whose attention is in `score`
PLACED = "leankv_placed"        # per slot: left the window and got a tier


def _check_alpha(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0 (threshold = alpha / position), got {value!r}")
    return float(value)


@register_policy("leankv")
class LeanKV(EvictionPolicy):
    gqa_reduce = "max"
    default_trigger = "every_step"
    new_token_tier = TIER_HIGH          # the manager writes new (window) tokens at high precision

    def __init__(self, alpha_h: float = 1.0, alpha_l: float = 0.1, window: int = 64, obs_window: int = 8):
        self.alpha_h = _check_alpha("alpha_h", alpha_h)
        self.alpha_l = _check_alpha("alpha_l", alpha_l)
        if self.alpha_l >= self.alpha_h:
            raise ValueError(f"alpha_l ({alpha_l}) must be smaller than alpha_h ({alpha_h})")
        self.window = check_positive_int("window", window)
        self.obs_window = check_positive_int("obs_window", obs_window)

    def fast_mode_profile(self) -> FastModeProfile:
        # tiers of different page capacities and a significance that is not monotone in time: fast
        # mode runs the token-level manager on a sample of the rows (sim/kv/fast/sampled/rows.py)
        return FastModeProfile(sampled_rows=True)

    def on_admit(self, state, ctx):
        state.add_field(OBSERVED, np.int32, 0)
        state.add_field(PLACED, bool, False)
        state.field(OBSERVED)[:] = 0          # a re-admission starts over
        state.field(PLACED)[:] = False

    def observe(self, state, ctx, scores, phase):
        if scores is None:
            return
        super().observe(state, ctx, scores, phase)
        seen = state.field(OBSERVED)
        if phase == "prefill":     # query j of the window sits at position T - w + j and sees pos <= it
            seen += np.where(state.live, np.clip(state.num_tokens - state.pos, 0, scores.shape[0]), 0).astype(np.int32)
        else:
            seen += state.live

    def significance(self, state) -> np.ndarray:
        return state.score / np.maximum(state.field(OBSERVED), 1)

    def compress(self, state, ctx, reason, scores):
        placed = state.field(PLACED)
        sig = self.significance(state)
        n = state.num_tokens
        leaving = state.live & ~placed & (state.pos < n - self.window)
        if reason == "prefill":
            scale = (state.pos + 1).astype(np.float32)
        else:
            scale = np.float32(n)
        high = leaving & (sig * scale > self.alpha_h)
        low = leaving & ~high & (sig * scale > self.alpha_l)
        evict = leaving & ~high & ~low
        tier = np.full(state.live.shape, -1, dtype=np.int8)
        tier[high], tier[low] = TIER_HIGH, TIER_LOW
        if reason != "prefill":
            self._make_room(state, sig, placed, high, low, evict, tier, n)
        placed |= leaving & ~evict
        if not evict.any() and not (tier != state.tier)[state.live & (tier >= 0)].any():
            return None
        tier[evict] = -1
        return Decision(evict=evict, tier=tier)

    def _make_room(self, state, sig, placed, high, low, evict, tier, n) -> None:
        """Tokens entering a tier push out that tier's least significant token if it is below the bar."""
        resident = state.live & placed
        in_high = resident & (state.tier == TIER_HIGH)
        demote = lowest_k_mask(sig, high.sum(axis=1), in_high & (sig * n <= self.alpha_h))
        tier[demote] = TIER_LOW
        in_low = resident & (state.tier == TIER_LOW)
        entering_low = low.sum(axis=1) + demote.sum(axis=1)
        prune = lowest_k_mask(sig, entering_low, (in_low | demote) & (sig * n <= self.alpha_l))
        evict |= prune
