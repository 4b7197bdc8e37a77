"""least_outstanding: the replica with the fewest running + waiting requests (ties: lowest index)."""
from .base import RouterBase, register_router


@register_router("least_outstanding")
class LeastOutstanding(RouterBase):
    def route(self, req):
        if self.signals.refresh_s <= 0:          # the exact state (and today's behaviour, bit for bit)
            return min(self.replicas, key=lambda rep: (rep.outstanding, rep.index))
        loads = self.signals.loads()
        return self.pick_max([-load.outstanding for load in loads])
