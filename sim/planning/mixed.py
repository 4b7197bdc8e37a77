"""`kvsim plan --disaggregated --mixed-pools N`: fleets whose roles mix pool types.

A role (prefill or decode) is then up to N pools of different types (GPU x TP), each with 1 to
`max_pool_replicas` replicas, as `kvsim simulate` runs them (`fleet.prefill` a list; the proxy picks a pool by
`fleet.pool_choice`, least_work by default). The space grows fast (T types, N = 2, 16 replicas: T x 16 +
T(T-1)/2 x 256 options a role, and prefill options x decode options fleets), so it is never listed whole:

1. **Per-role options, pruned by the bounds.** A one-type option keeps its type's bound from bounds.py
   (`replica_bound`, as without the option); a mix's capacity is the sum of its pools'
   (`bounds.mixed_role_bound`: the prompt tokens, output tokens and KV token-seconds due, against
   sum(n_i x a replica of type i's rate) over the span), and a limit is out of reach only when it is for the
   fastest type of the mix. Options below are never simulated.
2. **Cheapest first, lazily.** Each role's options sorted by ($/hour, GPUs) (or GPUs, $/hour); fleets (prefill
   option x decode option, for each decider threshold) come out of a heap in order of their sum, then of their
   number of pools (at the same price and GPUs, one pool type a role goes first: a mix is the answer only where
   it is cheaper), so only the fleets cheaper than the answer are ever built.
3. **What a failure implies.** A failed fleet implies every fleet of the *same pool types in each role* with at
   most as many replicas in every pool fails (more replicas never hurt: the same assumption as the one-type
   search; adding a pool of another type is not assumed harmless: the proxy may send it work it serves
   worse). A prefill queue above the TTFT limit rules out the same prefill pools with at most those replicas,
   whatever the decode pools (threshold 0 only).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from .bounds import MixedBound
from .fleets import FleetPoint, Pools, PoolType, _pools_usd, point_of


@dataclass(frozen=True)
class RoleOption:
    """One way to build a role: its pools ((type, replicas) each, in the role's type order)."""
    pools: Pools

    def rank(self, objective: str) -> tuple:
        usd, gpus = _pools_usd(self.pools), sum(n * t.tp for t, n in self.pools)
        return (gpus, usd) if objective == "gpus" else (usd, gpus)


def role_options(types: list[PoolType], single_min: list[int | None], mixed_bound, max_n: int, cap: int,
                 objective: str, exhaustive: bool) -> tuple[int, list[RoleOption]]:
    """(how many options the role has within the limits, those above the bounds cheapest first).
    `single_min[i]`: type i's fewest replicas alone (None: it cannot); `mixed_bound(indices)`: the
    MixedBound of a mix of those types."""
    total, keep = 0, []
    for size in range(1, min(cap, len(types)) + 1):
        for combo in itertools.combinations(range(len(types)), size):
            total += max_n ** size
            if size == 1:
                lo = 1 if exhaustive else single_min[combo[0]]
                if lo is not None:
                    keep += [RoleOption(((types[combo[0]], n),)) for n in range(lo, max_n + 1)]
                continue
            bound: MixedBound | None = None if exhaustive else mixed_bound(combo)
            if bound is not None and bound.impossible:
                continue
            for counts in itertools.product(range(1, max_n + 1), repeat=size):
                if bound is None or bound.admits(counts):
                    keep.append(RoleOption(tuple((types[i], n) for i, n in zip(combo, counts, strict=True))))
    keep.sort(key=lambda o: (o.rank(objective), len(o.pools), [(t.gpu, t.tp, n) for t, n in o.pools]))
    return total, keep


def _shape(pools: Pools) -> tuple[tuple[PoolType, ...], tuple[int, ...]]:
    return tuple(t for t, _ in pools), tuple(n for _, n in pools)


def _at_most(counts: tuple[int, ...], limit: tuple[int, ...]) -> bool:
    return all(a <= b for a, b in zip(counts, limit, strict=True))


class MixedGrid:
    """One model's search over mixed fleets (the interface of disaggregated._Grid): the fleets above the
    bounds come out of a heap cheapest first, as the search asks for them."""

    def __init__(self, model: str, prefill: dict[int, tuple[int, list[RoleOption]]],
                 decode: tuple[int, list[RoleOption]], objective: str = "usd", exhaustive: bool = False):
        """`prefill`: threshold -> (options within the limits, those above the bounds); `decode` likewise."""
        self.model, self.objective, self.exhaustive = model, objective, exhaustive
        self.total = self.below = 0
        self._prefill = sorted(prefill.items())
        self._decode = decode[1]
        self._heap: list[tuple] = []
        for t, (_, (n_all, opts)) in enumerate(self._prefill):
            self.total += n_all * decode[0]
            self.below += n_all * decode[0] - len(opts) * len(self._decode)
            if opts and self._decode:
                heapq.heappush(self._heap, (self._sum(opts[0], self._decode[0]), t, 0, 0))
        self.generated: list[tuple[tuple, tuple]] = []     # (rank, key) in the order of the heap
        self.pending: list[tuple[tuple, tuple]] = []
        self.failed: dict[tuple, list[tuple]] = {}         # (prefill types, decode types, threshold) -> counts
        self.prefill_failed: dict[tuple, list[tuple]] = {}  # prefill types -> counts whose queue fails
        self.done: dict[tuple, FleetPoint] = {}
        self.best: FleetPoint | None = None

    def _sum(self, a: RoleOption, b: RoleOption) -> tuple:
        ra, rb = a.rank(self.objective), b.rank(self.objective)
        return (ra[0] + rb[0], ra[1] + rb[1], len(a.pools) + len(b.pools))

    def _order(self, point: FleetPoint) -> tuple:
        """The search's order: the rank, then the fewest pools (a mix only where it is cheaper)."""
        return point.rank(self.objective) + (len(point.prefill_pools) + len(point.decode_pools),)

    def _pull(self) -> tuple[tuple, tuple] | None:
        if not self._heap:
            return None
        _, t, i, j = heapq.heappop(self._heap)
        local, (_, opts) = self._prefill[t]
        if j == 0 and i + 1 < len(opts):
            heapq.heappush(self._heap, (self._sum(opts[i + 1], self._decode[0]), t, i + 1, 0))
        if j + 1 < len(self._decode):
            heapq.heappush(self._heap, (self._sum(opts[i], self._decode[j + 1]), t, i, j + 1))
        p, d = opts[i].pools, self._decode[j].pools
        point = FleetPoint(self.model, p[0][0], p[0][1], d[0][0], d[0][1], local, None, "", p[1:], d[1:])
        item = (self._order(point), point.key)
        self.generated.append(item)
        return item

    def failure_implied(self, key: tuple) -> str:
        if self.exhaustive:
            return ""
        point = point_of(key)
        (tp, cp), (td, cd) = _shape(point.prefill_pools), _shape(point.decode_pools)
        if not point.local:
            for fp in self.prefill_failed.get(tp, ()):
                if _at_most(cp, fp):
                    return "the prefill queue of those prefill pools with as many or more replicas is above the TTFT limit"
        for fp, fd in self.failed.get((tp, td, point.local), ()):
            if _at_most(cp, fp) and _at_most(cd, fd):
                return "the same pools with as many or more replicas fail"
        return ""

    def next(self, count: int) -> list[tuple]:
        """Up to `count` fleets to simulate: the cheapest not yet simulated, not implied to fail, and cheaper
        than the best answer found."""
        self.pending = [(r, k) for r, k in self.pending if k not in self.done and not self.failure_implied(k)]
        picked: list[tuple] = []
        i = 0
        while len(picked) < count:
            if i < len(self.pending):
                rank, key = self.pending[i]
            else:
                item = self._pull()
                if item is None:
                    break
                self.pending.append(item)
                rank, key = item
            i += 1
            if self.best is not None and rank >= self._order(self.best) and not self.exhaustive:
                break
            if key in self.done or self.failure_implied(key):
                continue
            picked.append(key)
        return picked

    def record(self, point: FleetPoint, prefill_queue_fails: bool) -> None:
        self.done[point.key] = point
        if point.meets:
            if self.best is None or self._order(point) < self._order(self.best):
                self.best = point
            return
        if not point.row or point.row.get("status") != "ok":
            return
        (tp, cp), (td, cd) = _shape(point.prefill_pools), _shape(point.decode_pools)
        self.failed.setdefault((tp, td, point.local), []).append((cp, cd))
        if prefill_queue_fails and not point.local:
            self.prefill_failed.setdefault(tp, []).append(cp)

    def count_implied(self) -> int:
        """Fleets cheaper than the answer (every fleet when there is none: the heap is then empty) that a
        failure ruled out."""
        return sum(1 for rank, k in self.generated
                   if (self.best is None or rank < self._order(self.best))
                   and k not in self.done and self.failure_implied(k))
