"""FastKVManager: the scheduler-facing surface of fast mode (allocation, freeing, the step's policy
work, invariants), over the components that do the work:

    settings  FastSettings      the run's constants, resolved once from the profile and the options
    heads     Heads | None      the simulated rows' attention parameters (scored policies)
    budgets   CutBudgets        each row's keep at a cut; when a re-cut fires
    slab      FastSlab          the per-slot arrays, the slot map, the scheduler's mirrors
    ledger    Ledger            the count pool and the step's plan
    scorer    Scorer            which token goes; the heavy lists
    slots     SlotStrategy      how pages answer evictions; pages the next token takes
    step      FastStep          the prompt cut and the batched decode step
    recut     Recut | None      decode-time re-cuts (SnapKV decode compression)
    reclaimer Reclaim | None    compression under memory pressure (KV-Compress)
"""
from __future__ import annotations

import operator

import numpy as np

from ...core.request import Request
from ..base import EvictingManagerBase, FastOptions
from ..policy import EvictionPolicy, PolicyContext
from ..slots import REUSE_STRATEGIES, KVStepEffects
from .budgets import CutBudgets, budget_order_key
from .reclaim import Reclaim
from .recut import Recut
from .scoring import Scorer, sample_heads
from .settings import resolve_settings
from .slab import CountPool, FastSlab, Ledger, note_evicted
from .slots import SlotStrategy
from .step import FastStep

_first = operator.itemgetter(0)


class FastKVManager(EvictingManagerBase):
    """The scheduler-facing fast-mode manager: allocation, freeing, the batched step, invariants."""

    def __init__(self, num_blocks: int, block_size: int, ctx: PolicyContext, policy: EvictionPolicy,
                 options: FastOptions = FastOptions()):
        self.settings = cfg = resolve_settings(block_size, ctx, policy, options)
        profile = policy.fast_mode_profile()
        self.block_size, self.ctx, self.policy = block_size, ctx, policy
        # rows (layer, KV head) are alike in fast mode: simulate a divisor of them, each standing for `unit`
        self.rows, self.unit = cfg.rows, cfg.unit
        self.heads = None
        strata = np.arange(ctx.rows).reshape(cfg.rows, cfg.unit)
        if cfg.scores:
            self.heads = sample_heads(ctx, options.importance, options.seed, (cfg.rows, cfg.unit),
                                      budget_order_key(profile.cut_budgets, ctx), int(profile.obs_window))
            strata = self.heads.strata
        self.budgets = CutBudgets(cfg, profile, ctx, strata)
        mean_read = policy.mean_read          # selection policies: what attention reads
        self.slab = FastSlab(cfg, self.heads, None if mean_read is None else lambda live: mean_read(live, ctx))
        self.ledger = Ledger(CountPool(num_blocks, cfg.unit), cfg.bytes_per_token_row)
        self.pool = self.ledger.pool
        rng = np.random.default_rng([options.seed, 3])
        self.scorer = Scorer(cfg, self.slab, self.heads, rng, self.budgets)
        self.slots = SlotStrategy(cfg, self.slab, self.ledger, self.scorer)
        self.step = FastStep(cfg, self.slab, self.ledger, rng, self.budgets, self.scorer, self.slots)
        self.recut = Recut(cfg, self.slab, self.ledger, self.budgets, self.slots, self.heads) if cfg.recut else None
        self.reclaimer = None               # KV-Compress compresses again under memory pressure
        if profile.reclaim_target is not None:
            self.reclaimer = Reclaim(cfg, self.slab, self.ledger, rng, self.slots, profile.reclaim_target)
        self.logical_token_steps = 0
        self.stored_token_steps = 0.0
        self._pending: dict[int, int] = {}          # slot -> pages taken for this step's decode token (not yet written)

    @property
    def req_blocks(self):
        return self.slab.slot_of

    def kv_tokens(self, req) -> float:
        """Token-equivalents attention reads per row (holes included, as in token-level mode)."""
        s = self.slab.slot_of.get(req)
        return self.slab.read_l[s] / self.rows if s is not None else 0

    def block_table_entries(self, req) -> int:
        s = self.slab.slot_of.get(req)
        if s is None:
            return 0
        return (self.slab.pages_l[s] + self._pending.get(s, 0)) * self.unit   # pages this step's token opens count

    def slot_stats(self) -> tuple[int, int]:
        return self.slab.live_total * self.unit, self.slab.pages_total * self.block_size * self.unit

    def reclaim(self, num_blocks, running) -> int:
        if self.reclaimer is None or num_blocks <= 0:
            return 0
        return self.reclaimer.reclaim(num_blocks, running, self._flush_one)

    def blocks_needed(self, req, n: int, num_computed_blocks: int = 0) -> int:
        s = self.slab.slot_of.get(req)
        if s is None:
            return self.ctx.rows * -(-n // self.block_size)
        return self._need(s, n) * self.unit

    def _need(self, s: int, n: int) -> int:
        bs, slab = self.block_size, self.slab
        if not slab.prefilled_l[s]:
            t = int(slab.ntok[s])
            return self.rows * (-(-(t + n) // bs) - -(-t // bs))
        # multi-token decode writes (rare) go one token at a time: a bound for the later tokens
        return slab.need_l[s] + self.rows * -(-(n - 1) // bs)

    def allocate_slots(self, req: Request, n: int, computed_blocks=None) -> bool:
        slab = self.slab
        s = slab.slot_of.get(req)
        if s is None and req.num_computed_tokens:
            n += req.num_computed_tokens     # loaded by a KV connector (no prefix cache here): written with the new ones
        if n <= 0:
            return True
        if n == 1 and s is not None and slab.prefilled_l[s] and s not in self._pending:
            # the per-request hot path: pure Python; pages are placed by finish_step's batched write
            need = slab.need_l[s]
            if need * self.unit > self.pool.num_free_blocks:
                return False
            self.pool.take(need)
            self._pending[s] = need
            return True
        need = self.rows * -(-n // self.block_size) if s is None else self._need(s, n)
        if need * self.unit > self.pool.num_free_blocks:
            return False
        s = slab.slot(req)
        if not slab.prefilled_l[s]:
            self._prefill_write(s, n)
        else:
            self._flush_one(s)
            self._decode_write_one(s, n)
        slab.restat(np.array([s]))
        return True

    def allocate_decodes(self, reqs) -> list[float] | None:
        """Reserve one decode token's pages for every request in `reqs` at once (the scheduler's
        common step): the contexts (kv_tokens before the step) when all fit, else None with nothing
        reserved, exactly as allocate_slots(req, 1) per request would have succeeded or not."""
        slab = self.slab
        slot_of, pending, prefilled, need_l = slab.slot_of, self._pending, slab.prefilled_l, slab.need_l
        slots = []
        total = 0
        for req in reqs:
            s = slot_of.get(req)
            if s is None or not prefilled[s] or s in pending:
                return None
            slots.append(s)
            total += need_l[s]
        if total * self.unit > self.pool.num_free_blocks:
            return None
        self.pool.take(total)
        for s in slots:
            pending[s] = need_l[s]
        read_l, rows = slab.read_l, self.rows
        return [read_l[s] / rows for s in slots]

    def _prefill_write(self, s: int, n: int) -> None:
        """Before the cut every row holds the same tokens densely: columns are filled in order."""
        bs, slab = self.block_size, self.slab
        t = int(slab.ntok[s])
        end = t + n
        cols = -(-end // bs)
        slab.ensure_cols(cols)
        first = -(-t // bs)
        self.pool.take(self.rows * (cols - first))
        c = np.arange(t // bs, cols)
        slab.occ[s, :, c[0]:cols] = np.clip(end - c * bs, 0, bs)[None, :]
        slab.alive[s, :, first:cols] = True
        slab.pages[s] = cols
        slab.ncol[s] = cols
        slab.ncol_hi = max(slab.ncol_hi, cols)
        slab.tail[s] = cols - 1
        slab.tail_w[s] = end - (cols - 1) * bs
        slab.live[s] = end
        slab.ntok[s] = end
        if self.settings.strategy in REUSE_STRATEGIES:     # a chunked prefill leaves the last page open
            slab.hole_col[s] = cols - 1 if end % bs else -1

    def _decode_write_one(self, s: int, n: int) -> None:
        """Rare path: a multi-token decode write (one token at a time through the batched step)."""
        for _ in range(n):
            self.pool.take(self.slab.need_l[s])
            self.step.step(np.array([s]))

    def _flush_one(self, s: int) -> None:
        if self._pending.pop(s, None) is not None:
            self.step.step(np.array([s]))

    def free(self, req: Request) -> int:
        s = self.slab.slot_of.get(req)
        if s is None:
            return 0
        n = int(self.slab.pages[s].sum()) + self._pending.pop(s, 0)
        self.pool.give(n)
        self.slab.release(req, s)
        self.budgets.cut_len.pop(s, None)
        return n * self.unit

    def finish_step(self, scheduled) -> KVStepEffects:
        slab, ledger = self.slab, self.ledger
        slot_get, pending_pop, prefilled = slab.slot_of.get, self._pending.pop, slab.prefilled_l
        dec, slots = [], []
        logical = 0
        for sch in scheduled:
            req = sch.request
            s = slot_get(req)
            if s is None:
                continue
            slots.append(s)
            computed = req.num_computed_tokens + sch.num_new_tokens
            logical += computed
            if pending_pop(s, None) is not None:
                dec.append((s, req))
            elif sch.is_prefill and not prefilled[s] and computed >= req.num_tokens:
                before = ledger.effects.evicted_tokens
                self.step.finish_prefill(s)
                note_evicted(req, ledger.effects.evicted_tokens - before, self.rows)
                slab.restat(np.array([s]))
        if dec:
            # in slab order the step walks its rows' memory ascending (a third faster on 1,000 requests)
            dec.sort(key=_first)
            evicted = self.step.step(np.fromiter(map(_first, dec), np.int64, len(dec)))
            if any(evicted):
                for (_, req), k in zip(dec, evicted, strict=False):
                    if k:
                        req.kv_evicted_tokens += k / self.rows
            if self.recut is not None:
                self.recut.after_decode(dec)
        live_l = slab.live_l
        self.logical_token_steps += logical
        self.stored_token_steps += sum([live_l[s] for s in slots]) / self.rows
        plan = ledger.take_effects()
        plan.evicted_tokens *= self.unit
        plan.blocks_freed_by_eviction *= self.unit
        plan.bytes_moved *= self.unit
        return plan

    def check_invariants(self, live_requests) -> None:
        slab, bs = self.slab, self.block_size
        self.pool.check_invariants()
        slots = np.fromiter(slab.slot_of.values(), np.int64, len(slab.slot_of))
        held = (int(slab.pages[slots].sum()) + sum(self._pending.values())) * self.unit
        assert self.pool.num_used_blocks == held, f"pool ownership drifted: {self.pool.num_used_blocks} != {held}"
        assert set(slab.slot_of) <= set(live_requests), "pages held by a request that is not live"
        occ, alive = slab.occ[slots], slab.alive[slots]
        assert (slab.pages[slots] == alive.sum(axis=2)).all(), "page count drifted"
        assert slab.live_total == int(slab.live[slots].sum()), "live slot total drifted"
        assert slab.pages_total == int(slab.pages[slots].sum()), "page total drifted"
        assert int(slab.ncol.max()) <= slab.ncol_hi, "column bound drifted"
        assert slab.need_l == slab.need_next.tolist() and slab.prefilled_l == slab.prefilled.tolist(), \
            "scheduler-facing mirrors drifted"
        if not self.settings.tracks_columns:
            return
        if self.settings.strategy in REUSE_STRATEGIES:        # first-free pointers: the first column with a free slot
            free = alive & (occ < bs)
            first = np.where(free.any(axis=2), np.argmax(free, axis=2), -1)
            assert (slab.hole_col[slots] == first).all(), "first-free pointer drifted"
            assert (alive == (occ > 0)).all(), "an empty page is held (reuse strategies free it at once)"
        assert ((occ >= 0) & (occ <= bs)).all(), "page occupancy out of range"
        assert not (occ * ~alive).any(), "live tokens in a freed page"
        assert (slab.live[slots] == occ.sum(axis=2)).all(), "live count drifted"
        assert ((slab.win[slots] >= 0) & (slab.win[slots] <= occ)).all(), "window count out of range"
        if self.settings.budget is not None:        # heavy list = the columns of the live non-window tokens
            pf = slots[slab.prefilled[slots]]
            P, Hc = slab.occ.shape[2], slab.heavy.shape[2]
            listed = np.arange(Hc)[None, None, :] < slab.hn[pf][:, :, None]
            page = (np.arange(pf.size * self.rows).reshape(pf.size, self.rows, 1) * P + slab.heavy[pf])[listed]
            held = np.bincount(page, minlength=pf.size * self.rows * P).reshape(pf.size, self.rows, P)
            assert (held == slab.occ[pf] - slab.win[pf]).all(), "heavy list drifted from the non-window tokens"
