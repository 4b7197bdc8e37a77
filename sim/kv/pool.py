"""Array-backed block pool for eviction-aware managers (no prefix caching).

Same read-only surface as `sim.core.block_pool.BlockPool` (num_blocks, num_free_blocks,
num_used_blocks, num_cached_free_blocks, check_invariants), but allocation and freeing take and
return numpy arrays, so per-head layouts with hundreds of thousands of blocks stay vectorized.
`order="stack"` reuses the most recently freed block first; `order="ring"` is LeanKV's circular
free-page list: allocation advances one pointer, recycling appends at the other.
"""
from __future__ import annotations

import numpy as np


class ArrayBlockPool:
    enable_caching = False
    num_cached_free_blocks = 0
    num_cache_evictions = 0

    def __init__(self, num_blocks: int, order: str = "stack"):
        if num_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_blocks}")
        if order not in ("stack", "ring"):
            raise ValueError(f"pool order must be stack or ring, got {order!r}")
        self.num_blocks = num_blocks
        self.order = order
        self.owned = np.zeros(num_blocks, dtype=bool)
        # stack: free ids in free[:top], next allocation takes from the top (free[top-1], ...)
        # ring: free ids in ring positions [head, head + count) modulo num_blocks
        self.free = np.arange(num_blocks, dtype=np.int64)[::-1].copy() if order == "stack" \
            else np.arange(num_blocks, dtype=np.int64)
        self.count = num_blocks
        self.head = 0

    @property
    def num_free_blocks(self) -> int:
        return self.count

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.count

    def get_new_blocks(self, n: int) -> np.ndarray:
        if n > self.count:
            raise ValueError(f"cannot allocate {n} blocks, only {self.count} free")
        if self.order == "stack":
            ids = self.free[self.count - n:self.count][::-1].copy()
        else:
            ids = self.free[(self.head + np.arange(n)) % self.num_blocks]
            self.head = (self.head + n) % self.num_blocks
        self.count -= n
        self.owned[ids] = True
        return ids

    def free_blocks(self, ids) -> None:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size == 0:
            return
        if not self.owned[ids].all():
            raise AssertionError(f"freeing blocks not owned: {ids[~self.owned[ids]][:10].tolist()}")
        self.owned[ids] = False
        if self.order == "stack":
            self.free[self.count:self.count + ids.size] = ids[::-1]
        else:
            self.free[(self.head + self.count + np.arange(ids.size)) % self.num_blocks] = ids
        self.count += ids.size

    def check_invariants(self) -> None:
        # O(pool) with no sort: a per-head pool on a large GPU holds tens of millions of blocks
        assert self.num_blocks - self.owned.sum() == self.count, "free count drifted"
        free = self._free_ids()
        assert not self.owned[free].any(), "a free-list block is owned"
        covered = self.owned.copy()
        covered[free] = True
        # owned + free sizes add up to num_blocks, so full cover means no id is listed twice
        assert covered.all(), "a block is in the free list twice"

    def _free_ids(self) -> np.ndarray:
        if self.order == "stack":
            return self.free[:self.count]
        end = self.head + self.count
        if end <= self.num_blocks:
            return self.free[self.head:end]
        return np.concatenate([self.free[self.head:], self.free[:end - self.num_blocks]])
