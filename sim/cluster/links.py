"""Links that KV cache crosses between engines and memory tiers: bandwidth, latency, and occupancy.

A transfer of B bytes takes latency + B / bandwidth on its link. Transfers that share a link are
served one after another in the order they were started (a FIFO model of one NIC or PCIe lane
group): a transfer starts when the link is free, so a burst of hand-offs queues.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import isfinite

from ..model.links import link_catalog, link_names


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


def get_link(name: str, *, bandwidth_gb_s: float | None = None, latency_s: float | None = None) -> LinkSpec:
    """The catalog's link type `name` (one GPU's link), its bandwidth or latency replaced where given."""
    entry = link_catalog().get(name)
    if entry is None:
        raise ValueError(f"unknown link {name!r}; known: {', '.join(link_names())}")
    return LinkSpec(name, entry["bandwidth_gb_s"] if bandwidth_gb_s is None else bandwidth_gb_s,
                    entry["latency_s"] if latency_s is None else latency_s)


def handoff_link(spec: LinkSpec, tp_prefill: int, tp_decode: int) -> LinkSpec:
    """The link between a prefill instance of TP `tp_prefill` and a decode instance of TP `tp_decode`:
    each GPU has its own link (a NIC per GPU, as in a DGX H100; NVLink per GPU) and NIXL moves each
    rank's KV shard over its own; when the TPs differ (re-sharding) the side with fewer GPUs serves or
    receives several shards over its links, so min(tp_prefill, tp_decode) links work in parallel."""
    lanes = min(tp_prefill, tp_decode)
    name = spec.name if lanes == 1 else f"{spec.name}x{lanes}"
    return LinkSpec(name, spec.bandwidth_gb_s * lanes, spec.latency_s)


def layerwise_seconds(spec: LinkSpec, nbytes: float, layers: int, overlap_s: float) -> float:
    """The exposed time of a layer-wise pushed transfer of `nbytes` over `layers` layers, `overlap_s` of
    which ran beside the compute that produced the KV (LMCache's and Mooncake's layer-wise push: layer l's
    KV moves while layer l+1 is prefilled): latency + max(0, T - overlap_s) + T / layers, T = bytes /
    bandwidth; at least one layer's transfer (the last layer's KV exists only when the prefill ends), at
    most the whole transfer (no overlap: the plain pull)."""
    t = nbytes / (spec.bandwidth_gb_s * 1e9)
    return spec.latency_s + min(t, max(0.0, t - overlap_s) + t / layers)


class Link:
    """One link in use: transfers are served in order; counts bytes and busy time."""

    def __init__(self, spec: LinkSpec):
        self.spec = spec
        self.free_at = 0.0
        self.bytes_moved = 0.0
        self.busy_s = 0.0
        self.num_transfers = 0

    def reserve(self, now: float, nbytes: float, seconds: float | None = None) -> tuple[float, float]:
        """(start, end) of a transfer of `nbytes` asked for at `now`: it starts once the link is free and
        takes `seconds` (default: the link's time for the bytes, `LinkSpec.seconds`)."""
        start = max(now, self.free_at)
        duration = self.spec.seconds(nbytes) if seconds is None else seconds
        self.free_at = end = start + duration
        self.bytes_moved += nbytes
        self.busy_s += duration
        self.num_transfers += 1
        return start, end
