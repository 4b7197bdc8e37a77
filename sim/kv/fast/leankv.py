"""LeanKV in fast mode: the sampled-row token-level manager with its decode steps compiled.

`SampledRowsKVManager` (sampled.py) runs the token-level manager on a stratified sample of the rows;
what it pays for is the per-request Python and numpy of every decode step (about 3 ms a
request-step at 8 sampled rows and 2,000-token contexts). `BatchedLeanKVManager` runs each prefilled
request's decode step in one compiled call (sim/kv/fast/leankv_kernel.py) on the same token-level
arrays — write, decode attention, LeanKV's placement, demotion and pruning, tier moves, the slot
strategy — and keeps the token-level manager for everything else (prefill and the prompt cut,
allocation of prompts, freeing, invariants). The scheduler's per-request work per decode step is a
count: pages are reserved by `allocate_decodes` / `allocate_slots` and the token is written in
`finish_step`. Same results as the sampled-row manager up to float rounding (tested).

Used for `leankv` with its `every_step` trigger and the noop / free_block / slot_reuse / compact
strategies when numba is present; otherwise (the copy strategies, parallel_compact, other triggers)
fast mode is the sampled-row manager.
"""
from __future__ import annotations

import numpy as np

from ..importance import CHUNK
from ..policies.leankv import OBSERVED, PLACED
from ..slots import QUANT_FLOPS
from . import leankv_kernel as K
from .sampled import SampledRowsKVManager

FIELDS = {"imp_w", OBSERVED, PLACED}


def batched_leankv_supported(policy, slot_strategy: str, trigger: str) -> bool:
    """Whether `BatchedLeanKVManager` covers this configuration (else the sampled-row manager runs)."""
    return (K.njit is not None and policy.name == "leankv" and slot_strategy in K.STRATEGY_CODES
            and (trigger == "policy" or trigger == policy.default_trigger == "every_step"))


class _Decoding:
    """A prefilled request whose decode steps run compiled: its token and page arrays (the token-level
    manager's, plus each page's live and written slot counts), [tokens, entries] and the pages its
    next token needs."""
    __slots__ = ("rk", "imp", "meta", "need", "tokens", "pages")

    def __init__(self, rk, imp, stride: int):
        self.rk, self.imp = rk, imp
        self.meta = np.array([rk.state.num_tokens, rk.num_entries], dtype=np.int64)
        self.bind(stride)

    def bind(self, stride: int) -> None:
        """(Re)build the array tuples the kernel takes (after the table grew)."""
        rk = self.rk
        st = rk.state
        self.tokens = (st.live, st.pos, st.score, st.tier, st.field("imp_w"), st.field(OBSERVED), st.field(PLACED))
        occ = np.zeros(rk.table.shape, dtype=np.int64)
        self.pages = (rk.table, rk.page_tier, occ, np.zeros_like(occ), rk.tail, rk.tail_off)
        K.page_counts(self.tokens, self.pages, stride, int(self.meta[1]))


class BatchedLeanKVManager(SampledRowsKVManager):
    """Sampled-row LeanKV with compiled decode steps (module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        inner = self.inner
        model = inner.importance
        self._strategy = K.STRATEGY_CODES[inner.strategy]
        self._tau32 = model.tau.astype(np.float32)
        self._heads = (model.s.astype(np.float32), model.l.astype(np.float32), self._local_decay(256),
                       np.asarray(model.tau, dtype=np.float64))
        self._sink = np.asarray(model.spec.sink_weights, dtype=np.float64)
        self._cap = np.asarray(inner.tier_capacity, dtype=np.int64)
        self._tier_bytes = np.asarray(self.ctx.tier_bytes, dtype=np.float64)
        self._quant_flops = QUANT_FLOPS * 2 * self.ctx.head_dim * self.ctx.heads_per_row
        self._decoding: dict = {}
        self._pending: dict = {}            # request -> block ids reserved for its next decode token
        self._out = np.zeros(K.OUT_SIZE)
        self._scratch = np.zeros(0, dtype=np.float32)
        self._ids = np.zeros(0, dtype=np.int64)
        self._none = np.zeros(0, dtype=np.int64)

    # ----- scheduler-facing surface --------------------------------------------------------------
    def block_table_entries(self, req) -> int:
        ids = self._pending.get(req)
        return (self.inner.block_table_entries(req) + (ids.size if ids is not None else 0)) * self.unit

    def blocks_needed(self, req, num_new_tokens: int, num_computed_blocks: int = 0) -> int:
        d = self._decoding.get(req)
        if d is not None and num_new_tokens == 1:
            return d.need * self.unit
        self._leave(req)
        return super().blocks_needed(req, num_new_tokens, num_computed_blocks)

    def allocate_slots(self, req, num_new_tokens: int, computed_blocks=None) -> bool:
        d = self._decoding.get(req)
        if d is not None and num_new_tokens == 1:
            if req in self._pending:
                raise AssertionError(f"request {req.request_id}: a second decode token in one step")
            pool = self.inner.pool
            if d.need > pool.num_free_blocks:
                return False
            self._pending[req] = pool.get_new_blocks(d.need) if d.need else self._none
            return True
        self._leave(req)
        return super().allocate_slots(req, num_new_tokens, computed_blocks)

    def allocate_decodes(self, reqs) -> list[float] | None:
        decoding, pending = self._decoding, self._pending
        total = 0
        for req in reqs:
            d = decoding.get(req)
            if d is None or req in pending:
                return None
            total += d.need
        pool = self.inner.pool
        if total > pool.num_free_blocks:
            return None
        ids = pool.get_new_blocks(total) if total else self._none
        stats = self.inner._stats
        contexts = []
        k = 0
        for req in reqs:
            n = decoding[req].need
            pending[req] = ids[k:k + n]
            k += n
            contexts.append(stats[req][2])
        return contexts

    def free(self, req) -> int:
        ids = self._pending.pop(req, None)
        if ids is not None and ids.size:
            self.inner.pool.free_blocks(ids)
        self._decoding.pop(req, None)
        return super().free(req)

    def finish_step(self, scheduled):
        inner = self.inner
        rest = []
        for s in scheduled:
            req = s.request
            ids = self._pending.pop(req, None)
            if ids is None:
                rest.append(s)
                continue
            self._decode(req, self._decoding[req], ids)
            inner.logical_token_steps += req.num_computed_tokens + s.num_new_tokens
            inner.stored_token_steps += inner._stats[req][4]
        plan = super().finish_step(rest)
        for s in rest:
            rk = inner.req_kv.get(s.request)
            if rk is not None and rk.prefilled and s.request not in self._decoding and set(rk.state._fields) == FIELDS:
                self._enter(s.request, rk)
        return plan

    def check_invariants(self, live_requests) -> None:
        assert not self._pending, "pages reserved for a decode token outlived the step"
        super().check_invariants(live_requests)

    # ----- compiled decode steps ----------------------------------------------------------------
    def _local_decay(self, ages: int) -> np.ndarray:
        """exp(-age / tau) per row for ages 0..ages-1, in float32 as SyntheticImportance computes it."""
        return np.exp(-np.arange(ages, dtype=np.float32)[None, :] / self._tau32[:, None])

    def _enter(self, req, rk) -> None:
        d = self._decoding[req] = _Decoding(rk, self.inner.importance._r(req.request_id), self.inner.stride)
        d.need = K.next_token_pages(d.pages, self._cap, rk.num_entries, self._strategy >= K.SLOT_REUSE)

    def _leave(self, req) -> None:
        """Anything but a one-token decode goes back to the token-level manager, with the table's
        entry count the compiled steps gave it (the padding for their growth comes off)."""
        if req in self._pending:
            raise AssertionError(f"request {req.request_id}: leaves compiled decoding with a token reserved")
        d = self._decoding.pop(req, None)
        if d is None:
            return
        rk, entries = d.rk, int(d.meta[1])
        if rk.num_entries > entries:
            assert (rk.table[:, entries:] < 0).all()
            rk.table, rk.page_tier = rk.table[:, :entries].copy(), rk.page_tier[:, :entries].copy()
            rk.state.resize(entries * rk.stride)

    def _decode(self, req, d: _Decoding, reserved: np.ndarray) -> None:
        inner, rk, meta = self.inner, d.rk, d.meta
        st = rk.state
        if rk.num_entries < 2 * meta[1] + 2:         # room for the step to double the entries
            rk.grow(int(2 * meta[1] + 2))
            d.bind(inner.stride)
        if self._scratch.size < st.num_slots:
            self._scratch = np.zeros(2 * st.num_slots, dtype=np.float32)
        if self._ids.size < rk.table.size:
            self._ids = np.zeros(2 * rk.table.size, dtype=np.int64)
        q = st.num_tokens
        if self._heads[2].shape[1] <= q:
            self._heads = (*self._heads[:2], self._local_decay(2 * (q + 1)), self._heads[3])
        imp = d.imp
        if imp["chunk"] != q // CHUNK:
            inner.importance._weights(req.request_id, imp, np.array([q]))
        out = self._out
        policy = self.policy
        pool = inner.pool
        count = np.array([pool.count], dtype=np.int64)
        K.leankv_decode(d.tokens, d.pages, meta, np.ascontiguousarray(imp["w"][:, q % CHUNK]), imp["wsum"],
                        self._heads, self._sink, self._cap, self._tier_bytes, policy.alpha_h, policy.alpha_l,
                        policy.window, self._strategy, reserved, (pool.free, pool.owned, count), self._scratch,
                        self._ids, out)
        if out[K.OUT_ERROR]:
            raise AssertionError(f"request {req.request_id}: compiled LeanKV step failed (code {out[K.OUT_ERROR]:g})")
        pool.count = int(count[0])
        st.num_tokens = int(meta[0])
        st.num_steps_observed += 1
        rk.decode_steps += 1
        rk.added_since_compress = 0
        plan = inner.plan
        mass = float(out[K.OUT_MASS])
        rk.mass_sum += mass
        rk.mass_steps += 1
        plan.mass_retained[req.request_id] = mass
        evicted = int(out[K.OUT_EVICTED])
        rk.evicted_rows += evicted
        plan.evicted_tokens += evicted
        plan.blocks_freed_by_eviction += int(out[K.OUT_FREED])
        bpr = inner.bytes_per_token_row
        if out[K.OUT_MOVED]:
            plan.bytes_moved += int(round(float(out[K.OUT_MOVED_BYTES]) * bpr))
            plan.op_flops += self._quant_flops * int(out[K.OUT_MOVED])
        if out[K.OUT_COMPACT_BYTES]:
            plan.bytes_moved += int(round(float(out[K.OUT_COMPACT_BYTES]) * bpr))
        rows = inner.rows
        inner._unstat(req)
        live, alloc = int(out[K.OUT_LIVE]), int(out[K.OUT_ALLOC])
        inner._stats[req] = (live, alloc, float(out[K.OUT_READ]) / rows, int(out[K.OUT_PAGES]),
                             float(out[K.OUT_STORED]) / rows)
        inner._live_total += live
        inner._alloc_total += alloc
        d.need = int(out[K.OUT_NEED])
