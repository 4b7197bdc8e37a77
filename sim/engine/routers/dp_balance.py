"""dp_balance: vLLM's data-parallel load balancer (vllm/v1/engine/core_client.py, DPLBAsyncMPClient
.get_core_engine_for_request): each request goes to the engine of the lowest score

    score = max(in flight, waiting + running) + waiting x 6 x max(0, KV usage - 0.5)

(a single API server: in flight = the requests it sent there and not yet finished), scanning the engines
from a start index that advances by one at every request, so ties go round robin. Older vLLM releases
(0.9-0.10, its DP coordinator) scored waiting x 4 + running; the newer score differs from it only when
requests wait on an engine whose KV cache is more than half full. The engines' counts are exact here
(vLLM's coordinator publishes them every 100 ms; `router_options.refresh_s` models that staleness)."""
from .base import RouterBase, register_router


@register_router("dp_balance")
class DPBalance(RouterBase):
    def __init__(self, replicas: list, options=None):
        super().__init__(replicas, options)
        self.start = 0

    def route(self, req):
        loads = self.signals.loads()
        n = len(self.replicas)
        best, best_score = 0, float("inf")
        for i in range(n):
            idx = (self.start + i) % n
            load = loads[idx]
            in_flight = self.replicas[idx].outstanding + len(getattr(self.replicas[idx], "inbox", ()))
            score = float(max(in_flight, load.outstanding))
            if load.waiting:
                score += load.waiting * 6.0 * max(0.0, load.kv_usage - 0.5)
            if score < best_score:
                best, best_score = idx, score
        self.start = (self.start + 1) % n
        return self.replicas[best]
