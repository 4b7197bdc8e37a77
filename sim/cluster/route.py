"""A request's route through a fleet: the replicas it visited and the KV transfers made for it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Hop(NamedTuple):
    """A visit to one replica: its pool and role there, when it entered and when it left."""
    replica: int
    pool: str
    role: str
    enter_s: float
    leave_s: float


class Transfer(NamedTuple):
    """KV moved for the request: what (a load from a store, a prefill-to-decode hand-off), between
    which ends, how many tokens and bytes, when it started and ended on its link."""
    kind: str
    source: str
    destination: str
    num_tokens: int
    nbytes: float
    start_s: float
    end_s: float


@dataclass
class Route:
    hops: list[Hop] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)

    @property
    def transfer_s(self) -> float:
        """Seconds the request's KV spent on links (summed)."""
        return sum(t.end_s - t.start_s for t in self.transfers)


def route_of(req) -> Route:
    """The request's route, made on first use."""
    if req.route is None:
        req.route = Route()
    return req.route
