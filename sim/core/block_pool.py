"""Block pool with block identities, ref counts, a free queue and a prefix-cache index.

Modelled on vLLM v1's `BlockPool`: a freed block keeps its hash and stays findable until the
allocator needs it (lazy eviction). Freed hashed blocks go to the tail of the free queue (evicted
last, LRU); freed unhashed blocks go to the head (reused first).

Blocks are hashed only while owned, so the free queue is always its unhashed blocks (head side)
followed by its hashed ones: it is kept as those two parts, a stack of unhashed blocks whose END is
the head and a FIFO of hashed ones, which lets blocks move in bulk (`get_new_blocks(n)` takes the
stack's end, then the FIFO's front) in exactly vLLM's single queue order.

Hashes are of two kinds. Shared ones (a prompt block's chain of prefix ids) go in the `cached`
index, where any request may hit them. A private hash (a block only its own request can hit again,
after a preemption) stays out of the index: its request keeps the chain of its blocks
(`private_lookup`), so filling and evicting such blocks costs no dict update. A private hash is
the tuple `(request id, block index)`, or `(request id,)` for every block a request fills before
its first preemption: such a block sits in its chain at its own index for as long as it keeps that
hash (the chain only grows until then), so the index need not be stored, and one tuple serves all
the blocks a call hashes (no tuple per block to build, then free on eviction).
"""
from __future__ import annotations

from collections.abc import Callable
from itertools import repeat

import numpy as np


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False):
        if num_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.block_hash: list = [None] * num_blocks
        self.cached: dict = {}                  # shared block hash -> block id
        self.num_cache_evictions = 0
        # free unhashed blocks, a list used as a stack whose END is the head of the free queue
        self._stack = list(range(num_blocks - 1, -1, -1))
        # free hashed blocks in LRU order: a list read from `_head` on (slices pop in bulk); a block
        # revived from the middle (a prefix hit) leaves a tombstone, `_dead[block]` entries of it
        # to skip from the front
        self._fifo: list[int] = []
        self._head = 0
        self._dead: dict[int, int] = {}
        self._num_dead = 0
        # ref counts in a list (scalar access is far faster than numpy's); without caching no block
        # is shared and a block is owned exactly when it is not free (computed on demand)
        self._ref_cnt: list[int] = [0] * num_blocks if enable_caching else []
        self._shared_refs = 0                   # references beyond each owned block's first
        # told the shared hashes that leave the prefix-cache index when their blocks are evicted (KV events,
        # kvsim serve --kv-events-endpoint); None: nothing is told (and nothing is collected)
        self.on_evict: Callable[[list], None] | None = None

    @property
    def ref_cnt(self) -> list[int]:
        if self.enable_caching:
            return self._ref_cnt
        ref = [1] * self.num_blocks
        for block in self._stack:
            ref[block] -= 1
        return ref

    @property
    def num_free_blocks(self) -> int:
        return len(self._stack) + len(self._fifo) - self._head - self._num_dead

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding a reusable prefix."""
        return len(self._fifo) - self._head - self._num_dead

    @property
    def num_unhashed_free_blocks(self) -> int:
        """Free blocks without a hash: the allocator hands them out before any hashed one."""
        return len(self._stack)

    @property
    def num_shared_refs(self) -> int:
        """References to owned blocks beyond each one's first (prefix hits on an owned block)."""
        return self._shared_refs

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks, head (next to allocate) first."""
        return self._stack[::-1] + self._hashed_free(len(self._fifo))

    def next_free_blocks(self, n: int) -> list[int]:
        """The first `n` blocks the allocator would hand out, in order."""
        if n <= 0:
            return []
        head = self._stack[:-n - 1:-1]
        return head + self._hashed_free(n - len(head))

    def _hashed_free(self, n: int) -> list[int]:
        """The first `n` free hashed blocks (LRU first), tombstones skipped."""
        fifo, h = self._fifo, self._head
        if not self._num_dead:
            return fifo[h:h + n]
        dead = dict(self._dead)
        out: list[int] = []
        for block in fifo[h:]:
            if len(out) == n:
                break
            if dead.get(block):
                dead[block] -= 1
            else:
                out.append(block)
        return out

    def get_new_blocks(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free_blocks} free")
        if n <= 0:
            return []
        stack = self._stack
        blocks = stack[-n:]
        del stack[-n:]
        blocks.reverse()
        if self.enable_caching:
            ref = self._ref_cnt
            for block in blocks:
                ref[block] = 1
        rest = n - len(blocks)
        if rest:
            blocks += self._pop_hashed(rest)
        return blocks

    def _pop_hashed(self, n: int) -> list[int]:
        """Evict the `n` least recently freed hashed blocks and hand them out (one reference each)."""
        fifo, h = self._fifo, self._head
        if not self._num_dead:
            blocks = fifo[h:h + n]
            h += n
        else:
            blocks, dead = [], self._dead
            while len(blocks) < n:
                block = fifo[h]
                h += 1
                if dead.get(block):
                    dead[block] -= 1
                    if not dead[block]:
                        del dead[block]
                    self._num_dead -= 1
                else:
                    blocks.append(block)
        if h > 4096 and 2 * h > len(fifo):
            del fifo[:h]
            h = 0
        self._head = h
        block_hash, cached = self.block_hash, self.cached
        if cached:
            if self.on_evict is None:
                for block in blocks:
                    key = block_hash[block]
                    if cached.get(key) == block:        # a shared hash (private ones are not indexed)
                        del cached[key]
            else:
                removed = []
                for block in blocks:
                    key = block_hash[block]
                    if cached.get(key) == block:
                        del cached[key]
                        removed.append(key)
                if removed:
                    self.on_evict(removed)
        ref = self._ref_cnt
        for block in blocks:
            block_hash[block] = None
            ref[block] = 1
        self.num_cache_evictions += n
        return blocks

    def free_blocks(self, blocks) -> None:
        """Drop one reference from each block, in the given order (callers pass tail blocks first)."""
        if not self.enable_caching:      # each goes to the head, the last one given first
            self._stack.extend(blocks)
            return
        ref, block_hash, stack, fifo = self._ref_cnt, self.block_hash, self._stack, self._fifo
        for block in blocks:
            if ref[block] > 1:
                self._shared_refs -= 1
            ref[block] -= 1
            if not ref[block]:
                if block_hash[block] is None:
                    stack.append(block)
                else:
                    fifo.append(block)

    def free_request_blocks(self, blocks: list[int]) -> None:
        """`free_blocks(reversed(blocks))`: a request's blocks, tail first; in bulk while no block
        is shared (every owned block then has one reference)."""
        if not self.enable_caching or self._shared_refs:
            self.free_blocks(reversed(blocks))
            return
        ref, block_hash = self._ref_cnt, self.block_hash
        unhashed, hashed = self._stack.append, self._fifo.append
        for block in reversed(blocks):
            ref[block] = 0
            if block_hash[block] is None:
                unhashed(block)
            else:
                hashed(block)

    def lookup(self, block_hash) -> int | None:
        return self.cached.get(block_hash)

    def private_lookup(self, chain: list[int], key: tuple[int, int]) -> int | None:
        """The block still holding private `key` (request id, block index), given its request's
        chain of private blocks."""
        if key[1] < len(chain):
            block = chain[key[1]]
            h = self.block_hash[block]
            if h == key or h == key[:1]:
                return block
        return None

    def touch(self, blocks) -> None:
        """Take a reference on cached blocks hit by a new request; revive them if free."""
        ref = self._ref_cnt
        for block in blocks:
            if ref[block] == 0:
                if self.block_hash[block] is not None:       # free and hashed: in the FIFO
                    self._dead[block] = self._dead.get(block, 0) + 1
                    self._num_dead += 1
                else:
                    self._stack.remove(block)
            else:
                self._shared_refs += 1
            ref[block] += 1

    def cache_block(self, block: int, block_hash) -> None:
        self.cache_blocks([block], [block_hash])

    def cache_blocks(self, blocks: list[int], hashes: list) -> None:
        """Hash each owned block (an identical shared block already cached keeps the index: the new
        one stays unhashed)."""
        if not self.enable_caching:
            return
        block_hash, cached = self.block_hash, self.cached
        for block, h in zip(blocks, hashes, strict=False):
            if block_hash[block] is None and h not in cached:
                block_hash[block] = h
                cached[h] = block

    def cache_private(self, blocks: list[int], request_id: int, first: int, chain: list[int],
                      fresh: bool = False) -> None:
        """Hash owned blocks with their request's private keys (request id, first + i); `first` is at
        most len(chain), the request's chain of the block of each index. `fresh`: the request was
        never preempted, so its blocks are unhashed and its chain ends at `first` (they all get the
        key `(request id,)`: see the module's docstring)."""
        block_hash = self.block_hash
        own = (request_id,)
        if fresh:
            chain.extend(blocks)
            for block in blocks:
                block_hash[block] = own
            return
        for block, key in zip(blocks, zip(repeat(request_id), range(first, first + len(blocks))), strict=False):
            if block_hash[block] is not None:
                continue
            j = key[1]
            if j == len(chain):
                chain.append(block)
            elif block_hash[chain[j]] in (key, own):          # an identical block is cached: keep it
                continue
            else:
                chain[j] = block
            block_hash[block] = key

    def check_invariants(self) -> None:
        free_ids = self.free_block_ids()
        assert len(set(free_ids)) == len(free_ids), "a block is in the free queue twice (double free)"
        free = np.zeros(self.num_blocks, dtype=bool)
        free[free_ids] = True
        ref_cnt = self.ref_cnt
        ref = np.asarray(ref_cnt)
        assert (ref >= 0).all(), "negative ref count"
        both = np.flatnonzero(free & (ref > 0))
        assert both.size == 0, f"blocks both free and owned: {both[:10].tolist()}"
        lost = np.flatnonzero(~free & (ref == 0))
        assert lost.size == 0, f"blocks neither free nor owned: {lost[:10].tolist()}"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cache index points at block {b} with another hash"
        assert self._shared_refs == int(np.maximum(ref - 1, 0).sum()), "shared reference count drifted"
        assert all(self.block_hash[b] is None for b in self._stack), "a hashed block in the unhashed part"
        hashed = self._hashed_free(len(self._fifo))
        assert all(self.block_hash[b] is not None for b in hashed), "an unhashed block in the hashed part"
        assert len(hashed) == self.num_cached_free_blocks, "cached-free block count drifted"
