"""Block pool with block identities, ref counts, a free queue and a prefix-cache index.

Modelled on vLLM v1's `BlockPool`: a freed block keeps its hash and stays findable until the
allocator needs it (lazy eviction). Freed hashed blocks go to the tail of the free queue (evicted
last, LRU); freed unhashed blocks go to the head (reused first).
"""
from __future__ import annotations

from collections import OrderedDict
from itertools import islice

import numpy as np


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False):
        if num_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}        # block hash -> block id
        self.num_cache_evictions = 0
        self.num_cached_free_blocks = 0         # free blocks still holding a reusable prefix
        if enable_caching:
            # Free queue, head = next to allocate: an OrderedDict gives O(1) pop/append/remove-from-
            # middle (revival). Ref counts in a list: scalar access is far faster than numpy's.
            self.free_queue = OrderedDict.fromkeys(range(num_blocks))
            self._ref_cnt = [0] * num_blocks
        else:
            # Without caching no block is shared (ref counts are 0 or 1) and nothing leaves the
            # middle of the queue: a list used as a stack whose END is the head moves blocks in bulk.
            self._stack = list(range(num_blocks - 1, -1, -1))

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
        return len(self.free_queue) if self.enable_caching else len(self._stack)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks, head (next to allocate) first."""
        return list(self.free_queue) if self.enable_caching else self._stack[::-1]

    def next_free_blocks(self, n: int) -> list[int]:
        """The first `n` blocks the allocator would hand out, in order."""
        if self.enable_caching:
            return list(islice(self.free_queue, n))
        return self._stack[:-n - 1:-1] if n > 0 else []

    def get_new_blocks(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free_blocks} free")
        if not self.enable_caching:
            if n <= 0:
                return []
            stack = self._stack
            blocks = stack[-n:]
            del stack[-n:]
            blocks.reverse()
            return blocks
        blocks = []
        pop = self.free_queue.popitem
        for _ in range(n):
            block, _ = pop(last=False)
            if self.block_hash[block] is not None:
                self._evict_cached(block)
            self._ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def _evict_cached(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.num_cached_free_blocks -= 1
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
            self.num_cache_evictions += 1

    def free_blocks(self, blocks) -> None:
        """Drop one reference from each block, in the given order (callers pass tail blocks first)."""
        if not self.enable_caching:      # each goes to the head, the last one given first
            self._stack.extend(blocks)
            return
        ref = self._ref_cnt
        for block in blocks:
            ref[block] -= 1
            if ref[block] == 0:
                self.free_queue[block] = None
                if self.block_hash[block] is None:
                    self.free_queue.move_to_end(block, last=False)
                else:
                    self.num_cached_free_blocks += 1

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, blocks) -> None:
        """Take a reference on cached blocks hit by a new request; revive them if free."""
        ref = self._ref_cnt
        for block in blocks:
            if ref[block] == 0:
                del self.free_queue[block]
                self.num_cached_free_blocks -= 1
            ref[block] += 1

    def cache_block(self, block: int, block_hash: int) -> None:
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.cached:       # an identical block exists; keep the first one
            return
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block

    def cache_blocks(self, blocks: list[int], hashes: list) -> None:
        """`cache_block` for each (block, hash) pair."""
        if not self.enable_caching:
            return
        block_hash, cached = self.block_hash, self.cached
        for block, h in zip(blocks, hashes):
            if block_hash[block] is None and h not in cached:
                block_hash[block] = h
                cached[h] = block

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
        cached_free = sum(1 for b in self.cached.values() if ref_cnt[b] == 0)
        assert cached_free == self.num_cached_free_blocks, "cached-free block count drifted"
