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

Below the CPU, LMCache's backends (lmcache/v1/storage_backend/storage_manager.py: `batched_put`,
`get_block_mapping`, `batched_get`): a local disk per replica and a remote store shared by the fleet
(`LowerTier`). A block stored in CPU is written through to each of them when its copy to the CPU ends
(`batched_put` puts to every backend), over the tier's own link; it is readable there once that write
ends. A lookup is LMCache's prefix match across backends: the CPU's leading hits, then the next
backend's leading hits among the remaining blocks, and so on. A block loaded from disk or the remote
store crosses that tier's read link, then the host-to-device link; one read from the remote store is
written back to the CPU (`batched_get`'s write-back). The unit stored is `kv_offload.chunk_tokens`
tokens (LMCache: 256; vLLM's OffloadingConnector: the GPU block).

LMCache's own connector (`kv_offload.connector: lmcache`, LMCacheConnectorV1 without layer-wise mode) moves
KV inside the step instead of beside it: a prefix hit is loaded before the forward that computes the rest of
the prompt (`get_num_new_matched_tokens` returns (tokens, False): the request is scheduled at once and the
step waits for the load: `start_load_kv`), and the chunks a step fills are saved at its end before the next
one starts (`wait_for_save`); both add their link time to the step (`KVTransferStep`), so they slow every
request in the batch, not only the one loading.

Simplifications (what differs from vLLM, and why it matters little here): only prompt blocks are stored
(a trace names content by prompt ids only, so generated blocks can never be hit by another request; their
copies would add device-to-host traffic, small for short answers); a block is the GPU block (vLLM's
default offloaded block size); the tier's copies of blocks in flight are reserved when the copy starts.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pandas as pd

from ...core.connector import FinishedTransfers, KVTransferStep
from ...kv.build import stored_token_bytes_ratio

from ..links import Link
from ..route import Transfer, route_of
from ..links import LinkSpec, get_link
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


class LMCacheCPUWork(NamedTuple):
    """LMCache's connector (`kv_offload.connector: lmcache`: loads and saves inside the step) and its CPU work there,
    per token and chunk (0: none): hashing tokens (its ChunkedTokenDatabase chains a
    hash over each 256-token chunk from the first token, at every lookup and every save) and allocating and
    putting each saved chunk into its CPU backend. Sources and figures: docs/kv-tiers.md#lmcaches-cpu-work."""
    hash_s_per_token: float
    put_s_per_chunk: float


class LowerTier(NamedTuple):
    """A tier behind the CPU as one replica reaches it: the tier (a disk of its own, or the store every
    replica shares), the links it is written and read over, and whether a block read from it is written
    back to the CPU (LMCache does so for remote reads)."""
    tier: BlockTier
    write: Link
    read: Link
    write_back: bool = False


class OffloadingConnector:
    """One replica's CPU offloading (sim/core/connector.py's protocol): its tier, and the PCIe link of
    its GPU in each direction (`to_tier`: device to host, stores; `from_tier`: host to device, loads);
    `lower`: the disk and remote tiers behind the CPU, in LMCache's order."""

    def __init__(self, tier: BlockTier, to_tier: Link, from_tier: Link, block_size: int,
                 clock: Callable[[], float], name: str = "replica", lower: tuple[LowerTier, ...] = (),
                 lmcache: LMCacheCPUWork | None = None):
        self.tier, self.to_tier, self.from_tier = tier, to_tier, from_tier
        self.lower = lower
        self.in_step = lmcache is not None  # LMCache's connector: loads and saves inside the step (see the module doc)
        self.cpu_work = lmcache            # ... and its hashing and puts, in the step
        self._step_lookup_cpu_s = 0.0      # this step's lookups' hashing (before its forward)
        self.cpu_s = 0.0                   # LMCache's CPU work over the run (summed)
        self.occupancy: list[tuple] = []   # (time, blocks held per tier: CPU, then the lower tiers), sampled
        self._next_sample_s = 0.0
        self._step_load_s = 0.0
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
        self._loading_lower: dict = {}     # request -> [(LowerTier, keys)] it reads from disk or remote
        self.blocks_written_back = 0       # remote reads kept in this replica's CPU
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
        if len(keys) >= n:
            return keys[:n]
        if req.prefix_hash_ids is None:        # every block the request's own (block_key's last case), inlined
            h, rid = keys[-1] if keys else None, req.request_id
            for j in range(len(keys), n):
                h = hash((h, ("req", rid, j)))
                keys.append(h)
            return keys[:n]
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
        keys = self.block_hashes(req, limit)[first:]
        now = self.clock() if self.lower else float("-inf")
        hits = self.tier.lookup(keys, now)
        for path in self.lower:            # LMCache's prefix match: each backend gets the rest
            if hits == len(keys):
                break
            hits += path.tier.lookup(keys[hits:], now)
        return hits * bs, hits > 0 and not self.in_step

    def update_state_after_alloc(self, req, num_external_tokens: int) -> None:
        # called once per admitted request (not per schedule that tried it): the lookup counted here
        self.num_queried_tokens += req.num_tokens - (req.num_computed_tokens - num_external_tokens)
        self.num_hit_tokens += num_external_tokens
        if self.cpu_work is not None:      # LMCache's lookup hashes the whole prompt's chunks, hit or miss
            cpu = self.cpu_work.hash_s_per_token * req.num_tokens
            self._step_lookup_cpu_s += cpu
            self.cpu_s += cpu
        if not num_external_tokens:
            return
        bs = self.block_size
        first = (req.num_computed_tokens - num_external_tokens) // bs      # after the GPU prefix hits
        keys = self.block_hashes(req, first + num_external_tokens // bs)[first:]
        now = self.clock()
        if self.lower:
            in_cpu = self.tier.lookup(keys, now)
            keys, end = keys[:in_cpu], self._load_lower(req, keys[in_cpu:], now)
        else:
            end = now
        if keys:
            self.tier.prepare_load(keys)
            nbytes = len(keys) * self.tier.spec.bytes_per_block
            start, cpu_end = self.from_tier.reserve(now, nbytes)
            route_of(req).transfers.append(Transfer("load", self.tier.spec.name, self.name, len(keys) * bs, nbytes,
                                                    start, cpu_end))
            end = max(end, cpu_end)
        self._next_stored[req] = first + num_external_tokens // bs     # loaded blocks are not stored again
        self.load_s += end - now
        self.num_loads += 1
        if self.in_step:                   # read before this step's forward, which waits for it
            self._step_load_s = max(self._step_load_s, end - now)
            self._loads_done(req, keys)
            return
        self._loading[req] = keys
        self._loads.add(end, req)

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
        if self.in_step:
            return self._step_transfers()
        return None                                     # nothing the step itself waits for

    def _step_transfers(self) -> KVTransferStep | None:
        """LMCache's in-step transfers: this step's loads (the longest: they share the host link, whose
        queue the reservations already hold), then the saves of the chunks it fills at its end."""
        now, save_s, cpu_s = self.clock(), 0.0, 0.0
        pending, self._pending = self._pending, []
        work = self.cpu_work
        for req, keys in pending:
            new = self.tier.prepare_store(keys)
            self._storing.pop(req, None)
            if work is not None:           # the save hashes the request's chunks up to what it saves, from token 0
                cpu_s += work.hash_s_per_token * self._next_stored.get(req, len(keys)) * self.block_size \
                    + work.put_s_per_chunk * len(new or ())
            if not new:
                continue
            end = self._copy_to_tier(req, new, now)
            save_s = max(save_s, end - now)
            self.tier.complete_store(new)
            if self.lower:
                self._write_through(new, end)
        load_s, self._step_load_s = self._step_load_s, 0.0
        if work is not None:               # CPU work on the worker's thread, beside no transfer: it adds
            lookup_s, self._step_lookup_cpu_s = self._step_lookup_cpu_s, 0.0
            load_s, save_s = load_s + lookup_s, save_s + cpu_s
            self.cpu_s += cpu_s
        return KVTransferStep(load_s=load_s, save_s=save_s) if load_s or save_s else None

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
        if now >= self._next_sample_s:
            self._sample(now)
        sent: list = []
        if self._pending:
            self._start_stores(now, sent)
        for req, keys, end in self._stores.done(now):
            self.tier.complete_store(keys)
            if self.lower:
                self._write_through(keys, end)
            self._store_done(req, sent)
        received = self._loads.done(now)
        for req in received:
            self._loads_done(req, self._loading.pop(req))
        return FinishedTransfers(received, sent)

    def _sample(self, now: float) -> None:
        """The tiers' blocks held at each whole OCCUPANCY_SAMPLE_S since the last poll, taken before this
        poll changes them: a replica's tiers change only when it polls (a step end or a transfer's end,
        then its schedule), so they held this much at every such instant, however seldom the replica polled
        (a decode run polls once, at its end). The shared remote store records its own (`BlockTier.record_occupancy`)."""
        held = (len(self.tier), *(len(path.tier) for path in self.lower))
        first, last = round(self._next_sample_s / OCCUPANCY_SAMPLE_S), int(now // OCCUPANCY_SAMPLE_S)
        self.occupancy.extend((i * OCCUPANCY_SAMPLE_S, *held) for i in range(first, last + 1))
        self._next_sample_s = (last + 1) * OCCUPANCY_SAMPLE_S

    def _loads_done(self, req, cpu_keys: list) -> None:
        self.tier.complete_load(cpu_keys)
        for path, keys in self._loading_lower.pop(req, ()):
            path.tier.complete_load(keys)
            if path.write_back:
                self._write_back(keys)

    # ----- the tiers behind the CPU (LMCache's disk and remote backends) --------------------------
    def _load_lower(self, req, keys: list, now: float) -> float:
        """Pin and read `keys` (those the CPU lacks) from the lower tiers in LMCache's prefix order: each
        segment crosses its tier's read link, then the host-to-device link. When the last one ends."""
        end, bs = now, self.block_size
        for path in self.lower:
            if not keys:
                break
            n = path.tier.lookup(keys, now)
            segment, keys = keys[:n], keys[n:]
            if not segment:
                continue
            path.tier.prepare_load(segment, now)
            nbytes = len(segment) * path.tier.spec.bytes_per_block
            start, read_end = path.read.reserve(now, nbytes)
            _, seg_end = self.from_tier.reserve(read_end, nbytes)
            route_of(req).transfers.append(Transfer("load", path.tier.spec.name, self.name, len(segment) * bs,
                                                    nbytes, start, seg_end))
            self._loading_lower.setdefault(req, []).append((path, segment))
            end = max(end, seg_end)
        assert not keys, f"{self.name}: {len(keys)} blocks offered that no tier holds"
        return end

    def _write_through(self, keys: list, stored_s: float) -> None:
        """LMCache's batched_put: blocks now in CPU are written to every lower tier, each over its own
        link from when the copy to the CPU ended."""
        for path in self.lower:
            if path.write_back:            # a store the replicas share: its occupancy is its own record
                path.tier.record_occupancy(self.clock(), OCCUPANCY_SAMPLE_S)
            new = path.tier.place(keys)
            if new:
                _, end = path.write.reserve(stored_s, len(new) * path.tier.spec.bytes_per_block)
                path.tier.ready_at(new, end)

    def _write_back(self, keys: list) -> None:
        """A remote read lands in CPU memory and stays there (LMCache's write-back to the local CPU)."""
        new = self.tier.prepare_store(keys)
        if new:
            self.tier.complete_store(new)
            self.blocks_written_back += len(new)

    def _start_stores(self, now: float, sent: list) -> None:
        pending, self._pending = self._pending, []
        for req, keys in pending:
            new = self.tier.prepare_store(keys)
            if not new:
                self._store_done(req, sent)
                continue
            end = self._copy_to_tier(req, new, now)
            self._stores.add(end, (req, new, end))

    def _copy_to_tier(self, req, keys: list, now: float) -> float:
        """`keys`' device-to-host copy on the replica's link from `now`, on the request's route; when it ends."""
        nbytes = len(keys) * self.tier.spec.bytes_per_block
        start, end = self.to_tier.reserve(now, nbytes)
        route_of(req).transfers.append(Transfer("store", self.name, self.tier.spec.name, len(keys) * self.block_size,
                                                nbytes, start, end))
        return end

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
        pinned = sum(state >> 1 for state in self.tier.blocks.values() if state & 1)     # (tiers.READY)
        assert pinned == loading, f"{self.name}: {pinned} tier pins for {loading} blocks being loaded"
        for path in self.lower:
            path.tier.check_invariants()


LMCACHE_CHUNK_TOKENS = 256      # LMCache's default chunk_size
OCCUPANCY_SAMPLE_S = 1.0        # tiers.parquet: the tiers at every whole simulated second


def offload_unit(offload, plan) -> int:
    """Tokens per offloaded block: `kv_offload.chunk_tokens`, else LMCache's chunk (its connector) or the
    GPU block (vLLM's OffloadingConnector)."""
    if offload.chunk_tokens:
        return offload.chunk_tokens
    return LMCACHE_CHUNK_TOKENS if offload.connector == "lmcache" else plan.cfg.engine.block_size


def offload_block_bytes(offload, plan) -> float:
    """Bytes of one offloaded block as it is copied off the GPU: its tokens x the KV bytes per token at the
    run's KV dtype (the cost model's) x the share the KV policy writes them at (a mixed-precision policy's
    quantized tokens: sim.kv.build.stored_token_bytes_ratio; 1 for the plain cache). Both the tiers'
    capacities and the bytes their links move follow it."""
    ratio = stored_token_bytes_ratio(plan.cfg.kv, plan.cost.model, plan.policy)
    return plan.cost.kv_bytes_per_token * offload_unit(offload, plan) * ratio


def cpu_tier_spec(offload, plan) -> TierSpec:
    """The CPU tier of one replica of `plan` from the config's `kv_offload` section (resolved once): its
    capacity in offloaded blocks at the run's KV dtype, and its PCIe link (the GPU's per-direction
    bandwidth x the profile's pcie_eff, one link per TP rank, unless `bandwidth_gb_s` is given)."""
    bytes_per_block = offload_block_bytes(offload, plan)
    bandwidth = offload.bandwidth_gb_s or plan.gpu.pcie_gbps * plan.cost.profile.pcie_eff * plan.cfg.tp
    capacity = _capacity_blocks(offload.cpu_gib, bytes_per_block, "cpu_gib")
    return TierSpec("cpu", capacity, bytes_per_block, LinkSpec("pcie", bandwidth, offload.latency_s), offload.eviction)


def lower_tier_specs(offload, plan) -> tuple[TierSpec, ...]:
    """The tiers behind each replica's CPU that the config names, in LMCache's order: a local disk per
    replica (its write and read bandwidths), then a remote store the replicas share (`remote_gib` in
    all), reached over each GPU's NIC (one per TP rank, as a DGX has)."""
    bytes_per_block = offload_block_bytes(offload, plan)
    specs = []
    if offload.disk_gib:
        specs.append(TierSpec("disk", _capacity_blocks(offload.disk_gib, bytes_per_block, "disk_gib"), bytes_per_block,
                              LinkSpec("disk-write", offload.disk_write_gb_s, offload.disk_latency_s), offload.eviction,
                              read_link=LinkSpec("disk-read", offload.disk_read_gb_s, offload.disk_latency_s)))
    if offload.remote_gib:
        nic = get_link(offload.remote_link, bandwidth_gb_s=offload.remote_bandwidth_gb_s,
                       latency_s=offload.remote_latency_s)
        link = LinkSpec(nic.name, nic.bandwidth_gb_s * plan.cfg.tp, nic.latency_s)
        specs.append(TierSpec("remote", _capacity_blocks(offload.remote_gib, bytes_per_block, "remote_gib"),
                              bytes_per_block, link, offload.eviction))
    return tuple(specs)


def _capacity_blocks(gib: float, bytes_per_block: float, field: str) -> int:
    capacity = int(gib * 2**30 // bytes_per_block)
    if capacity < 1:
        raise ValueError(f"kv_offload.{field}: {gib:g} GiB holds no KV block of {bytes_per_block / 2**20:g} MiB; "
                         "expected at least that much")
    return capacity


def offload_connectors(spec: TierSpec, block_size: int, lower: tuple[TierSpec, ...] = (),
                       lmcache: LMCacheCPUWork | None = None) -> Callable:
    """build_engine's `connector(index, clock)`: each replica its own CPU tier and PCIe link pair, its own
    disk, and the remote store every replica shares (each over its own links); `lmcache`: LMCache's
    connector (loads and saves inside the step) with its CPU work. The connectors made are kept in the returned callable's
    `.made` list (for the run's summary)."""
    made: list[OffloadingConnector] = []
    shared = {s.name: BlockTier(s) for s in lower if s.name == "remote"}

    def make(index: int, clock) -> OffloadingConnector:
        paths = tuple(LowerTier(shared[s.name] if s.name in shared else BlockTier(s), Link(s.link),
                                Link(s.read_link or s.link), write_back=s.name in shared) for s in lower)
        conn = OffloadingConnector(BlockTier(spec), Link(spec.link), Link(spec.link), block_size,
                                   lambda: clock.now, name=f"replica{index}", lower=paths, lmcache=lmcache)
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
        **({"lmcache_cpu_s": sum(c.cpu_s for c in connectors)} if connectors[0].cpu_work is not None else {}),
        **({"lower_tiers": lower_tier_summary(connectors)} if connectors[0].lower else {}),
    }


def distinct_tiers(connectors: list[OffloadingConnector], level: int) -> list[BlockTier]:
    """The tiers at `level` (0: the CPU, then the lower tiers in order) over the replicas, each once: one per
    replica, or the one store they share."""
    at = [c.tier if level == 0 else c.lower[level - 1].tier for c in connectors]
    return list({id(t): t for t in at}.values())


def lower_tier_summary(connectors: list[OffloadingConnector]) -> dict:
    """Per tier behind the CPU (disk: summed over the replicas' own; remote: the one shared store), in
    blocks of `chunk_tokens`: capacity, stored (written through), loaded (read on a prefix hit), evicted,
    dropped, held at the end, and bytes written and read over the replicas' links."""
    out = {}
    for i, path in enumerate(connectors[0].lower):
        name = path.tier.spec.name
        paths = [c.lower[i] for c in connectors]
        tiers = distinct_tiers(connectors, i + 1)
        out[name] = {
            "capacity_blocks": sum(t.capacity for t in tiers), "shared": len(tiers) == 1 and len(paths) > 1,
            "blocks_stored": sum(t.stats.blocks_stored for t in tiers),
            "blocks_loaded": sum(t.stats.blocks_loaded for t in tiers),
            "blocks_evicted": sum(t.stats.blocks_evicted for t in tiers),
            "stores_dropped_blocks": sum(t.stats.stores_dropped for t in tiers),
            "blocks_held": sum(len(t) for t in tiers),
            "bytes_written": sum(p.write.bytes_moved for p in paths),
            "bytes_read": sum(p.read.bytes_moved for p in paths),
            "write_gb_s": path.write.spec.bandwidth_gb_s, "read_gb_s": path.read.spec.bandwidth_gb_s,
            **({"blocks_written_back_to_cpu": sum(c.blocks_written_back for c in connectors)} if path.write_back else {}),
        }
    return out


def tier_occupancy(connectors: list[OffloadingConnector]) -> pd.DataFrame:
    """tiers.parquet: per second of simulated time and tier, the blocks held at the second's end (the last
    second's: at the end of the run), from each replica's record of its tiers at every whole second
    (`OffloadingConnector._sample`; CPU and disk summed over the replicas) and the shared remote store's own
    record (`BlockTier.record_occupancy`, counted once), and the tier's capacity, in blocks of
    `chunk_tokens`."""
    first = connectors[0]
    names = [first.tier.spec.name, *(p.tier.spec.name for p in first.lower)]
    levels = [distinct_tiers(connectors, j) for j in range(len(names))]
    shared = [len(tiers) == 1 for tiers in levels]     # one store for every replica: its occupancy once
    end = max((c.occupancy[-1][0] for c in connectors if c.occupancy), default=0.0)
    seconds = np.arange(int(end // OCCUPANCY_SAMPLE_S) + 1) * OCCUPANCY_SAMPLE_S
    held = np.zeros((len(seconds), len(names)))
    for c in connectors:
        if not c.occupancy:
            continue
        now = (len(c.tier), *(len(path.tier) for path in c.lower))
        values = _at_second_ends(c.occupancy, now, seconds)
        for j in range(len(names)):
            held[:, j] = np.maximum(held[:, j], values[:, j]) if shared[j] else held[:, j] + values[:, j]
    for j, tiers in enumerate(levels):
        if shared[j] and tiers[0].occupancy:      # a store the replicas share: what it held, from its own record
            held[:, j] = _at_second_ends(tiers[0].occupancy, (len(tiers[0]),), seconds)[:, 0]
    capacity = [sum(t.capacity for t in tiers) for tiers in levels]
    return pd.DataFrame({"time_s": np.repeat(seconds, len(names)), "tier": names * len(seconds),
                         "blocks_held": held.reshape(-1).astype(np.int64),
                         "capacity_blocks": np.tile(capacity, len(seconds)).astype(np.int64)})


def _at_second_ends(records: list, now: tuple, seconds: np.ndarray) -> np.ndarray:
    """Blocks held at the end of each of `seconds` from `records` ((whole second, blocks...) up to the
    last change) and `now` (held since the last change: after the last recorded second)."""
    samples = np.asarray(records, dtype=np.float64)
    final = np.array([[samples[-1, 0] + OCCUPANCY_SAMPLE_S / 2, *now]])
    samples = np.concatenate((samples, final))
    last = np.searchsorted(samples[:, 0], seconds + OCCUPANCY_SAMPLE_S, side="right") - 1
    return np.where(last[:, None] >= 0, samples[np.maximum(last, 0), 1:], 0.0)
