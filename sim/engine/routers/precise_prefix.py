"""precise_prefix: llm-d's precise prefix-cache scorer: each replica scored by the prompt tokens its own
prefix cache holds now (what vLLM's KV events report to llm-d's KV-cache indexer), read from the
replicas' KV managers at the decision; ties (no hit anywhere): the least loaded replica."""
from .base import RouterBase, register_router


def cached_fraction(replica, req) -> float:
    """The fraction of the prompt the replica's GPU prefix cache holds (blocks hit x block size)."""
    kv = replica.kv
    hits = len(kv.get_computed_blocks(req)) * kv.block_size
    return hits / req.prompt_tokens if req.prompt_tokens else 0.0


@register_router("precise_prefix")
class PrecisePrefix(RouterBase):
    def route(self, req):
        loads = self.signals.loads()
        return self.pick_max([cached_fraction(r, req) - 1e-9 * load.outstanding
                              for r, load in zip(self.replicas, loads, strict=True)])
