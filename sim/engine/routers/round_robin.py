"""round_robin: requests go to the replicas in turn (vLLM's production stack's default)."""
from .base import RouterBase, register_router


@register_router("round_robin")
class RoundRobin(RouterBase):
    reads_replicas = False          # its own counter only: routed ahead on open-loop runs
    def __init__(self, replicas, options=None):
        super().__init__(replicas, options)
        self._next = 0

    def route(self, req):
        replica = self.replicas[self._next % len(self.replicas)]
        self._next += 1
        return replica
