"""CPU offloading as vLLM's OffloadingConnector runs it (one connector per replica, its own CPU tier).

Read from vLLM (vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py, the scheduler side
`OffloadingConnectorScheduler`, and vllm/v1/kv_offload/lru_manager.py):

- What is stored: every *full* block of a scheduled request, identified by its block hash. At each
  schedule (`build_connector_meta` -> `_get_reqs_to_store`) the blocks that the step fills
  (num_computed_tokens + the step's new tokens, in whole blocks, from the request's next unstored
  block) are queued for store; blocks the tier already holds are skipped (`prepare_store`). A
  preempted request starts over from block 0.
- When: asynchronously. The worker copies GPU -> CPU after the step's forward on its own stream; the
  blocks become visible to lookups when the copy ends (`complete_store`). Here a step's stores start
  on the replica's device-to-host PCIe link at the step's end and the tier marks them ready when their
  transfer ends. A request that finishes while its blocks are still being copied keeps them
  (`request_finished` returns True: vLLM's delay-free) until the copy ends.
- When the tier is full: the least recently used blocks no load is reading are evicted; if that cannot
  make room the store is dropped (`prepare_store` returns None).
- Loads: at admission, after the GPU prefix-cache hits, the connector looks up the following blocks in
  the tier (`lookup`: the leading ready ones) and offers them as external tokens loaded
  asynchronously (`get_num_new_matched_tokens` returns (tokens, True)): the request waits in
  WAITING_FOR_REMOTE_KVS holding its blocks while they cross the host-to-device link, then computes
  the rest of its prompt (the last prompt token always recomputed, for its logits).

Simplifications (what differs from vLLM, and why it matters little here): only prompt blocks are stored
(a trace names content by prompt ids only, so generated blocks can never be hit by another request; their
copies would add device-to-host traffic, small for short answers); a block is the GPU block (vLLM's
default offloaded block size); the tier's copies of blocks in flight are reserved when the copy starts.
"""
from __future__ import annotations

from collections.abc import Callable

from ...core.connector import FinishedTransfers, KVTransferStep

from ..links import Link
from ..route import Transfer, route_of
from ..links import LinkSpec
from ..tiers import BlockTier, TierSpec
from .in_flight import InFlight


def block_key(req, j: int, block_size: int) -> tuple:
    """What fills block j of the request's prompt, as the KV manager keys it (sim/core/kv_manager.py):
    the trace's prefix ids covering its tokens, or the request itself where they do not."""
    start, end = j * block_size, (j + 1) * block_size
    ids, span = req.prefix_hash_ids, req.prefix_block_tokens
    if ids is not None and span and end <= req.prompt_tokens and (end - 1) // span < len(ids):
        return (tuple(ids[start // span:(end - 1) // span + 1]), start % span)
    return ("req", req.request_id, j)


class OffloadingConnector:
    """One replica's CPU offloading (sim/core/connector.py's protocol): its tier, and the PCIe link of
    its GPU in each direction (`to_tier`: device to host, stores; `from_tier`: host to device, loads)."""

    def __init__(self, tier: BlockTier, to_tier: Link, from_tier: Link, block_size: int,
                 clock: Callable[[], float], name: str = "replica"):
        self.tier, self.to_tier, self.from_tier = tier, to_tier, from_tier
        self.block_size = block_size
        self.clock = clock
        self.name = name
        self._keys: dict = {}              # request -> its block hashes so far (a chain, as vLLM's)
        self._next_stored: dict = {}       # request -> its first block not yet queued for store
        self._pending: list = []           # (request, keys) queued at a schedule, started at the step's end
        self._storing: dict = {}           # request -> its stores queued or in flight
        self._finished: set = set()        # finished requests whose blocks wait for their stores
        self._stores = InFlight()
        self._loads = InFlight()
        self._loading: dict = {}           # request -> the keys it loads
        self.num_queried_tokens = 0        # vLLM: external prefix cache queries / hits (tokens)
        self.num_hit_tokens = 0
        self.load_s = 0.0                  # seconds requests waited for their loads (summed)
        self.num_loads = 0

    # ----- keys -------------------------------------------------------------------------------------
    def block_hashes(self, req, n: int) -> list:
        """The first `n` block hashes of `req` (chained: a block's hash covers the blocks before it)."""
        keys = self._keys.get(req)
        if keys is None:
            keys = self._keys[req] = []
        bs = self.block_size
        while len(keys) < n:
            keys.append(hash((keys[-1] if keys else None, block_key(req, len(keys), bs))))
        return keys[:n]

    # ----- the scheduler side (sim/core/connector.py) -----------------------------------------------
    def get_num_new_matched_tokens(self, req, num_computed_tokens: int) -> tuple[int | None, bool]:
        bs = self.block_size
        first = num_computed_tokens // bs
        limit = (req.num_tokens - 1) // bs            # the last token is recomputed: never a full hit
        if limit <= first:
            return 0, False
        hits = self.tier.lookup(self.block_hashes(req, limit)[first:])
        return hits * bs, hits > 0

    def update_state_after_alloc(self, req, num_external_tokens: int) -> None:
        # called once per admitted request (not per schedule that tried it): the lookup counted here
        self.num_queried_tokens += req.num_tokens - (req.num_computed_tokens - num_external_tokens)
        self.num_hit_tokens += num_external_tokens
        if not num_external_tokens:
            return
        bs = self.block_size
        first = (req.num_computed_tokens - num_external_tokens) // bs      # after the GPU prefix hits
        keys = self.block_hashes(req, first + num_external_tokens // bs)[first:]
        self.tier.prepare_load(keys)
        now = self.clock()
        nbytes = len(keys) * self.tier.spec.bytes_per_block
        start, end = self.from_tier.reserve(now, nbytes)
        route_of(req).transfers.append(Transfer("load", self.tier.spec.name, self.name, len(keys) * bs, nbytes,
                                                start, end))
        self._loading[req] = keys
        self._next_stored[req] = first + len(keys)     # loaded blocks are not stored again
        self._loads.add(end, req)
        self.load_s += end - now
        self.num_loads += 1

    def build_connector_meta(self, out) -> KVTransferStep | None:
        for req in out.preempted:
            self._next_stored[req] = 0
        bs = self.block_size
        for s in out.scheduled:
            req = s.request
            full = min(req.num_computed_tokens + s.num_new_tokens, req.prompt_tokens) // bs
            first = self._next_stored.get(req, 0)
            if full > first:
                self._next_stored[req] = full
                self._pending.append((req, self.block_hashes(req, full)[first:]))
                self._storing[req] = self._storing.get(req, 0) + 1
        return None                                     # nothing the step itself waits for

    def request_finished(self, req) -> bool:
        self._keys.pop(req, None)
        self._next_stored.pop(req, None)
        if self._storing.get(req):
            self._finished.add(req)
            return True
        return False

    def keeps_blocks_at_finish(self, req) -> bool:
        """request_finished's answer now (sim.core.connector.FinishAwareConnector): True while a store of the
        request's blocks is queued or copying; it changes only when the connector is polled (a store
        starts or ends: `get_finished`), never inside a decode run."""
        return bool(self._storing.get(req))

    def get_finished(self, now: float) -> FinishedTransfers:
        sent: list = []
        if self._pending:
            self._start_stores(now, sent)
        for req, keys in self._stores.done(now):
            self.tier.complete_store(keys)
            self._store_done(req, sent)
        received = self._loads.done(now)
        for req in received:
            self.tier.complete_load(self._loading.pop(req))
        return FinishedTransfers(received, sent)

    def _start_stores(self, now: float, sent: list) -> None:
        pending, self._pending = self._pending, []
        for req, keys in pending:
            new = self.tier.prepare_store(keys)
            if not new:
                self._store_done(req, sent)
                continue
            nbytes = len(new) * self.tier.spec.bytes_per_block
            start, end = self.to_tier.reserve(now, nbytes)
            route_of(req).transfers.append(Transfer("store", self.name, self.tier.spec.name,
                                                    len(new) * self.block_size, nbytes, start, end))
            self._stores.add(end, (req, new))

    def _store_done(self, req, sent: list) -> None:
        left = self._storing[req] - 1
        if left:
            self._storing[req] = left
            return
        del self._storing[req]
        if req in self._finished:
            self._finished.discard(req)
            sent.append(req)

    def next_completion(self) -> float:
        if self._pending:
            return self.clock()          # stores start at the step's end: the next poll
        return min(self._loads.next_end(), self._stores.next_end())

    def check_invariants(self) -> None:
        self.tier.check_invariants()
        loading = sum(len(k) for k in self._loading.values())
        pinned = sum(b.ref_cnt for b in self.tier.blocks.values() if b.ready)
        assert pinned == loading, f"{self.name}: {pinned} tier pins for {loading} blocks being loaded"


def cpu_tier_spec(offload, plan) -> TierSpec:
    """The CPU tier of one replica of `plan` from the config's `kv_offload` section (resolved once): its
    capacity in GPU-sized blocks at the run's KV dtype, and its PCIe link (the GPU's per-direction
    bandwidth x the profile's pcie_eff, one link per TP rank, unless `bandwidth_gb_s` is given)."""
    block_size = plan.cfg.engine.block_size
    bytes_per_block = plan.cost.kv_bytes_per_token * block_size
    bandwidth = offload.bandwidth_gb_s or plan.gpu.pcie_gbps * plan.cost.profile.pcie_eff * plan.cfg.tp
    capacity = int(offload.cpu_gib * 2**30 // bytes_per_block)
    if capacity < 1:
        raise ValueError(f"kv_offload.cpu_gib: {offload.cpu_gib:g} GiB holds no KV block of "
                         f"{bytes_per_block / 2**20:g} MiB; expected at least that much")
    return TierSpec("cpu", capacity, bytes_per_block, LinkSpec("pcie", bandwidth, offload.latency_s), offload.eviction)


def offload_connectors(spec: TierSpec, block_size: int) -> Callable:
    """build_engine's `connector(index, clock)`: each replica its own CPU tier and PCIe link pair;
    the connectors made are kept in the returned callable's `.made` list (for the run's summary)."""
    made: list[OffloadingConnector] = []

    def make(index: int, clock) -> OffloadingConnector:
        conn = OffloadingConnector(BlockTier(spec), Link(spec.link), Link(spec.link), block_size,
                                   lambda: clock.now, name=f"replica{index}")
        made.append(conn)
        return conn
    make.made = made        # type: ignore[attr-defined]  # the run's summary reads the connectors it made
    return make


def offload_summary(connectors: list[OffloadingConnector]) -> dict:
    """summary.json's `kv_offload`: the tiers' figures over all replicas (vLLM's names where vLLM has them:
    external_prefix_cache_queries/hits, in tokens)."""
    queried = sum(c.num_queried_tokens for c in connectors)
    hit = sum(c.num_hit_tokens for c in connectors)
    loads = sum(c.num_loads for c in connectors)
    spec = connectors[0].tier.spec
    return {
        "tier": spec.name, "capacity_blocks_per_replica": spec.capacity_blocks,
        "bytes_per_block": spec.bytes_per_block, "link_gb_s": spec.link.bandwidth_gb_s,
        "external_prefix_cache_queries": queried, "external_prefix_cache_hits": hit,
        "external_prefix_cache_hit_rate": hit / queried if queried else 0.0,
        "blocks_stored": sum(c.tier.stats.blocks_stored for c in connectors),
        "blocks_loaded": sum(c.tier.stats.blocks_loaded for c in connectors),
        "blocks_evicted": sum(c.tier.stats.blocks_evicted for c in connectors),
        "stores_dropped_blocks": sum(c.tier.stats.stores_dropped for c in connectors),
        "bytes_to_tier": sum(c.to_tier.bytes_moved for c in connectors),
        "bytes_from_tier": sum(c.from_tier.bytes_moved for c in connectors),
        "num_loads": loads,
        "mean_load_wait_s": sum(c.load_s for c in connectors) / loads if loads else 0.0,
    }
