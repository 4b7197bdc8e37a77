"""`streaming` (StreamingLLM): keep the first `sink` tokens and a sliding window of the last `window`."""
from __future__ import annotations

from ..policy import Decision, EvictionPolicy, check_positive_int, register_policy


@register_policy("streaming")
class Streaming(EvictionPolicy):
    needs_scores = False
    default_trigger = "every_step"

    def __init__(self, sink: int = 4, window: int = 252):
        self.sink = check_positive_int("sink", sink, minimum=0)
        self.window = check_positive_int("window", window)

    def compress(self, state, ctx, reason, scores):
        pos = state.pos
        drop = state.live & (pos >= self.sink) & (pos < state.num_tokens - self.window)
        return Decision(evict=drop) if drop.any() else None

    def fast_mode_profile(self) -> dict:
        return {"budget": self.sink + self.window, "protect_recent": self.window,
                "protect_first": self.sink, "age_weight": "oldest", "per_step": 1}
