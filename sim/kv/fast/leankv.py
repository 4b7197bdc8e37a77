"""LeanKV in fast mode: the sampled-row token-level manager with its decode steps compiled.

`SampledRowsKVManager` (sampled.py) runs the token-level manager on a stratified sample of the rows;
what it pays for is the per-request Python and numpy of every decode step (about 3 ms a
request-step at 8 sampled rows and 2,000-token contexts). `BatchedLeanKVManager` runs the decode
step of every prefilled request of an engine step in one compiled call (sim/kv/fast/leankv_kernel.py)
on the same token-level arrays — write, decode attention, LeanKV's placement, demotion and pruning,
tier moves, the slot strategy — with the rows' attention in parallel, and keeps the token-level
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

from ..importance import CHUNK
from ..policies.leankv import OBSERVED, PLACED
from ..slots import QUANT_FLOPS
from . import leankv_kernel as K
from .sampled import SampledRowsKVManager
from .threads import ThreadBudget

FIELDS = {"imp_w", OBSERVED, PLACED}
# dtypes of the arrays whose addresses the kernel takes (leankv_kernel._arrays), in order
DTYPES = tuple(np.dtype(t) for t in (bool, np.int64, np.float32, np.int8, np.float32, np.int32, bool, np.int64,
                                     np.int8, np.int64, np.int64, np.int64, np.int64, np.float64, np.float32, bool))
META_TOKENS, META_ENTRIES, META_STEPS, META_EVICTED, META_ERROR, META_PROMPT, META_MAX = range(7)


def batched_leankv_supported(policy, slot_strategy: str, trigger: str) -> bool:
    """Whether `BatchedLeanKVManager` covers this configuration (else the sampled-row manager runs)."""
    return (K.njit is not None and policy.name == "leankv" and slot_strategy in K.STRATEGY_CODES
            and (trigger == "policy" or trigger == policy.default_trigger == "every_step"))


class _Decoding:
    """A prefilled request whose decode steps run compiled: its handle (row of the kernel's address
    table), the arrays it points at (kept alive here), what it had when it entered."""
    __slots__ = ("rk", "imp", "handle", "steps0", "arrays")

    def __init__(self, rk, imp, handle: int):
        self.rk, self.imp, self.handle = rk, imp, handle
        self.steps0 = rk.decode_steps
        self.arrays = ()


class BatchedLeanKVManager(SampledRowsKVManager):
    """Sampled-row LeanKV with compiled decode steps (module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        inner = self.inner
        model = inner.importance
        self._strategy = K.STRATEGY_CODES[inner.strategy]
        self._hole_first = self._strategy >= K.SLOT_REUSE
        self._tau32 = model.tau.astype(np.float32)
        self._heads = (model.s.astype(np.float32), model.l.astype(np.float32), self._local_decay(256),
                       np.asarray(model.tau, dtype=np.float64))
        self._sink = np.asarray(model.spec.sink_weights, dtype=np.float64)
        self._cap = np.asarray(inner.tier_capacity, dtype=np.int64)
        self._tier_bytes = np.asarray(self.ctx.tier_bytes, dtype=np.float64)
        self._quant_flops = QUANT_FLOPS * 2 * self.ctx.head_dim * self.ctx.heads_per_row
        self._decoding: dict = {}
        # threads of the parallel step: from the batch's rows and the cores other processes leave free
        self.thread_budget = ThreadBudget(K.max_threads())
        self._pending: dict = {}            # request -> block ids reserved for its next decode token
        self._free_handles: list[int] = []
        self._handles = 0                   # handles ever given out
        self._addr = np.zeros((0, len(DTYPES)), dtype=np.int64)
        self._dims = np.zeros((0, 2), dtype=np.int64)
        self._meta = np.zeros((0, 7), dtype=np.int64)
        self._stats = np.zeros((0, K.OUT_SIZE))
        self._sums = np.zeros((0, self.inner.rows, 3))
        self._ids = np.zeros(0, dtype=np.int64)
        self._none = np.zeros(0, dtype=np.int64)
        self._live_dec = 0                  # live and allocated slots of the requests decoding compiled
        self._alloc_dec = 0

    # ----- scheduler-facing surface --------------------------------------------------------------
    def kv_tokens(self, req) -> float:
        d = self._decoding.get(req)
        if d is None:
            return self.inner.kv_tokens(req)
        return self._stats[d.handle, K.OUT_READ] / self.inner.rows

    def block_table_entries(self, req) -> int:
        d = self._decoding.get(req)
        if d is None:
            return super().block_table_entries(req)
        ids = self._pending.get(req)
        return (int(self._stats[d.handle, K.OUT_PAGES]) + (ids.size if ids is not None else 0)) * self.unit

    def slot_stats(self) -> tuple[int, int]:
        live, alloc = self.inner.slot_stats()
        return (live + self._live_dec) * self.unit, (alloc + self._alloc_dec) * self.unit

    def blocks_needed(self, req, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        d = self._decoding.get(req)
        if d is not None and num_new_tokens == 1:
            return int(self._stats[d.handle, K.OUT_NEED]) * self.unit
        return super().blocks_needed(req, num_new_tokens, num_computed_blocks)   # reads pages only

    def allocate_slots(self, req, num_new_tokens: int, computed_blocks=None) -> bool:
        d = self._decoding.get(req)
        if d is not None and num_new_tokens == 1:
            if req in self._pending:
                raise AssertionError(f"request {req.request_id}: a second decode token in one step")
            pool = self.inner.pool
            need = int(self._stats[d.handle, K.OUT_NEED])
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
        stats = self._stats[handles]
        need = stats[:, K.OUT_NEED].astype(np.int64)
        total = int(need.sum())
        pool = self.inner.pool
        if total > pool.num_free_blocks:
            return None
        ids = pool.get_new_blocks(total) if total else self._none
        ends = np.cumsum(need).tolist()
        start = 0
        for req, end in zip(reqs, ends):
            pending[req] = ids[start:end]
            start = end
        return (stats[:, K.OUT_READ] / self.inner.rows).tolist()

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
            st = d.rk.state
            row = self._stats[d.handle]
            assert int(st.live.sum()) == row[K.OUT_LIVE], f"request {req.request_id}: live slot count drifted"
            occ, wr = d.arrays[9], d.arrays[10]
            pages = d.rk.table >= 0
            live3 = st.live.reshape(st.rows, -1, d.rk.stride)
            written3 = (st.pos >= 0).reshape(st.rows, -1, d.rk.stride)
            assert (occ[pages] == live3.sum(axis=2)[pages]).all(), f"request {req.request_id}: page live counts drifted"
            assert (wr[pages] == written3.sum(axis=2)[pages]).all(), f"request {req.request_id}: written counts drifted"
            q = st.num_tokens - 1
            age = np.where(st.live, q - st.pos, 0)
            local = np.where(st.live, np.exp(-age / self._heads[3][:, None]), 0.0).sum(axis=1)
            content = np.where(st.live, st.field("imp_w"), 0.0).sum(axis=1, dtype=np.float64)
            sums = self._sums[d.handle]
            assert np.allclose(sums[:, 0], local, rtol=1e-9, atol=1e-9), (req.request_id, sums[:, 0], local)
            assert np.allclose(sums[:, 1], content, rtol=1e-9), (req.request_id, sums[:, 1], content)
        self.inner._live_total += self._live_dec          # the token-level check counts every request's slots
        try:
            super().check_invariants(live_requests)
        finally:
            self.inner._live_total -= self._live_dec

    # ----- compiled decode steps ----------------------------------------------------------------
    def _local_decay(self, ages: int) -> np.ndarray:
        """exp(-age / tau) per row for ages 0..ages-1, in float32 as SyntheticImportance computes it."""
        return np.exp(-np.arange(ages, dtype=np.float32)[None, :] / self._tau32[:, None])

    def _handle(self) -> int:
        if self._free_handles:
            return self._free_handles.pop()
        h = self._handles
        self._handles += 1
        if h >= self._meta.shape[0]:
            grow = max(16, h)
            self._addr = np.concatenate([self._addr, np.zeros((grow, len(DTYPES)), np.int64)])
            self._dims = np.concatenate([self._dims, np.zeros((grow, 2), np.int64)])
            self._meta = np.concatenate([self._meta, np.zeros((grow, 7), np.int64)])
            self._stats = np.concatenate([self._stats, np.zeros((grow, K.OUT_SIZE))])
            self._sums = np.concatenate([self._sums, np.zeros((grow,) + self._sums.shape[1:])])
        return h

    def _bind(self, d: _Decoding) -> None:
        """Give the kernel the addresses of the request's arrays (after it entered or its table grew);
        `d.arrays` keeps them alive as long as the kernel may use them."""
        rk, h = d.rk, d.handle
        st = rk.state
        occ = np.zeros(rk.table.shape, dtype=np.int64)
        wr = np.zeros_like(occ)
        settled = np.zeros(st.live.shape, dtype=bool)
        fresh = not d.arrays
        if not fresh:                               # the table grew: slots keep their indices
            old = d.arrays[15]
            settled[:, :old.shape[1]] = old
        d.arrays = (st.live, st.pos, st.score, st.tier, st.field("imp_w"), st.field(OBSERVED), st.field(PLACED),
                    rk.table, rk.page_tier, occ, wr, rk.tail, rk.tail_off, d.imp["wsum"], d.imp["w"], settled)
        for i, (a, dt) in enumerate(zip(d.arrays, DTYPES)):
            assert a.dtype == dt and a.flags.c_contiguous, (i, a.dtype, a.flags)
            self._addr[h, i] = a.ctypes.data
        self._dims[h] = st.num_slots, rk.num_entries
        assert d.arrays[14].shape == (self.inner.rows, CHUNK)
        policy = self.policy
        m = self._meta[h]
        K.page_counts(d.arrays[:7] + d.arrays[15:], d.arrays[7:13], self.inner.stride, int(m[META_ENTRIES]),
                      int(m[META_TOKENS]) - 1, self._heads[3], policy.alpha_h, policy.alpha_l, self._sums[h],
                      int(m[META_PROMPT]), policy.obs_window, int(m[META_MAX]), fresh)
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
        self._meta[h] = (q, rk.num_entries, rk.decode_steps, rk.evicted_rows, 0, q, most)
        self._bind(d)
        live, alloc, read, pages, stored = inner._stats[req]
        inner._unstat(req)
        row = self._stats[h]
        row[:] = 0
        row[K.OUT_LIVE], row[K.OUT_ALLOC], row[K.OUT_READ] = live, alloc, read * inner.rows
        row[K.OUT_PAGES], row[K.OUT_STORED] = pages, stored * inner.rows
        row[K.OUT_NEED] = K.next_token_pages(d.arrays[7:13], self._cap, rk.num_entries, self._hole_first)
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
        m, row = self._meta[h], self._stats[h]
        steps = int(m[META_STEPS] - d.steps0)
        st = rk.state
        st.num_steps_observed += steps
        self._restore_observed(st, int(m[META_PROMPT]))
        rk.decode_steps = int(m[META_STEPS])
        rk.evicted_rows = int(m[META_EVICTED])
        rk.mass_sum += float(row[K.OUT_MASS_SUM])
        rk.mass_steps += steps
        rk.added_since_compress = 0
        entries = int(m[META_ENTRIES])
        if rk.num_entries > entries:
            assert (rk.table[:, entries:] < 0).all()
            rk.table, rk.page_tier = rk.table[:, :entries].copy(), rk.page_tier[:, :entries].copy()
            st.resize(entries * rk.stride)
        self._live_dec -= int(row[K.OUT_LIVE])
        self._alloc_dec -= int(row[K.OUT_ALLOC])
        inner._stat(req)
        self._addr[h] = 0
        d.arrays = ()
        self._free_handles.append(h)

    def _restore_observed(self, st, prompt: int) -> None:
        """The queries each live token saw (the kernel derives them from positions instead of counting)."""
        q = st.num_tokens - 1
        pos = st.pos
        seen = np.minimum(np.maximum(prompt - pos, 0), min(self.policy.obs_window, prompt)) + q - np.maximum(prompt, pos) + 1
        st.field(OBSERVED)[st.live] = seen[st.live]

    def _decode(self, batch: list, reserved: list) -> None:
        inner = self.inner
        meta, stats = self._meta, self._stats
        handles = np.fromiter((d.handle for d in batch), np.int64, len(batch))
        longest = int(meta[handles, META_TOKENS].max()) + 1
        if self._heads[2].shape[1] < longest:
            self._heads = (*self._heads[:2], self._local_decay(2 * longest), self._heads[3])
        for d in batch:
            h = d.handle
            q = int(meta[h, META_TOKENS])
            imp = d.imp
            if imp["chunk"] != q // CHUNK:                   # the next chunk of content weights
                self._next_chunk(d, q)
            rk = d.rk
            if rk.num_entries < 2 * meta[h, META_ENTRIES] + 2:    # room for the step to double the entries
                rk.grow(int(2 * meta[h, META_ENTRIES] + 2))
                self._bind(d)
        ends = np.cumsum([r.size for r in reserved])
        ids = np.concatenate(reserved) if len(reserved) > 1 else reserved[0]
        pool = inner.pool
        count = np.array([pool.count], dtype=np.int64)
        policy = self.policy
        K.run_step(self.thread_budget.threads(len(batch) * inner.rows), handles, ids, ends, self._addr, self._dims, inner.rows, self._heads, self._sink, self._cap, self._tier_bytes,
                      policy.alpha_h, policy.alpha_l, policy.window, policy.obs_window, self._strategy,
                      (pool.free, pool.owned, count),
                      self._ids, meta, stats, self._sums)
        pool.count = int(count[0])
        if meta[handles, META_ERROR].any():
            bad = handles[meta[handles, META_ERROR] != 0][0]
            raise AssertionError(f"compiled LeanKV step failed (handle {bad}, code {meta[bad, META_ERROR]})")
        for d, tokens in zip(batch, meta[handles, META_TOKENS].tolist()):
            d.rk.state.num_tokens = tokens
        step = stats[handles]
        plan = inner.plan
        plan.evicted_tokens += int(step[:, K.OUT_EVICTED].sum())
        plan.blocks_freed_by_eviction += int(step[:, K.OUT_FREED].sum())
        bpr = inner.bytes_per_token_row
        plan.bytes_moved += int(np.rint(step[:, K.OUT_MOVED_BYTES] * bpr).sum()
                                + np.rint(step[:, K.OUT_COMPACT_BYTES] * bpr).sum())
        plan.op_flops += self._quant_flops * float(step[:, K.OUT_MOVED].sum())
        inner.stored_token_steps += float(step[:, K.OUT_STORED].sum()) / inner.rows
        active = [d.handle for d in self._decoding.values()]
        self._live_dec = int(stats[active, K.OUT_LIVE].sum())
        self._alloc_dec = int(stats[active, K.OUT_ALLOC].sum())

    def _next_chunk(self, d: _Decoding, q: int) -> None:
        self.inner.importance._weights(self._request_id(d), d.imp, np.array([q]))
        d.arrays = d.arrays[:14] + (d.imp["w"],) + d.arrays[15:]
        self._addr[d.handle, 14] = d.imp["w"].ctypes.data

    @staticmethod
    def _request_id(d: _Decoding) -> int:
        return d.rk.state.extra["request_id"]
