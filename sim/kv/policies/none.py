"""`none`: the full cache stays resident (vLLM baseline)."""
from __future__ import annotations

from ..policy import EvictionPolicy, FastModeProfile, register_policy


@register_policy("none")
class NoEviction(EvictionPolicy):
    needs_scores = False
    evicts = False
    default_trigger = "never"

    def fast_mode_profile(self) -> FastModeProfile:
        return FastModeProfile()
