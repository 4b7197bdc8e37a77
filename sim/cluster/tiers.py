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


# A block's state is one small int, not an object (a fleet's CPU tiers hold millions of blocks: ~70 bytes
# a block less): its pins (ref_cnt) shifted left by one, or'ed with READY once its store has completed.
READY = 1
PIN = 2


@dataclass
class TierStats:
    """Counters of one tier, in blocks."""
    blocks_stored: int = 0        # stores completed
    blocks_loaded: int = 0
    blocks_evicted: int = 0
    stores_dropped: int = 0       # blocks a full tier could not take (every block pinned)


class BlockTier:
    """The blocks one tier holds, in LRU order (oldest first): `blocks` maps a block's key to its state
    (PIN x ref_cnt | READY), `_ready_at` a written-through block's key to when it can be read (a block
    not in it: never before its store completes)."""

    def __init__(self, spec: TierSpec):
        self.spec = spec
        self.capacity = spec.capacity_blocks
        self.blocks: OrderedDict = OrderedDict()
        self._ready_at: dict = {}
        self.stats = TierStats()
        self.occupancy: list[tuple[float, int]] = []     # (whole second, blocks held then): record_occupancy
        self._next_record = 0

    def record_occupancy(self, now: float, every: float) -> None:
        """Record the blocks held at each multiple of `every` seconds up to `now` not recorded yet; called
        before the tier changes at `now` (a store shared by replicas: whichever changes it), so each
        record is what it held at that instant."""
        first, last = self._next_record, int(now // every)
        if last >= first:
            held = len(self.blocks)
            self.occupancy.extend((i * every, held) for i in range(first, last + 1))
            self._next_record = last + 1

    def __len__(self) -> int:
        return len(self.blocks)

    def readable(self, key, now: float = float("-inf")) -> bool:
        """Whether the held block `key` can be read at `now` (stored, or written through by then)."""
        return bool(self.blocks[key] & READY) or self._ready_at.get(key, float("inf")) <= now

    def ref_cnt(self, key) -> int:
        return self.blocks[key] >> 1

    def lookup(self, keys: list, now: float = float("-inf")) -> int:
        """Leading `keys` held and ready (a written-through block: written by `now`)."""
        n = 0
        blocks, ready_at = self.blocks, self._ready_at
        for key in keys:
            state = blocks.get(key)
            if state is None or not (state & READY or (ready_at and ready_at.get(key, float("inf")) <= now)):
                break
            n += 1
        return n

    def prepare_load(self, keys: list, now: float = float("-inf")) -> None:
        blocks = self.blocks
        for key in keys:
            assert self.readable(key, now), f"tier {self.spec.name}: loading block {key!r} that is not stored yet"
            blocks[key] += PIN
            blocks.move_to_end(key)

    def complete_load(self, keys: list) -> None:
        blocks = self.blocks
        for key in keys:
            blocks[key] -= PIN
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
        ready_at = self._ready_at
        for key in keys:
            ready_at[key] = at_s

    def prepare_store(self, keys: list, pinned: bool = True) -> list | None:
        """The keys of `keys` this tier will store (those it lacks), room made for them; None when it
        cannot make the room (nothing stored, nothing evicted)."""
        blocks = self.blocks
        new = [k for k in dict.fromkeys(keys) if k not in blocks]
        excess = len(blocks) + len(new) - self.capacity
        if excess > 0:
            victims = []
            for key, state in blocks.items():
                if state < PIN:            # no pin: no load reads it, no store is writing it
                    victims.append(key)
                    if len(victims) == excess:
                        break
            if len(victims) < excess:
                self.stats.stores_dropped += len(new)
                return None
            ready_at = self._ready_at
            for key in victims:
                del blocks[key]
                if ready_at:
                    ready_at.pop(key, None)
            self.stats.blocks_evicted += len(victims)
        state = PIN if pinned else 0       # a block being stored cannot be evicted (vLLM: ref_cnt 1 until stored)
        for key in new:
            blocks[key] = state
        return new

    def complete_store(self, keys: list) -> None:
        blocks = self.blocks
        for key in keys:
            blocks[key] = (blocks[key] - PIN) | READY
        self.stats.blocks_stored += len(keys)

    def check_invariants(self) -> None:
        assert len(self.blocks) <= self.capacity, (
            f"tier {self.spec.name}: {len(self.blocks)} blocks over its capacity of {self.capacity}")
        for key, state in self.blocks.items():
            assert state >= 0, f"tier {self.spec.name}: block {key!r} released more than pinned"
            assert state & READY or state >= PIN or key in self._ready_at, (
                f"tier {self.spec.name}: block {key!r} lost its store")
        assert self._ready_at.keys() <= self.blocks.keys(), f"tier {self.spec.name}: a read time for a block it lacks"
