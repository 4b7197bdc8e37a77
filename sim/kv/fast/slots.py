"""Fast mode's slot strategies on page counts: first-hole reuse, compaction, ring rebuilds, the
sparse / holed copy rewrite and the exact count-based paths for rows in an unusual state."""
from __future__ import annotations

import numpy as np

from ..slots import COPY_STRATEGIES, FREEING_STRATEGIES, REUSE_STRATEGIES
from .compiled.layout import HOLE, HOLED, LIVE, NCOL, PAGES, TAIL, TAIL_WRITTEN
from .compiled.reference import advance_first_free_np, first_free_np
from .scoring import Scorer
from .settings import FastSettings
from .slab import COMPACT, FastSlab, Ledger


class SlotStrategy:
    """How a row's pages answer evictions: freed, refilled, compacted or rewritten, and the pages a
    row's next token takes. Reads the settings (slot strategy, sizes, window), the slab, the ledger
    (pages given back, bytes moved) and the scorer (heavy lists follow moved tokens)."""

    def __init__(self, settings: FastSettings, slab: FastSlab, ledger: Ledger, scorer: Scorer):
        self.cfg, self.slab, self.ledger, self.scorer = settings, slab, ledger, scorer

    def due(self, S) -> np.ndarray:
        """bool [len(S), rows]: holed rows whose rewrite is due: any hole (copy_threshold 0), else more
        holes (written slots - live tokens; append strategies fill every page but the tail) than the threshold."""
        due = self.slab.holed[S] != -1
        h = self.cfg.copy_threshold
        if h:
            written = self.slab.pages[S].astype(np.int64) * self.cfg.block_size - (self.cfg.block_size - self.slab.tail_w[S])
            due &= written - self.slab.live[S] > h
        return due

    def typical_copy(self, S) -> np.ndarray:
        """holed_copy rows whose holes are all in one page other than the tail (the steady state; the
        kernel rewrites them) and whose rewrite is due. sparse_copy rewrites whole rows: none is typical."""
        h = self.slab.holed[S]
        if self.cfg.strategy == "sparse_copy":
            return np.zeros(h.shape, dtype=bool)
        typical = (h >= 0) & (h != self.slab.tail[S]) & (self.cfg.window >= self.cfg.block_size)
        return typical & self.due(S) if self.cfg.copy_threshold else typical

    def need_rows(self, S: np.ndarray) -> np.ndarray:
        """int [len(S), rows]: pages the next one-token write of each row takes (sparse copy included)."""
        bs = self.cfg.block_size
        if self.cfg.strategy in REUSE_STRATEGIES:
            return (self.slab.pages[S] * bs - self.slab.live[S] < 1).astype(np.int64)
        need = ((self.slab.tail_w[S] >= bs) | (self.slab.ncol[S] == 0)).astype(np.int64)
        if self.cfg.strategy not in COPY_STRATEGIES:
            return need
        qP = (S[:, None] * self.cfg.rows + self.slab._row_ids) * self.slab.occ.shape[2]
        holed = self.slab.holed[S]
        typical = self.typical_copy(S)
        moved = self.slab.occ_f[qP + np.maximum(holed, 0)] + self.slab.occ_f[qP + self.slab.tail[S]]
        dst = -(-moved // bs)
        need = np.where(typical, dst + (dst * bs - moved < 1), need)
        slot_index, rows = np.nonzero(self.due(S) & ~typical)   # rows not due append as noop
        if rows.size:                            # several holed pages: all such rows at once
            slots = S[slot_index]
            width = self.slab.used_width(slots, rows)
            moved = (self.slab.occ[slots, rows, :width] * self.dirty_rows(slots, rows, width)).sum(axis=1)
            dst = -(-moved // bs)
            need[slot_index, rows] = dst + (dst * bs - moved < 1)
        return need

    def update_need(self, S: np.ndarray, need_rows: np.ndarray | None = None) -> None:
        """Pages each slot's next token takes, from its rows' [len(S), rows] needs."""
        slab = self.slab
        slab.need_next[S] = (self.need_rows(S) if need_rows is None else need_rows).sum(axis=1)
        slab.need_l = slab.need_next.tolist()

    def dirty_rows(self, s, rows: np.ndarray, width: int) -> np.ndarray:
        """sparse_copy: bool [rows, width] pages to rewrite (holed pages, plus the tail of a holed row) of some rows (s: a slot, or one slot per row)."""
        bs = self.cfg.block_size
        tail = self.slab.tail[s, rows]
        written = np.where(np.arange(width)[None, :] == tail[:, None], self.slab.tail_w[s, rows][:, None], bs)
        alive = self.slab.alive[s, rows, :width]
        dirty = alive & (self.slab.occ[s, rows, :width] < written)
        if self.cfg.strategy == "sparse_copy":              # the whole row of a holed row
            return alive & dirty.any(axis=1)[:, None]
        r = np.flatnonzero(dirty.any(axis=1))
        dirty[r, tail[r]] = True
        return dirty

    def settle_generic(self, s: int, rows: np.ndarray) -> None:
        """Exact count-based slot strategy for some rows of slot s (any number of holed pages)."""
        bs = self.cfg.block_size
        occ, alive = self.slab.occ[s, rows], self.slab.alive[s, rows]
        if self.cfg.strategy in FREEING_STRATEGIES:
            empty = alive & (occ == 0)
            if self.cfg.strategy not in REUSE_STRATEGIES:          # keep an append tail with unwritten slots
                tail = self.slab.tail[s, rows]
                open_tail = self.slab.tail_w[s, rows] < bs
                empty[np.arange(rows.size)[open_tail], tail[open_tail]] = False
            self.drop(s, rows, empty)
        if self.cfg.strategy in COMPACT:
            self.compact_rows(s, rows)
        if self.cfg.strategy in REUSE_STRATEGIES:
            self.rescan_holes(s, rows)
        if self.cfg.strategy in COPY_STRATEGIES:
            self.mark_holed(s, rows)

    def drop(self, s: int, rows: np.ndarray, cols_mask: np.ndarray) -> None:
        n = int(cols_mask.sum())
        if not n:
            return
        self.slab.alive[s, rows] &= ~cols_mask
        self.slab.pages[s, rows] -= cols_mask.sum(axis=1).astype(np.int32)
        self.ledger.free_evicted(n)

    def compact_rows(self, s: int, rows: np.ndarray) -> None:
        """Survivors of each row's last pages move into holes of its first ceil(live/bs) pages."""
        bs = self.cfg.block_size
        occ, alive, win = self.slab.occ[s, rows], self.slab.alive[s, rows], self.slab.win[s, rows]
        keep = -(-self.slab.live[s, rows] // bs)
        rank = np.cumsum(alive, axis=1)
        kept = alive & (rank <= keep[:, None])
        gone = alive & ~kept
        moved = (occ * gone).sum(axis=1)
        if not gone.any():
            return
        self.ledger.charge_moved(moved.sum())
        holes = np.where(kept, bs - occ, 0)
        before = np.cumsum(holes, axis=1) - holes
        add = np.minimum(np.maximum(moved[:, None] - before, 0), holes)
        self.slab.occ[s, rows] = np.where(kept, occ + add, 0)
        # moved tokens are the newest ones: window counts follow them into the filled holes
        wmoved = (win * gone).sum(axis=1)
        self.slab.win[s, rows] = np.where(kept, win + np.minimum(np.maximum(wmoved[:, None] - (np.cumsum(add, axis=1) - add), 0),
                                                           add), 0)
        n = int(gone.sum())
        self.slab.alive[s, rows] = kept
        self.slab.pages[s, rows] = keep.astype(np.int32)
        self.ledger.free_evicted(n)
        self.rebuild_ring(s, rows)
        if self.slab.prefilled[s]:
            self.scorer.rebuild_heavy(s, rows)

    def rebuild_ring(self, s, rows: np.ndarray) -> None:
        """Window tokens are the newest live ones: place them by each column's window count, in column
        order (s: a slot, or one slot per row)."""
        if not self.cfg.window:
            return
        width = self.slab.used_width(s, rows)
        win = self.slab.win[s, rows, :width]
        cw = np.cumsum(win, axis=1)
        nwin = cw[:, -1]
        t = np.asarray(self.slab.ntok[s])[..., None]
        k = np.arange(self.cfg.window)
        pos = t - self.cfg.window + k                                   # window positions, oldest first
        first = self.cfg.window - nwin                                  # rows with fewer window tokens
        idx = k[None, :] - first[:, None]
        # column of the k-th window token = how many prefix counts are <= k: one searchsorted over all
        # rows, each row's (nondecreasing, <= window) prefix counts shifted above the previous row's
        n, P = cw.shape
        row = np.arange(n)[:, None]
        shift = row * (self.cfg.window + 1)
        col = np.searchsorted((cw + shift).ravel(), np.maximum(idx, 0) + shift, side="right") - row * P
        col = np.minimum(col, P - 1)
        ring = self.slab.ring[s, rows]
        np.put_along_axis(ring, np.broadcast_to(pos % self.cfg.window, col.shape), col, axis=1)
        self.slab.ring[s, rows] = ring
        n = self.slab.ncol[s, rows]
        alive = self.slab.alive[s, rows, :width]
        hi = np.where(alive.any(axis=1), width - np.argmax(alive[:, ::-1], axis=1), 0)
        self.slab.ncol[s, rows] = np.minimum(n, hi)

    def rescan_holes(self, s: int, rows: np.ndarray) -> None:
        free = self.slab.alive[s, rows] & (self.slab.occ[s, rows] < self.cfg.block_size)
        self.slab.hole_col[s, rows] = np.where(free.any(axis=1), np.argmax(free, axis=1), -1)

    def mark_holed(self, s: int, rows: np.ndarray) -> None:
        bs = self.cfg.block_size
        cols = self.slab.occ.shape[2]
        written = np.where(np.arange(cols)[None, :] == self.slab.tail[s, rows][:, None], self.slab.tail_w[s, rows][:, None], bs)
        holed = self.slab.alive[s, rows] & (self.slab.occ[s, rows] < written)
        cnt = holed.sum(axis=1)
        self.slab.holed[s, rows] = np.where(cnt == 0, -1, np.where(cnt == 1, np.argmax(holed, axis=1), -2))

    def after_evict(self, over, ev, ev_at, st) -> np.ndarray | None:
        """The slot strategy's answer to this step's evictions (column ev of each over-budget row),
        on the gathered row scalars `st`. Returns the rows whose first-hole pointer must be searched for."""
        tail, tw, ncol, pages, _, hole = st.T[:HOLED]
        empty = None
        if self.cfg.strategy in FREEING_STRATEGIES:
            empty = over & (self.slab.occ_f[ev_at] == 0)
            if self.cfg.append:
                empty &= (tail != ev) | (tw >= self.cfg.block_size)
            if np.count_nonzero(empty):
                self.slab.alive_f[ev_at[empty]] = False
                pages -= empty
                ncol -= empty & (ncol == ev + 1)
                n = int(np.count_nonzero(empty))
                self.ledger.free_evicted(n)
                if self.cfg.strategy in REUSE_STRATEGIES:
                    hole[empty & (hole == ev)] = -1
            else:
                empty = None
        if self.cfg.strategy in REUSE_STRATEGIES:
            kept = over if empty is None else over & ~empty
            np.copyto(hole, np.where(hole < 0, ev, np.minimum(hole, ev)), where=kept)
            return None if empty is None else empty & (hole < 0)
        if self.cfg.strategy in COPY_STRATEGIES:
            holed = st[:, HOLED]
            holed[:] = np.where(over, np.where(holed == -1, ev, np.where(holed == ev, holed, -2)), holed)
        return None

    def compact_step(self, S, q, col) -> None:
        """Compaction after the step's evictions: a row holding one page more than its live tokens
        need, whose newest token (just written at column col) sits alone in its last page with a hole
        before it, moves that token into the hole and frees the page; other rows with spare pages go
        through the exact count-based path."""
        bs, R, W = self.cfg.block_size, self.cfg.rows, self.cfg.window
        st = self.slab.row_state_f[q]
        pages, live, ncol, hole = st[:, PAGES], st[:, LIVE], st[:, NCOL], st[:, HOLE]
        extra = pages - -(-live // bs)
        if not (extra > 0).any():
            return
        P = self.slab.occ.shape[2]
        occ_f, win_f, alive_f = self.slab.occ_f, self.slab.win_f, self.slab.alive_f
        last = np.maximum(ncol - 1, 0)
        at_last = q * P + last
        simple = (extra == 1) & (occ_f[at_last] == 1) & (hole >= 0) & (hole < last) & alive_f[at_last]
        if W:
            simple &= col == last                # the newest token is the one alone in the last page
        if simple.any():
            moving_rows, last_page = q[simple], at_last[simple]
            hole_page = moving_rows * P + hole[simple]
            occ_f[hole_page] += 1
            occ_f[last_page] = 0
            win_f[hole_page] += 1
            win_f[last_page] = 0
            if W:
                newest = np.repeat(self.slab.ntok[S] - 1, R)[simple]
                self.slab.ring_f[moving_rows * W + newest % W] = hole[simple]
            alive_f[last_page] = False
            pages -= simple
            ncol[simple] = last[simple]
            n = int(moving_rows.size)
            self.ledger.free_evicted(n)
            self.ledger.charge_moved(n)
            moved = st[simple]                   # a filled hole moves the first-free pointer on
            advance_first_free_np(self.slab.occ.reshape(-1, P), moving_rows * P, hole[simple], moved[:, HOLE],
                                  moved[:, PAGES], moved[:, LIVE], moved[:, NCOL], bs)
            st[simple] = moved
            self.slab.row_state_f[q] = st
        hard = ((extra > 0) & ~simple).reshape(S.size, R)
        for i in np.flatnonzero(hard.any(axis=1)):
            rows = np.flatnonzero(hard[i])
            self.compact_rows(int(S[i]), rows)
            self.rescan_holes(int(S[i]), rows)

    def sparse_copy(self, S) -> None:
        """Rewrite each holed row's holed page and tail densely into fresh pages, then free the old ones."""
        bs, W = self.cfg.block_size, self.cfg.window
        typical = self.typical_copy(S)
        slot_index, row = np.nonzero(typical)
        if slot_index.size:
            # flat row ids and page ids (row q = slot * rows + row, page = q * cols + column)
            P, row_state = self.slab.occ.shape[2], self.slab.row_state_f
            slots = S[slot_index]
            q = slots * self.cfg.rows + row
            holed_col, tail_col = row_state[q, HOLED], row_state[q, TAIL]
            holed_page, tail_page = q * P + holed_col, q * P + tail_col
            occ_f, win_f = self.slab.occ_f, self.slab.win_f
            holed_occ, tail_occ = occ_f[holed_page], occ_f[tail_page]
            moved = holed_occ + tail_occ
            dst = -(-moved // bs)
            tail_first_pos = self.slab.ntok[slots] - tail_occ          # the tail holds the newest tail_occ tokens
            to_holed = np.where(dst == 2, bs - holed_occ, tail_occ)  # tail tokens that move into the holed column
            per_row = np.maximum(to_holed, 0).astype(np.int64)
            entry_row = np.repeat(np.arange(per_row.size), per_row)  # one entry per moved tail token
            if entry_row.size:
                nth = np.arange(entry_row.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
                self.slab.ring_f[q[entry_row] * W + (tail_first_pos[entry_row] + nth) % W] = holed_col[entry_row]
            window_moved = np.minimum(to_holed, win_f[tail_page])
            win_f[holed_page] += window_moved
            win_f[tail_page] -= window_moved
            kept = np.minimum(moved, bs)
            occ_f[holed_page] = kept
            occ_f[tail_page] = moved - kept
            one = dst == 1
            self.slab.alive_f[tail_page[one]] = False
            st = row_state[q]
            top = one & (st[:, NCOL] == tail_col + 1)
            st[top, NCOL] = tail_col[top]
            st[one, TAIL] = holed_col[one]
            st[:, TAIL_WRITTEN] = np.where(one, moved, moved - bs)
            st[:, PAGES] += (dst - 2).astype(np.int32)
            st[:, HOLED] = -1
            row_state[q] = st
            self.ledger.pool.give(2 * slot_index.size)
            self.ledger.charge_moved(moved.sum())
        self.densify_generic(S, typical)

    def densify_generic(self, S, typical) -> None:
        """sparse_copy's rows with several holed pages (or holed at the tail) go through _densify."""
        generic = self.due(S) & ~typical
        slot_index, rows = np.nonzero(generic)
        if rows.size:                            # all of them at once (one slot per row)
            self.densify(S[slot_index], rows)

    def densify(self, s, rows: np.ndarray) -> None:
        """sparse_copy, any number of holed pages: their live tokens (and the tail's) go densely, in
        order, into new columns after the row's last one (s: a slot, or one slot per row)."""
        bs = self.cfg.block_size
        width = self.slab.used_width(s, rows)        # columns past every row's ncol hold nothing
        dirty = self.dirty_rows(s, rows, width)
        occ, win = self.slab.occ[s, rows, :width], self.slab.win[s, rows, :width]
        moved = (occ * dirty).sum(axis=1)
        wmoved = (win * dirty).sum(axis=1)
        dst = -(-moved // bs)
        n_old = int(dirty.sum())
        self.slab.occ[s, rows, :width] = np.where(dirty, 0, occ)
        self.slab.win[s, rows, :width] = np.where(dirty, 0, win)
        alive = self.slab.alive[s, rows, :width] & ~dirty
        self.slab.alive[s, rows, :width] = alive
        self.slab.pages[s, rows] += (dst - dirty.sum(axis=1)).astype(np.int32)
        self.ledger.pool.give(n_old)
        # a whole-row rewrite (sparse_copy) starts again at column 0, holed pages go after the last column
        whole = ~alive.any(axis=1)
        base = np.where(whole, 0, self.slab.ncol[s, rows]).astype(np.int64)
        self.slab.ensure_cols(int((base + dst).max()))
        if dst.size and dst.max() > 0:           # new page j of a row holds its moved tokens j*bs .. (j+1)*bs - 1
            start = np.arange(int(dst.max()))[None, :] * bs
            m = start < dst[:, None] * bs
            cnt = np.minimum(np.maximum(moved[:, None] - start, 0), bs)
            lo = (moved - wmoved)[:, None]           # window tokens are the last wmoved ones
            wcnt = np.maximum(np.minimum(start + cnt, moved[:, None]) - np.maximum(start, lo), 0)
            r, c = np.broadcast_to(rows[:, None], m.shape)[m], (base[:, None] + start // bs)[m]
            sl = np.broadcast_to(np.broadcast_to(s, rows.shape)[:, None], m.shape)[m]
            self.slab.occ[sl, r, c] = cnt[m]
            self.slab.alive[sl, r, c] = True
            self.slab.win[sl, r, c] = wcnt[m]
        has = dst > 0
        self.slab.tail[s, rows] = np.where(has, base + dst - 1, self.slab.tail[s, rows])
        self.slab.tail_w[s, rows] = np.where(has, moved - (dst - 1) * bs, bs)
        self.slab.ncol[s, rows] = base + dst
        self.slab.ncol_hi = max(self.slab.ncol_hi, int((base + dst).max()))
        self.charge_moves(s, moved)
        self.slab.holed[s, rows] = -1
        self.rebuild_ring(s, rows)
        self.scorer.rebuild_heavy(s, rows)

    def charge_moves(self, s, moved: np.ndarray) -> None:
        """Bytes of the tokens rewritten per row (moved), rounded per slot (s: a slot or one per row)."""
        if np.ndim(s) == 0:
            self.ledger.charge_moved(moved.sum())
            return
        slots, slot_of_row = np.unique(s, return_inverse=True)
        per_slot = np.bincount(slot_of_row, weights=moved, minlength=slots.size).astype(np.int64)
        self.ledger.effects.bytes_moved += sum(int(round(int(n) * self.ledger.bytes_per_token_row)) for n in per_slot)

    def after_fill(self, qP, st, at, col) -> None:
        """Reuse strategies: a filled page moves the first-hole pointer (in `st`) on."""
        advance_first_free_np(self.slab.occ.reshape(-1, self.slab.occ.shape[2]), qP, col, st[:, HOLE], st[:, PAGES],
                              st[:, LIVE], st[:, NCOL], self.cfg.block_size)

    def first_free(self, qP: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """First column with a free slot in [start, stop) of each flat row (given as its first page
        id qP = row * cols). Callers pass rows with room (a free slot exists) and their old first-free
        pointer + 1 as start: every column before it is full, so the first free column is found in the
        range (check_invariants verifies the pointers). Reuse strategies hold no empty page (an
        emptied page is freed at once; check_invariants verifies it), so a free slot is 0 < occ < bs."""
        if qP.size == 0:
            return start
        return first_free_np(self.slab.occ.reshape(-1, self.slab.occ.shape[2]), qP, start, stop, self.cfg.block_size)
