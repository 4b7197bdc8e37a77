"""queue_depth: llm-d's queue-scorer alone: the replica with the fewest waiting requests (stale when
router_options.refresh_s > 0)."""
from .base import RouterBase, register_router


def queue_scores(loads) -> list[float]:
    """llm-d's queue scorer: 1 for the shortest queue, 0 for the longest, linear between."""
    qs = [load.waiting for load in loads]
    lo, hi = min(qs), max(qs)
    return [1.0 if hi == lo else (hi - q) / (hi - lo) for q in qs]


@register_router("queue_depth")
class QueueDepth(RouterBase):
    reads = "loads"

    def route(self, req):
        return self.pick_max(queue_scores(self.signals.loads()))
