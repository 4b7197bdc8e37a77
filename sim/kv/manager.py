"""Eviction-aware paged KV manager: layouts, slot state, slot strategies, triggers, step plans.

Stands in for `sim.core.kv_manager.KVCacheManager` (same scheduler-facing surface) when a KV
policy, the per_head layout or a slot strategy other than the default is configured. The same
manager drives the real backend: it tells the executor, per step, what to do on tensors
(`KVStepEffects`) and accepts real attention scores (`supply_scores`).

Layouts: `shared` (one block table per request, a block holds `block_size` tokens of every layer
and KV head; state has one row) and `per_head` (tables per (request, layer, KV head); a block
holds tokens of one row; `num_blocks` counts per-head blocks). Pages, precision groups, slot ids and
the slot strategies (what happens to the hole an evicted token leaves) are in sim/kv/slots.py.

Triggers (when the policy's `compress` runs): `never`, `every_step`, `every_n` (every
`trigger_interval` decode steps), `after_prefill`, `after_prefill+pressure`, `pressure` (only
from `reclaim`), `threshold` (when tokens added since the last compression reach
`trigger_threshold`). `reclaim` (the scheduler's hook before a preemption) asks the policy to
evict whenever the trigger includes `pressure`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..core.request import Request
from .base import EvictingManagerBase
from .importance import ImportanceSource
from .policy import Decision, EvictionPolicy, PolicyContext
from .pool import ArrayBlockPool
from .slots import (FREEING_STRATEGIES, REUSE_STRATEGIES, SLOT_STRATEGIES, KVStepEffects,
                    RequestKV, SlotStrategies)
from .state import PRECISION_FULL

TRIGGERS = ("policy", "never", "every_step", "every_n", "after_prefill", "after_prefill+pressure", "pressure",
            "threshold")


@dataclass(frozen=True)
class EvictingOptions:
    """The token-level manager's options (resolved once from `kv:` by sim/kv/build.py)."""
    slot_strategy: str = "free_block"
    trigger: str = "policy"
    trigger_interval: int = 1
    trigger_threshold: int = 0
    bytes_per_token_row: float = 0.0
    precision_capacity: tuple[int, int, int] | None = None
    new_token_precision: int = PRECISION_FULL
    copy_threshold: int = 0              # copy strategies: holes a row may hold before its rewrite


class ReqStats(NamedTuple):
    """One request's numbers after its last change (what the scheduler and the step log read)."""
    live: int           # live token-rows
    alloc: int          # slots of its pages (precision group capacities)
    kv_tokens: float    # fp16 token-equivalents attention reads per row
    pages: int          # block-table entries
    stored: float       # fp16 token-equivalents stored per row (token-steps of the stored-KV metric)


class EvictingKVManager(SlotStrategies, EvictingManagerBase):
    """Token-level eviction-aware manager: per-request pages and token state, policies run per step."""

    def __init__(self, num_blocks: int, block_size: int, ctx: PolicyContext, policy: EvictionPolicy,
                 importance: ImportanceSource | None = None, options: EvictingOptions = EvictingOptions()):
        slot_strategy, trigger = options.slot_strategy, options.trigger
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
        self.copy_threshold = options.copy_threshold
        self.trigger = policy.default_trigger if trigger == "policy" else trigger
        self.trigger_interval = max(1, options.trigger_interval)
        self.trigger_threshold = options.trigger_threshold
        self.bytes_per_token_row = options.bytes_per_token_row
        self.precision_capacity = np.asarray(options.precision_capacity or (block_size, block_size, block_size), dtype=np.int64)
        self.stride = int(self.precision_capacity.max())
        self.new_token_precision = options.new_token_precision
        # Quality proxy: query the importance model for the attention mass kept even when the
        # policy itself needs no scores (streaming); off for policies that never evict.
        self.track_mass = policy.evicts
        self.logical_token_steps = 0      # sum over steps of the scheduled requests' logical tokens
        self.stored_token_steps = 0.0     # ... and of their stored fp16 token-equivalents per row
        self.pool = ArrayBlockPool(num_blocks, "ring" if slot_strategy == "parallel_compact" else "stack")
        self.req_kv: dict[Request, RequestKV] = {}
        self.effects = KVStepEffects()
        self._external: dict[int, np.ndarray] = {}
        self._live_total = 0
        self._alloc_total = 0
        self._stats: dict[Request, ReqStats] = {}

    # ----- scheduler-facing surface (as KVCacheManager) ------------------------------------------
    @property
    def req_blocks(self):
        return self.req_kv

    def kv_tokens(self, req: Request) -> float:
        """fp16 token-equivalents attention reads per row: every written slot of the row's pages, live
        or evicted (a paged kernel masks holes but still reads them), precision groups weighted by their bytes;
        selection policies count only what they read."""
        st = self._stats.get(req)
        return st.kv_tokens if st else 0

    def block_table_entries(self, req: Request) -> int:
        st = self._stats.get(req)
        return st.pages if st else 0

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
            rk.state.request_id = req.request_id
            rk.state.prompt_tokens = req.prompt_tokens
            self.policy.on_admit(rk.state, self.ctx)
        return rk

    def blocks_needed(self, req: Request, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        rk = self.req_kv.get(req) or RequestKV(self.rows, self.stride)
        return int(self._needs(rk, num_new_tokens)[0].sum() + self._needs(rk, num_new_tokens)[1].sum())

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks=None) -> bool:
        """Slots for `num_new_tokens` from the request's computed tokens. A request this manager holds
        nothing for whose leading tokens are computed already had them supplied by a KV connector (loaded
        from a CPU tier: no prefix cache here): they are written with the new ones, as the load fills
        the pages (`_external_prefix`)."""
        loaded = self._external_prefix(req)
        if num_new_tokens + loaded <= 0:
            return True
        rk = self._rk(req)
        num_write = num_new_tokens + loaded
        need, copy_dst = self._needs(rk, num_write)
        if need.sum() + copy_dst.sum() > self.pool.num_free_blocks:
            if rk.num_entries == 0 and rk.state.num_tokens == 0:
                del self.req_kv[req]
            return False
        self._unstat(req)
        if copy_dst.any():
            self._sparse_copy(rk, copy_dst)
        self._add_pages(rk, need, self.new_token_precision)
        positions = np.arange(req.num_computed_tokens - loaded, req.num_computed_tokens + num_new_tokens)
        if positions[0] != rk.state.num_tokens:
            raise AssertionError(f"request {req.request_id}: writing position {positions[0]} but "
                                 f"{rk.state.num_tokens} tokens are cached")
        num_new_tokens = num_write
        slots = self._place(rk, np.full(self.rows, num_new_tokens), self.new_token_precision)
        st = rk.state
        r = np.arange(self.rows)[:, None]
        st.clear_slots(np.broadcast_to(r, slots.shape), slots)
        st.live[r, slots] = True
        st.pos[r, slots] = positions[None, :]
        st.precision[r, slots] = self.new_token_precision
        st.num_tokens += num_new_tokens
        rk.added_since_compress += num_new_tokens
        self.importance.on_write(req.request_id, st, np.arange(self.rows), slots, positions)
        self.effects.slot_mapping[req.request_id] = np.take_along_axis(rk.table, slots // self.stride, 1) \
            * self.stride + slots % self.stride
        self._stat(req)
        return True

    def _external_prefix(self, req: Request) -> int:
        """Computed tokens of `req` that this manager never wrote: a connector's load (0 otherwise). A
        request the manager holds tokens for must continue where they end (checked at the write)."""
        rk = self.req_kv.get(req)
        if req.num_computed_tokens and (rk is None or rk.state.num_tokens == 0):
            return req.num_computed_tokens      # no prefix cache, no swap here (swap-in allocates from 0)
        return 0

    def free(self, req: Request) -> int:
        rk = self.req_kv.pop(req, None)
        if rk is None:
            return 0
        self._unstat(req)
        ids = rk.table[rk.table >= 0]
        self.pool.free_blocks(ids[::-1])
        if rk.mass_steps:
            req.kv_mass_sum += rk.mass_sum
            req.kv_mass_steps += rk.mass_steps
        req.kv_evicted_tokens += rk.evicted_rows / self.rows
        self.importance.release(req.request_id)
        self._external.pop(req.request_id, None)
        return int(ids.size)

    # ----- per-step policy application ----------------------------------------------------------
    def supply_scores(self, req: Request, scores: np.ndarray) -> None:
        """Real backend: this step's attention for `req` ([rows, S] decode, [w, rows, S] prefill),
        used instead of the importance model."""
        self._external[req.request_id] = scores

    def begin_step(self) -> None:
        self.effects = KVStepEffects()

    def finish_step(self, scheduled) -> KVStepEffects:
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
                self.stored_token_steps += self._stats[req].stored
        plan = self.effects
        self.effects = KVStepEffects()
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
            self.effects.op_bytes += cost[0]
            self.effects.op_flops += cost[1]

    def _after_decode(self, req: Request, rk: RequestKV) -> None:
        rk.decode_steps += 1
        scores, mass = self._scores(req, rk, "decode")
        if not self.policy.needs_scores:
            scores = None
        if mass is not None:
            rk.mass_sum += mass
            rk.mass_steps += 1
            self.effects.mass_retained[req.request_id] = mass
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
                self.effects.evicted_tokens += n
                tbl = rk.table[r, s // self.stride]
                self.effects.evicted[req.request_id] = (r, tbl * self.stride + s % self.stride)
                self.effects.decisions.append((req.request_id, r, st.pos[r, s], rk.decode_steps, st.num_tokens))
        if decision.precision is not None:
            self._move_precision(rk, decision.precision)
        if self.strategy in FREEING_STRATEGIES:
            freed += self._free_empty_pages(rk)
        if self.strategy in ("compact", "parallel_compact"):
            freed += self._compact(rk)
        return freed

    # ----- memory pressure ----------------------------------------------------------------------
    def reclaim(self, num_blocks: int, running: list[Request]) -> int:
        """Compress running requests (newest first) until `num_blocks` pages are free, if the trigger
        allows it; returns pages freed (0 = preempt)."""
        if "pressure" not in self.trigger or num_blocks <= 0:
            return 0
        freed = 0
        cap = int(self.precision_capacity[self.new_token_precision])
        for req in reversed(running):
            rk = self.req_kv.get(req)
            if rk is None or not rk.prefilled:
                continue
            self._unstat(req)
            decision = self.policy.reclaim(rk.state, self.ctx, (num_blocks - freed) * cap)
            if decision is not None:
                self._charge(rk, "reclaim")
            freed += self._apply(req, rk, decision)
            self._stat(req)
            if freed >= num_blocks:
                break
        return freed

    # ----- bookkeeping ---------------------------------------------------------------------------
    def _unstat(self, req: Request) -> None:
        st = self._stats.pop(req, None)
        if st:
            self._live_total -= st.live
            self._alloc_total -= st.alloc

    def _stat(self, req: Request) -> None:
        rk = self.req_kv[req]
        st = rk.state
        live = int(st.live.sum())
        pages = rk.table >= 0
        alloc = int(self.precision_capacity[rk.page_precision[pages]].sum())
        tb = np.asarray(self.ctx.precision_bytes, dtype=np.float64)
        stored = float(tb[st.precision[st.live]].sum()) / self.rows
        read = self.policy.read_tokens(st, self.ctx)
        if read is None:  # noqa: SIM108  (the why of each branch)
            # A paged kernel scans every slot of each page in the block table up to the sequence's
            # last written slot; evicted slots are masked, not skipped: holes cost their bytes.
            # Slots ever written (pos >= 0: live or evicted), weighted by their precision group's bytes.
            kv = float(tb[st.precision[st.pos >= 0]].sum()) / self.rows
        else:
            kv = float(np.sum(read)) / self.rows
        self._stats[req] = ReqStats(live, alloc, kv, int(pages.sum()), stored)
        self._live_total += live
        self._alloc_total += alloc

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
                t = rk.tail[r]
                if self.strategy not in REUSE_STRATEGIES and t >= 0:      # an append tail's next slots are unwritten
                    cap = int(self.precision_capacity[rk.page_precision[r, t]])
                    ahead = st.pos[r, t * self.stride + rk.tail_off[r]:t * self.stride + cap]
                    assert (ahead < 0).all(), f"request {req.request_id}: the append tail runs into written slots"
            assert (st.pos[st.live] < st.num_tokens).all()
        ids = np.concatenate(seen) if seen else np.zeros(0, dtype=np.int64)
        assert np.unique(ids).size == ids.size, "a block is in two tables"
        assert self.pool.owned[ids].all() and self.pool.owned.sum() == ids.size, "pool ownership drifted"
        assert set(self.req_kv) <= set(live_requests), "blocks held by a request that is not live"
        live = sum(int(rk.state.live.sum()) for rk in self.req_kv.values())
        assert live == self._live_total, f"live slot count drifted: {live} != {self._live_total}"
