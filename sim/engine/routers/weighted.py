"""weighted: llm-d's inference scheduler profile: each replica's score is a weighted sum of scorers, each
in [0, 1], and the highest wins (max-score picker; ties: lowest index). Scorers (llm-d's names in
parentheses): queue (queue-scorer), kv_usage (kv-cache-utilization-scorer), prefix (precise
prefix-cache-scorer), approx_prefix (approximate prefix affinity), session (session-affinity-scorer: 1
for the replica of the session's previous turn). Weights from
`router_options.weights`, default llm-d's sample profile: queue 1, kv_usage 1, prefix 2."""
from .base import RouterBase, RouterError, register_router
from .kv_usage import kv_usage_scores
from .precise_prefix import cached_fraction
from .prefix_affinity import PrefixAffinity, leading_block_hashes, prefix_scores
from .queue_depth import queue_scores
from .session_affinity import SessionAffinity

SCORERS = ("queue", "kv_usage", "prefix", "approx_prefix", "session")
DEFAULT_WEIGHTS = {"queue": 1.0, "kv_usage": 1.0, "prefix": 2.0}


@register_router("weighted")
class Weighted(RouterBase):
    def __init__(self, replicas, options=None):
        super().__init__(replicas, options)
        given = getattr(options, "weights", None)
        self.weights = dict(DEFAULT_WEIGHTS if given is None else given)       # {} is refused below, not defaulted
        bad = sorted(set(self.weights) - set(SCORERS))
        if bad:
            raise RouterError(f"router_options.weights: unknown scorer {bad[0]!r}; known: {', '.join(SCORERS)}")
        negative = next((k for k, v in self.weights.items() if not v >= 0), None)
        if negative is not None:       # a negative weight would send requests to the worst replica by that scorer
            raise RouterError(f"router_options.weights.{negative}: {self.weights[negative]:g}; expected a weight >= 0")
        if not any(self.weights.values()):     # every score 0: every request to replica 0 (the max-score tie)
            raise RouterError("router_options.weights: no scorer has a weight > 0; expected at least one "
                              f"(scorers: {', '.join(SCORERS)})")
        self._reads_loads = bool(self.weights.get("queue") or self.weights.get("kv_usage"))
        self._approx = PrefixAffinity(replicas, options) if self.weights.get("approx_prefix") else None
        self._session = SessionAffinity(replicas, options) if self.weights.get("session") else None

    def reads_state_now(self) -> bool:
        # its load signals only, with a queue or KV-usage scorer (the prefix scorer: computed_blocks_now)
        return self._reads_loads and self.signals.due()

    def next_state_read(self) -> float:
        return self.signals.next_due() if self._reads_loads else float("inf")

    def route(self, req):
        w = self.weights
        loads = self.signals.loads() if w.get("queue") or w.get("kv_usage") else []
        total = [0.0] * len(self.replicas)
        parts = []
        if w.get("queue"):
            parts.append((w["queue"], queue_scores(loads)))
        if w.get("kv_usage"):
            parts.append((w["kv_usage"], kv_usage_scores(loads)))
        if w.get("prefix"):
            parts.append((w["prefix"], [cached_fraction(r, req) for r in self.replicas]))
        hashes = None
        if self._approx is not None:
            hashes = leading_block_hashes(req, self._approx.block_tokens)
            parts.append((w["approx_prefix"], prefix_scores(self._approx.matched_blocks(hashes), len(hashes))))
        if self._session is not None:
            last = self._session.last_replica(req)
            parts.append((w["session"], [1.0 if i == last else 0.0 for i in range(len(self.replicas))]))
        for weight, scores in parts:
            for i, s in enumerate(scores):
                total[i] += weight * s
        replica = self.pick_max(total)
        if hashes is not None:
            self._approx.remember(hashes, self.replicas.index(replica))
        if self._session is not None:
            self._session.remember(req, self.replicas.index(replica))
        return replica
