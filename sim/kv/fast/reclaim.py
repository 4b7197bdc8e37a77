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

from collections.abc import Callable

import numpy as np

from .settings import FastSettings
from .slab import FastSlab, Ledger, note_evicted
from .slots import SlotStrategy


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


class Reclaim:
    """Compression under memory pressure (see the module doc). Reads the settings, the slab, the
    ledger, the run's Generator (which tokens of a row go), the slot strategy (how pages answer) and
    the profile's `target(tokens)`: the tokens a row keeps at least."""

    def __init__(self, settings: FastSettings, slab: FastSlab, ledger: Ledger, rng: np.random.Generator,
                 slots: SlotStrategy, target: Callable[[int], int]):
        self.cfg, self.slab, self.ledger, self.rng, self.slots, self.target = settings, slab, ledger, rng, slots, target

    def reclaim(self, num_blocks: int, running, flush: Callable[[int], None]) -> int:
        """Compress running requests, newest first, until num_blocks pool pages are free; returns the
        pool pages freed (0 = the scheduler preempts). `flush(slot)` writes a slot's token reserved
        for this step first."""
        freed = 0
        for req in reversed(running):
            s = self.slab.slot_of.get(req)
            if s is None or not self.slab.prefilled_l[s]:
                continue
            flush(s)
            asked = -(-(num_blocks - freed) // self.cfg.unit) * self.cfg.block_size
            freed += self.reclaim_slot(s, req, asked) * self.cfg.unit
            if freed >= num_blocks:
                break
        return freed

    def reclaim_slot(self, s: int, req, asked_token_rows: int) -> int:
        """Evict whole groups of one slot's token-rows down to its target; returns the pages freed."""
        bs = self.cfg.block_size
        target = self.target(int(self.slab.ntok[s])) * self.cfg.rows
        excess = int(self.slab.live[s].sum()) - target
        evict = min(asked_token_rows, excess // bs * bs)
        if evict <= 0:
            return 0
        rows = np.arange(self.cfg.rows)
        outside = np.maximum(self.slab.occ[s] - self.slab.win[s], 0) * self.slab.alive[s]
        groups = groups_per_row(outside.sum(axis=1), evict // bs, bs)
        if not groups.any():
            return 0
        for r in np.flatnonzero(groups):
            drawn = self.rng.multivariate_hypergeometric(outside[r], int(groups[r]) * bs, method="marginals")
            self.slab.occ[s, r] -= drawn.astype(np.int32)
        evicted = int(groups.sum()) * bs
        self.slab.live[s] -= (groups * bs).astype(np.int32)
        self.ledger.effects.evicted_tokens += evicted
        note_evicted(req, evicted, self.cfg.rows)
        before = self.ledger.effects.blocks_freed_by_eviction
        self.slots.settle_generic(s, rows)
        self.slots.update_need(np.array([s]))
        self.slab.restat(np.array([s]))
        return self.ledger.effects.blocks_freed_by_eviction - before
