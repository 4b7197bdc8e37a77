"""precise_prefix: llm-d's precise prefix-cache scorer: each replica scored by the prompt tokens its own
prefix cache holds now (what vLLM's KV events report to llm-d's KV-cache indexer), read from the
replicas' KV managers at the decision; ties (no hit anywhere): the least loaded replica."""
from .base import RouterBase, computed_blocks_now, register_router


def cached_fraction(replica, req) -> float:
    """The fraction of the prompt the replica's GPU prefix cache holds (blocks hit x block size)."""
    hits = len(computed_blocks_now(replica, req)) * replica.kv.block_size
    return hits / req.prompt_tokens if req.prompt_tokens else 0.0


@register_router("precise_prefix")
class PrecisePrefix(RouterBase):
    reads = "outstanding"

    def route(self, req):
        outstanding = self.signals.outstanding()
        return self.pick_max([cached_fraction(r, req) - 1e-9 * n
                              for r, n in zip(self.replicas, outstanding, strict=True)])
