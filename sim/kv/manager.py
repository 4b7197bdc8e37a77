"""Eviction-aware paged KV manager: layouts, slot state, slot strategies, triggers, step plans.

Stands in for `sim.core.kv_manager.KVCacheManager` (same scheduler-facing surface) when a KV
policy, the per_head layout or a slot strategy other than the default is configured. The same
manager drives the real backend: it tells the executor, per step, what to do on tensors
(`KVStepPlan`) and accepts real attention scores (`supply_scores`).

Layouts: `shared` (one block table per request, a block holds `block_size` tokens of every layer
and KV head; state has one row) and `per_head` (tables per (request, layer, KV head); a block
holds tokens of one row; `num_blocks` counts per-head blocks). Pages of a row may hold different
precision tiers (LeanKV): a page has fixed bytes, so tier t holds `tier_capacity[t]` tokens; slot id
= block id * `slot_stride` + offset with `slot_stride` the largest capacity.

Slot strategies (what happens to the hole an evicted token leaves):
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
  compact       slot_reuse, and after each eviction survivors move from the row's last pages into
                holes of its first ceil(live / capacity) pages; emptied pages are freed.
  parallel_compact  compact with LeanKV's circular free-page list (pool order "ring"); all rows'
                page needs of a step are placed with one prefix sum.

Triggers (when the policy's `compress` runs): `never`, `every_step`, `every_n` (every
`trigger_interval` decode steps), `after_prefill`, `after_prefill+pressure`, `pressure` (only
from `reclaim`), `threshold` (when tokens added since the last compression reach
`trigger_threshold`). `reclaim` (the scheduler's hook before a preemption) asks the policy to
evict whenever the trigger includes `pressure`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.request import Request
from .base import EvictingManagerBase
from .importance import ImportanceSource
from .policy import Decision, EvictionPolicy, PolicyContext
from .pool import ArrayBlockPool
from .state import TIER_FULL, TIER_LOW, TokenState

SLOT_STRATEGIES = ("noop", "free_block", "slot_reuse", "sparse_copy", "holed_copy", "compact", "parallel_compact")
_COPY = {"sparse_copy", "holed_copy"}
QUANT_FLOPS = 6            # FLOPs per quantized element (min/max, scale, round, clamp, pack)
TRIGGERS = ("policy", "never", "every_step", "every_n", "after_prefill", "after_prefill+pressure", "pressure",
            "threshold")
_REUSE = {"slot_reuse", "compact", "parallel_compact"}
_FREES = {"free_block", "slot_reuse", "compact", "parallel_compact"}


@dataclass
class KVStepPlan:
    """What the executor must do on the KV tensors in one step (global slot = block * stride + offset).

    slot_mapping: request id -> int64 [rows, n] slots the step's new tokens are written to (rows =
        1 in the shared layout, layers * kv_heads in per_head, row = layer * kv_heads + head).
    evicted: request id -> (rows int64 [k], slots int64 [k]) slots whose live bit clears.
    copy_src / copy_dst: int64 [m] global slots (per-row flattened): copy K/V (and live) from src
        to dst, then clear src — sparse copy, compaction and tier moves; done BEFORE new tokens are
        written when `copies_before_write` (sparse copy happens at allocation), else after.
    copy_tiers / copy_dst_tiers: int8 [m] tier of each copied token before / after the copy (they
        differ for tier moves, which a mixed-precision cache re-quantizes).
    freed_blocks / allocated_blocks: block ids returned to / taken from the pool this step.
    block_tables: request id -> list (per row) of int64 block-id arrays, valid after the step.
    """
    slot_mapping: dict[int, np.ndarray] = field(default_factory=dict)
    evicted: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    copy_src: list[np.ndarray] = field(default_factory=list)
    copy_dst: list[np.ndarray] = field(default_factory=list)
    copy_tiers: list[np.ndarray] = field(default_factory=list)
    copy_dst_tiers: list[np.ndarray] = field(default_factory=list)
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
        self.page_tier = np.zeros((rows, 0), dtype=np.int8)
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
        pt[:, :self.num_entries] = self.page_tier
        self.table, self.page_tier = t, pt
        self.state.resize(entries * self.stride)


class EvictingKVManager(EvictingManagerBase):

    def __init__(self, num_blocks: int, block_size: int, ctx: PolicyContext, policy: EvictionPolicy,
                 importance: ImportanceSource | None = None, *, slot_strategy: str = "free_block",
                 trigger: str = "policy", trigger_interval: int = 1, trigger_threshold: int = 0,
                 bytes_per_token_row: float = 0.0, tier_capacity: tuple[int, int, int] | None = None,
                 new_token_tier: int = TIER_FULL):
        if slot_strategy not in SLOT_STRATEGIES:
            raise ValueError(f"kv.slot_strategy must be one of {SLOT_STRATEGIES}, got {slot_strategy!r}")
        if trigger not in TRIGGERS:
            raise ValueError(f"kv.trigger must be one of {TRIGGERS}, got {trigger!r}")
        self.block_size = block_size
        self.ctx = ctx
        self.rows = ctx.rows
        self.policy = policy
        self.importance = importance if importance is not None else ImportanceSource()
        self.strategy = slot_strategy
        self.trigger = policy.default_trigger if trigger == "policy" else trigger
        self.trigger_interval = max(1, trigger_interval)
        self.trigger_threshold = trigger_threshold
        self.bytes_per_token_row = bytes_per_token_row
        self.tier_capacity = np.asarray(tier_capacity or (block_size, block_size, block_size), dtype=np.int64)
        self.stride = int(self.tier_capacity.max())
        self.new_token_tier = new_token_tier
        # Quality proxy: query the importance model for the attention mass kept even when the
        # policy itself needs no scores (streaming); off for policies that never evict.
        self.track_mass = policy.evicts
        self.logical_token_steps = 0      # sum over steps of the scheduled requests' logical tokens
        self.stored_token_steps = 0.0     # ... and of their stored fp16 token-equivalents per row
        self.pool = ArrayBlockPool(num_blocks, "ring" if slot_strategy == "parallel_compact" else "stack")
        self.req_kv: dict[Request, RequestKV] = {}
        self.plan = KVStepPlan()
        self._external: dict[int, np.ndarray] = {}
        self._live_total = 0
        self._alloc_total = 0
        self._stats: dict[Request, tuple[int, int, float, int]] = {}   # live, alloc slots, kv tokens, pages

    # ----- scheduler-facing surface (as KVCacheManager) ------------------------------------------
    @property
    def req_blocks(self):
        return self.req_kv

    def kv_tokens(self, req: Request) -> float:
        """fp16 token-equivalents attention reads per row: every written slot of the row's pages, live
        or evicted (a paged kernel masks holes but still reads them), tiers weighted by their bytes;
        selection policies count only what they read."""
        st = self._stats.get(req)
        return st[2] if st else 0

    def block_table_entries(self, req: Request) -> int:
        st = self._stats.get(req)
        return st[3] if st else 0

    def slot_stats(self) -> tuple[int, int]:
        return self._live_total, self._alloc_total

    def blocks_of(self, req: Request) -> np.ndarray:
        rk = self.req_kv.get(req)
        return rk.table[rk.table >= 0] if rk is not None else np.zeros(0, dtype=np.int64)

    # ----- allocation ----------------------------------------------------------------------------
    def _rk(self, req: Request) -> RequestKV:
        rk = self.req_kv.get(req)
        if rk is None:
            rk = self.req_kv[req] = RequestKV(self.rows, self.stride)
            rk.state.extra["request_id"] = req.request_id
            rk.state.extra["prompt_tokens"] = req.prompt_tokens    # a recompute prefills generated tokens too
            self.policy.on_admit(rk.state, self.ctx)
        return rk

    def _valid(self, rk: RequestKV) -> np.ndarray:
        """bool [rows, S]: slots inside an allocated page's capacity."""
        cap = np.where(rk.table >= 0, self.tier_capacity[rk.page_tier], 0)
        return (np.arange(self.stride)[None, None, :] < cap[:, :, None]).reshape(self.rows, -1)

    def _free_slots(self, rk: RequestKV, tier: int, hole_first: bool | None = None) -> np.ndarray:
        """bool [rows, S]: slots new tokens of `tier` may take without a new page: any empty slot of a
        page of that tier when filling hole-first (default: the reuse strategies), else the append tail's."""
        if rk.num_entries == 0:
            return np.zeros((self.rows, 0), dtype=bool)
        if self.strategy in _REUSE if hole_first is None else hole_first:
            tier_ok = np.repeat(rk.page_tier == tier, self.stride, axis=1)
            return self._valid(rk) & ~rk.state.live & tier_ok
        out = np.zeros((self.rows, rk.num_entries, self.stride), dtype=bool)
        has = rk.tail >= 0
        r = np.flatnonzero(has)
        cap = self.tier_capacity[rk.page_tier[r, rk.tail[r]]]
        off = np.arange(self.stride)[None, :]
        out[r, rk.tail[r], :] = (off >= rk.tail_off[r, None]) & (off < cap[:, None])
        return out.reshape(self.rows, -1)

    def _dirty_pages(self, rk: RequestKV) -> np.ndarray:
        """bool [rows, E] pages to rewrite densely: sparse_copy every page of a holed row; holed_copy the
        holed pages, plus the tail of a holed row."""
        st = rk.state
        holes = (~st.live & (st.pos >= 0)).reshape(self.rows, -1, self.stride).any(axis=2) & (rk.table >= 0)
        rows_holed = holes.any(axis=1)
        if self.strategy == "sparse_copy":
            return (rk.table >= 0) & rows_holed[:, None]
        r = np.flatnonzero(rows_holed & (rk.tail >= 0))
        holes[r, rk.tail[r]] = True
        return holes

    def blocks_needed(self, req: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        rk = self.req_kv.get(req) or RequestKV(self.rows, self.stride)
        return int(self._needs(rk, num_new_tokens)[0].sum() + self._needs(rk, num_new_tokens)[1].sum())

    def _needs(self, rk: RequestKV, n: int):
        """(pages for new tokens per row, sparse-copy destination pages per row)."""
        cap = int(self.tier_capacity[self.new_token_tier])
        if self.strategy in _COPY and rk.num_entries:
            dirty = self._dirty_pages(rk)
            moved = (rk.state.live.reshape(self.rows, -1, self.stride) & dirty[:, :, None]).sum(axis=(1, 2))
            dst = -(-moved // cap)
            avail = np.where(dirty.any(axis=1), dst * cap - moved, self._free_slots(rk, self.new_token_tier).sum(axis=1))
            return -(-np.maximum(n - avail, 0) // cap), dst
        avail = self._free_slots(rk, self.new_token_tier).sum(axis=1) if rk.num_entries else np.zeros(self.rows, int)
        return -(-np.maximum(n - avail, 0) // cap), np.zeros(self.rows, dtype=np.int64)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks=None) -> bool:
        if num_new_tokens <= 0:
            return True
        rk = self._rk(req)
        need, copy_dst = self._needs(rk, num_new_tokens)
        if need.sum() + copy_dst.sum() > self.pool.num_free_blocks:
            if rk.num_entries == 0 and rk.state.num_tokens == 0:
                del self.req_kv[req]
            return False
        self._unstat(req)
        if copy_dst.any():
            self._sparse_copy(rk, copy_dst)
        self._add_pages(rk, need, self.new_token_tier)
        positions = np.arange(req.num_computed_tokens, req.num_computed_tokens + num_new_tokens)
        if positions[0] != rk.state.num_tokens:
            raise AssertionError(f"request {req.request_id}: writing position {positions[0]} but "
                                 f"{rk.state.num_tokens} tokens are cached")
        slots = self._place(rk, np.full(self.rows, num_new_tokens), self.new_token_tier)
        st = rk.state
        r = np.arange(self.rows)[:, None]
        st.clear_slots(np.broadcast_to(r, slots.shape), slots)
        st.live[r, slots] = True
        st.pos[r, slots] = positions[None, :]
        st.tier[r, slots] = self.new_token_tier
        st.num_tokens += num_new_tokens
        rk.added_since_compress += num_new_tokens
        self.importance.on_write(req.request_id, st, np.arange(self.rows), slots, positions)
        self.plan.slot_mapping[req.request_id] = np.take_along_axis(rk.table, slots // self.stride, 1) \
            * self.stride + slots % self.stride
        self._stat(req)
        return True

    def _add_pages(self, rk: RequestKV, need: np.ndarray, tier: int) -> np.ndarray:
        """Allocate need[r] pages for each row into free table entries; returns bool [rows, E] of new
        entries. Low-precision pages (LeanKV) take the highest free entries, all others the lowest: a
        request-head's high- and low-precision pages grow from opposite ends of its page table."""
        total = int(need.sum())
        if total == 0:
            return np.zeros(rk.table.shape, dtype=bool)
        free_entries = (rk.table < 0).sum(axis=1)
        rk.grow(rk.num_entries + int(np.maximum(need - free_entries, 0).max()))
        empty = rk.table < 0
        rank = np.cumsum(empty[:, ::-1], axis=1)[:, ::-1] if tier == TIER_LOW else np.cumsum(empty, axis=1)
        chosen = empty & (rank <= need[:, None])
        ids = self.pool.get_new_blocks(total)
        rk.table[chosen] = ids
        rk.page_tier[chosen] = tier
        self.plan.allocated_blocks.append(ids)
        return chosen

    def _place(self, rk: RequestKV, n: np.ndarray, tier: int, hole_first: bool | None = None) -> np.ndarray:
        """Pick n[r] free slots per row in fill order (tail page first, then by slot; hole-first: by slot,
        default for the reuse strategies); returns [rows, max n] (rows with fewer tokens repeat their
        last slot; callers pass equal n or mask)."""
        if hole_first is None:
            hole_first = self.strategy in _REUSE
        free = self._free_slots(rk, tier, hole_first)
        if not hole_first:                # append-only: tail page, then the freshly added pages
            fresh = np.repeat((rk.page_tier == tier) & (rk.table >= 0), self.stride, axis=1) & \
                ~rk.state.live & (rk.state.pos < 0)
            fresh &= self._valid(rk)
            key = np.where(free, 0, np.where(fresh, 1, 2)) * rk.state.num_slots + np.arange(rk.state.num_slots)
            usable = free | fresh
        else:
            key = np.arange(rk.state.num_slots)[None, :] + np.zeros((self.rows, 1), dtype=np.int64)
            usable = free
        key = np.where(usable, key, np.iinfo(np.int64).max)
        k = int(n.max())
        if k == 1:
            slots = key.argmin(axis=1)[:, None]
        else:
            slots = np.argsort(key, axis=1, kind="stable")[:, :k]
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
        new = self._add_pages(rk, dst_pages, self.new_token_tier)
        old_entries = np.zeros(rk.table.shape, dtype=bool)
        old_entries[:, :dirty.shape[1]] = dirty
        # destination slots: the first `moved` slots of each row's new pages, in order
        cap = int(self.tier_capacity[self.new_token_tier])
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

    def _record_moves(self, rk, src_r, src_s, dst_r, dst_s, dst_tier: int | None = None) -> None:
        if src_r.size == 0:
            return
        assert (src_r == dst_r).all()
        tbl = rk.table
        g_src = tbl[src_r, src_s // self.stride] * self.stride + src_s % self.stride
        g_dst = tbl[dst_r, dst_s // self.stride] * self.stride + dst_s % self.stride
        tiers = rk.state.tier[src_r, src_s]
        self.plan.copy_src.append(g_src)
        self.plan.copy_dst.append(g_dst)
        self.plan.copy_tiers.append(tiers)
        self.plan.copy_dst_tiers.append(tiers if dst_tier is None else np.full(tiers.size, dst_tier, np.int8))
        self.plan.bytes_moved += int(round(float(np.asarray(self.ctx.tier_bytes)[tiers].sum())
                                           * self.bytes_per_token_row))

    def _release_entries(self, rk: RequestKV, entries: np.ndarray, count_as_eviction: bool) -> int:
        """Return the pages at bool [rows, E] `entries` to the pool and empty their slots."""
        if not entries.any():
            return 0
        ids = rk.table[entries]
        self.pool.free_blocks(ids)
        self.plan.freed_blocks.append(ids)
        r, e = np.nonzero(entries)
        slots = (e[:, None] * self.stride + np.arange(self.stride)[None, :])
        rk.state.clear_slots(np.broadcast_to(r[:, None], slots.shape), slots)
        rk.table[entries] = -1
        tail_gone = (rk.tail >= 0) & entries[np.arange(self.rows), np.maximum(rk.tail, 0)]
        rk.tail[tail_gone] = -1
        if count_as_eviction:
            self.plan.blocks_freed_by_eviction += ids.size
        return int(ids.size)

    def free(self, req: Request) -> int:
        rk = self.req_kv.pop(req, None)
        if rk is None:
            return 0
        self._unstat(req)
        ids = rk.table[rk.table >= 0]
        self.pool.free_blocks(ids[::-1])
        if rk.mass_steps:
            req.extra["kv_mass_sum"] = req.extra.get("kv_mass_sum", 0.0) + rk.mass_sum
            req.extra["kv_mass_steps"] = req.extra.get("kv_mass_steps", 0) + rk.mass_steps
        req.extra["kv_evicted_tokens"] = req.extra.get("kv_evicted_tokens", 0.0) + rk.evicted_rows / self.rows
        self.importance.release(req.request_id)
        self._external.pop(req.request_id, None)
        return int(ids.size)

    # ----- per-step policy application ----------------------------------------------------------
    def supply_scores(self, req: Request, scores: np.ndarray) -> None:
        """Real backend: this step's attention for `req` ([rows, S] decode, [w, rows, S] prefill),
        used instead of the importance model."""
        self._external[req.request_id] = scores

    def begin_step(self) -> None:
        self.plan = KVStepPlan()

    def finish_step(self, scheduled) -> KVStepPlan:
        """Run policies for the step's scheduled requests (after attention), apply decisions."""
        for s in scheduled:
            req = s.request
            rk = self.req_kv.get(req)
            if rk is None:
                continue
            done = req.num_computed_tokens + s.num_new_tokens >= req.num_tokens
            if s.is_prefill and not done:
                continue
            self._unstat(req)
            if s.is_prefill:
                self._after_prefill(req, rk)
            else:
                self._after_decode(req, rk)
            self._stat(req)
        for s in scheduled:
            req = s.request
            if req in self._stats:
                self.logical_token_steps += req.num_computed_tokens + s.num_new_tokens
                self.stored_token_steps += self._stats[req][4]
        plan = self.plan
        self.plan = KVStepPlan()
        return plan

    def _scores(self, req: Request, rk: RequestKV, phase: str):
        ext = self._external.pop(req.request_id, None)
        if ext is not None:
            return ext, None
        if not self.policy.needs_scores and not (phase == "decode" and self.track_mass):
            return None, None
        if phase == "prefill":
            return self.importance.prefill_scores(req.request_id, rk.state, self.policy.obs_window), None
        return self.importance.decode_scores(req.request_id, rk.state)

    def _after_prefill(self, req: Request, rk: RequestKV) -> None:
        scores, _ = self._scores(req, rk, "prefill")
        self.policy.observe(rk.state, self.ctx, scores, "prefill")
        rk.prefilled = True
        if self.trigger in ("every_step", "every_n", "after_prefill", "after_prefill+pressure", "threshold"):
            self._charge(rk, "prefill")
            self._apply(req, rk, self.policy.compress(rk.state, self.ctx, "prefill", scores))
            rk.added_since_compress = 0

    def _charge(self, rk: RequestKV, reason: str, decision: Decision | None = None) -> None:
        """Add the policy's own work for a compression to the step (before its decision applies)."""
        cost = self.policy.op_cost(rk.state, self.ctx, reason)
        if cost is not None:
            self.plan.op_bytes += cost[0]
            self.plan.op_flops += cost[1]

    def _after_decode(self, req: Request, rk: RequestKV) -> None:
        rk.decode_steps += 1
        scores, mass = self._scores(req, rk, "decode")
        if not self.policy.needs_scores:
            scores = None
        if mass is not None:
            rk.mass_sum += mass
            rk.mass_steps += 1
            self.plan.mass_retained[req.request_id] = mass
        self.policy.observe(rk.state, self.ctx, scores, "decode")
        fire = (self.trigger == "every_step"
                or (self.trigger == "every_n" and rk.decode_steps % self.trigger_interval == 0)
                or (self.trigger == "threshold" and rk.added_since_compress >= self.trigger_threshold))
        if fire:
            decision = self.policy.compress(rk.state, self.ctx, "decode", scores)
            if decision is not None:
                self._charge(rk, "decode")
            self._apply(req, rk, decision)
            rk.added_since_compress = 0

    def _apply(self, req: Request, rk: RequestKV, decision: Decision | None) -> int:
        """Apply a decision; returns pages freed."""
        if decision is None:
            return 0
        st = rk.state
        freed = 0
        if decision.evict is not None:
            ev = decision.evict & st.live
            n = int(ev.sum())
            if n:
                r, s = np.nonzero(ev)
                st.live[r, s] = False
                rk.evicted_rows += n
                self.plan.evicted_tokens += n
                tbl = rk.table[r, s // self.stride]
                self.plan.evicted[req.request_id] = (r, tbl * self.stride + s % self.stride)
                self.plan.decisions.append((req.request_id, r, st.pos[r, s], rk.decode_steps, st.num_tokens))
        if decision.tier is not None:
            self._retier(rk, decision.tier)
        if self.strategy in _FREES:
            freed += self._free_empty_pages(rk)
        if self.strategy in ("compact", "parallel_compact"):
            freed += self._compact(rk)
        return freed

    def _free_empty_pages(self, rk: RequestKV) -> int:
        live_pages = rk.state.live.reshape(self.rows, -1, self.stride).any(axis=2)
        empty = (rk.table >= 0) & ~live_pages
        if self.strategy not in _REUSE:      # keep an append tail that still has unwritten slots
            r = np.flatnonzero(rk.tail >= 0)
            cap = self.tier_capacity[rk.page_tier[r, rk.tail[r]]]
            keep = rk.tail_off[r] < cap
            empty[r[keep], rk.tail[r[keep]]] = False
        return self._release_entries(rk, empty, count_as_eviction=True)

    def _compact(self, rk: RequestKV) -> int:
        """Move survivors from each row's last pages into holes of its first pages; free the emptied pages."""
        st = rk.state
        freed = 0
        for tier in np.unique(rk.page_tier[rk.table >= 0]):
            pages = (rk.table >= 0) & (rk.page_tier == tier)
            cap = int(self.tier_capacity[tier])
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

    def _retier(self, rk: RequestKV, new_tier: np.ndarray) -> None:
        st = rk.state
        change = st.live & (new_tier >= 0) & (new_tier != st.tier)
        for tier in np.unique(new_tier[change]):
            m = change & (new_tier == tier)
            n = m.sum(axis=1)
            src_r, src_s = np.nonzero(m)
            # hold the tokens' fields, empty their slots, then place them in pages of the new tier;
            # tier pages are filled hole-first whatever the strategy of new tokens' pages (the append
            # tail is left alone)
            free_cnt = self._free_slots(rk, int(tier), hole_first=True).sum(axis=1)
            cap = int(self.tier_capacity[tier])
            need = -(-np.maximum(n - free_cnt, 0) // cap)
            if need.sum() > self.pool.num_free_blocks:
                continue                                   # no room: tokens keep their tier
            self._add_pages(rk, need, int(tier))
            slots = self._place(rk, n, int(tier), hole_first=True)
            take = np.arange(slots.shape[1])[None, :] < n[:, None]
            dst_r = np.broadcast_to(np.arange(self.rows)[:, None], slots.shape)[take]
            dst_s = slots[take]
            self._record_moves(rk, src_r, src_s, dst_r, dst_s, dst_tier=int(tier))
            # quantization (LeanKV): per element of K and V, a min/max pass for scale and zero, then
            # scale, round, clamp and pack: QUANT_FLOPS each (the bytes are the move's, charged above)
            self.plan.op_flops += QUANT_FLOPS * 2 * self.ctx.head_dim * self.ctx.heads_per_row * src_r.size
            st.move(src_r, src_s, dst_s)
            st.tier[dst_r, dst_s] = tier

    # ----- memory pressure ----------------------------------------------------------------------
    def reclaim(self, num_blocks: int, running: list[Request]) -> int:
        """Compress running requests (newest first) until `num_blocks` pages are free, if the trigger
        allows it; returns pages freed (0 = preempt)."""
        if "pressure" not in self.trigger or num_blocks <= 0:
            return 0
        freed = 0
        cap = int(self.tier_capacity[self.new_token_tier])
        for req in reversed(running):
            rk = self.req_kv.get(req)
            if rk is None or not rk.prefilled:
                continue
            self._unstat(req)
            decision = self.policy.reclaim(rk.state, self.ctx, (num_blocks - freed) * cap)
            if decision is not None:
                self._charge(rk, "reclaim")
            freed += self._apply(req, rk, decision)
            if decision is not None and self.strategy == "noop":
                pass
            self._stat(req)
            if freed >= num_blocks:
                break
        return freed

    # ----- bookkeeping ---------------------------------------------------------------------------
    def _unstat(self, req: Request) -> None:
        st = self._stats.pop(req, None)
        if st:
            self._live_total -= st[0]
            self._alloc_total -= st[1]

    def _stat(self, req: Request) -> None:
        rk = self.req_kv[req]
        st = rk.state
        live = int(st.live.sum())
        pages = rk.table >= 0
        alloc = int(self.tier_capacity[rk.page_tier[pages]].sum())
        tb = np.asarray(self.ctx.tier_bytes, dtype=np.float64)
        stored = float(tb[st.tier[st.live]].sum()) / self.rows
        read = self.policy.read_tokens(st, self.ctx)
        if read is None:
            # A paged kernel scans every slot of each page in the block table up to the sequence's
            # last written slot; evicted slots are masked, not skipped: holes cost their bytes.
            # Slots ever written (pos >= 0: live or evicted), weighted by their tier's bytes.
            kv = float(tb[st.tier[st.pos >= 0]].sum()) / self.rows
        else:
            kv = float(np.sum(read)) / self.rows
        self._stats[req] = (live, alloc, kv, int(pages.sum()), stored)
        self._live_total += live
        self._alloc_total += alloc

    def stored_token_equivalents(self) -> float:
        return sum(v[4] for v in self._stats.values())

    def check_invariants(self, live_requests) -> None:
        self.pool.check_invariants()
        seen = []
        for req, rk in self.req_kv.items():
            ids = rk.table[rk.table >= 0]
            seen.append(ids)
            st = rk.state
            valid = self._valid(rk)
            assert not (st.live & ~valid).any(), f"request {req.request_id}: live token outside a page"
            pos = np.where(st.live, st.pos, -1)
            for r in range(min(self.rows, 4)):
                p = pos[r][pos[r] >= 0]
                assert np.unique(p).size == p.size, f"request {req.request_id}: a position is live twice"
            assert (st.pos[st.live] < st.num_tokens).all()
        ids = np.concatenate(seen) if seen else np.zeros(0, dtype=np.int64)
        assert np.unique(ids).size == ids.size, "a block is in two tables"
        assert self.pool.owned[ids].all() and self.pool.owned.sum() == ids.size, "pool ownership drifted"
        assert set(self.req_kv) <= set(live_requests), "blocks held by a request that is not live"
        live = sum(int(rk.state.live.sum()) for rk in self.req_kv.values())
        assert live == self._live_total, f"live slot count drifted: {live} != {self._live_total}"
