"""The fleets `kvsim plan --disaggregated` searches: pool types, a role's pools, one fleet (FleetPoint)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolType:
    """One pool's hardware: GPU, TP degree and the price of one replica."""
    gpu: str
    tp: int
    usd_per_replica_hour: float

    @property
    def label(self) -> str:
        return f"{self.gpu} TP{self.tp}"


Pools = tuple[tuple[PoolType, int], ...]          # a role's pools: (type, replicas) each, in the role's type order


def _pools_usd(pools: Pools) -> float:
    usd = 0.0
    for i, (pool, n) in enumerate(pools):
        usd = n * pool.usd_per_replica_hour if i == 0 else usd + n * pool.usd_per_replica_hour
    return usd


def _pools_label(pools: Pools) -> str:
    return " + ".join(f"{n}x {pool.label}" for pool, n in pools)


@dataclass
class FleetPoint:
    """One fleet: its first prefill and decode pool (type, replicas), and with `--mixed-pools` the role's
    other pools (`more_prefill`, `more_decode`: (type, replicas) each, in the role's type order)."""
    model: str
    prefill: PoolType
    n_prefill: int
    decode: PoolType
    n_decode: int
    local: int = 0                 # conditional disaggregation threshold (0: every request disaggregated)
    row: dict | None = None
    implied: str = ""              # why it fails without a run
    more_prefill: Pools = ()
    more_decode: Pools = ()

    @property
    def prefill_pools(self) -> Pools:
        return ((self.prefill, self.n_prefill),) + self.more_prefill

    @property
    def decode_pools(self) -> Pools:
        return ((self.decode, self.n_decode),) + self.more_decode

    @property
    def mixed(self) -> bool:
        return bool(self.more_prefill or self.more_decode)

    @property
    def usd_per_hour(self) -> float:
        if not self.mixed:
            return self.n_prefill * self.prefill.usd_per_replica_hour + self.n_decode * self.decode.usd_per_replica_hour
        return _pools_usd(self.prefill_pools) + _pools_usd(self.decode_pools)

    @property
    def gpus(self) -> int:
        return sum(n * pool.tp for pool, n in self.prefill_pools + self.decode_pools)

    @property
    def key(self) -> tuple:
        base = (self.model, self.prefill, self.n_prefill, self.decode, self.n_decode, self.local)
        return base + (self.more_prefill, self.more_decode) if self.mixed else base

    @property
    def label(self) -> str:
        local = f", local prefill <= {self.local:,}" if self.local else ""
        return f"{_pools_label(self.prefill_pools)} prefill + {_pools_label(self.decode_pools)} decode{local}"

    def pool_names(self) -> str:
        """The pools as `kvsim simulate` names them: 'prefill-0 2x h100 TP1, prefill-1 ...; decode 1x h200 TP2'."""
        parts = []
        for role, pools in (("prefill", self.prefill_pools), ("decode", self.decode_pools)):
            parts.append(", ".join(f"{role if len(pools) == 1 else f'{role}-{i}'} {n}x {pool.label}"
                                   for i, (pool, n) in enumerate(pools)))
        return "; ".join(parts)

    def rank(self, objective: str = "usd") -> tuple:
        """The search's order: ($/hour, GPUs), or (GPUs, $/hour) for the gpus objective."""
        return (self.gpus, self.usd_per_hour) if objective == "gpus" else (self.usd_per_hour, self.gpus)

    @property
    def meets(self) -> bool:
        return bool(self.row and self.row.get("status") == "ok" and self.row.get("meets_slo"))


def point_of(key: tuple, row: dict | None = None) -> FleetPoint:
    """The FleetPoint of a search key (FleetPoint.key)."""
    return FleetPoint(*key[:6], row, "", *key[6:])
