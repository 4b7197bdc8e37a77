"""Fast mode under memory pressure: policies that compress again before the scheduler preempts
(KV-Compress: `reclaim_target` in the profile) evict whole blocks of token-rows down to their target.

Token level evicts, newest request first, groups of block_size tokens chosen across the request's
rows by metric, never below the target (ceil(T / r) tokens a row on average) and no more than asked.
Fast mode evicts the same number of token-rows per request; the groups go to the rows holding the
most tokens outside the protected window first (water-filling, a group at a time: decode tokens
accumulate alike in every row, so the rows the prompt cut left long give first), and within a row a
uniform draw of its non-window tokens (per page column, multivariate hypergeometric) leaves; the
slot strategy then answers as after the prompt cut (compaction frees the emptied pages). A slot
with a page reserved for this step's token writes that token first (its reservation assumed the
old pages).
"""
from __future__ import annotations

import numpy as np


def groups_per_row(evictable: np.ndarray, num_groups: int, block_size: int) -> np.ndarray:
    """int [rows]: groups of block_size each row gives up, a group at a time to the row with the most
    evictable tokens left (ties to the lower row), at most evictable // block_size per row."""
    left = evictable.astype(np.int64).copy()
    out = np.zeros(left.size, np.int64)
    for _ in range(num_groups):
        row = int(np.argmax(left))
        if left[row] < block_size:
            break
        out[row] += 1
        left[row] -= block_size
    return out


class ReclaimMixin:
    """FastKVManager.reclaim for policies that compress under memory pressure."""

    def _reclaim_blocks(self, num_blocks: int, running) -> int:
        """Compress running requests, newest first, until num_blocks pool pages are free; returns the
        pool pages freed (0 = the scheduler preempts)."""
        freed = 0
        for req in reversed(running):
            s = self.slot_of.get(req)
            if s is None or not self._prefilled_l[s]:
                continue
            self._flush_one(s)                   # this step's reserved token is written first
            asked = -(-(num_blocks - freed) // self.unit) * self.block_size
            freed += self._reclaim_slot(s, req, asked) * self.unit
            if freed >= num_blocks:
                break
        return freed

    def _reclaim_slot(self, s: int, req, asked_token_rows: int) -> int:
        """Evict whole groups of one slot's token-rows down to its target; returns the pages freed."""
        bs = self.block_size
        target = self._reclaim_target(int(self.ntok[s])) * self.rows
        excess = int(self.live[s].sum()) - target
        evict = min(asked_token_rows, excess // bs * bs)
        if evict <= 0:
            return 0
        rows = np.arange(self.rows)
        outside = np.maximum(self.occ[s] - self.win[s], 0) * self.alive[s]
        groups = groups_per_row(outside.sum(axis=1), evict // bs, bs)
        if not groups.any():
            return 0
        for r in np.flatnonzero(groups):
            drawn = self.rng.multivariate_hypergeometric(outside[r], int(groups[r]) * bs, method="marginals")
            self.occ[s, r] -= drawn.astype(np.int32)
        evicted = int(groups.sum()) * bs
        self.live[s] -= (groups * bs).astype(np.int32)
        self.plan.evicted_tokens += evicted
        self._note_evicted(req, evicted)
        before = self.plan.blocks_freed_by_eviction
        self._settle_generic(s, rows)
        self._update_need(np.array([s]))
        self._restat(np.array([s]))
        return self.plan.blocks_freed_by_eviction - before
