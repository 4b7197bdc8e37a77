"""FastKVManager: the scheduler-facing surface of fast mode (allocation, freeing, the step's policy work, invariants)."""
from __future__ import annotations

import operator

import numpy as np

from ...core.request import Request
from ..base import EvictingManagerBase, sample_row_count
from ..importance import ImportanceModelSpec
from ..slots import SLOT_STRATEGIES, KVStepPlan, REUSE_STRATEGIES
from ..policy import EvictionPolicy, FastModeProfile, PolicyContext, PolicyError
from .budgets import CutBudgetMixin
from .reclaim import ReclaimMixin
from .recut import BUDGET_SENTINEL, RecutMixin
from .scoring import ScoringMixin
from .slab import APPEND, CountPool, SlabMixin
from .slots import SlotStrategyMixin
from .step import StepMixin

_first = operator.itemgetter(0)


class FastKVManager(SlabMixin, CutBudgetMixin, ScoringMixin, SlotStrategyMixin, StepMixin, ReclaimMixin, RecutMixin,
                    EvictingManagerBase):
    """The scheduler-facing fast-mode manager: allocation, freeing, the batched step, invariants."""

    def __init__(self, num_blocks: int, block_size: int, ctx: PolicyContext, policy: EvictionPolicy, *,
                 slot_strategy: str = "free_block", bytes_per_token_row: float = 0.0, seed: int = 0,
                 sample_rows: int = 32, importance: "str | ImportanceModelSpec" = "smollm2-135m"):
        if slot_strategy not in SLOT_STRATEGIES:
            raise ValueError(f"kv.slot_strategy must be one of {SLOT_STRATEGIES}, got {slot_strategy!r}")
        profile = policy.fast_mode_profile()
        if profile is None:
            raise PolicyError(f"kv.mode=fast: policy {policy.name!r} has no fast-mode profile; use kv.mode=token")
        self.block_size = block_size
        self.ctx, self.policy = ctx, policy
        # rows (layer, KV head) are alike in fast mode: simulate a divisor of them, each standing for `unit`
        self.real_rows = ctx.rows
        self.tracks_columns = slot_strategy != "noop"      # noop: counts decide every metric, rows are identical
        if not self.tracks_columns:
            sample_rows = 1
        self.rows = sample_row_count(ctx.rows, sample_rows) if sample_rows > 0 else ctx.rows
        self.unit = ctx.rows // self.rows
        self.budget = profile.budget
        self._mean_read = policy.mean_read      # selection policies: what attention reads
        self.window = int(profile.protect_recent)
        self.sink = int(profile.protect_first)
        self.age_weight = profile.age_weight
        # "oldest": the token leaving the window goes; "uniform": a uniformly drawn non-window token;
        # "young" (H2O): the lowest accumulated attention under the importance model (see _pick_scored)
        self.evict_leaving = self.age_weight == "oldest"
        # "prompt_only" (SnapKV): the prompt cut keeps `budget` per row (its newest `protect_recent`
        # included), decode never evicts
        self.cut_budget, self.cut_window = self.budget, self.window
        # per-step eviction without a prompt cut (h2o evict_per_step=1): the prompt is scored and listed
        # whole, decode evicts one token per row per step while over the budget
        self.prompt_cut = bool(profile.prompt_cut)
        if not self.prompt_cut:
            self._check_per_step(policy, profile)
            self.cut_budget = None
        self.prompt_only = bool(profile.prompt_only)
        if self.prompt_only:
            self.budget, self.window = None, 0
        self._init_cut_budgets(profile)
        self._init_recut(profile)
        if self.recut:                           # re-cuts evict; the kernel only keeps the lists
            self.budget = BUDGET_SENTINEL
        self._reclaim_target = profile.reclaim_target     # compress again under memory pressure
        if self._cut_budgets is not None and not (self.prompt_only or self.recut):
            raise PolicyError(f"kv.mode=fast: policy {policy.name!r}: per-row cut budgets need a prompt-only profile")
        self._strata = np.arange(ctx.rows).reshape(self.rows, self.unit)
        self.scored = self.age_weight == "young" and self.budget is not None
        self.cut_scored = self.age_weight == "young" and (self.cut_budget is not None or self._cut_budgets is not None
                                                          or not self.prompt_cut)
        self._scores = self.scored or self.cut_scored
        if self._scores:
            self._init_heads(importance, seed, int(profile.obs_window))
        self.strategy = slot_strategy
        self.append = slot_strategy in APPEND
        self.bytes_per_token_row = bytes_per_token_row
        self.pool = CountPool(num_blocks, self.unit)
        self.rng = np.random.default_rng([seed, 3])
        self.plan = KVStepPlan()
        self.logical_token_steps = 0
        self.stored_token_steps = 0.0
        self._live_total = 0
        self._pages_total = 0
        self.slot_of: dict[Request, int] = {}
        self._free_slots: list[int] = []
        self._pending: dict[int, int] = {}          # slot -> pages taken for this step's decode token (not yet written)
        self._ncol_hi = 0                           # >= every row's ncol: below the slab's width, pages open unchecked
        self._list_cap = 64 if self.recut else max(self.cut_budget or 0, self.budget or 0) + 2   # heavy-list entries per row
        self._cut_len: dict[int, int] = {}          # slot -> tokens at its prompt cut (re-cut intervals)
        self._alloc_arrays(4, 8)

    @staticmethod
    def _check_per_step(policy: EvictionPolicy, profile: FastModeProfile) -> None:
        if profile.age_weight != "young":
            raise PolicyError(f"kv.mode=fast: policy {policy.name!r} with kv.params.evict_per_step evicts the oldest "
                              f"tokens of a per-request window fast mode does not track; use kv.mode=token")
        if int(profile.per_step) != 1:
            raise PolicyError(f"kv.mode=fast: policy {policy.name!r}: kv.params.evict_per_step must be 1 in fast "
                              f"mode (got {profile.per_step}); use kv.mode=token for more")

    @property
    def req_blocks(self):
        return self.slot_of

    def kv_tokens(self, req) -> float:
        """Token-equivalents attention reads per row (holes included, as in token-level mode)."""
        s = self.slot_of.get(req)
        return self._read_l[s] / self.rows if s is not None else 0

    def block_table_entries(self, req) -> int:
        s = self.slot_of.get(req)
        if s is None:
            return 0
        return (self._pages_l[s] + self._pending.get(s, 0)) * self.unit   # pages this step's token opens count

    def slot_stats(self) -> tuple[int, int]:
        return self._live_total * self.unit, self._pages_total * self.block_size * self.unit

    def reclaim(self, num_blocks, running) -> int:
        if self._reclaim_target is None or num_blocks <= 0:
            return 0
        return self._reclaim_blocks(num_blocks, running)

    def blocks_needed(self, req, n: int, num_computed_blocks: int = 0) -> int:
        s = self.slot_of.get(req)
        if s is None:
            return self.real_rows * -(-n // self.block_size)
        return self._need(s, n) * self.unit

    def _need(self, s: int, n: int) -> int:
        bs = self.block_size
        if not self._prefilled_l[s]:
            t = int(self.ntok[s])
            return self.rows * (-(-(t + n) // bs) - -(-t // bs))
        # multi-token decode writes (rare) go one token at a time: a bound for the later tokens
        return self._need_l[s] + self.rows * -(-(n - 1) // bs)

    def _update_need(self, S: np.ndarray, need_rows: np.ndarray | None = None) -> None:
        """Pages each slot's next token takes, from its rows' [len(S), rows] needs."""
        self.need_next[S] = (self._need_rows(S) if need_rows is None else need_rows).sum(axis=1)
        self._need_l = self.need_next.tolist()

    def allocate_slots(self, req: Request, n: int, computed_blocks=None) -> bool:
        if n <= 0:
            return True
        s = self.slot_of.get(req)
        if n == 1 and s is not None and self._prefilled_l[s] and s not in self._pending:
            # the per-request hot path: pure Python; pages are placed by finish_step's batched write
            need = self._need_l[s]
            if need * self.unit > self.pool.num_free_blocks:
                return False
            self.pool.take(need)
            self._pending[s] = need
            return True
        need = self.rows * -(-n // self.block_size) if s is None else self._need(s, n)
        if need * self.unit > self.pool.num_free_blocks:
            return False
        s = self._slot(req)
        if not self._prefilled_l[s]:
            self._prefill_write(s, n)
        else:
            self._flush_one(s)
            self._decode_write_one(s, n)
        self._restat(np.array([s]))
        return True

    def allocate_decodes(self, reqs) -> list[float] | None:
        """Reserve one decode token's pages for every request in `reqs` at once (the scheduler's
        common step): the contexts (kv_tokens before the step) when all fit, else None with nothing
        reserved, exactly as allocate_slots(req, 1) per request would have succeeded or not."""
        slot_of, pending, prefilled, need_l = self.slot_of, self._pending, self._prefilled_l, self._need_l
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
        read_l, rows = self._read_l, self.rows
        return [read_l[s] / rows for s in slots]

    def _prefill_write(self, s: int, n: int) -> None:
        """Before the cut every row holds the same tokens densely: columns are filled in order."""
        bs = self.block_size
        t = int(self.ntok[s])
        end = t + n
        cols = -(-end // bs)
        self._ensure_cols(cols)
        first = -(-t // bs)
        self.pool.take(self.rows * (cols - first))
        c = np.arange(t // bs, cols)
        self.occ[s, :, c[0]:cols] = np.clip(end - c * bs, 0, bs)[None, :]
        self.alive[s, :, first:cols] = True
        self.pages[s] = cols
        self.ncol[s] = cols
        self._ncol_hi = max(self._ncol_hi, cols)
        self.tail[s] = cols - 1
        self.tail_w[s] = end - (cols - 1) * bs
        self.live[s] = end
        self.ntok[s] = end
        if self.strategy in REUSE_STRATEGIES:              # a chunked prefill leaves the last page open
            self.hole_col[s] = cols - 1 if end % bs else -1

    def _decode_write_one(self, s: int, n: int) -> None:
        """Rare path: a multi-token decode write (one token at a time through the batched step)."""
        for _ in range(n):
            self.pool.take(self._need_l[s])
            self._step(np.array([s]))

    def _flush_one(self, s: int) -> None:
        if self._pending.pop(s, None) is not None:
            self._step(np.array([s]))

    def free(self, req: Request) -> int:
        s = self.slot_of.get(req)
        if s is None:
            return 0
        n = int(self.pages[s].sum()) + self._pending.pop(s, 0)
        self.pool.give(n)
        self._release_slot(req, s)
        return n * self.unit

    def finish_step(self, scheduled) -> KVStepPlan:
        slot_get, pending_pop, prefilled = self.slot_of.get, self._pending.pop, self._prefilled_l
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
                before = self.plan.evicted_tokens
                self._finish_prefill(s)
                self._note_evicted(req, self.plan.evicted_tokens - before)
                self._restat(np.array([s]))
        if dec:
            # in slab order the step walks its rows' memory ascending (a third faster on 1,000 requests)
            dec.sort(key=_first)
            evicted = self._step(np.fromiter(map(_first, dec), np.int64, len(dec)))
            if any(evicted):
                for (_, req), k in zip(dec, evicted):
                    if k:
                        req.kv_evicted_tokens += k / self.rows
            if self.recut:
                self._recut_step(dec)
        live_l = self._live_l
        self.logical_token_steps += logical
        self.stored_token_steps += sum([live_l[s] for s in slots]) / self.rows
        plan, self.plan = self.plan, KVStepPlan()
        plan.evicted_tokens *= self.unit
        plan.blocks_freed_by_eviction *= self.unit
        plan.bytes_moved *= self.unit
        return plan

    def _note_evicted(self, req, n: int) -> None:
        if n:
            req.kv_evicted_tokens += n / self.rows

    def check_invariants(self, live_requests) -> None:
        self.pool.check_invariants()
        slots = np.fromiter(self.slot_of.values(), np.int64, len(self.slot_of))
        held = (int(self.pages[slots].sum()) + sum(self._pending.values())) * self.unit
        assert self.pool.num_used_blocks == held, f"pool ownership drifted: {self.pool.num_used_blocks} != {held}"
        assert set(self.slot_of) <= set(live_requests), "pages held by a request that is not live"
        occ, alive = self.occ[slots], self.alive[slots]
        assert (self.pages[slots] == alive.sum(axis=2)).all(), "page count drifted"
        assert self._live_total == int(self.live[slots].sum()), "live slot total drifted"
        assert self._pages_total == int(self.pages[slots].sum()), "page total drifted"
        assert int(self.ncol.max()) <= self._ncol_hi, "column bound drifted"
        assert self._need_l == self.need_next.tolist() and self._prefilled_l == self.prefilled.tolist(), \
            "scheduler-facing mirrors drifted"
        if not self.tracks_columns:
            return
        if self.strategy in REUSE_STRATEGIES:                 # first-free pointers: the first column with a free slot
            free = alive & (occ < self.block_size)
            first = np.where(free.any(axis=2), np.argmax(free, axis=2), -1)
            assert (self.hole_col[slots] == first).all(), "first-free pointer drifted"
            assert (alive == (occ > 0)).all(), "an empty page is held (reuse strategies free it at once)"
        assert ((occ >= 0) & (occ <= self.block_size)).all(), "page occupancy out of range"
        assert not (occ * ~alive).any(), "live tokens in a freed page"
        assert (self.live[slots] == occ.sum(axis=2)).all(), "live count drifted"
        assert ((self.win[slots] >= 0) & (self.win[slots] <= occ)).all(), "window count out of range"
        if self.budget is not None:                 # heavy list = the columns of the live non-window tokens
            pf = slots[self.prefilled[slots]]
            P, Hc = self.occ.shape[2], self.heavy.shape[2]
            listed = np.arange(Hc)[None, None, :] < self.hn[pf][:, :, None]
            page = (np.arange(pf.size * self.rows).reshape(pf.size, self.rows, 1) * P + self.heavy[pf])[listed]
            held = np.bincount(page, minlength=pf.size * self.rows * P).reshape(pf.size, self.rows, P)
            assert (held == self.occ[pf] - self.win[pf]).all(), "heavy list drifted from the non-window tokens"
