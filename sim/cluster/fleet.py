"""A fleet: pools of engine replicas, the links between them, and how requests flow through them.

A pool is a group of identical replicas behind a router, with a role: `mixed` (prefill and decode,
today's replicas), `prefill` or `decode`. An aggregated fleet is one mixed pool (sim.engine.assembly.s
`build_engine` builds that run); a disaggregated one pairs a prefill pool and a decode pool through
`DisaggregatedProxy` and the NIXL-style connectors of sim/cluster/connectors/disaggregation.py.
Replica indices run over the whole fleet, pool after pool (the step log's `replica` column).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple
from collections.abc import Callable

from ..core.connector import KVConnector
from ..core.protocols import Executor, KVManager
from ..core.request import Request, RequestStatus
from ..core.scheduler import Scheduler, SchedulerConfig
from ..engine.loop import ArrivalProcess, EngineClock, EngineReplica, ReplicaFeed, ReplicaOptions, Router
from ..engine.routers.base import RouterBase
from ..results.metrics import StepLog
from .connectors.disaggregation import (NIXL_ABORT_TIMEOUT_S, DecodeSideConnector, PrefillHandoff, PrefillLeg,
                                        PrefillSideConnector)
from .links import Link, LinkSpec
from .route import Hop, route_of

ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class PoolSpec:
    """A pool: its name, role, replica count, scheduler settings and router policy."""
    name: str
    role: str
    num_replicas: int
    scheduler: SchedulerConfig
    router: str = "round_robin"

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"pool {self.name!r}: role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.num_replicas < 1:
            raise ValueError(f"pool {self.name!r}: num_replicas must be at least 1, got {self.num_replicas}")


# (pool, replica index within the pool, replica index in the fleet) -> its KV manager and executor
PartsFn = Callable[[PoolSpec, int, int], tuple[KVManager, Executor]]
# (pool, replica index in the fleet) -> its KV connector, or None
ConnectorFn = Callable[[PoolSpec, int], KVConnector | None]


@dataclass
class Pool:
    spec: PoolSpec
    replicas: list[EngineReplica]
    router: RouterBase
    connectors: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class Fleet:
    """The built fleet: its clock, pools, every replica (fleet order) and the arrivals feeding it."""
    env: EngineClock
    pools: list[Pool]
    arrivals: ArrivalProcess | None = None

    @property
    def replicas(self) -> list[EngineReplica]:
        return [r for p in self.pools for r in p.replicas]

    def next_arrival(self) -> float:
        """When the next trace request reaches the fleet (inf: none, or not fed yet)."""
        return self.arrivals.next_arrival() if self.arrivals is not None else float("inf")

    def pool_of(self, replica: int) -> Pool:
        for pool in self.pools:
            if any(r.index == replica for r in pool.replicas):
                return pool
        raise KeyError(f"no replica {replica} in the fleet")


class PoolWiring(NamedTuple):
    """How a pool meets the rest of the fleet: when its next request may arrive (its decode runs stop
    there) and whom it tells that requests left it."""
    next_arrival: Callable[[], float]
    on_finished: Callable[[list[Request], float], None] | None = None
    next_handoff: Callable[[], float] = lambda: float("inf")


def build_pools(env: EngineClock, specs: list[PoolSpec], step_log: StepLog, parts: PartsFn,
                connector: ConnectorFn, wiring: Callable[[PoolSpec], PoolWiring],
                options: ReplicaOptions = ReplicaOptions()) -> list[Pool]:
    """The pools' replicas, numbered over the fleet, each with its KV manager, executor and connector."""
    pools, index = [], 0
    for spec in specs:
        replicas, connectors = [], []
        wired = wiring(spec)
        for i in range(spec.num_replicas):
            kv, executor = parts(spec, i, index)
            conn = connector(spec, index)
            replica = EngineReplica(env, index, Scheduler(spec.scheduler, kv, conn), executor, step_log, options,
                                    ReplicaFeed(next_arrival=wired.next_arrival, on_finished=wired.on_finished,
                                                next_handoff=wired.next_handoff))
            if isinstance(conn, PrefillSideConnector):
                conn.wake = replica.wake
            replicas.append(replica)
            connectors.append(conn)
            index += 1
        pools.append(Pool(spec, replicas, Router(replicas, spec.router), connectors))
    return pools


class DisaggregatedProxy:
    """vLLM's disaggregated-serving proxy: each request is prefilled as a one-token leg on the prefill
    pool, then sent with the leg's hand-off to the decode pool, which pulls the KV and decodes. The
    request's route records both visits and the transfer; its TTFT runs from its arrival to its first
    token on the decode side, as the client of the proxy sees it."""

    def __init__(self, env: EngineClock, prefill: Pool, decode: Pool, local_prefill_tokens: int = 0):
        self.env, self.prefill, self.decode = env, prefill, decode
        self.local_prefill_tokens = local_prefill_tokens
        self.legs: dict[int, Request] = {}        # request id -> its prefill leg
        self.local: set[int] = set()              # ids of requests prefilled on the decode pool
        self.links: dict[int, Link] = {}          # decode replica -> the link its pulls cross (-1: shared)

    def route(self, req: Request) -> DisaggregatedProxy:
        return self

    def submit(self, req: Request) -> None:
        if self.local_prefill_tokens and self._prefill_locally(req):
            return
        leg = Request(request_id=req.request_id, arrival_time=self.env.now, prompt_tokens=req.prompt_tokens,
                      max_output_tokens=1, priority=req.priority, prefix_hash_ids=req.prefix_hash_ids,
                      prefix_block_tokens=req.prefix_block_tokens, kv_transfer_params=PrefillLeg(req))
        self.legs[req.request_id] = leg
        self.prefill.router.route(leg).submit(leg)

    def _prefill_locally(self, req: Request) -> bool:
        """Conditional disaggregation (Dynamo's and llm-d's decider): a request whose prompt, less what
        the decode replica the router picks has cached, is at most `local_prefill_tokens` is prefilled
        on that replica, with no prefill leg and no transfer."""
        replica = self.decode.router.route(req)
        cached = len(replica.kv.get_computed_blocks(req)) * replica.kv.block_size
        if req.prompt_tokens - cached > self.local_prefill_tokens:
            return False
        self.local.add(req.request_id)
        replica.submit(req)
        return True

    def prefill_finished(self, legs: list[Request], now: float) -> None:
        for leg in legs:
            params = leg.kv_transfer_params
            assert isinstance(params, PrefillLeg)
            req = params.parent
            route_of(req).hops.append(Hop(leg.replica, self.prefill.name, "prefill", leg.arrival_time, now))
            if leg.status == RequestStatus.REJECTED:
                req.status, req.reject_reason, req.replica = RequestStatus.REJECTED, leg.reject_reason, leg.replica
                continue
            connector = self.prefill.connectors[self.prefill.replicas.index(self._replica(leg.replica))]
            req.kv_transfer_params = connector.handoffs[leg]
            self.decode.router.route(req).submit(req)

    def decode_finished(self, reqs: list[Request], now: float) -> None:
        for req in reqs:
            route = route_of(req)
            entered = route.hops[-1].leave_s if route.hops else req.arrival_time
            route.hops.append(Hop(req.replica, self.decode.name, "decode", entered, now))
            handoff = req.kv_transfer_params
            if req.status == RequestStatus.REJECTED and isinstance(handoff, PrefillHandoff) and not handoff.pulled:
                handoff.pulled = True
                handoff.source.release(handoff.leg, now)       # nobody will pull it

    def _replica(self, index: int) -> EngineReplica:
        return next(r for r in self.prefill.replicas if r.index == index)

    def next_handoff(self, next_arrival: float) -> float:
        """The earliest a hand-off can reach the decode pool: a prefill replica's step in flight ends,
        or (idle ones) a request arrives first. Decode runs stop there, as they stop at arrivals."""
        now = self.env.now
        handoff = min((r.busy_until for r in self.prefill.replicas if r.busy_until >= now), default=next_arrival)
        # requests prefilled locally reach the decode pool at their arrival
        return min(handoff, next_arrival) if self.local_prefill_tokens else handoff


class Handoff(NamedTuple):
    """How a prefill pool hands KV to a decode pool: the link hand-offs cross (a Link: one shared by all;
    a LinkSpec: a link of that kind for each decode replica), the KV bytes a token moves, how long the
    prefill side keeps unpulled KV, up to how many uncached prompt tokens a request is prefilled
    on the decode pool instead (conditional disaggregation; 0: never), and over how many layers the
    hand-off is pushed while the prefill runs (layer-wise overlap; 0: pulled after the prefill)."""
    link: Link | LinkSpec
    kv_bytes_per_token: float
    abort_timeout_s: float = NIXL_ABORT_TIMEOUT_S
    local_prefill_tokens: int = 0
    layerwise_layers: int = 0


def build_disaggregated(env: EngineClock, prefill: PoolSpec, decode: PoolSpec, handoff: Handoff, step_log: StepLog,
                        parts: PartsFn, options: ReplicaOptions = ReplicaOptions()) -> tuple[Fleet, DisaggregatedProxy]:
    """A prefill pool and a decode pool joined by a link (every hand-off crosses it) behind a proxy."""
    if prefill.role != "prefill" or decode.role != "decode":
        raise ValueError(f"a disaggregated fleet needs a prefill and a decode pool, got roles "
                         f"{prefill.role!r} and {decode.role!r}")
    clock = lambda: env.now        # noqa: E731 - the connectors read the engine's clock
    proxy: list = []
    fleet = Fleet(env, [])
    links: dict[int, Link] = {}                # decode replica (fleet index) -> its link

    def connector(spec: PoolSpec, index: int) -> KVConnector:
        if spec.role == "prefill":
            return PrefillSideConnector(clock, abort_timeout_s=handoff.abort_timeout_s, name=f"{spec.name}/{index}")
        # a LinkSpec gives each decode replica a link of its own (its GPUs' NICs); a Link is shared by all
        link = handoff.link if isinstance(handoff.link, Link) else links.setdefault(index, Link(handoff.link))
        return DecodeSideConnector(link, handoff.kv_bytes_per_token, clock, name=f"{spec.name}/{index}",
                                   layers=handoff.layerwise_layers)

    def wiring(spec: PoolSpec) -> PoolWiring:
        if spec.role == "prefill":
            return PoolWiring(fleet.next_arrival, lambda reqs, now: proxy[0].prefill_finished(reqs, now))
        # the decode pool's only arrivals are hand-offs of requests that arrived at the fleet earlier
        return PoolWiring(lambda: float("inf"), lambda reqs, now: proxy[0].decode_finished(reqs, now),
                          lambda: proxy[0].next_handoff(fleet.next_arrival()))

    fleet.pools = build_pools(env, [prefill, decode], step_log, parts, connector, wiring, options)
    proxy.append(DisaggregatedProxy(env, fleet.pools[0], fleet.pools[1], local_prefill_tokens=handoff.local_prefill_tokens))
    proxy[0].links = links if links else {-1: handoff.link}
    return fleet, proxy[0]


def feed(fleet: Fleet, requests: list[Request], router) -> Fleet:
    """Trace arrivals into the fleet through `router` (a pool's router, or a proxy)."""
    fleet.arrivals = ArrivalProcess(fleet.env, requests, router)
    return fleet
