"""session_affinity: every turn of a multi-turn session goes to the replica that served its previous
turn (its prefix cache and CPU tier hold the conversation so far), as llm-d's session-affinity scorer
(a session token the gateway sets on the first answer) and the vLLM production stack's session router
(a session header, consistent hashing) keep a session on one pod. A session's first turn, or a
request without a session, goes to the least loaded replica (fewest running + waiting, ties: the
lowest index), read through the router's load signals (stale by `router_options.refresh_s`)."""
from .base import RouterBase, register_router


@register_router("session_affinity")
class SessionAffinity(RouterBase):
    reads = "outstanding"

    def __init__(self, replicas, options=None):
        super().__init__(replicas, options)
        self._where: dict[int, int] = {}        # session -> index of the replica of its last turn

    def last_replica(self, req) -> int | None:
        """The replica index that served the session's previous turn (None: a new session or none)."""
        return None if req.session is None else self._where.get(req.session)

    def remember(self, req, index: int) -> None:
        if req.session is not None:
            self._where[req.session] = index

    def route(self, req):
        index = self.last_replica(req)
        if index is None:
            index = self.replicas.index(self.pick_max([-n for n in self.signals.outstanding()]))
        self.remember(req, index)
        return self.replicas[index]
