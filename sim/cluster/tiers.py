"""KV memory tiers below the GPU's HBM: CPU DRAM (vLLM's OffloadingConnector), local disk and a remote
store (LMCache's backends behind the CPU: docs/kv-tiers.md#disk-and-remote-tiers). A tier holds KV blocks by content hash, with a capacity in blocks, a link
that prices reading and writing them (bandwidth, latency: sim/cluster/links.py), and an eviction order.

The block lifecycle follows vLLM's offloading manager (vllm/v1/kv_offload/lru_manager.py,
`LRUOffloadingManager`):

- `prepare_store(keys)`: keys already held are skipped; room for the rest is made by evicting the least
  recently used blocks that no load is reading (ref_cnt 0); when not enough can be evicted the store is
  dropped (None), as vLLM's manager does. The new blocks occupy capacity at once but are not *ready*
  (a lookup does not see them) until `complete_store`, when their transfer has ended.
- `lookup(keys)`: the number of leading keys held and ready (a prefix hit stops at the first miss).
- `prepare_load(keys)` pins the blocks (ref_cnt + 1) until `complete_load`, and marks them recently used.

A tier written through from the CPU (disk, remote) places blocks with the time their write ends
(`place`, then `ready_at`): a lookup at `now` sees them from then on, so a replica sees another's
writes to a shared store at the right time whether or not that replica has polled since.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from math import isfinite

from .links import LinkSpec

EVICTION_ORDERS = ("lru",)


@dataclass(frozen=True)
class TierSpec:
    """A tier resolved for one replica: its name, capacity in KV blocks, the bytes of one block, the
    link blocks cross to and from it, and its eviction order."""
    name: str
    capacity_blocks: int
    bytes_per_block: float
    link: LinkSpec
    eviction: str = "lru"
    read_link: LinkSpec | None = None     # reads, where they differ from writes (a disk); None: `link`

    def __post_init__(self):
        if self.capacity_blocks < 1:
            raise ValueError(f"tier {self.name!r}: capacity must hold at least one KV block "
                             f"({self.bytes_per_block:g} bytes), got {self.capacity_blocks} blocks")
        if not (isfinite(self.bytes_per_block) and self.bytes_per_block > 0):
            raise ValueError(f"tier {self.name!r}: bytes_per_block must be a positive number, got {self.bytes_per_block!r}")
        if self.eviction not in EVICTION_ORDERS:
            raise ValueError(f"tier {self.name!r}: eviction must be one of {', '.join(EVICTION_ORDERS)}, "
                             f"got {self.eviction!r}")


class _Block:
    __slots__ = ("ready", "ref_cnt", "ready_at")

    def __init__(self, ref_cnt: int = 1):
        self.ready = False
        self.ref_cnt = ref_cnt    # a block being stored cannot be evicted (vLLM: ref_cnt 1 until stored)
        self.ready_at = float("inf")   # a written-through block: readable from this time on

    def readable(self, now: float) -> bool:
        return self.ready or self.ready_at <= now


@dataclass
class TierStats:
    """Counters of one tier, in blocks."""
    blocks_stored: int = 0        # stores completed
    blocks_loaded: int = 0
    blocks_evicted: int = 0
    stores_dropped: int = 0       # blocks a full tier could not take (every block pinned)


class BlockTier:
    """The blocks one tier holds, in LRU order (oldest first)."""

    def __init__(self, spec: TierSpec):
        self.spec = spec
        self.capacity = spec.capacity_blocks
        self.blocks: OrderedDict = OrderedDict()
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self.blocks)

    def lookup(self, keys: list, now: float = float("-inf")) -> int:
        """Leading `keys` held and ready (a written-through block: written by `now`)."""
        n = 0
        for key in keys:
            block = self.blocks.get(key)
            if block is None or not (block.ready or block.ready_at <= now):
                break
            n += 1
        return n

    def prepare_load(self, keys: list, now: float = float("-inf")) -> None:
        blocks = self.blocks
        for key in keys:
            block = blocks[key]
            assert block.readable(now), f"tier {self.spec.name}: loading block {key!r} that is not stored yet"
            block.ref_cnt += 1
            blocks.move_to_end(key)

    def complete_load(self, keys: list) -> None:
        for key in keys:
            self.blocks[key].ref_cnt -= 1
        self.stats.blocks_loaded += len(keys)

    def place(self, keys: list) -> list | None:
        """A write-through store (LMCache's put to a lower backend): as prepare_store, but the new blocks
        are not pinned while written (a full tier may evict them) and count as stored; `ready_at` says
        when they can be read."""
        new = self.prepare_store(keys, pinned=False)
        if new:
            self.stats.blocks_stored += len(new)
        return new

    def ready_at(self, keys: list, at_s: float) -> None:
        blocks = self.blocks
        for key in keys:
            blocks[key].ready_at = at_s

    def prepare_store(self, keys: list, pinned: bool = True) -> list | None:
        """The keys of `keys` this tier will store (those it lacks), room made for them; None when it
        cannot make the room (nothing stored, nothing evicted)."""
        blocks = self.blocks
        new = [k for k in dict.fromkeys(keys) if k not in blocks]
        excess = len(blocks) + len(new) - self.capacity
        if excess > 0:
            victims = []
            for key, block in blocks.items():
                if block.ref_cnt == 0:
                    victims.append(key)
                    if len(victims) == excess:
                        break
            if len(victims) < excess:
                self.stats.stores_dropped += len(new)
                return None
            for key in victims:
                del blocks[key]
            self.stats.blocks_evicted += len(victims)
        ref_cnt = 1 if pinned else 0
        for key in new:
            blocks[key] = _Block(ref_cnt)
        return new

    def complete_store(self, keys: list) -> None:
        blocks = self.blocks
        for key in keys:
            block = blocks[key]
            block.ready = True
            block.ref_cnt -= 1
        self.stats.blocks_stored += len(keys)

    def check_invariants(self) -> None:
        assert len(self.blocks) <= self.capacity, (
            f"tier {self.spec.name}: {len(self.blocks)} blocks over its capacity of {self.capacity}")
        for key, block in self.blocks.items():
            assert block.ref_cnt >= 0, f"tier {self.spec.name}: block {key!r} released more than pinned"
            assert block.ready or block.ref_cnt >= 1 or block.ready_at < float("inf"), (
                f"tier {self.spec.name}: block {key!r} lost its store")
