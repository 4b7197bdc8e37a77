"""Prefix-cache lookup counts of a KV manager (the summary's prefix_hit_rate and, counted apart as
vLLM does, prefix_hit_rate_preempted for requests resuming after a recompute preemption)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixLookups:
    queries: int = 0                # prompt tokens looked up by first admissions
    hits: int = 0                   # of which served from the cache
    queries_preempted: int = 0      # the same for requests resuming after a recompute preemption
    hits_preempted: int = 0

    def record(self, num_queried: int, num_hit: int, preempted: bool = False) -> None:
        if preempted:
            self.queries_preempted += num_queried
            self.hits_preempted += num_hit
        else:
            self.queries += num_queried
            self.hits += num_hit

    @classmethod
    def total(cls, parts) -> PrefixLookups:
        parts = list(parts)
        return cls(sum(p.queries for p in parts), sum(p.hits for p in parts),
                   sum(p.queries_preempted for p in parts), sum(p.hits_preempted for p in parts))
