"""Slot strategies of the eviction-aware manager: where new tokens go and what an evicted token's hole becomes.

Holds a request's pages and token state (`RequestKV`), what one step asks of the KV tensors
(`KVStepEffects`, which the real backend applies) and the page/slot operations (`SlotStrategies`,
mixed into `sim.kv.manager.EvictingKVManager`).

Pages of a row may hold different precision groups (LeanKV): a page has fixed bytes, so precision group t holds
`precision_capacity[t]` tokens; slot id = block id * `stride` + offset with `stride` the largest capacity.

Slot strategies:
  noop          evicted slots stay allocated; new tokens append at the row's tail page.
  free_block    as noop, and a page whose tokens are all evicted returns to the pool.
  slot_reuse    free_block, and new tokens fill evicted slots before a new page is allocated.
  sparse_copy   the published sparse copy: at the next allocation of a row with holes (the step
                after an eviction) ALL its kept tokens are rewritten densely into fresh pages
                allocated BEFORE the old ones are freed (the allocation is part of the step's memory
                plan: when the destination pages cannot be allocated the request cannot run and the
                scheduler preempts); bytes copied are charged.
  holed_copy    kvsim's cheaper variant: as sparse_copy, but only the holed pages (and the tail
                page) of a row are rewritten.
                Both batched (`copy_threshold` h > 0): a row is rewritten only once it holds more
                than h holes (evicted slots in allocated pages); until then it appends as noop.
  compact       slot_reuse, and after each eviction survivors move from the row's last pages into
                holes of its first ceil(live / capacity) pages; emptied pages are freed.
  parallel_compact  compact with LeanKV's circular free-page list (pool order "ring"); all rows'
                page needs of a step are placed with one prefix sum.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .names import SLOT_STRATEGIES  # noqa: F401 (the one list, light for the CLI's help)
from .state import PRECISION_LOW, TokenState

COPY_STRATEGIES = {"sparse_copy", "holed_copy"}
QUANT_FLOPS = 6            # FLOPs per quantized element (min/max, scale, round, clamp, pack)
REUSE_STRATEGIES = {"slot_reuse", "compact", "parallel_compact"}
FREEING_STRATEGIES = {"free_block", "slot_reuse", "compact", "parallel_compact"}


@dataclass
class KVStepEffects:
    """What the executor must do on the KV tensors in one step (global slot = block * stride + offset).

    slot_mapping: request id -> int64 [rows, n] slots the step's new tokens are written to (rows =
        1 in the shared layout, layers * kv_heads in per_head, row = layer * kv_heads + head).
    evicted: request id -> (rows int64 [k], slots int64 [k]) slots whose live bit clears.
    copy_src / copy_dst: int64 [m] global slots (per-row flattened): copy K/V (and live) from src
        to dst, then clear src — sparse copy, compaction and precision group moves; done BEFORE new tokens are
        written when `copies_before_write` (sparse copy happens at allocation), else after.
    copy_precisions / copy_dst_precisions: int8 [m] precision group of each copied token before / after the copy (they
        differ for precision group moves, which a mixed-precision cache re-quantizes).
    freed_blocks / allocated_blocks: block ids returned to / taken from the pool this step.
    block_tables: request id -> list (per row) of int64 block-id arrays, valid after the step.
    """
    slot_mapping: dict[int, np.ndarray] = field(default_factory=dict)
    evicted: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    copy_src: list[np.ndarray] = field(default_factory=list)
    copy_dst: list[np.ndarray] = field(default_factory=list)
    copy_precisions: list[np.ndarray] = field(default_factory=list)
    copy_dst_precisions: list[np.ndarray] = field(default_factory=list)
    freed_blocks: list[np.ndarray] = field(default_factory=list)
    allocated_blocks: list[np.ndarray] = field(default_factory=list)
    evicted_tokens: int = 0          # (token, row) entries evicted
    blocks_freed_by_eviction: int = 0
    bytes_moved: int = 0
    op_bytes: float = 0.0            # bytes read + written by the policy's own operations (metric, sort,
    op_flops: float = 0.0            # table rewrite, quantization) and their FLOPs: EvictionPolicy.op_cost
    mass_retained: dict[int, float] = field(default_factory=dict)
    # every applied eviction in order (a request may be evicted twice in one plan, e.g. by two reclaim
    # calls): (request id, rows int64 [k], positions int64 [k], decode steps, tokens cached) — the
    # real backend records these as decisions.parquet, the `recorded` policy replays them
    decisions: list[tuple[int, np.ndarray, np.ndarray, int, int]] = field(default_factory=list)


class RequestKV:
    """Per-request pages and token state. table [rows, E] block ids (-1 = no page at that entry)."""

    def __init__(self, rows: int, stride: int):
        self.state = TokenState(rows, 0)
        self.table = np.full((rows, 0), -1, dtype=np.int64)
        self.page_precision = np.zeros((rows, 0), dtype=np.int8)
        self.tail = np.full(rows, -1, dtype=np.int64)        # append page entry (append-only strategies)
        self.tail_off = np.zeros(rows, dtype=np.int64)
        self.stride = stride
        self.decode_steps = 0
        self.added_since_compress = 0
        self.prefilled = False
        self.mass_sum = 0.0
        self.mass_steps = 0
        self.evicted_rows = 0

    @property
    def num_entries(self) -> int:
        return self.table.shape[1]

    def grow(self, entries: int) -> None:
        if entries <= self.num_entries:
            return
        entries = max(entries, 2 * self.num_entries)
        rows = self.table.shape[0]
        t = np.full((rows, entries), -1, dtype=np.int64)
        t[:, :self.num_entries] = self.table
        pt = np.zeros((rows, entries), dtype=np.int8)
        pt[:, :self.num_entries] = self.page_precision
        self.table, self.page_precision = t, pt
        self.state.resize(entries * self.stride)




class SlotStrategies:
    """Page and slot operations of the slot strategies, on a request's `RequestKV`.

    Mixed into `sim.kv.manager.EvictingKVManager`, which sets `rows`, `stride`, `strategy`,
    `precision_capacity`, `new_token_precision`, `pool` (an ArrayBlockPool), `plan` (this step's KVStepEffects),
    `ctx` and `bytes_per_token_row`.
    """
    copy_threshold = 0          # copy strategies: holes a row may hold before it is rewritten (0: none)

    def _valid(self, rk: RequestKV) -> np.ndarray:
        """bool [rows, S]: slots inside an allocated page's capacity."""
        cap = np.where(rk.table >= 0, self.precision_capacity[rk.page_precision], 0)
        return (np.arange(self.stride)[None, None, :] < cap[:, :, None]).reshape(self.rows, -1)

    def _free_slots(self, rk: RequestKV, precision: int, hole_first: bool | None = None) -> np.ndarray:
        """bool [rows, S]: slots new tokens of `precision group` may take without a new page: any empty slot of a
        page of that precision group when filling hole-first (default: the reuse strategies), else the append tail's."""
        if rk.num_entries == 0:
            return np.zeros((self.rows, 0), dtype=bool)
        if self.strategy in REUSE_STRATEGIES if hole_first is None else hole_first:
            same_precision = np.repeat(rk.page_precision == precision, self.stride, axis=1)
            return self._valid(rk) & ~rk.state.live & same_precision
        out = np.zeros((self.rows, rk.num_entries, self.stride), dtype=bool)
        has = rk.tail >= 0
        r = np.flatnonzero(has)
        cap = self.precision_capacity[rk.page_precision[r, rk.tail[r]]]
        off = np.arange(self.stride)[None, :]
        out[r, rk.tail[r], :] = (off >= rk.tail_off[r, None]) & (off < cap[:, None])
        return out.reshape(self.rows, -1)

    def _dirty_pages(self, rk: RequestKV) -> np.ndarray:
        """bool [rows, E] pages to rewrite densely: sparse_copy every page of a holed row; holed_copy the
        holed pages, plus the tail of a holed row."""
        st = rk.state
        hole_slots = (~st.live & (st.pos >= 0)).reshape(self.rows, -1, self.stride) & (rk.table >= 0)[:, :, None]
        holes = hole_slots.any(axis=2)
        rows_holed = hole_slots.sum(axis=(1, 2)) > self.copy_threshold if self.copy_threshold else holes.any(axis=1)
        if self.strategy == "sparse_copy":
            return (rk.table >= 0) & rows_holed[:, None]
        holes &= rows_holed[:, None]             # batched: rows under the threshold append as noop
        r = np.flatnonzero(rows_holed & (rk.tail >= 0))
        holes[r, rk.tail[r]] = True
        return holes

    def _needs(self, rk: RequestKV, n: int):
        """(pages for new tokens per row, sparse-copy destination pages per row)."""
        cap = int(self.precision_capacity[self.new_token_precision])
        if self.strategy in COPY_STRATEGIES and rk.num_entries:
            dirty = self._dirty_pages(rk)
            moved = (rk.state.live.reshape(self.rows, -1, self.stride) & dirty[:, :, None]).sum(axis=(1, 2))
            dst = -(-moved // cap)
            avail = np.where(dirty.any(axis=1), dst * cap - moved, self._free_slots(rk, self.new_token_precision).sum(axis=1))
            return -(-np.maximum(n - avail, 0) // cap), dst
        avail = self._free_slots(rk, self.new_token_precision).sum(axis=1) if rk.num_entries else np.zeros(self.rows, int)
        return -(-np.maximum(n - avail, 0) // cap), np.zeros(self.rows, dtype=np.int64)

    def _add_pages(self, rk: RequestKV, need: np.ndarray, precision: int) -> np.ndarray:
        """Allocate need[r] pages for each row into free table entries; returns bool [rows, E] of new
        entries. Low-precision pages (LeanKV) take the highest free entries, all others the lowest: a
        request-head's high- and low-precision pages grow from opposite ends of its page table."""
        total = int(need.sum())
        if total == 0:
            return np.zeros(rk.table.shape, dtype=bool)
        free_entries = (rk.table < 0).sum(axis=1)
        rk.grow(rk.num_entries + int(np.maximum(need - free_entries, 0).max()))
        empty = rk.table < 0
        rank = np.cumsum(empty[:, ::-1], axis=1)[:, ::-1] if precision == PRECISION_LOW else np.cumsum(empty, axis=1)
        chosen = empty & (rank <= need[:, None])
        ids = self.pool.get_new_blocks(total)
        rk.table[chosen] = ids
        rk.page_precision[chosen] = precision
        self.effects.allocated_blocks.append(ids)
        return chosen

    def _place(self, rk: RequestKV, n: np.ndarray, precision: int, hole_first: bool | None = None) -> np.ndarray:
        """Pick n[r] free slots per row in fill order (tail page first, then by slot; hole-first: by slot,
        default for the reuse strategies); returns [rows, max n] (rows with fewer tokens repeat their
        last slot; callers pass equal n or mask)."""
        if hole_first is None:
            hole_first = self.strategy in REUSE_STRATEGIES
        free = self._free_slots(rk, precision, hole_first)
        if not hole_first:                # append-only: tail page, then the freshly added pages
            # (a page no token was ever written to: a slot a precision group move emptied in an older page has
            # pos -1 too, but appending there would make the tail's next slots live ones)
            unwritten = ~(rk.state.pos >= 0).reshape(self.rows, -1, self.stride).any(axis=2)
            fresh = np.repeat((rk.page_precision == precision) & (rk.table >= 0) & unwritten, self.stride, axis=1)
            fresh &= self._valid(rk)
            key = np.where(free, 0, np.where(fresh, 1, 2)) * rk.state.num_slots + np.arange(rk.state.num_slots)
            usable = free | fresh
        else:
            key = np.arange(rk.state.num_slots)[None, :] + np.zeros((self.rows, 1), dtype=np.int64)
            usable = free
        key = np.where(usable, key, np.iinfo(np.int64).max)
        k = int(n.max())
        slots = key.argmin(axis=1)[:, None] if k == 1 else np.argsort(key, axis=1, kind="stable")[:, :k]
        if not hole_first:
            last = slots[:, -1]
            rk.tail = last // self.stride
            rk.tail_off = last % self.stride + 1
        return slots

    def _sparse_copy(self, rk: RequestKV, dst_pages: np.ndarray) -> None:
        dirty = self._dirty_pages(rk)
        st = rk.state
        live3 = st.live.reshape(self.rows, -1, self.stride) & dirty[:, :, None]
        src_r, src_e, src_o = np.nonzero(live3)
        new = self._add_pages(rk, dst_pages, self.new_token_precision)
        old_entries = np.zeros(rk.table.shape, dtype=bool)
        old_entries[:, :dirty.shape[1]] = dirty
        # destination slots: the first `moved` slots of each row's new pages, in order
        cap = int(self.precision_capacity[self.new_token_precision])
        dst_mask = (np.repeat(new, self.stride, axis=1)
                    & (np.tile(np.arange(self.stride), rk.num_entries)[None, :] < cap))
        moved = live3.sum(axis=(1, 2))
        rank = np.cumsum(dst_mask, axis=1)
        dst_mask &= rank <= moved[:, None]
        dst_r, dst_s = np.nonzero(dst_mask)
        src_s = src_e * self.stride + src_o
        self._record_moves(rk, src_r, src_s, dst_r, dst_s)
        st.move(src_r, src_s, dst_s)
        # the old pages go back to the pool after the copy
        self._release_entries(rk, old_entries, count_as_eviction=False)
        has = moved > 0
        r = np.flatnonzero(has)
        if r.size:
            # tail = the page holding each row's last copied token
            ends = np.zeros(self.rows, dtype=np.int64)
            np.maximum.at(ends, dst_r, dst_s)
            rk.tail[r] = ends[r] // self.stride
            rk.tail_off[r] = ends[r] % self.stride + 1
        rk.tail[~has & dirty.any(axis=1)] = -1

    def _record_moves(self, rk, src_r, src_s, dst_r, dst_s, dst_precision: int | None = None) -> None:
        if src_r.size == 0:
            return
        assert (src_r == dst_r).all()
        tbl = rk.table
        g_src = tbl[src_r, src_s // self.stride] * self.stride + src_s % self.stride
        g_dst = tbl[dst_r, dst_s // self.stride] * self.stride + dst_s % self.stride
        precisions = rk.state.precision[src_r, src_s]
        self.effects.copy_src.append(g_src)
        self.effects.copy_dst.append(g_dst)
        self.effects.copy_precisions.append(precisions)
        self.effects.copy_dst_precisions.append(precisions if dst_precision is None else np.full(precisions.size, dst_precision, np.int8))
        self.effects.bytes_moved += int(round(float(np.asarray(self.ctx.precision_bytes)[precisions].sum())
                                           * self.bytes_per_token_row))

    def _release_entries(self, rk: RequestKV, entries: np.ndarray, count_as_eviction: bool) -> int:
        """Return the pages at bool [rows, E] `entries` to the pool and empty their slots."""
        if not entries.any():
            return 0
        ids = rk.table[entries]
        self.pool.free_blocks(ids)
        self.effects.freed_blocks.append(ids)
        r, e = np.nonzero(entries)
        slots = (e[:, None] * self.stride + np.arange(self.stride)[None, :])
        rk.state.clear_slots(np.broadcast_to(r[:, None], slots.shape), slots)
        rk.table[entries] = -1
        tail_gone = (rk.tail >= 0) & entries[np.arange(self.rows), np.maximum(rk.tail, 0)]
        rk.tail[tail_gone] = -1
        if count_as_eviction:
            self.effects.blocks_freed_by_eviction += ids.size
        return int(ids.size)

    def _free_empty_pages(self, rk: RequestKV) -> int:
        live_pages = rk.state.live.reshape(self.rows, -1, self.stride).any(axis=2)
        empty = (rk.table >= 0) & ~live_pages
        if self.strategy not in REUSE_STRATEGIES:      # keep an append tail that still has unwritten slots
            r = np.flatnonzero(rk.tail >= 0)
            cap = self.precision_capacity[rk.page_precision[r, rk.tail[r]]]
            keep = rk.tail_off[r] < cap
            empty[r[keep], rk.tail[r[keep]]] = False
        return self._release_entries(rk, empty, count_as_eviction=True)

    def _compact(self, rk: RequestKV) -> int:
        """Move survivors from each row's last pages into holes of its first pages; free the emptied pages."""
        st = rk.state
        freed = 0
        for precision in np.unique(rk.page_precision[rk.table >= 0]):
            pages = (rk.table >= 0) & (rk.page_precision == precision)
            cap = int(self.precision_capacity[precision])
            page_slots = np.repeat(pages, self.stride, axis=1) & self._valid(rk)
            live = st.live & page_slots
            n_live = live.sum(axis=1)
            keep_pages = -(-n_live // cap)
            if ((pages.sum(axis=1) - keep_pages) <= 0).all():
                continue
            keep = pages & (np.cumsum(pages, axis=1) <= keep_pages[:, None])
            keep_slots = np.repeat(keep, self.stride, axis=1) & page_slots
            src = live & ~keep_slots
            dst = keep_slots & ~st.live
            src_r, src_s = np.nonzero(src)
            dst_r, dst_s = np.nonzero(dst)
            n_src = src.sum(axis=1)
            src_start = np.concatenate(([0], np.cumsum(n_src)[:-1]))
            dst_start = np.concatenate(([0], np.cumsum(dst.sum(axis=1))[:-1]))
            pick = dst_start[src_r] + (np.arange(src_r.size) - src_start[src_r])
            dst_r, dst_s = dst_r[pick], dst_s[pick]
            self._record_moves(rk, src_r, src_s, dst_r, dst_s)
            st.move(src_r, src_s, dst_s)
            freed += self._release_entries(rk, pages & ~keep, count_as_eviction=True)
        return freed

    def _move_precision(self, rk: RequestKV, new_precision: np.ndarray) -> None:
        st = rk.state
        change = st.live & (new_precision >= 0) & (new_precision != st.precision)
        for precision in np.unique(new_precision[change]):
            m = change & (new_precision == precision)
            n = m.sum(axis=1)
            src_r, src_s = np.nonzero(m)
            # hold the tokens' fields, empty their slots, then place them in pages of the new precision group;
            # precision group pages are filled hole-first whatever the strategy of new tokens' pages (the append
            # tail is left alone)
            free_cnt = self._free_slots(rk, int(precision), hole_first=True).sum(axis=1)
            cap = int(self.precision_capacity[precision])
            need = -(-np.maximum(n - free_cnt, 0) // cap)
            if need.sum() > self.pool.num_free_blocks:
                continue                                   # no room: tokens keep their precision group
            self._add_pages(rk, need, int(precision))
            slots = self._place(rk, n, int(precision), hole_first=True)
            take = np.arange(slots.shape[1])[None, :] < n[:, None]
            dst_r = np.broadcast_to(np.arange(self.rows)[:, None], slots.shape)[take]
            dst_s = slots[take]
            self._record_moves(rk, src_r, src_s, dst_r, dst_s, dst_precision=int(precision))
            # quantization (LeanKV): per element of K and V, a min/max pass for scale and zero, then
            # scale, round, clamp and pack: QUANT_FLOPS each (the bytes are the move's, charged above)
            self.effects.op_flops += QUANT_FLOPS * 2 * self.ctx.head_dim * self.ctx.heads_per_row * src_r.size
            st.move(src_r, src_s, dst_s)
            st.precision[dst_r, dst_s] = precision
