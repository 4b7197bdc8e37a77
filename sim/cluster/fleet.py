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
from collections.abc import Callable, Mapping

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
from .pool_choice import PoolChoice, make_pool_choice
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
    """vLLM's disaggregated-serving proxy: each request is prefilled as a one-token leg on a prefill pool,
    then sent with the leg's hand-off to a decode pool, which pulls the KV and decodes. The request's route
    records both visits and the transfer; its TTFT runs from its arrival to its first token on the decode
    side, as the client of the proxy sees it. With several pools of a role (`prefill`, `decode`: lists),
    `choice` (sim/cluster/pool_choice.py) picks the replica; with one, that pool's router does."""

    def __init__(self, env: EngineClock, prefill: Pool | list[Pool], decode: Pool | list[Pool],
                 local_prefill_tokens: int = 0, choice: PoolChoice | None = None):
        self.env = env
        self.prefills = prefill if isinstance(prefill, list) else [prefill]
        self.decodes = decode if isinstance(decode, list) else [decode]
        self.local_prefill_tokens = local_prefill_tokens
        self.choice = choice if choice is not None else make_pool_choice("least_work")
        self.legs: dict[int, Request] = {}        # request id -> its prefill leg
        self.local: set[int] = set()              # ids of requests prefilled on a decode pool
        self.links: dict = {}                     # decode replica (or (replica, link type)) -> its link (-1: shared)
        self._pool_of = {r.index: p for p in (*self.prefills, *self.decodes) for r in p.replicas}
        self._connector = {r.index: c for p in self.prefills for r, c in zip(p.replicas, p.connectors, strict=True)}

    @property
    def prefill(self) -> Pool:
        """The first prefill pool (the only one in a one-pool-a-role fleet)."""
        return self.prefills[0]

    @property
    def decode(self) -> Pool:
        return self.decodes[0]

    def pool_name(self, replica: int | None, default: str) -> str:
        pool = self._pool_of.get(replica) if replica is not None else None
        return pool.name if pool is not None else default

    def decode_pool_of(self, replica: int | None) -> str:
        """The decode pool a request finished on (the first decode pool if it never reached one)."""
        pool = self._pool_of.get(replica) if replica is not None else None
        return pool.name if pool is not None and pool.spec.role == "decode" else self.decode.name

    def _pick(self, pools: list[Pool], req: Request, role: str) -> EngineReplica:
        if len(pools) == 1:
            return pools[0].router.route(req)
        return self.choice.choose(pools, req, role)

    def route(self, req: Request) -> DisaggregatedProxy:
        return self

    def submit(self, req: Request) -> None:
        if self.local_prefill_tokens and self._prefill_locally(req):
            return
        leg = Request(request_id=req.request_id, arrival_time=self.env.now, prompt_tokens=req.prompt_tokens,
                      max_output_tokens=1, priority=req.priority, prefix_hash_ids=req.prefix_hash_ids,
                      prefix_block_tokens=req.prefix_block_tokens, kv_transfer_params=PrefillLeg(req))
        self.legs[req.request_id] = leg
        self._pick(self.prefills, leg, "prefill").submit(leg)

    def _prefill_locally(self, req: Request) -> bool:
        """Conditional disaggregation (Dynamo's and llm-d's decider): a request whose prompt, less what
        the decode replica the proxy picks has cached, is at most `local_prefill_tokens` is prefilled
        on that replica, with no prefill leg and no transfer."""
        replica = self._pick(self.decodes, req, "decode")
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
            route_of(req).hops.append(Hop(leg.replica, self.pool_name(leg.replica, self.prefill.name), "prefill",
                                          leg.arrival_time, now))
            if leg.status == RequestStatus.REJECTED:
                req.status, req.reject_reason, req.replica = RequestStatus.REJECTED, leg.reject_reason, leg.replica
                continue
            req.kv_transfer_params = self._connector[leg.replica].handoffs[leg]
            self._pick(self.decodes, req, "decode").submit(req)

    def decode_finished(self, reqs: list[Request], now: float) -> None:
        for req in reqs:
            route = route_of(req)
            entered = route.hops[-1].leave_s if route.hops else req.arrival_time
            route.hops.append(Hop(req.replica, self.decode_pool_of(req.replica), "decode", entered, now))
            handoff = req.kv_transfer_params
            if req.status == RequestStatus.REJECTED and isinstance(handoff, PrefillHandoff) and not handoff.pulled:
                handoff.pulled = True
                handoff.source.release(handoff.leg, now)       # nobody will pull it

    def next_handoff(self, next_arrival: float) -> float:
        """The earliest a hand-off can reach a decode pool: a prefill replica's step in flight ends,
        or (idle ones) a request arrives first. Decode runs stop there, as they stop at arrivals."""
        now = self.env.now
        handoff = min((r.busy_until for p in self.prefills for r in p.replicas if r.busy_until >= now),
                      default=next_arrival)
        # requests prefilled locally reach the decode pool at their arrival
        return min(handoff, next_arrival) if self.local_prefill_tokens else handoff


class Handoff(NamedTuple):
    """How prefill pools hand KV to decode pools: the link hand-offs cross (a Link: one shared by all;
    a LinkSpec: a link of that kind for each decode replica), the KV bytes a token moves, how long the
    prefill side keeps unpulled KV, up to how many uncached prompt tokens a request is prefilled
    on the decode pool instead (conditional disaggregation; 0: never), over how many layers the
    hand-off is pushed while the prefill runs (layer-wise overlap; 0: pulled after the prefill), and,
    with several pools of a role, per pool pair: `pairs` (prefill pool, decode pool) -> the pair's link (named
    by its link type, its bandwidth with the pair's lanes; pulls over one link type into one decode replica
    share one FIFO queue, each priced at its own pair's bandwidth)
    and `pool_kv_bytes` decode pool -> its bytes a token (its KV layout)."""
    link: Link | LinkSpec
    kv_bytes_per_token: float
    abort_timeout_s: float = NIXL_ABORT_TIMEOUT_S
    local_prefill_tokens: int = 0
    layerwise_layers: int = 0
    pairs: Mapping[tuple[str, str], LinkSpec] | None = None
    pool_kv_bytes: Mapping[str, float] | None = None


def build_disaggregated(env: EngineClock, prefill: PoolSpec | list[PoolSpec], decode: PoolSpec | list[PoolSpec],
                        handoff: Handoff, step_log: StepLog, parts: PartsFn, options: ReplicaOptions = ReplicaOptions(),
                        choice: PoolChoice | None = None) -> tuple[Fleet, DisaggregatedProxy]:
    """Prefill pools and decode pools joined by links behind a proxy (`choice` picks among several pools
    of a role; default least_work at equal speeds). Pools are numbered prefill pools first."""
    prefills = prefill if isinstance(prefill, list) else [prefill]
    decodes = decode if isinstance(decode, list) else [decode]
    if not prefills or not decodes or any(p.role != "prefill" for p in prefills) or any(
            d.role != "decode" for d in decodes):
        raise ValueError(f"a disaggregated fleet needs prefill and decode pools, got roles "
                         f"{[p.role for p in prefills]} and {[d.role for d in decodes]}")
    names = [p.name for p in (*prefills, *decodes)]
    if len(set(names)) != len(names):
        raise ValueError(f"a fleet's pools need distinct names, got {names}")
    clock = lambda: env.now        # noqa: E731 - the connectors read the engine's clock
    proxy: list = []
    fleet = Fleet(env, [])
    links: dict = {}                           # decode replica (fleet index; with pairs: (index, link type)) -> link

    def pair_route(index: int, decode_pool: str) -> Callable[[str], tuple[Link, LinkSpec]]:
        pairs = handoff.pairs or {}

        def route(prefill_pool: str) -> tuple[Link, LinkSpec]:
            spec = pairs[(prefill_pool, decode_pool)]
            return links.setdefault((index, spec.name), Link(spec)), spec
        return route

    def connector(spec: PoolSpec, index: int) -> KVConnector:
        if spec.role == "prefill":
            return PrefillSideConnector(clock, abort_timeout_s=handoff.abort_timeout_s, name=f"{spec.name}/{index}",
                                        pool=spec.name)
        per_token = (handoff.pool_kv_bytes or {}).get(spec.name, handoff.kv_bytes_per_token)
        if handoff.pairs is not None:
            first = handoff.pairs[(prefills[0].name, spec.name)]
            return DecodeSideConnector(Link(first), per_token, clock, name=f"{spec.name}/{index}",
                                       layers=handoff.layerwise_layers, pair=pair_route(index, spec.name))
        # a LinkSpec gives each decode replica a link of its own (its GPUs' NICs); a Link is shared by all
        link = handoff.link if isinstance(handoff.link, Link) else links.setdefault(index, Link(handoff.link))
        return DecodeSideConnector(link, per_token, clock, name=f"{spec.name}/{index}",
                                   layers=handoff.layerwise_layers)

    def wiring(spec: PoolSpec) -> PoolWiring:
        if spec.role == "prefill":
            return PoolWiring(fleet.next_arrival, lambda reqs, now: proxy[0].prefill_finished(reqs, now))
        # the decode pools' only arrivals are hand-offs of requests that arrived at the fleet earlier
        return PoolWiring(lambda: float("inf"), lambda reqs, now: proxy[0].decode_finished(reqs, now),
                          lambda: proxy[0].next_handoff(fleet.next_arrival()))

    fleet.pools = build_pools(env, [*prefills, *decodes], step_log, parts, connector, wiring, options)
    n = len(prefills)
    proxy.append(DisaggregatedProxy(env, fleet.pools[:n], fleet.pools[n:], local_prefill_tokens=handoff.local_prefill_tokens,
                                    choice=choice))
    proxy[0].links = links if links or handoff.pairs is not None else {-1: handoff.link}
    return fleet, proxy[0]


def feed(fleet: Fleet, requests: list[Request], router) -> Fleet:
    """Trace arrivals into the fleet through `router` (a pool's router, or a proxy)."""
    fleet.arrivals = ArrivalProcess(fleet.env, requests, router)
    return fleet
