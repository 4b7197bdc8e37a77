"""The router registry and what every router shares: the replicas and their load signals.

A gateway does not see a replica's exact state: llm-d's inference scheduler reads each vLLM pod's
metrics (queue depth, KV-cache usage) as scraped every so often. `LoadSignals` models that: with
`refresh_s` > 0 the figures a router reads are those of the last refresh (at most `refresh_s` old);
0 reads the replicas' state at each decision (today's least_outstanding).
"""
from __future__ import annotations

from typing import NamedTuple
from collections.abc import Callable


class RouterError(ValueError):
    """An unknown router name or a bad router option."""


_REGISTRY: dict[str, type] = {}


def register_router(name: str) -> Callable[[type], type]:
    def add(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise RouterError(f"register_router({name!r}) in {cls.__module__}: the name is taken by "
                              f"{_REGISTRY[name].__module__}")
        _REGISTRY[name] = cls
        cls.name = name
        return cls
    return add


def router_names() -> list[str]:
    return sorted(_REGISTRY)


class Load(NamedTuple):
    """One replica's load as a router sees it."""
    outstanding: int      # running + waiting (vLLM: num_requests_running + num_requests_waiting)
    waiting: int          # vLLM: num_requests_waiting (llm-d's queue scorer)
    kv_usage: float       # vLLM: kv_cache_usage_perc, 0..1


def load_of(replica) -> Load:
    pool = replica.kv.pool
    return Load(replica.outstanding, len(replica.scheduler.waiting), pool.num_used_blocks / max(pool.num_blocks - 1, 1))


class LoadSignals:
    """The replicas' loads, refreshed every `refresh_s` seconds of engine time (0: always exact)."""

    def __init__(self, replicas: list, refresh_s: float = 0.0):
        self.replicas = replicas
        self.refresh_s = refresh_s
        self._at = -float("inf")
        self._loads: list[Load] = []

    def loads(self) -> list[Load]:
        if self.refresh_s <= 0:
            return [load_of(r) for r in self.replicas]
        now = self.replicas[0].now
        if now - self._at >= self.refresh_s:
            self._loads = [load_of(r) for r in self.replicas]
            self._at = now
        return self._loads

    def outstanding(self) -> list[int]:
        """Each replica's running + waiting requests as the router sees them: exact (0: a lazy replica
        counts them from its planned run, `EngineReplica.outstanding_now`), or the last refresh's."""
        if self.refresh_s <= 0:
            return [outstanding_now(r) for r in self.replicas]
        return [load.outstanding for load in self.loads()]

    def due(self) -> bool:
        """Whether `loads` reads the replicas now (always, or a refresh is due)."""
        return self.refresh_s <= 0 or self.replicas[0].now - self._at >= self.refresh_s

    def next_due(self) -> float:
        """The earliest time `loads` may read the replicas again (0: at once)."""
        return 0.0 if self.refresh_s <= 0 else self._at + self.refresh_s


def outstanding_now(replica) -> int:
    """A replica's running + waiting requests now (a lazy fleet's replica counts them from its plan)."""
    counted = getattr(replica, "outstanding_now", None)
    return counted() if counted is not None else replica.outstanding


def computed_blocks_now(replica, req) -> list:
    """A replica's prefix-cache hits for `req` now (a lazy fleet's replica reads them past its plan)."""
    read = getattr(replica, "computed_blocks_now", None)
    return read(req) if read is not None else replica.kv.get_computed_blocks(req)


class RouterBase:
    """A router over `replicas`; subclasses implement `route(req)` (the replica the request goes to).

    `reads_replicas`: whether `route` reads the replicas' state (load, KV, prefix caches). A router that
    reads none (round-robin: its own counter only) declares False; on an open-loop run (trace arrivals
    alone: no concurrency limit, no sessions) the engine then routes every request ahead of the run, in
    arrival order, and each replica takes its own arrivals as one replica does: its decode runs stop at
    (or admit) its own arrivals only, not at every arrival of the fleet. Same decisions, same results."""
    name = "?"
    reads_replicas = True
    # what `route` reads of the replicas (`reads_state_now`): "state" (anything: the default), "loads" (its
    # LoadSignals only), "outstanding" (LoadSignals.outstanding and computed_blocks_now only)
    reads = "state"

    def __init__(self, replicas: list, options=None):
        self.replicas = replicas
        self.options = options
        self.signals = LoadSignals(replicas, getattr(options, "refresh_s", 0.0) or 0.0)

    def route(self, req):
        raise NotImplementedError

    def reads_state_now(self) -> bool:
        """Whether `route` reads the replicas' exact state (beyond `LoadSignals.outstanding` and
        `computed_blocks_now`) at this decision: a lazy fleet (sim.engine.loop.LazyRouting) brings every
        replica to now first. Per `reads`: "state" always; "loads" (its load signals only) when they refresh
        (`LoadSignals.due`); "outstanding" (the outstanding counts of its signals and prefix-cache hits only)
        never with exact signals (refresh_s 0: read from the replicas' plans), else when they refresh."""
        if self.reads == "state":
            return True
        signals = self.signals
        if self.reads == "outstanding" and signals.refresh_s <= 0:
            return False
        return signals.due()

    def next_state_read(self) -> float:
        """The earliest time `reads_state_now` may be True again (0: at the next decision; inf: never)."""
        if self.reads == "state":
            return 0.0
        if self.reads == "outstanding" and self.signals.refresh_s <= 0:
            return float("inf")
        return self.signals.next_due()

    def pick_max(self, scores: list[float]):
        """The replica of the highest score; ties go to the lowest index (deterministic)."""
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        return self.replicas[best]


def routes_ahead(name: str) -> bool:
    """Whether the router `name` reads no replica state (`RouterBase.reads_replicas` False): its decisions
    can be taken before the run. An unknown name: False (build_router refuses it)."""
    cls = _REGISTRY.get(name)
    return cls is not None and getattr(cls, "reads_replicas", True) is False


def build_router(name: str, replicas: list, options=None):
    cls = _REGISTRY.get(name)
    if cls is None:
        raise RouterError(f"router: unknown router {name!r}; known: {', '.join(router_names())}")
    return cls(replicas, options)
