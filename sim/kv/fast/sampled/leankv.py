"""LeanKV in fast mode: the sampled-row token-level manager with its decode steps compiled.

`SampledRowsKVManager` (sampled.py) runs the token-level manager on a stratified sample of the rows;
what it pays for is the per-request Python and numpy of every decode step (about 3 ms a
request-step at 8 sampled rows and 2,000-token contexts). `BatchedLeanKVManager` runs the decode
step of every prefilled request of an engine step in one compiled call (sim/kv/fast/sampled/leankv_kernel.py)
on the same token-level arrays — write, decode attention, LeanKV's placement, demotion and pruning,
precision group moves, the slot strategy — with the rows' attention in parallel, and keeps the token-level
manager for everything else (prefill and the prompt cut, prompt allocation, freeing, invariants).
Per decode step the scheduler's work per request is a count: pages are reserved by
`allocate_decodes` / `allocate_slots` and the token is written in `finish_step`. Same results as the
sampled-row manager up to float rounding (tested); the per-step `mass_retained` of the plan (read by
the real backend only) is not filled, each request's mean retained mass is.

Used for `leankv` with its `every_step` trigger and the noop / free_block / slot_reuse / compact
strategies when numba is present; otherwise (sparse_copy, holed_copy, parallel_compact, other
triggers) fast mode is the sampled-row manager.
"""
from __future__ import annotations

import numpy as np

from ...importance import CHUNK
from ...policies.leankv import OBSERVED, PLACED
from ...slots import QUANT_FLOPS
from . import leankv_kernel as K
from .rows import SampledRowsKVManager
from ..compiled.threads import ThreadBudget

FIELDS = {"imp_w", OBSERVED, PLACED}


def batched_leankv_supported(policy, slot_strategy: str, trigger: str) -> bool:
    """Whether `BatchedLeanKVManager` covers this configuration (else the sampled-row manager runs)."""
    return (K.njit is not None and policy.name == "leankv" and slot_strategy in K.STRATEGY_CODES
            and (trigger == "policy" or trigger == policy.default_trigger == "every_step"))


class _Decoding:
    """A prefilled request whose decode steps run compiled: its handle (its index in the kernel's
    per-request arrays), the arrays the kernel works on (`K.RequestArrays`), what it had when it entered."""
    __slots__ = ("rk", "imp", "handle", "steps0", "arrays")

    def __init__(self, rk, imp, handle: int):
        self.rk, self.imp, self.handle = rk, imp, handle
        self.steps0 = rk.decode_steps
        self.arrays: K.RequestArrays | None = None


class BatchedLeanKVManager(SampledRowsKVManager):
    """Sampled-row LeanKV with compiled decode steps (module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        inner = self.inner
        model = inner.importance
        self._strategy = K.STRATEGY_CODES[inner.strategy]
        self._hole_first = self._strategy >= K.SLOT_REUSE
        self._tau32 = model.tau.astype(np.float32)
        self._heads = K.Heads(model.s.astype(np.float32), model.l.astype(np.float32), self._local_decay(256),
                              np.asarray(model.tau, dtype=np.float64),
                              np.asarray(model.spec.sink_weights, dtype=np.float64))
        self._cap = np.asarray(inner.precision_capacity, dtype=np.int64)
        policy = self.policy
        self._params = K.StepParams(inner.rows, int(inner.stride), self._cap,
                                    np.asarray(self.ctx.precision_bytes, dtype=np.float64), float(policy.alpha_h),
                                    float(policy.alpha_l), int(policy.window), int(policy.obs_window),
                                    self._strategy, self._hole_first)
        self._quant_flops = QUANT_FLOPS * 2 * self.ctx.head_dim * self.ctx.heads_per_row
        self._decoding: dict = {}
        # threads of the parallel step: from the batch's rows and the cores other processes leave free
        self.thread_budget = ThreadBudget(K.max_threads())
        self._pending: dict = {}            # request -> block ids reserved for its next decode token
        self._free_handles: list[int] = []
        self._handles = 0                   # handles ever given out
        self._empty = K.empty_request(inner.rows)
        self._reqs = None                   # K.request_list: the kernel's arrays by handle (made on first use)
        self._meta = K.new_meta(0)
        self._stats = K.new_stats(0)
        self._ids = np.zeros(0, dtype=np.int64)
        self._none = np.zeros(0, dtype=np.int64)
        self._live_dec = 0                  # live and allocated slots of the requests decoding compiled
        self._alloc_dec = 0

    # ----- scheduler-facing surface --------------------------------------------------------------
    def kv_tokens(self, req) -> float:
        d = self._decoding.get(req)
        if d is None:
            return self.inner.kv_tokens(req)
        return self._stats.read[d.handle] / self.inner.rows

    def block_table_entries(self, req) -> int:
        d = self._decoding.get(req)
        if d is None:
            return super().block_table_entries(req)
        ids = self._pending.get(req)
        return (int(self._stats.pages[d.handle]) + (ids.size if ids is not None else 0)) * self.unit

    def slot_stats(self) -> tuple[int, int]:
        live, alloc = self.inner.slot_stats()
        return (live + self._live_dec) * self.unit, (alloc + self._alloc_dec) * self.unit

    def blocks_needed(self, req, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        d = self._decoding.get(req)
        if d is not None and num_new_tokens == 1:
            return int(self._stats.need[d.handle]) * self.unit
        return super().blocks_needed(req, num_new_tokens, num_computed_blocks)   # reads pages only

    def allocate_slots(self, req, num_new_tokens: int, computed_blocks=None) -> bool:
        d = self._decoding.get(req)
        if d is not None and num_new_tokens == 1:
            if req in self._pending:
                raise AssertionError(f"request {req.request_id}: a second decode token in one step")
            pool = self.inner.pool
            need = int(self._stats.need[d.handle])
            if need > pool.num_free_blocks:
                return False
            self._pending[req] = pool.get_new_blocks(need) if need else self._none
            return True
        self._leave(req)
        return super().allocate_slots(req, num_new_tokens, computed_blocks)

    def allocate_decodes(self, reqs) -> list[float] | None:
        decoding, pending = self._decoding, self._pending
        handles = []
        for req in reqs:
            d = decoding.get(req)
            if d is None or req in pending:
                return None
            handles.append(d.handle)
        need = self._stats.need[handles].astype(np.int64)
        total = int(need.sum())
        pool = self.inner.pool
        if total > pool.num_free_blocks:
            return None
        ids = pool.get_new_blocks(total) if total else self._none
        ends = np.cumsum(need).tolist()
        start = 0
        for req, end in zip(reqs, ends, strict=False):
            pending[req] = ids[start:end]
            start = end
        return (self._stats.read[handles] / self.inner.rows).tolist()

    def free(self, req) -> int:
        ids = self._pending.pop(req, None)
        if ids is not None and ids.size:
            self.inner.pool.free_blocks(ids)
        self._leave(req)
        return super().free(req)

    def finish_step(self, scheduled):
        inner = self.inner
        rest, batch, reserved = [], [], []
        logical = 0
        for s in scheduled:
            req = s.request
            ids = self._pending.pop(req, None)
            if ids is None:
                rest.append(s)
                continue
            batch.append(self._decoding[req])
            reserved.append(ids)
            logical += req.num_computed_tokens + s.num_new_tokens
        if batch:
            self._decode(batch, reserved)
            inner.logical_token_steps += logical
        plan = super().finish_step(rest)
        for s in rest:
            rk = inner.req_kv.get(s.request)
            if rk is not None and rk.prefilled and s.request not in self._decoding and set(rk.state._fields) == FIELDS:
                self._enter(s.request, rk)
        return plan

    def check_invariants(self, live_requests) -> None:
        assert not self._pending, "pages reserved for a decode token outlived the step"
        for req, d in self._decoding.items():
            self._check_decoding(req, d)
        self.inner._live_total += self._live_dec          # the token-level check counts every request's slots
        try:
            super().check_invariants(live_requests)
        finally:
            self.inner._live_total -= self._live_dec

    def _check_decoding(self, req, d: _Decoding) -> None:
        """What the kernel keeps beside a request's token state agrees with it (module doc of the kernel)."""
        st, arrays = d.rk.state, d.arrays
        K.sync_scores(st.score, arrays.active)
        rid = req.request_id
        assert int(st.live.sum()) == self._stats.live[d.handle], f"request {rid}: live slot count drifted"
        pages = d.rk.table >= 0
        live3 = st.live.reshape(st.rows, -1, d.rk.stride)
        written3 = (st.pos >= 0).reshape(st.rows, -1, d.rk.stride)
        assert (arrays.pages.occ[pages] == live3.sum(axis=2)[pages]).all(), f"request {rid}: page live counts drifted"
        assert (arrays.pages.written[pages] == written3.sum(axis=2)[pages]).all(), f"request {rid}: written counts drifted"
        act = arrays.active
        high_slot = np.repeat(d.rk.page_precision == K.HIGH, d.rk.stride, axis=1)
        for r in range(st.rows):
            n = int(act.count[r])
            slots = act.slot[r, :n]
            listed = np.zeros(st.num_slots, dtype=bool)
            listed[slots] = True
            assert (listed == (st.live[r] & ~arrays.tokens.settled[r])).all(), f"request {rid}: active list drifted"
            assert (act.index[r, slots] == np.arange(n)).all() and (act.index[r] >= 0).sum() == n
            assert (act.pos[r, :n] == st.pos[r, slots]).all() and (act.imp_w[r, :n] == st.field("imp_w")[r, slots]).all()
            assert (act.high[r, :n] == high_slot[r, slots]).all(), f"request {rid}: active list's page precision groups drifted"
        q = st.num_tokens - 1
        age = np.where(st.live, q - st.pos, 0)
        local = np.where(st.live, np.exp(-age / self._heads.tau[:, None]), 0.0).sum(axis=1)
        content = np.where(st.live, st.field("imp_w"), 0.0).sum(axis=1, dtype=np.float64)
        assert np.allclose(arrays.sums[:, 0], local, rtol=1e-9, atol=1e-9), (rid, arrays.sums[:, 0], local)
        assert np.allclose(arrays.sums[:, 1], content, rtol=1e-9), (rid, arrays.sums[:, 1], content)

    # ----- compiled decode steps ----------------------------------------------------------------
    def _local_decay(self, ages: int) -> np.ndarray:
        """exp(-age / tau) per row for ages 0..ages-1, in float32 as SyntheticImportance computes it."""
        return np.exp(-np.arange(ages, dtype=np.float32)[None, :] / self._tau32[:, None])

    def _handle(self) -> int:
        if self._reqs is None:
            self._reqs = K.request_list(self._empty)
        if self._free_handles:
            return self._free_handles.pop()
        h = self._handles
        self._handles += 1
        if h >= self._meta.tokens.shape[0]:
            grow = max(16, h)
            self._meta = K.grown(self._meta, grow)
            self._stats = K.grown(self._stats, grow)
        return h

    def _bind(self, d: _Decoding) -> None:
        """Give the kernel the request's arrays (after it entered or its table grew): the token state,
        the table, the counts and active lists page_counts fills (slots keep their indices on growth)."""
        rk, h = d.rk, d.handle
        st = rk.state
        rows, slots = st.rows, st.num_slots
        settled = np.zeros(st.live.shape, dtype=bool)
        fresh = d.arrays is None
        if fresh:
            sums = np.zeros((rows, 3))
        else:
            old = d.arrays.tokens.settled
            settled[:, :old.shape[1]] = old
            sums = d.arrays.sums
        tokens = K.TokenArrays(st.live, st.pos, st.score, st.precision, st.field("imp_w"), st.field(OBSERVED),
                               st.field(PLACED), settled)
        pages = K.PageArrays(rk.table, rk.page_precision, np.zeros(rk.table.shape, dtype=np.int64),
                             np.zeros(rk.table.shape, dtype=np.int64), rk.tail, rk.tail_off)
        d.arrays = K.RequestArrays(tokens, pages, K.new_active(rows, slots), d.imp["wsum"], d.imp["w"], sums)
        for group in (tokens, pages):
            for name, a in zip(group._fields, group, strict=False):
                assert a.flags.c_contiguous, (name, a.flags)
        assert d.arrays.weights.shape == (rows, CHUNK) and d.arrays.wsum.dtype == np.float64
        meta = self._meta
        K.page_counts(d.arrays, self._params, self._heads.tau, int(meta.entries[h]), int(meta.tokens[h]) - 1,
                      int(meta.prompt[h]), int(meta.most[h]), fresh)
        K.store(self._reqs, h, d.arrays)
        if self._ids.size < rk.table.size:
            self._ids = np.zeros(2 * rk.table.size, dtype=np.int64)

    def _enter(self, req, rk) -> None:
        inner = self.inner
        imp = inner.importance._r(req.request_id)
        q = rk.state.num_tokens
        if imp["chunk"] != q // CHUNK:
            inner.importance._weights(req.request_id, imp, np.array([q]))
        d = self._decoding[req] = _Decoding(rk, imp, self._handle())
        h = d.handle
        most = req.prompt_tokens + req.max_output_tokens
        meta = self._meta
        meta.tokens[h], meta.entries[h], meta.steps[h], meta.evicted[h] = q, rk.num_entries, rk.decode_steps, rk.evicted_rows
        meta.error[h], meta.prompt[h], meta.most[h] = 0, q, most
        self._bind(d)
        live, alloc, read, pages, stored = inner._stats[req]
        inner._unstat(req)
        stats = self._stats
        for a in stats:
            a[h] = 0.0
        stats.live[h], stats.alloc[h], stats.read[h] = live, alloc, read * inner.rows
        stats.pages[h], stats.stored[h] = pages, stored * inner.rows
        stats.need[h] = K.next_token_pages(d.arrays.pages, self._cap, rk.num_entries, self._hole_first)
        self._live_dec += live
        self._alloc_dec += alloc

    def _leave(self, req) -> None:
        """Back to the token-level manager (anything but one decode token at a time, or freeing): the
        counters the compiled steps kept go back to the request, the table keeps its entry count."""
        if req in self._pending:
            raise AssertionError(f"request {req.request_id}: leaves compiled decoding with a token reserved")
        d = self._decoding.pop(req, None)
        if d is None:
            return
        inner, rk, h = self.inner, d.rk, d.handle
        meta, stats = self._meta, self._stats
        steps = int(meta.steps[h] - d.steps0)
        st = rk.state
        K.sync_scores(st.score, d.arrays.active)
        st.num_steps_observed += steps
        self._restore_observed(st, int(meta.prompt[h]))
        rk.decode_steps = int(meta.steps[h])
        rk.evicted_rows = int(meta.evicted[h])
        rk.mass_sum += float(stats.mass_sum[h])
        rk.mass_steps += steps
        rk.added_since_compress = 0
        entries = int(meta.entries[h])
        if rk.num_entries > entries:
            assert (rk.table[:, entries:] < 0).all()
            rk.table, rk.page_precision = rk.table[:, :entries].copy(), rk.page_precision[:, :entries].copy()
            st.resize(entries * rk.stride)
        self._live_dec -= int(stats.live[h])
        self._alloc_dec -= int(stats.alloc[h])
        inner._stat(req)
        K.store(self._reqs, h, self._empty)
        d.arrays = None
        self._free_handles.append(h)

    def _restore_observed(self, st, prompt: int) -> None:
        """The queries each live token saw (the kernel derives them from positions instead of counting)."""
        q = st.num_tokens - 1
        pos = st.pos
        seen = np.minimum(np.maximum(prompt - pos, 0), min(self.policy.obs_window, prompt)) + q - np.maximum(prompt, pos) + 1
        st.field(OBSERVED)[st.live] = seen[st.live]

    def _prepare(self, batch: list) -> None:
        """Before a step: the local-decay table covers the longest context, each request has its current
        chunk of content weights and room in its table for the step to double its entries."""
        meta = self._meta
        handles = [d.handle for d in batch]
        longest = int(meta.tokens[handles].max()) + 1
        if self._heads.local_decay.shape[1] < longest:
            self._heads = self._heads._replace(local_decay=self._local_decay(2 * longest))
        for d in batch:
            h = d.handle
            q = int(meta.tokens[h])
            if d.imp["chunk"] != q // CHUNK:                 # the next chunk of content weights
                self._next_chunk(d, q)
            rk = d.rk
            entries = int(meta.entries[h])
            if rk.num_entries < 2 * entries + 2:
                K.sync_scores(rk.state.score, d.arrays.active)    # the lists are rebuilt from the state
                rk.grow(2 * entries + 2)
                self._bind(d)

    def _decode(self, batch: list, reserved: list) -> None:
        inner = self.inner
        meta, stats = self._meta, self._stats
        self._prepare(batch)
        handles = np.fromiter((d.handle for d in batch), np.int64, len(batch))
        ends = np.cumsum([r.size for r in reserved])
        ids = np.concatenate(reserved) if len(reserved) > 1 else reserved[0]
        pool = inner.pool
        count = np.array([pool.count], dtype=np.int64)
        K.run_step(self.thread_budget.threads(len(batch) * inner.rows), self._reqs, K.StepBatch(handles, ids, ends),
                   self._heads, self._params, K.PoolArrays(pool.free, pool.owned, count), self._ids, meta, stats)
        pool.count = int(count[0])
        errors = meta.error[handles]
        if errors.any():
            bad = handles[errors != 0][0]
            raise AssertionError(f"compiled LeanKV step failed (handle {bad}, code {meta.error[bad]})")
        for d, tokens in zip(batch, meta.tokens[handles].tolist(), strict=False):
            d.rk.state.num_tokens = tokens
        self._account(handles)

    def _account(self, handles: np.ndarray) -> None:
        """The step's evictions, frees, moves and stored tokens into the plan and the manager's totals."""
        inner, stats = self.inner, self._stats
        plan = inner.effects
        plan.evicted_tokens += int(stats.evicted[handles].sum())
        plan.blocks_freed_by_eviction += int(stats.freed[handles].sum())
        bpr = inner.bytes_per_token_row
        plan.bytes_moved += int(np.rint(stats.moved_bytes[handles] * bpr).sum()
                                + np.rint(stats.compact_bytes[handles] * bpr).sum())
        plan.op_flops += self._quant_flops * float(stats.moved[handles].sum())
        inner.stored_token_steps += float(stats.stored[handles].sum()) / inner.rows
        active = [d.handle for d in self._decoding.values()]
        self._live_dec = int(stats.live[active].sum())
        self._alloc_dec = int(stats.alloc[active].sum())

    def _next_chunk(self, d: _Decoding, q: int) -> None:
        self.inner.importance._weights(self._request_id(d), d.imp, np.array([q]))
        d.arrays = d.arrays._replace(weights=d.imp["w"])
        K.store(self._reqs, d.handle, d.arrays)

    @staticmethod
    def _request_id(d: _Decoding) -> int:
        return d.rk.state.request_id
