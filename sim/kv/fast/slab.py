"""Fast mode's slab: the per-slot arrays of all running requests, their growth and the Python
mirrors the scheduler reads per request; the count pool and the step's ledger."""
from __future__ import annotations

import numpy as np

from typing import TYPE_CHECKING
from collections.abc import Callable

from ...core.request import Request
from ..slots import COPY_STRATEGIES, FREEING_STRATEGIES, REUSE_STRATEGIES, KVStepEffects
from .compiled.layout import (EMPTY_SCORES, HOLE, HOLED, LIST_LEN, LIVE, NCOL, NUM_CANDIDATES, PAGES, ROW_FIELDS, TAIL, TAIL_WRITTEN,
                     RowConsts, ScoreArrays, SlabArrays, StepFlags)
from .settings import FastSettings

if TYPE_CHECKING:
    from .scoring import Heads

COMPACT = {"compact", "parallel_compact"}


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


def note_evicted(req, token_rows: int, rows: int) -> None:
    """A request's evicted tokens (per row, as token-level mode counts them)."""
    if token_rows:
        req.kv_evicted_tokens += token_rows / rows


class Ledger:
    """The count pool and the step's plan: pages the components take and give back, and what the
    step evicted, freed and moved (in simulated rows; the manager scales the plan by `unit`)."""

    def __init__(self, pool: CountPool, bytes_per_token_row: float):
        self.pool, self.bytes_per_token_row = pool, bytes_per_token_row
        self.effects = KVStepEffects()

    def free_evicted(self, n: int) -> None:
        """n pages emptied by evictions go back to the pool."""
        self.pool.give(n)
        self.effects.blocks_freed_by_eviction += n

    def charge_moved(self, tokens) -> None:
        """Bytes of `tokens` token-rows rewritten (rounded per call)."""
        self.effects.bytes_moved += int(round(tokens * self.bytes_per_token_row))

    def take_effects(self) -> KVStepEffects:
        plan, self.effects = self.effects, KVStepEffects()
        return plan


class FastSlab:
    """One slot of [rows, cols] arrays per running request (see the package doc), the slot map and
    the scheduler's mirrors. Reads the settings, the sampled heads (their constants go to the
    kernel's score arrays; None when unscored) and `read_tokens` (a selection policy's mean tokens
    read per row from live counts; None: every written slot of the pages is read)."""

    _SCORED = ("terms", "eref", "ring_static", "ring_content", "norm", "hsum", "sigma", "cand", "thr")

    def __init__(self, settings: FastSettings, heads: Heads | None,
                 read_tokens: Callable[[np.ndarray], np.ndarray] | None):
        self.settings, self.heads, self.read_tokens = settings, heads, read_tokens
        self.rows = settings.rows
        self.scores = settings.scores
        self.slot_of: dict[Request, int] = {}
        self.free_slots: list[int] = []
        self.ncol_hi = 0                  # >= every row's ncol: below the slab's width, pages open unchecked
        self.list_cap = settings.list_cap  # heavy-list entries per row
        self.live_total = 0
        self.pages_total = 0
        self.alloc(4, 8)

    def alloc(self, n: int, cols: int) -> None:
        R, W = self.rows, max(self.settings.window, 1)
        self.occ = np.zeros((n, R, cols), np.int32)         # live tokens per page column
        self.win = np.zeros((n, R, cols), np.int32)         # ... of which in the recent window
        self.alive = np.zeros((n, R, cols), bool)           # column holds a page
        self.ring = np.zeros((n, R, W), np.int32)           # page column of position p at p % W
        self.heavy = np.zeros((n, R, self.list_cap), np.int32)   # columns of non-window live tokens
        self.row_state = np.zeros((n, R, len(ROW_FIELDS)), np.int32)
        if self.scores:
            # H2O scores in closed form (see Scorer.pick_scored): per listed token its score terms `terms`
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
        rs = self.row_state
        self.tail, self.tail_w, self.ncol, self.pages = rs[:, :, TAIL], rs[:, :, TAIL_WRITTEN], rs[:, :, NCOL], rs[:, :, PAGES]
        self.live, self.hole_col, self.holed, self.hn = rs[:, :, LIVE], rs[:, :, HOLE], rs[:, :, HOLED], rs[:, :, LIST_LEN]
        self.row_state_f = self.row_state.reshape(-1, len(ROW_FIELDS))
        self.occ_f, self.win_f, self.alive_f = self.occ.reshape(-1), self.win.reshape(-1), self.alive.reshape(-1)
        self.ring_f, self.heavy_f = self.ring.reshape(-1), self.heavy.reshape(-1)
        if self.scores:
            self.terms_f = self.terms.reshape(-1, 3)
        self._row_ids = np.arange(R)[None, :]
        self._index_key = None                              # S.tobytes() of the last step's index arrays
        self.ntok = np.zeros(n, np.int64)
        self.prefilled = np.zeros(n, bool)
        self.need_next = np.zeros(n, np.int64)              # pages the next 1-token write takes
        self.slot_live = np.zeros(n, np.int64)              # live tokens of the slot, all rows
        self.slot_pages = np.zeros(n, np.int64)
        self._kernel_args(cols)
        self.mirror()

    def _kernel_args(self, cols: int) -> None:
        """decode_rows' arguments that hold from step to step: views of the slab, the flags, the scores."""
        cfg = self.settings
        self.arrays = SlabArrays(self.row_state_f, self.occ.reshape(-1, cols), self.win.reshape(-1, cols),
                                 self.alive.reshape(-1, cols), self.ring.reshape(-1, self.ring.shape[2]), self.ntok,
                                 self.heavy_f)
        strategy = cfg.strategy
        self.flags = StepFlags(cfg.block_size, cfg.window, -1 if cfg.budget is None else int(cfg.budget),
                               cfg.tracks_columns, cfg.append, strategy in REUSE_STRATEGIES,
                               strategy in FREEING_STRATEGIES, strategy in COPY_STRATEGIES, strategy in COMPACT,
                               cfg.evict_leaving, cfg.scored, self.heavy.shape[2], cfg.copy_threshold)
        self.score_arrays = EMPTY_SCORES
        if self.scores:
            h = self.heads
            self.score_arrays = ScoreArrays(
                h.local, h.inv_tau, h.content, self.sigma.reshape(-1), self.norm.reshape(-1),
                self.hsum.reshape(-1), self.eref.reshape(-1), self.ring_static.reshape(-1),
                self.ring_content.reshape(-1), self.terms_f, self.cand.reshape(-1, NUM_CANDIDATES, 4),
                self.thr.reshape(-1))

    def mirror(self) -> None:
        """Python lists of the per-slot numbers the scheduler asks for per request (no numpy per call)."""
        self.prefilled_l = self.prefilled.tolist()
        self.mirror_counts()

    def mirror_counts(self) -> None:
        """The mirrors of the per-slot need / live / page arrays after they changed in place."""
        self.need_l = self.need_next.tolist()
        self.live_l = self.slot_live.tolist()
        self.pages_l = self.slot_pages.tolist()
        self.live_total = sum(self.live_l)
        self.pages_total = sum(self.pages_l)
        # what a paged kernel reads: every slot of the row's pages (evicted ones masked, not skipped)
        # but the never-written ones: the append page's unwritten end (append strategies); with hole-
        # first filling (reuse strategies) a new page opens only when no slot is free and earlier
        # holes are filled first, so the never-written slots are (about) the free ones of the last page
        bs = self.settings.block_size
        if self.settings.append:
            tw = self.tail_w
            unwritten = np.where((self.ncol > 0) & (tw < bs), bs - tw, 0).sum(axis=1)
        else:
            last = np.maximum(self.ncol.astype(np.int64) - 1, 0)[:, :, None]
            occ_last = np.take_along_axis(self.occ, last, axis=2)[:, :, 0]
            open_last = np.take_along_axis(self.alive, last, axis=2)[:, :, 0] & (self.ncol > 0)
            unwritten = np.where(open_last, bs - occ_last, 0).sum(axis=1)
        self.read_l = (self.slot_pages * bs - unwritten).tolist()
        if self.read_tokens is not None:
            live_row = self.slot_live // self.rows
            self.read_l = (self.read_tokens(live_row) * self.rows).tolist()

    def restat(self, S: np.ndarray, live: np.ndarray | None = None, pages: np.ndarray | None = None) -> None:
        """Per-slot live / page totals of the slots in S after they changed (from their [len(S), rows]
        counts when the caller has them), and the Python mirrors."""
        live = self.live[S] if live is None else live
        pages = self.pages[S] if pages is None else pages
        self.slot_live[S] = live.sum(axis=1)
        self.slot_pages[S] = pages.sum(axis=1)
        self.mirror_counts()

    def grow(self, n: int | None = None, cols: int | None = None) -> None:
        old = {k: getattr(self, k) for k in ("occ", "win", "alive", "ring", "heavy", "row_state", "ntok", "prefilled",
                                              "need_next", "slot_live", "slot_pages") + self._SCORED * self.scores}
        n0, _, c0 = old["occ"].shape
        self.alloc(n or n0, cols or c0)
        for k, a in old.items():
            dst = getattr(self, k)
            dst[tuple(slice(0, s) for s in a.shape)] = a
        self.mirror()

    def ensure_cols(self, cols: int) -> None:
        if cols > self.occ.shape[2]:
            self.grow(cols=max(cols, 2 * self.occ.shape[2]))

    def ensure_list_cap(self, entries: int) -> None:
        """Heavy lists hold at least `entries` per row (the kernel writes unchecked)."""
        if entries > self.list_cap:
            self.list_cap = max(entries, 2 * self.list_cap)
            self.grow()

    def slot(self, req: Request) -> int:
        s = self.slot_of.get(req)
        if s is None:
            if not self.free_slots:
                n = self.occ.shape[0]
                self.grow(n=2 * n)
                self.free_slots = list(range(2 * n - 1, n - 1, -1))
            s = self.slot_of[req] = self.free_slots.pop()
        return s

    def release(self, req, s) -> None:
        del self.slot_of[req]
        for a in (self.occ, self.win, self.alive, self.ring, self.heavy, self.row_state):
            a[s] = 0
        for k in self._SCORED * self.scores:
            getattr(self, k)[s] = 0
        if self.scores:
            self.reset_candidates(s)
        self.hole_col[s] = -1
        self.holed[s] = -1
        self.ntok[s] = self.need_next[s] = self.slot_live[s] = self.slot_pages[s] = 0
        self.prefilled[s] = False
        self.mirror()
        self.free_slots.append(s)

    def reset_candidates(self, s: int) -> None:
        self.cand[s, :, :, 0] = -1
        self.thr[s] = -np.inf                    # the first eviction scans the whole list

    def used_width(self, s, rows: np.ndarray) -> int:
        """Columns that can hold a page in these rows (every alive column is below its row's ncol)."""
        return max(1, int(self.ncol[s, rows].max())) if rows.size else 1

    def index(self, S: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat row ids q of the slots in S (slot-major), their first page ids q * cols and ring
        bases [len(S), rows]; cached: a decode batch repeats from step to step."""
        key = (S.tobytes(), self.occ.shape[2])
        if key != self._index_key:
            q2 = S[:, None] * self.rows + self._row_ids
            self._index_arrays = (q2.ravel(), q2.ravel() * self.occ.shape[2], q2 * max(self.settings.window, 1))
            self._index_key = key
            if self.settings.scored:             # per-row head constants of Scorer.pick_scored, in the same order
                r = np.tile(np.arange(self.rows), S.size)
                h = self.heads
                self.row_consts = RowConsts(h.local[r], 1.0 / h.tau[r], h.content[r])
        return self._index_arrays
