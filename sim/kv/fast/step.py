"""Fast mode's batched steps: the prompt cut at the end of prefill and one decode step for every
decoding request (the compiled kernel, or its numpy twin)."""
from __future__ import annotations

import numpy as np

from ..slots import COPY_STRATEGIES, REUSE_STRATEGIES
from .compiled import kernels
from .compiled.layout import HOLE, HOLED, LIVE, StepOutputs
from .budgets import CutBudgets
from .scoring import Scorer
from .settings import FastSettings
from .slab import COMPACT, FastSlab, Ledger
from .slots import SlotStrategy

_NO_DRAWS = np.zeros(0)


class FastStep:
    """The prompt cut and the batched decode step. Reads the settings, the slab, the ledger, the run's
    Generator (the cut's and the step's draws), the budgets (each row's keep at the cut), the scorer
    (which token goes) and the slot strategy (how pages answer)."""

    def __init__(self, settings: FastSettings, slab: FastSlab, ledger: Ledger, rng: np.random.Generator,
                 budgets: CutBudgets, scorer: Scorer, slots: SlotStrategy):
        self.cfg, self.slab, self.ledger, self.rng = settings, slab, ledger, rng
        self.budgets, self.scorer, self.slots = budgets, scorer, slots

    def finish_prefill(self, s: int) -> None:
        bs, R = self.cfg.block_size, self.cfg.rows
        L = int(self.slab.ntok[s])
        W = min(self.cfg.window, L)
        cols = -(-L // bs)
        if self.cfg.window and self.cfg.tracks_columns:
            wpos = np.arange(L - W, L)
            self.slab.ring[s][:, wpos % self.cfg.window] = (wpos // bs)[None, :]
            self.slab.win[s, :, :cols] = np.bincount(wpos // bs, minlength=cols)[None, :]
        scored = self.cfg.cut_scored and self.cfg.tracks_columns
        W = min(self.cfg.cut_window, L)
        cand = L - W
        keep = self.budgets.row_keep(L, W)
        kept_pos = None
        if scored:
            kept_pos, keep = self.scorer.score_prompt(s, L, W, keep)
        if (keep < cand).any():
            self.cut(s, L, cand, keep, kept_pos)
        self.slab.prefilled[s] = True
        self.slab.prefilled_l[s] = True
        self.budgets.cut_len[s] = L
        if self.cfg.prompt_only:                     # no decode evictions: no candidate list to keep
            self.slab.hn[s] = 0
        self.slots.settle_generic(s, np.arange(R))
        if not scored:                           # scored lists are built by _score_prompt (and remapped by compaction)
            self.scorer.rebuild_heavy(s, np.arange(R))
        self.slots.update_need(np.array([s]))

    def cut(self, s: int, L: int, cand: int, keep: np.ndarray, kept_pos: np.ndarray | None) -> None:
        """The prompt cut: row r keeps keep[r] of its `cand` candidates (the tokens before the window)
        — the scored ones in kept_pos, else the newest ("oldest" policies) or a uniform draw — and
        every window token."""
        bs, R = self.cfg.block_size, self.cfg.rows
        cols = -(-L // bs)
        pos_page = np.arange(L) // bs
        protect = min(self.cfg.sink, cand, int(keep.min()))
        per_page = np.bincount(pos_page[protect:cand], minlength=cols)
        if not self.cfg.tracks_columns:
            self.slab.live[s] = L - cand + keep
            self.ledger.plan.evicted_tokens += int((cand - keep).sum())
            return
        if kept_pos is not None:
            listed = kept_pos >= 0
            row_of = np.broadcast_to(np.arange(R)[:, None], kept_pos.shape)[listed]
            listed = np.bincount(row_of * cols + kept_pos[listed] // bs, minlength=R * cols)
            kept = per_page[None, :] - (np.bincount(pos_page[:cand], minlength=cols)[None, :]
                                        - listed.reshape(R, cols))
        elif self.cfg.age_weight == "oldest":
            kept = np.stack([np.bincount(pos_page[cand - k + protect:cand], minlength=cols) for k in keep])
        else:
            kept = np.stack([self.rng.multivariate_hypergeometric(per_page, k - protect, method="marginals")
                             for k in keep]) if (keep != keep[0]).any() else \
                self.rng.multivariate_hypergeometric(per_page, int(keep[0]) - protect, size=R, method="marginals")
        evict = per_page[None, :] - kept
        self.slab.occ[s, :, :cols] -= evict.astype(np.int32)
        self.slab.live[s] = L - cand + keep
        self.ledger.plan.evicted_tokens += int(evict.sum())

    def step(self, S: np.ndarray) -> list[int]:
        """Write one token per row of every slot in S, move the window, evict, apply the slot strategy.
        Returns the (token, row) evictions per slot. Pages were taken from the pool by allocate_slots.
        Runs as one compiled kernel (kernels.decode_rows) where numba is installed, else in numpy
        (`step_numpy`, its twin: the same state, draw for draw)."""
        if self.cfg.recut:                           # a row's list grows by at most one entry a step
            self.slab.ensure_list_cap(int(self.slab.hn[S].max()) + 2)
        sparse = self.cfg.strategy in COPY_STRATEGIES
        if kernels.decode_rows is None:
            if sparse:
                self.slots.sparse_copy(S)
            return self.step_numpy(S)
        if sparse:                               # rows with several holed pages; the kernel rewrites the rest
            self.slots.densify_generic(S, self.slots.typical_copy(S))
        return self.step_compiled(S)

    def step_compiled(self, S: np.ndarray) -> list[int]:
        num_pairs = S.size * self.cfg.rows
        if self.slab.ncol_hi >= self.slab.occ.shape[2]:
            self.slab.ncol_hi = int(self.slab.ncol.max())
            self.slab.ensure_cols(self.slab.ncol_hi + 1)
        draw = self.cfg.budget is not None and self.cfg.tracks_columns
        uniform = self.rng.random(num_pairs) if draw and not self.cfg.scored else _NO_DRAWS
        normal = self.rng.standard_normal(num_pairs) if draw and self.cfg.scored else _NO_DRAWS
        out = StepOutputs(np.empty(S.size, np.int64), np.empty(S.size, np.int64), self.slab.need_next, self.slab.slot_live,
                          self.slab.slot_pages)
        counts = kernels.decode_rows(S, self.cfg.rows, self.slab.arrays, self.slab.flags, uniform, normal, self.slab.score_arrays, out)
        self.apply_step_counts(*counts)
        if counts[-1]:                           # rows left to the exact paths
            self.finish_left_rows(S[out.left > 0])
        if self.cfg.strategy == "sparse_copy":       # the kernel's page need assumes holed_copy's rewrite
            self.slab.need_next[S] = self.slots.need_rows(S).sum(axis=1)
        self.slab.mirror_counts()
        return out.evicted.tolist()

    def apply_step_counts(self, opened, evicted, freed, copied_rows, copied_tokens, compacted, _left) -> None:
        """The pool and the step plan after the kernel's step (it counts, the manager gives back)."""
        if opened:
            self.slab.ncol_hi += 1
        self.ledger.plan.evicted_tokens += evicted
        if freed:
            self.ledger.free_evicted(freed)
        if copied_rows:
            self.ledger.pool.give(2 * copied_rows)
            self.ledger.charge_moved(copied_tokens)
        if compacted:
            self.ledger.free_evicted(compacted)
            self.ledger.charge_moved(compacted)

    def finish_left_rows(self, rest: np.ndarray) -> None:
        """Slots with rows the kernel left: compaction of several spare pages, then their page need."""
        if self.cfg.strategy in COMPACT:             # rows with more spare pages: the exact path, then recount
            for s in rest.tolist():
                rows = np.flatnonzero(self.slab.pages[s] - -(-self.slab.live[s] // self.cfg.block_size) > 0)
                self.slots.compact_rows(s, rows)
                self.slots.rescan_holes(s, rows)
            self.slab.restat(rest)
        self.slab.need_next[rest] = self.slots.need_rows(rest).sum(axis=1)

    def step_numpy(self, S: np.ndarray) -> list[int]:
        """`step` in numpy (sparse_copy's rewrite already done).

        Hot path: a constant number of numpy operations over all m = len(S) x rows (request, row)
        pairs. The per-row scalars of those pairs are gathered once into `st` [m, fields], updated
        in place through column views, and scattered back; page columns are addressed in the
        flattened slab (row id q = slot * rows + row, page id = q * cols + column)."""
        slab = self.slab
        q, qP, ring_base = slab.index(S)
        pos = slab.ntok[S]
        st = slab.row_state_f[q]
        col, qP, ring_base = self._write(S, st, qP, ring_base)
        at = qP + col
        ex, ec = self._move_window(pos, qP, ring_base, at, col)
        slab.ntok[S] += 1
        if self.cfg.strategy in REUSE_STRATEGIES:
            self.slots.after_fill(qP, st, at, col)
        evicted = self._evict(S.size, q, qP, st, ex, ec)
        slab.row_state_f[q] = st
        self._settle(S, q, col, st)
        return [0] * S.size if evicted is None else evicted

    def _write(self, S: np.ndarray, st: np.ndarray, qP, ring_base) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The new token of each row goes into the tail page, the first hole, or a page opened from the
        reservation. Returns its columns and the step's (re-cut when the slab widened) page ids and
        ring bases."""
        slab, bs, append = self.slab, self.cfg.block_size, self.cfg.append
        tail, tw, ncol, pages, _, hole = st.T[:HOLED]          # column views (field order of ROW_FIELDS)
        if append:
            new = tw >= bs
            new |= ncol == 0
            col = np.where(new, ncol, tail)
        else:
            new = hole < 0
            col = np.where(new, ncol, hole)
        if np.count_nonzero(new):
            if slab.ncol_hi >= slab.occ.shape[2]:
                slab.ncol_hi = int(slab.ncol.max())
                slab.ensure_cols(slab.ncol_hi + 1)
                _, qP, ring_base = slab.index(S)
            slab.ncol_hi += 1
            slab.alive_f[(qP + col)[new]] = True
            pages += new
            ncol += new                   # pages open at column ncol
            if append:
                tail[:] = col
                tw[new] = 0
            else:
                np.copyto(hole, col, where=new)
        if append:
            tw += 1
        if self.cfg.tracks_columns:
            slab.occ_f[qP + col] += 1
        st[:, LIVE] += 1
        return col, qP, ring_base

    def _move_window(self, pos, qP, ring_base, at, col):
        """The window moves on: the token at pos - W leaves it (ex: whether it does, per row or for all;
        ec: its column)."""
        slab, W = self.slab, self.cfg.window
        if not (W and self.cfg.tracks_columns):
            return False, col
        ring_at = (ring_base + (pos % W)[:, None]).ravel()
        ec = slab.ring_f[ring_at]
        if pos.min() >= W:
            ex = True
            slab.win_f[qP + ec] -= 1
        else:
            ex = np.repeat(pos >= W, self.cfg.rows)
            slab.win_f[qP + ec] -= ex
        slab.win_f[at] += 1
        slab.ring_f[ring_at] = col
        return ex, ec

    def _evict(self, nS: int, q, qP, st, ex, ec) -> list[int] | None:
        """Over-budget rows evict one token each (the scorer picks it, the slot strategy answers);
        rows below the budget list the token leaving the window. Returns evictions per slot (None: none)."""
        cfg, slab = self.cfg, self.slab
        if cfg.budget is None:
            return None
        _, _, ncol, pages, live, hole, _, hn = st.T
        over = live > cfg.budget
        n_over = int(np.count_nonzero(over))
        if not n_over:
            if cfg.tracks_columns:
                self.scorer.pick(q, over, ex, ec, hn)
            return None
        live -= over
        self.ledger.plan.evicted_tokens += n_over
        evicted = [cfg.rows] * nS if n_over == over.size else over.reshape(nS, cfg.rows).sum(axis=1).tolist()
        if cfg.tracks_columns:
            ev = self.scorer.pick(q, over, ex, ec, hn)
            ev_at = qP + ev
            slab.occ_f[ev_at] -= over
            rescan = self.slots.after_evict(over, ev, ev_at, st)
            if rescan is not None:
                rescan &= pages * cfg.block_size > live
                if np.count_nonzero(rescan):
                    hole[rescan] = self.slots.first_free(qP[rescan], ev[rescan] + 1, ncol[rescan])
        return evicted

    def _settle(self, S: np.ndarray, q, col, st) -> None:
        """Compaction's answer, then each slot's next page need and totals (from the gathered row state
        when no page moved)."""
        strategy, bs, R = self.cfg.strategy, self.cfg.block_size, self.cfg.rows
        if strategy in COMPACT:
            self.slots.compact_step(S, q, col)
        if strategy in COMPACT or strategy in COPY_STRATEGIES:   # pages moved: recount from the slab
            self.slots.update_need(S)
            self.slab.restat(S)
            return
        _, tw, ncol, pages, live = st.T[:HOLE]                  # the gathered row state is final
        need = (tw >= bs) | (ncol == 0) if self.cfg.append else pages * bs <= live
        self.slots.update_need(S, need.reshape(S.size, R))
        self.slab.restat(S, live.reshape(S.size, R), pages.reshape(S.size, R))
