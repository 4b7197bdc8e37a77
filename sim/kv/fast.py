"""Block-occupancy fast mode: per-(request, row) page occupancy instead of token-level state.

For large traces. Each request keeps, per row (layer, KV head), the live-token count of each of its
pages in the order the pages were created (`occ [rows, E]`) and how many slots of each were ever
written (`written`). No attention is computed: a policy's `fast_mode_profile()` says how many
tokens each row keeps (`budget`), which ones are protected (`protect_first` oldest, `protect_recent`
newest) and where evictions fall among the rest (`age_weight`: "oldest" — oldest first, as
StreamingLLM; "young" — next to the recent window, decaying over about one page, as H2O's
accumulated-attention ranking does to tokens that just left the window; "uniform"). A prompt cut
after prefill evicts proportionally over the evictable pages (the survivors of a score ranking are
spread over the prompt); decode-step evictions are drawn per row from that distribution with a
numpy Generator seeded per request. Slot strategies act on the occupancy counts exactly as they do
on slots in token-level mode. Validated against token-level mode (tests/test_kv_fast.py).
"""
from __future__ import annotations

import numpy as np

from ..core.request import Request
from .manager import SLOT_STRATEGIES, KVStepPlan, _FREES, _REUSE
from .policy import EvictionPolicy, PolicyContext, PolicyError
from .pool import ArrayBlockPool


class _FastReq:
    def __init__(self, rows: int, seed: int, req_id: int):
        self.occ = np.zeros((rows, 0), dtype=np.int64)
        self.fresh = np.zeros((rows, 0), dtype=np.int64)     # live tokens written during decode
        self.written = np.zeros((rows, 0), dtype=np.int64)
        self.ids = np.full((rows, 0), -1, dtype=np.int64)
        self.num_tokens = 0
        self.prefilled = False
        self.rng = np.random.default_rng([seed, 3, req_id])

    def add_pages(self, need: np.ndarray, pool: ArrayBlockPool, plan: KVStepPlan) -> None:
        total = int(need.sum())
        if not total:
            return
        rows = self.occ.shape[0]
        k = int(need.max())
        E = self.occ.shape[1]
        self.occ = np.concatenate([self.occ, np.zeros((rows, k), dtype=np.int64)], axis=1)
        self.written = np.concatenate([self.written, np.zeros((rows, k), dtype=np.int64)], axis=1)
        self.fresh = np.concatenate([self.fresh, np.zeros((rows, k), dtype=np.int64)], axis=1)
        new = np.full((rows, k), -1, dtype=np.int64)
        mask = np.arange(k)[None, :] < need[:, None]
        ids = pool.get_new_blocks(total)
        new[mask] = ids
        plan.allocated_blocks.append(ids)
        self.ids = np.concatenate([self.ids, new], axis=1)
        # rows that needed fewer pages keep placeholders; compact so pages stay in creation order
        if not mask.all():
            self._squeeze()
        del E

    def _squeeze(self) -> None:
        """Drop placeholder / freed columns (ids == -1), keeping each row's page order."""
        keep = self.ids >= 0
        n = keep.sum(axis=1)
        width = int(n.max()) if n.size else 0
        order = np.argsort(~keep, axis=1, kind="stable")[:, :width]
        valid = np.arange(width)[None, :] < n[:, None]
        for name in ("occ", "written", "fresh", "ids"):
            arr = np.take_along_axis(getattr(self, name), order, axis=1)
            arr[~valid] = -1 if name == "ids" else 0
            setattr(self, name, arr)


class FastKVManager:
    supports_fast_forward = False
    enable_caching = False

    def __init__(self, num_blocks: int, block_size: int, ctx: PolicyContext, policy: EvictionPolicy, *,
                 slot_strategy: str = "free_block", bytes_per_token_row: float = 0.0, seed: int = 0):
        if slot_strategy not in SLOT_STRATEGIES:
            raise ValueError(f"kv.slot_strategy must be one of {SLOT_STRATEGIES}, got {slot_strategy!r}")
        profile = policy.fast_mode_profile()
        if profile is None:
            raise PolicyError(f"kv.mode=fast: policy {policy.name!r} has no fast-mode profile; use kv.mode=token")
        self.block_size = block_size
        self.ctx, self.rows, self.policy = ctx, ctx.rows, policy
        self.budget = profile.get("budget")
        self.protect_recent = profile.get("protect_recent", 0)
        self.protect_first = profile.get("protect_first", 0)
        self.age_weight = profile.get("age_weight", "uniform")
        self.old_weight = float(profile.get("old_weight", 0.3))   # "young": odds of a prompt survivor vs a decode token
        self.strategy = slot_strategy
        self.seed = seed
        self.bytes_per_token_row = bytes_per_token_row
        self.pool = ArrayBlockPool(num_blocks, "ring" if slot_strategy == "parallel_compact" else "stack")
        self.reqs: dict[Request, _FastReq] = {}
        self.plan = KVStepPlan()
        self.num_prefix_queries = self.num_prefix_hits = 0
        self.logical_token_steps = 0
        self.stored_token_steps = 0.0
        self._live_total = 0
        self._alloc_total = 0
        self._stats: dict[Request, tuple[int, int, float, int]] = {}

    # ----- scheduler-facing surface ------------------------------------------------------------
    @property
    def req_blocks(self):
        return self.reqs

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def capacity_tokens(self) -> int:
        return self.pool.num_blocks // self.rows * self.block_size

    def max_tokens_per_request(self) -> int:
        return self.capacity_tokens()

    def get_computed_blocks(self, req):
        return []

    def record_prefix_lookup(self, *a) -> None:
        pass

    def kv_tokens(self, req) -> float:
        st = self._stats.get(req)
        return st[2] if st else 0

    def block_table_entries(self, req) -> int:
        st = self._stats.get(req)
        return st[3] if st else 0

    def slot_stats(self) -> tuple[int, int]:
        return self._live_total, self._alloc_total

    def reclaim(self, num_blocks, running) -> int:
        return 0

    # ----- allocation ----------------------------------------------------------------------------
    def _room(self, fr: _FastReq) -> np.ndarray:
        """Slots per row new tokens may take without a new page."""
        bs = self.block_size
        if self.strategy in _REUSE:
            return ((bs - fr.occ) * (fr.ids >= 0)).sum(axis=1)
        if fr.occ.shape[1] == 0:
            return np.zeros(self.rows, dtype=np.int64)
        return bs - fr.written[:, -1]          # the tail page (pages stay in creation order)

    def _sparse_dirty(self, fr: _FastReq):
        holed = (fr.written > fr.occ) & (fr.ids >= 0)
        any_hole = holed.any(axis=1)
        dirty = holed.copy()
        if dirty.shape[1]:
            dirty[:, -1] |= any_hole
        moved = (fr.occ * dirty).sum(axis=1)
        return dirty, moved, -(-moved // self.block_size)

    def blocks_needed(self, req, n: int, num_computed_blocks: int = 0) -> int:
        fr = self.reqs.get(req)
        if fr is None:
            return self.rows * -(-n // self.block_size)
        return int(self._need(fr, n).sum())

    def _need(self, fr: _FastReq, n: int) -> np.ndarray:
        bs = self.block_size
        if self.strategy == "sparse_copy" and fr.occ.shape[1]:
            dirty, moved, dst = self._sparse_dirty(fr)
            room = np.where(dirty.any(axis=1), dst * bs - moved, self._room(fr))
            return dst + -(-np.maximum(n - room, 0) // bs)
        return -(-np.maximum(n - self._room(fr), 0) // bs)

    def allocate_slots(self, req: Request, n: int, computed_blocks=None) -> bool:
        if n <= 0:
            return True
        fr = self.reqs.get(req)
        if fr is None:
            fr = _FastReq(self.rows, self.seed, req.request_id)
        if int(self._need(fr, n).sum()) > self.pool.num_free_blocks:
            return False
        self.reqs[req] = fr
        self._unstat(req)
        bs = self.block_size
        if self.strategy == "sparse_copy" and fr.occ.shape[1]:
            dirty, moved, dst = self._sparse_dirty(fr)
            if moved.any() or dirty.any():
                self.plan.bytes_moved += int(round(moved.sum() * self.bytes_per_token_row))
                old = fr.ids[dirty]
                fr.add_pages(dst, self.pool, self.plan)
                # fill the fresh pages (the last dst[r] of each row) densely with the moved tokens
                E = fr.occ.shape[1]
                col = np.arange(E)[None, :]
                first_new = (fr.ids >= 0).sum(axis=1) - dst
                idx = col - first_new[:, None]
                fresh = (idx >= 0) & (idx < dst[:, None])
                fill = np.clip(moved[:, None] - idx * bs, 0, bs) * fresh
                dirty = np.pad(dirty, ((0, 0), (0, E - dirty.shape[1])))
                fr.occ = np.where(fresh, fill, fr.occ)
                fr.fresh = np.where(fresh, 0, fr.fresh)
                fr.written = np.where(fresh, fill, fr.written)
                self.pool.free_blocks(old)
                self.plan.freed_blocks.append(old)
                fr.ids[dirty] = -1
                fr._squeeze()
        room = self._room(fr)
        need = -(-np.maximum(n - room, 0) // bs)
        fr.add_pages(need, self.pool, self.plan)
        self._write(fr, n)
        fr.num_tokens += n
        self._stat(req)
        return True

    def _write(self, fr: _FastReq, n: int) -> None:
        """Place n new tokens per row: into holes first (reuse strategies), else at the tail."""
        bs = self.block_size
        if self.strategy in _REUSE:
            space = (bs - fr.occ) * (fr.ids >= 0)
        else:
            space = np.zeros_like(fr.occ)
            live_pages = (fr.ids >= 0)
            # the tail page and the pages after it (freshly added)
            last_written = np.where(fr.written > 0, np.arange(fr.occ.shape[1])[None, :], -1).max(axis=1)
            after = np.arange(fr.occ.shape[1])[None, :] >= np.maximum(last_written, 0)[:, None]
            space = np.where(after & live_pages, bs - fr.written, 0)
        before = np.cumsum(space, axis=1) - space
        take = np.clip(n - before, 0, space)
        fr.occ += take
        if fr.prefilled:
            fr.fresh += take
        fr.written = np.maximum(fr.written + take, fr.occ) if self.strategy not in _REUSE else \
            np.maximum(fr.written, fr.occ)

    def free(self, req: Request) -> int:
        fr = self.reqs.pop(req, None)
        if fr is None:
            return 0
        self._unstat(req)
        ids = fr.ids[fr.ids >= 0]
        self.pool.free_blocks(ids)
        return int(ids.size)

    # ----- per step --------------------------------------------------------------------------------
    def finish_step(self, scheduled) -> KVStepPlan:
        for s in scheduled:
            req = s.request
            fr = self.reqs.get(req)
            if fr is None:
                continue
            done = req.num_computed_tokens + s.num_new_tokens >= req.num_tokens
            if s.is_prefill and not done:
                continue
            self._unstat(req)
            if self.budget is not None:
                self._evict(req, fr, prefill=s.is_prefill)
            fr.prefilled = True
            self._stat(req)
            self.logical_token_steps += req.num_computed_tokens + s.num_new_tokens
            self.stored_token_steps += self._stats[req][4]
        plan, self.plan = self.plan, KVStepPlan()
        return plan

    def _evictable(self, fr: _FastReq) -> np.ndarray:
        """Live tokens per page outside the protected oldest / newest tokens (pages in creation order)."""
        occ = fr.occ * (fr.ids >= 0)
        from_end = np.cumsum(occ[:, ::-1], axis=1)[:, ::-1]          # live tokens in this page and later
        newer = from_end - occ
        protected_new = np.clip(self.protect_recent - newer, 0, occ)
        from_start = np.cumsum(occ, axis=1) - occ
        protected_old = np.clip(self.protect_first - from_start, 0, occ)
        return np.maximum(occ - protected_new - protected_old, 0)

    def _evict(self, req, fr: _FastReq, prefill: bool) -> None:
        live = fr.occ.sum(axis=1)
        k = np.maximum(live - self.budget, 0)
        if not k.any():
            return
        ev = self._evictable(fr)
        k = np.minimum(k, ev.sum(axis=1))
        if prefill and self.age_weight != "oldest":
            take = _proportional(ev, k)
        else:
            take = self._draw(fr, ev, k)
        fr.occ -= take
        fr.fresh = np.minimum(fr.fresh, fr.occ)
        n = int(take.sum())
        self.plan.evicted_tokens += n
        req.extra["kv_evicted_tokens"] = req.extra.get("kv_evicted_tokens", 0.0) + n / self.rows
        if self.strategy in _FREES:
            self._free_empty(fr)
        if self.strategy in ("compact", "parallel_compact"):
            self._compact(fr)

    def _draw(self, fr: _FastReq, ev: np.ndarray, k: np.ndarray) -> np.ndarray:
        take = np.zeros_like(ev)
        if self.age_weight == "oldest":
            before = np.cumsum(ev, axis=1) - ev
            return np.clip(k[:, None] - before, 0, ev)
        E = ev.shape[1]
        if self.age_weight == "young":
            # tokens written during decode go first (prompt survivors are the heavy hitters)
            young = np.minimum(fr.fresh, ev)
            w = young + self.old_weight * (ev - young).astype(np.float64)
        else:
            w = ev.astype(np.float64)
        remaining = ev.copy()
        for _ in range(int(k.max())):
            active = k > 0
            if not active.any():
                break
            w = np.where(remaining > 0, w, 0.0)
            cum = np.cumsum(w, axis=1)
            u = fr.rng.random(len(k)) * cum[:, -1]
            pick = np.minimum((cum < u[:, None]).sum(axis=1), E - 1)
            r = np.flatnonzero(active & (cum[:, -1] > 0))
            take[r, pick[r]] += 1
            remaining[r, pick[r]] -= 1
            k = k - np.isin(np.arange(len(k)), r)
        return take

    def _free_empty(self, fr: _FastReq) -> None:
        empty = (fr.ids >= 0) & (fr.occ == 0)
        if self.strategy not in _REUSE and empty.shape[1]:
            empty[:, -1] &= fr.written[:, -1] >= self.block_size
        if empty.any():
            ids = fr.ids[empty]
            self.pool.free_blocks(ids)
            self.plan.freed_blocks.append(ids)
            self.plan.blocks_freed_by_eviction += ids.size
            fr.ids[empty] = -1
            fr._squeeze()

    def _compact(self, fr: _FastReq) -> None:
        bs = self.block_size
        pages = fr.ids >= 0
        live = fr.occ.sum(axis=1)
        keep = -(-live // bs)
        rank = np.cumsum(pages, axis=1)
        kept = pages & (rank <= keep[:, None])
        moved = (fr.occ * (pages & ~kept)).sum(axis=1)
        if not moved.any() and not (pages & ~kept).any():
            return
        self.plan.bytes_moved += int(round(moved.sum() * self.bytes_per_token_row))
        holes = np.where(kept, bs - fr.occ, 0)
        before = np.cumsum(holes, axis=1) - holes
        fr.occ = np.where(kept, fr.occ + np.clip(moved[:, None] - before, 0, holes), 0)
        fr.fresh = np.minimum(fr.fresh, fr.occ)
        fr.written = np.where(kept, np.maximum(fr.written, fr.occ), 0)
        gone = pages & ~kept
        ids = fr.ids[gone]
        self.pool.free_blocks(ids)
        self.plan.freed_blocks.append(ids)
        self.plan.blocks_freed_by_eviction += ids.size
        fr.ids[gone] = -1
        fr._squeeze()

    # ----- bookkeeping ---------------------------------------------------------------------------
    def _unstat(self, req) -> None:
        st = self._stats.pop(req, None)
        if st:
            self._live_total -= st[0]
            self._alloc_total -= st[1]

    def _stat(self, req) -> None:
        fr = self.reqs[req]
        pages = int((fr.ids >= 0).sum())
        live = int(fr.occ.sum())
        self._stats[req] = (live, pages * self.block_size, live / self.rows, pages, live / self.rows)
        self._live_total += live
        self._alloc_total += pages * self.block_size

    def check_invariants(self, live_requests) -> None:
        self.pool.check_invariants()
        ids = np.concatenate([f.ids[f.ids >= 0] for f in self.reqs.values()] or [np.zeros(0, np.int64)])
        assert np.unique(ids).size == ids.size and self.pool.owned.sum() == ids.size, "pool ownership drifted"
        for f in self.reqs.values():
            assert ((f.occ >= 0) & (f.occ <= self.block_size)).all(), "page occupancy out of range"


def _proportional(ev: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Take k[r] tokens from row r's pages in proportion to ev (largest remainders, deterministic)."""
    total = ev.sum(axis=1)
    share = ev * (k / np.maximum(total, 1))[:, None]
    take = np.floor(share).astype(np.int64)
    short = k - take.sum(axis=1)
    rem = share - take
    order = np.argsort(-rem, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(ev.shape[1])[None, :].repeat(ev.shape[0], 0), axis=1)
    take += (rank < short[:, None]) & (take < ev)
    return np.minimum(take, ev)
