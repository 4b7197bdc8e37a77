"""Links that KV cache crosses between engines and memory tiers: bandwidth, latency, and occupancy.

A transfer of B bytes takes latency + B / bandwidth on its link. Transfers that share a link are
served one after another in the order they were started (a FIFO model of one NIC or PCIe lane
group): a transfer starts when the link is free, so a burst of hand-offs queues.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import isfinite


@dataclass(frozen=True)
class LinkSpec:
    """A link type: payload bandwidth in GB/s (1e9 bytes/s) and per-transfer latency in seconds."""
    name: str
    bandwidth_gb_s: float
    latency_s: float = 0.0

    def __post_init__(self):
        if not (isfinite(self.bandwidth_gb_s) and self.bandwidth_gb_s > 0):
            raise ValueError(f"link {self.name!r}: bandwidth_gb_s must be a positive number, got {self.bandwidth_gb_s!r}")
        if not (isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"link {self.name!r}: latency_s must be a non-negative number, got {self.latency_s!r}")

    def seconds(self, nbytes: float) -> float:
        """Time one transfer of `nbytes` takes on an idle link."""
        return self.latency_s + nbytes / (self.bandwidth_gb_s * 1e9)


class Link:
    """One link in use: transfers are served in order; counts bytes and busy time."""

    def __init__(self, spec: LinkSpec):
        self.spec = spec
        self.free_at = 0.0
        self.bytes_moved = 0.0
        self.busy_s = 0.0
        self.num_transfers = 0

    def reserve(self, now: float, nbytes: float) -> tuple[float, float]:
        """(start, end) of a transfer of `nbytes` asked for at `now`: it starts once the link is free."""
        start = max(now, self.free_at)
        duration = self.spec.seconds(nbytes)
        self.free_at = end = start + duration
        self.bytes_moved += nbytes
        self.busy_s += duration
        self.num_transfers += 1
        return start, end
