"""least_outstanding: the replica with the fewest running + waiting requests (ties: lowest index)."""
from .base import RouterBase, outstanding_now, register_router


@register_router("least_outstanding")
class LeastOutstanding(RouterBase):
    reads = "outstanding"

    def route(self, req):
        if self.signals.refresh_s <= 0:          # the exact state (and today's behaviour, bit for bit)
            return min(self.replicas, key=lambda rep: (outstanding_now(rep), rep.index))
        loads = self.signals.loads()
        return self.pick_max([-load.outstanding for load in loads])
