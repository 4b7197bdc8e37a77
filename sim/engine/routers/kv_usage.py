"""kv_usage: llm-d's kv-cache-utilization-scorer alone: the replica whose KV pool is least used."""
from .base import RouterBase, register_router


def kv_usage_scores(loads) -> list[float]:
    return [1.0 - load.kv_usage for load in loads]


@register_router("kv_usage")
class KVUsage(RouterBase):
    reads = "loads"

    def route(self, req):
        return self.pick_max(kv_usage_scores(self.signals.loads()))
