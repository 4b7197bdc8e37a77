"""Fast mode's slab: the per-slot arrays of all running requests, their growth, the count pool and
the Python mirrors the scheduler reads per request."""
from __future__ import annotations

import numpy as np

from ...core.request import Request
from ..slots import COPY_STRATEGIES, FREEING_STRATEGIES, REUSE_STRATEGIES
from .layout import (EMPTY_SCORES, HOLE, HOLED, NUM_CANDIDATES, ROW_FIELDS, ScoreArrays, SlabArrays, StepFlags)

COMPACT = {"compact", "parallel_compact"}
APPEND = {"noop", "free_block", "sparse_copy", "holed_copy"}


class CountPool:
    """Free-page count of the per-head pool (fast mode tracks counts, not block ids)."""
    enable_caching = False
    num_cached_free_blocks = 0
    num_cache_evictions = 0

    def __init__(self, num_blocks: int, unit: int = 1):
        if num_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self.unit = unit                  # pool pages per simulated page (sampled rows)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def take(self, n: int) -> None:
        n *= self.unit
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free_blocks} free")
        self.num_free_blocks -= n

    def give(self, n: int) -> None:
        self.num_free_blocks += n * self.unit
        assert self.num_free_blocks <= self.num_blocks, "freed more blocks than the pool holds"

    def check_invariants(self) -> None:
        assert 0 <= self.num_free_blocks <= self.num_blocks, "free count out of range"


class SlabMixin:
    """FastKVManager's slab: one slot of [rows, cols] arrays per running request (see the package doc)."""

    def _alloc_arrays(self, n: int, cols: int) -> None:
        R, W = self.rows, max(self.window, 1)
        self.occ = np.zeros((n, R, cols), np.int32)         # live tokens per page column
        self.win = np.zeros((n, R, cols), np.int32)         # ... of which in the recent window
        self.alive = np.zeros((n, R, cols), bool)           # column holds a page
        self.ring = np.zeros((n, R, W), np.int32)           # page column of position p at p % W
        self.heavy = np.zeros((n, R, self._list_cap), np.int32)   # columns of non-window live tokens
        self.row_state = np.zeros((n, R, len(ROW_FIELDS)), np.int32)
        if self._scores:
            # H2O scores in closed form (see _pick_scored): per listed token its score terms `terms`
            # (static part A, content coefficient CW, local term E); A and CW of window tokens in a ring;
            # per row the content normalizer Zw (`norm`), the running sum H of 1/Zw, and sigma
            list_cap = self.heavy.shape[2]
            self.terms = np.zeros((n, R, list_cap, 3))      # A, CW and E = l exp((pos - eref) / tau)
            self.eref = np.zeros((n, R))                     # reference position of E (rebased as tokens age)
            self.cand = np.zeros((n, R, NUM_CANDIDATES, 4))  # the kernel's candidates and threshold
            self.thr = np.full((n, R), -np.inf)
            self.ring_static, self.ring_content = np.zeros((n, R, W)), np.zeros((n, R, W))
            self.norm, self.hsum, self.sigma = np.zeros((n, R)), np.zeros((n, R)), np.zeros((n, R))
        self.row_state[:, :, [HOLE, HOLED]] = -1
        # views of row_state: hn = heavy-list length (newest survivors last); tail = append column (append
        # strategies), tail_w = slots written in it; ncol = columns in use (alive or dead below);
        # hole_col = reuse: first column with a free slot; holed = sparse_copy: the one holed column, -2 = several
        for name, f in ROW_FIELDS.items():
            setattr(self, name, self.row_state[:, :, f])
        self._row_state_f = self.row_state.reshape(-1, len(ROW_FIELDS))
        self._occ_f, self._win_f, self._alive_f = self.occ.reshape(-1), self.win.reshape(-1), self.alive.reshape(-1)
        self._ring_f, self._heavy_f = self.ring.reshape(-1), self.heavy.reshape(-1)
        if self._scores:
            self._terms_f = self.terms.reshape(-1, 3)
        self._row_ids = np.arange(R)[None, :]
        self._index_key = None                              # S.tobytes() of the last step's index arrays
        self.ntok = np.zeros(n, np.int64)
        self.prefilled = np.zeros(n, bool)
        self.need_next = np.zeros(n, np.int64)              # pages the next 1-token write takes
        self.slot_live = np.zeros(n, np.int64)              # live tokens of the slot, all rows
        self.slot_pages = np.zeros(n, np.int64)
        self._kernel_args(cols)
        self._mirror()

    def _kernel_args(self, cols: int) -> None:
        """decode_rows' arguments that hold from step to step: views of the slab, the flags, the scores."""
        self._slab = SlabArrays(self._row_state_f, self.occ.reshape(-1, cols), self.win.reshape(-1, cols),
                                self.alive.reshape(-1, cols), self.ring.reshape(-1, self.ring.shape[2]), self.ntok,
                                self._heavy_f)
        self._flags = StepFlags(self.block_size, self.window, -1 if self.budget is None else int(self.budget),
                                self.tracks_columns, self.append, self.strategy in REUSE_STRATEGIES, self.strategy in FREEING_STRATEGIES,
                                self.strategy in COPY_STRATEGIES, self.strategy in COMPACT, self.evict_leaving, self.scored,
                                self.heavy.shape[2])
        self._score_arrays = EMPTY_SCORES
        if self._scores:
            self._score_arrays = ScoreArrays(
                self.h_local, self._inv_tau, self.h_content, self.sigma.reshape(-1), self.norm.reshape(-1),
                self.hsum.reshape(-1), self.eref.reshape(-1), self.ring_static.reshape(-1),
                self.ring_content.reshape(-1), self._terms_f, self.cand.reshape(-1, NUM_CANDIDATES, 4),
                self.thr.reshape(-1))

    def _mirror(self) -> None:
        """Python lists of the per-slot numbers the scheduler asks for per request (no numpy per call)."""
        self._prefilled_l = self.prefilled.tolist()
        self._mirror_counts()

    def _mirror_counts(self) -> None:
        """The mirrors of the per-slot need / live / page arrays after they changed in place."""
        self._need_l = self.need_next.tolist()
        self._live_l = self.slot_live.tolist()
        self._pages_l = self.slot_pages.tolist()
        self._live_total = sum(self._live_l)
        self._pages_total = sum(self._pages_l)
        # what a paged kernel reads: every slot of the row's pages (evicted ones masked, not skipped)
        # but the never-written ones: the append page's unwritten end (append strategies); with hole-
        # first filling (reuse strategies) a new page opens only when no slot is free and earlier
        # holes are filled first, so the never-written slots are (about) the free ones of the last page
        bs = self.block_size
        if self.append:
            tw = self.tail_w
            unwritten = np.where((self.ncol > 0) & (tw < bs), bs - tw, 0).sum(axis=1)
        else:
            last = np.maximum(self.ncol.astype(np.int64) - 1, 0)[:, :, None]
            occ_last = np.take_along_axis(self.occ, last, axis=2)[:, :, 0]
            open_last = np.take_along_axis(self.alive, last, axis=2)[:, :, 0] & (self.ncol > 0)
            unwritten = np.where(open_last, bs - occ_last, 0).sum(axis=1)
        self._read_l = (self.slot_pages * bs - unwritten).tolist()
        if self._mean_read is not None:
            live_row = self.slot_live // self.rows
            self._read_l = (self._mean_read(live_row, self.ctx) * self.rows).tolist()

    def _restat(self, S: np.ndarray, live: np.ndarray | None = None, pages: np.ndarray | None = None) -> None:
        """Per-slot live / page totals of the slots in S after they changed (from their [len(S), rows]
        counts when the caller has them), and the Python mirrors."""
        live = self.live[S] if live is None else live
        pages = self.pages[S] if pages is None else pages
        self.slot_live[S] = live.sum(axis=1)
        self.slot_pages[S] = pages.sum(axis=1)
        self._mirror_counts()

    _SCORED = ("terms", "eref", "ring_static", "ring_content", "norm", "hsum", "sigma", "cand", "thr")

    def _grow(self, n: int | None = None, cols: int | None = None) -> None:
        old = {k: getattr(self, k) for k in ("occ", "win", "alive", "ring", "heavy", "row_state", "ntok", "prefilled",
                                              "need_next", "slot_live", "slot_pages") + self._SCORED * self._scores}
        n0, _, c0 = old["occ"].shape
        self._alloc_arrays(n or n0, cols or c0)
        for k, a in old.items():
            dst = getattr(self, k)
            dst[tuple(slice(0, s) for s in a.shape)] = a
        self._mirror()

    def _ensure_cols(self, cols: int) -> None:
        if cols > self.occ.shape[2]:
            self._grow(cols=max(cols, 2 * self.occ.shape[2]))

    def _slot(self, req: Request) -> int:
        s = self.slot_of.get(req)
        if s is None:
            if not self._free_slots:
                n = self.occ.shape[0]
                self._grow(n=2 * n)
                self._free_slots = list(range(2 * n - 1, n - 1, -1))
            s = self.slot_of[req] = self._free_slots.pop()
        return s

    def _release_slot(self, req, s) -> None:
        del self.slot_of[req]
        self._cut_len.pop(s, None)
        for a in (self.occ, self.win, self.alive, self.ring, self.heavy, self.row_state):
            a[s] = 0
        for k in self._SCORED * self._scores:
            getattr(self, k)[s] = 0
        if self._scores:
            self._reset_candidates(s)
        self.hole_col[s] = -1
        self.holed[s] = -1
        self.ntok[s] = self.need_next[s] = self.slot_live[s] = self.slot_pages[s] = 0
        self.prefilled[s] = False
        self._mirror()
        self._free_slots.append(s)

    def _index(self, S: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat row ids q of the slots in S (slot-major), their first page ids q * cols and ring
        bases [len(S), rows]; cached: a decode batch repeats from step to step."""
        key = (S.tobytes(), self.occ.shape[2])
        if key != self._index_key:
            q2 = S[:, None] * self.rows + self._row_ids
            self._index_arrays = (q2.ravel(), q2.ravel() * self.occ.shape[2], q2 * max(self.window, 1))
            self._index_key = key
            if self.scored:                      # per-row head constants of _pick_scored, in the same order
                r = np.tile(np.arange(self.rows), S.size)
                self._row_consts = (self.h_local[r], 1.0 / self.h_tau[r], self.h_content[r])
        return self._index_arrays
