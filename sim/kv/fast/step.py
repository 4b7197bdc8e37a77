"""Fast mode's batched steps: the prompt cut at the end of prefill and one decode step for every
decoding request (the compiled kernel, or its numpy twin)."""
from __future__ import annotations

import numpy as np

from ..slots import COPY_STRATEGIES, REUSE_STRATEGIES
from . import kernels
from .layout import StepOutputs
from .slab import COMPACT

_NO_DRAWS = np.zeros(0)


class StepMixin:
    """The prompt cut and the decode step of FastKVManager."""

    def _finish_prefill(self, s: int) -> None:
        bs, R = self.block_size, self.rows
        L = int(self.ntok[s])
        W = min(self.window, L)
        cols = -(-L // bs)
        if self.window and self.tracks_columns:
            wpos = np.arange(L - W, L)
            self.ring[s][:, wpos % self.window] = (wpos // bs)[None, :]
            self.win[s, :, :cols] = np.bincount(wpos // bs, minlength=cols)[None, :]
        scored = self.cut_scored and self.tracks_columns
        W = min(self.cut_window, L)
        cand = L - W
        keep = self._row_keep(L, W)
        kept_pos = None
        if scored:
            kept_pos, keep = self._score_prompt(s, L, W, keep)
        if (keep < cand).any():
            self._cut(s, L, cand, keep, kept_pos)
        self.prefilled[s] = True
        self._prefilled_l[s] = True
        self._cut_len[s] = L
        if self.prompt_only:                     # no decode evictions: no candidate list to keep
            self.hn[s] = 0
        self._settle_generic(s, np.arange(R))
        if not scored:                           # scored lists are built by _score_prompt (and remapped by compaction)
            self._rebuild_heavy(s, np.arange(R))
        self._update_need(np.array([s]))

    def _cut(self, s: int, L: int, cand: int, keep: np.ndarray, kept_pos: np.ndarray | None) -> None:
        """The prompt cut: row r keeps keep[r] of its `cand` candidates (the tokens before the window)
        — the scored ones in kept_pos, else the newest ("oldest" policies) or a uniform draw — and
        every window token."""
        bs, R = self.block_size, self.rows
        cols = -(-L // bs)
        pos_page = np.arange(L) // bs
        protect = min(self.sink, cand, int(keep.min()))
        per_page = np.bincount(pos_page[protect:cand], minlength=cols)
        if not self.tracks_columns:
            self.live[s] = L - cand + keep
            self.plan.evicted_tokens += int((cand - keep).sum())
            return
        if kept_pos is not None:
            listed = kept_pos >= 0
            row_of = np.broadcast_to(np.arange(R)[:, None], kept_pos.shape)[listed]
            listed = np.bincount(row_of * cols + kept_pos[listed] // bs, minlength=R * cols)
            kept = per_page[None, :] - (np.bincount(pos_page[:cand], minlength=cols)[None, :]
                                        - listed.reshape(R, cols))
        elif self.age_weight == "oldest":
            kept = np.stack([np.bincount(pos_page[cand - k + protect:cand], minlength=cols) for k in keep])
        else:
            kept = np.stack([self.rng.multivariate_hypergeometric(per_page, k - protect, method="marginals")
                             for k in keep]) if (keep != keep[0]).any() else \
                self.rng.multivariate_hypergeometric(per_page, int(keep[0]) - protect, size=R, method="marginals")
        evict = per_page[None, :] - kept
        self.occ[s, :, :cols] -= evict.astype(np.int32)
        self.live[s] = L - cand + keep
        self.plan.evicted_tokens += int(evict.sum())

    def _step(self, S: np.ndarray) -> list[int]:
        """Write one token per row of every slot in S, move the window, evict, apply the slot strategy.
        Returns the (token, row) evictions per slot. Pages were taken from the pool by allocate_slots.
        Runs as one compiled kernel (kernels.decode_rows) where numba is installed, else in numpy
        (`_step_numpy`, its twin: the same state, draw for draw)."""
        if self.recut:                           # a row's list grows by at most one entry a step
            self._ensure_list_cap(int(self.hn[S].max()) + 2)
        sparse = self.strategy in COPY_STRATEGIES
        if kernels.decode_rows is None:
            if sparse:
                self._sparse_copy(S)
            return self._step_numpy(S)
        if sparse:                               # rows with several holed pages; the kernel rewrites the rest
            self._densify_generic(S, self._typical_copy(S))
        return self._step_compiled(S)

    def _step_compiled(self, S: np.ndarray) -> list[int]:
        num_pairs = S.size * self.rows
        if self._ncol_hi >= self.occ.shape[2]:
            self._ncol_hi = int(self.ncol.max())
            self._ensure_cols(self._ncol_hi + 1)
        draw = self.budget is not None and self.tracks_columns
        uniform = self.rng.random(num_pairs) if draw and not self.scored else _NO_DRAWS
        normal = self.rng.standard_normal(num_pairs) if draw and self.scored else _NO_DRAWS
        out = StepOutputs(np.empty(S.size, np.int64), np.empty(S.size, np.int64), self.need_next, self.slot_live,
                          self.slot_pages)
        counts = kernels.decode_rows(S, self.rows, self._slab, self._flags, uniform, normal, self._score_arrays, out)
        self._apply_step_counts(*counts)
        if counts[-1]:                           # rows left to the exact paths
            self._finish_left_rows(S[out.left > 0])
        if self.strategy == "sparse_copy":       # the kernel's page need assumes holed_copy's rewrite
            self.need_next[S] = self._need_rows(S).sum(axis=1)
        self._mirror_counts()
        return out.evicted.tolist()

    def _apply_step_counts(self, opened, evicted, freed, copied_rows, copied_tokens, compacted, _left) -> None:
        """The pool and the step plan after the kernel's step (it counts, the manager gives back)."""
        if opened:
            self._ncol_hi += 1
        self.plan.evicted_tokens += evicted
        if freed:
            self.pool.give(freed)
            self.plan.blocks_freed_by_eviction += freed
        if copied_rows:
            self.pool.give(2 * copied_rows)
            self.plan.bytes_moved += int(round(copied_tokens * self.bytes_per_token_row))
        if compacted:
            self.pool.give(compacted)
            self.plan.blocks_freed_by_eviction += compacted
            self.plan.bytes_moved += int(round(compacted * self.bytes_per_token_row))

    def _finish_left_rows(self, rest: np.ndarray) -> None:
        """Slots with rows the kernel left: compaction of several spare pages, then their page need."""
        if self.strategy in COMPACT:             # rows with more spare pages: the exact path, then recount
            for s in rest.tolist():
                rows = np.flatnonzero(self.pages[s] - -(-self.live[s] // self.block_size) > 0)
                self._compact_rows(s, rows)
                self._rescan_holes(s, rows)
            self._restat(rest)
        self.need_next[rest] = self._need_rows(rest).sum(axis=1)

    def _step_numpy(self, S: np.ndarray) -> list[int]:
        """`_step` in numpy (sparse_copy's rewrite already done).

        Hot path: a constant number of numpy operations over all m = len(S) x rows (request, row)
        pairs. The per-row scalars of those pairs are gathered once into `st` [m, fields], updated
        in place through column views, and scattered back; page columns are addressed in the
        flattened slab (row id q = slot * rows + row, page id = q * cols + column)."""
        bs, R, W = self.block_size, self.rows, self.window
        nS = S.size
        q, qP, ring_base = self._index(S)
        pos = self.ntok[S]
        st = self._row_state_f[q]
        tail, tw, ncol, pages, live, hole, _, hn = st.T        # column views (field order of ROW_FIELDS)
        # --- write the new token (into the tail page, the first hole, or a page opened from the reservation)
        if self.append:
            new = tw >= bs
            new |= ncol == 0
            col = np.where(new, ncol, tail)
        else:
            new = hole < 0
            col = np.where(new, ncol, hole)
        if np.count_nonzero(new):
            if self._ncol_hi >= self.occ.shape[2]:
                self._ncol_hi = int(self.ncol.max())
                self._ensure_cols(self._ncol_hi + 1)
                q, qP, ring_base = self._index(S)
            self._ncol_hi += 1
            self._alive_f[(qP + col)[new]] = True
            pages += new
            ncol += new                   # pages open at column ncol
            if self.append:
                tail[:] = col
                tw[new] = 0
            else:
                np.copyto(hole, col, where=new)
        if self.append:
            tw += 1
        at = qP + col
        track = self.tracks_columns
        if track:
            self._occ_f[at] += 1
        live += 1
        # --- the window moves on: the token at pos - W leaves it
        ex, ec = False, col
        if W and track:
            ring_at = (ring_base + (pos % W)[:, None]).ravel()
            ec = self._ring_f[ring_at]
            if pos.min() >= W:
                ex = True
                self._win_f[qP + ec] -= 1
            else:
                ex = np.repeat(pos >= W, R)
                self._win_f[qP + ec] -= ex
            self._win_f[at] += 1
            self._ring_f[ring_at] = col
        self.ntok[S] += 1
        if self.strategy in REUSE_STRATEGIES:
            self._after_fill(qP, st, at, col)
        # --- evict
        evicted = None
        rescan = None
        if self.budget is not None:
            over = live > self.budget
            n_over = int(np.count_nonzero(over))
            if n_over:
                live -= over
                self.plan.evicted_tokens += n_over
                evicted = [R] * nS if n_over == over.size else over.reshape(nS, R).sum(axis=1).tolist()
                if track:
                    ev = self._pick(q, over, ex, ec, hn)
                    ev_at = qP + ev
                    self._occ_f[ev_at] -= over
                    rescan = self._after_evict(over, ev, ev_at, st)
                    if rescan is not None:
                        rescan &= pages * bs > live
                        if np.count_nonzero(rescan):
                            hole[rescan] = self._first_free(qP[rescan], ev[rescan] + 1, ncol[rescan])
            elif track:                          # below budget: tokens leaving the window are listed
                self._pick(q, over, ex, ec, hn)
        self._row_state_f[q] = st
        if self.strategy in COMPACT:
            self._compact_step(S, q, col)
        if self.strategy in COMPACT or self.strategy in COPY_STRATEGIES:   # pages moved: recount from the slab
            self._update_need(S)
            self._restat(S)
        else:                                    # the gathered row state is final
            need = (tw >= bs) | (ncol == 0) if self.append else pages * bs <= live
            self._update_need(S, need.reshape(nS, R))
            self._restat(S, live.reshape(nS, R), pages.reshape(nS, R))
        return [0] * nS if evicted is None else evicted
