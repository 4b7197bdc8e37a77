"""Block-occupancy fast mode: page live-counts for all running requests in one slab, no token state.

For large traces. Every running request owns a slot of a slab of arrays; per (request, row = layer x
KV head) it keeps the live-token count of each page column (`occ [slots, rows, cols]`), how many of
those are still in the recent window (`win`), and — in a ring of `protect_recent` entries — the
page column of each window token, so the token leaving the window is located in O(1). No
attention is computed: a policy's `fast_mode_profile()` gives `budget` (tokens kept per row),
`protect_recent` (the newest tokens, never evicted), `protect_first` (the oldest, never evicted)
and `age_weight`, which says where evictions fall:

- "oldest" (StreamingLLM): the token leaving the window is evicted; the prompt cut keeps the newest
  candidates.
- "young" (H2O, ranking by accumulated attention): the simulated rows are a stratified sample (by
  head type, then local decay) of the importance model's rows for the run's seed (kv.importance:
  sink / local / heavy / spread heads in the model's mix, with their sink share s, local share l,
  decay tau and content concentration sigma), and each step evicts, per row, the candidate with
  the lowest accumulated attention, computed in closed form from the same model token-level mode
  scores with: token t holds l (d^(a0-t) - d^(q+1-t)) + (1-s-l) w_t (H(q) - H(a0-1)) after query q
  (d = exp(-1/tau); w_t = exp(sigma z) its content weight, drawn once; H = running sum of 1/Zw,
  Zw = the sum of all content weights so far; a0 = its first observed query). Per token only the
  static part, w_t and its decay term are stored (in the heavy list, or in a ring while in the
  window); the step is a compiled kernel (fast_kernels.decode_rows, numpy twin) that keeps a few
  candidates per row with an exact threshold and rescans a row's list only when they cannot hold
  the minimum. The prompt cut keeps each row's top candidates by the
  scores of the last `obs_window` prefill queries; the first NUM_SINK tokens (attention sinks) are
  never evicted. Nothing is fitted: local heads evict the oldest prompt remnants first (little local
  attention), spread heads mostly the token leaving the window, heavy/sink heads spread evictions
  over all ages, as measured per head type in token-level runs. The per-query renormalization over
  live tokens and the local normalizer's first tau steps are left out. Against token-level mode
  on four SmolLM2 closed-batch workloads (3-16 requests, prompts 48-300, outputs 80-300, budget 60)
  fragmentation and KV utilization agree within 2% for free_block and slot_reuse (global draws
  fitted on a grid: up to 9%).
- "uniform": every eviction is a uniformly drawn non-window token; the prompt cut keeps a uniformly
  random subset of the candidates (multivariate hypergeometric per row).

Per decode step the scheduler's `allocate_slots` (or `allocate_decodes` for the whole batch) only
reserves the pages precomputed for each request's next token (pure Python); `finish_step` then
applies the step to all decoding requests at once: one write, one window exit and one eviction per
row, plus the slot strategy (a page frees when its count reaches zero; reuse strategies fill the
first page with a hole; compaction moves the last page's tokens into the hole; sparse copy rewrites
the holed page and the tail), in one compiled kernel call (fast_kernels.decode_rows) or, without
numba, as fancy-index updates of [requests, rows] arrays (`_step_numpy`, its twin). Rows in an
unusual state (several holed pages right after the prompt cut, several pages to compact) take an
exact count-based path over their page columns. Rows differ only by their head parameters (H2O), so only `sample_rows` of them (a
divisor of layers x KV heads, `kv.fast_rows`, default 8; stratified by head type) are simulated,
each standing for the same number of pool pages. `noop` never frees or moves a page, so where
evictions fall changes no metric: it tracks counts only (live tokens, pages, the tail's fill) in one
row standing for all, with no draws. Decode rows are stepped in slab order (their memory walk
ascends). Draws come from one numpy Generator seeded by the run's seed: same inputs, same results.
Validated against token-level mode in tests/test_kv_fast.py, kernels against their twins in
tests/test_kv_fast_kernels.py.
"""
from __future__ import annotations

import operator
import warnings

import numpy as np

from ..core.request import Request
from .base import EvictingManagerBase
from .manager import SLOT_STRATEGIES, KVStepPlan, _COPY, _FREES, _REUSE
from .fast_kernels import (K as KCAND, advance_first_free_np, decode_rows, first_free_np, score_prompt,
                           scored_step_np)
from .importance import NUM_SINK, ImportanceModelSpec, SyntheticImportance
from .policy import EvictionPolicy, PolicyContext, PolicyError

_APPEND = {"noop", "free_block", "sparse_copy", "holed_copy"}
# per-row scalars, fields of one [slots, rows, fields] array so a step gathers / scatters them at once
TAIL, TAILW, NCOL, PAGES, LIVE, HOLE, HOLED, HN = range(8)
_ROW_FIELDS = {"tail": TAIL, "tail_w": TAILW, "ncol": NCOL, "pages": PAGES, "live": LIVE, "hole_col": HOLE,
               "holed": HOLED, "hn": HN}
_COMPACT = {"compact", "parallel_compact"}
_first = operator.itemgetter(0)
_NONE, _NONE_R = np.zeros(0), np.zeros(0)                 # placeholders of the kernel's unused arguments
_NONE_HV, _NONE_CAND = np.zeros((0, 3)), np.zeros((0, KCAND, 4))


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


class FastKVManager(EvictingManagerBase):

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
        self.rows = max(d for d in range(1, ctx.rows + 1) if ctx.rows % d == 0 and d <= max(sample_rows, 1)) \
            if sample_rows > 0 else ctx.rows
        self.unit = ctx.rows // self.rows
        self.budget = profile.get("budget")
        self._mean_read = getattr(policy, "mean_read", None)      # selection policies: what attention reads
        self.window = int(profile.get("protect_recent", 0))
        self.sink = int(profile.get("protect_first", 0))
        self.age_weight = profile.get("age_weight", "uniform")
        # "oldest": the token leaving the window goes; "uniform": a uniformly drawn non-window token;
        # "young" (H2O): the lowest accumulated attention under the importance model (see _pick_scored)
        self.evict_leaving = self.age_weight == "oldest"
        # "prompt_only" (SnapKV): the prompt cut keeps `budget` per row (its newest `protect_recent`
        # included), decode never evicts
        self.cut_budget, self.cut_window = self.budget, self.window
        self.prompt_only = bool(profile.get("prompt_only", False))
        if self.prompt_only:
            self.budget, self.window = None, 0
        self.scored = self.age_weight == "young" and self.budget is not None
        self.cut_scored = self.age_weight == "young" and self.cut_budget is not None
        self._scores = self.scored or self.cut_scored
        if self._scores:
            self._init_heads(importance, seed, int(profile.get("obs_window", 8)))
        self.strategy = slot_strategy
        self.append = slot_strategy in _APPEND
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
        self._alloc_arrays(4, 8)

    def _init_heads(self, importance, seed: int, obs_window: int) -> None:
        """Attention parameters of the simulated rows: a stratified sample (by head type, then local
        decay) of the importance model's rows for this seed, i.e. the heads token-level mode scores with."""
        model = SyntheticImportance(self.ctx, importance, seed)
        if model.spec.content_correlation > 0:
            warnings.warn(
                f"kv.mode=fast: importance model {model.spec.name!r} has content_correlation "
                f"{model.spec.content_correlation}, which fast mode ignores; its slot-strategy metrics can then "
                f"differ from token level by well over 5% (measured up to +19% fragmentation): compare slot "
                f"strategies with kv.mode=token", UserWarning, stacklevel=2)
        order = np.lexsort((model.tau, model.head_type))
        pick = order[self.unit // 2::self.unit][:self.rows]
        self.head_type = model.head_type[pick]
        self.h_local = model.l[pick]
        self.h_content = 1.0 - model.s[pick] - model.l[pick]
        self.h_tau = model.tau[pick]
        self.h_sigma = model.sigma[pick]
        self._inv_tau = 1.0 / self.h_tau
        self.sigma_jitter = model.spec.request_sigma_jitter
        self.obs_window = obs_window

    # ----- slab -----------------------------------------------------------------------------------
    def _alloc_arrays(self, n: int, cols: int) -> None:
        R, W = self.rows, max(self.window, 1)
        self.occ = np.zeros((n, R, cols), np.int32)         # live tokens per page column
        self.win = np.zeros((n, R, cols), np.int32)         # ... of which in the recent window
        self.alive = np.zeros((n, R, cols), bool)           # column holds a page
        self.ring = np.zeros((n, R, W), np.int32)           # page column of position p at p % W
        self.heavy = np.zeros((n, R, (self.cut_budget or 0) + 2), np.int32)  # columns of non-window live tokens
        self.rs = np.zeros((n, R, len(_ROW_FIELDS)), np.int32)
        if self._scores:
            # H2O scores in closed form (see _pick_scored): per listed token its score terms `hv`
            # (static part A, content coefficient CW, local term E); A and CW of window tokens in a ring;
            # per row the content normalizer Zw, the running sum H of 1/Zw, and sigma
            Hc = self.heavy.shape[2]
            self.hv = np.zeros((n, R, Hc, 3))               # A, CW and E = l exp((pos - eref) / tau)
            self.eref = np.zeros((n, R))                     # reference position of E (rebased as tokens age)
            self.cand = np.zeros((n, R, KCAND, 4))           # evict_lowest's candidates and threshold
            self.thr = np.full((n, R), -np.inf)
            self.ringA, self.ringcw = np.zeros((n, R, W)), np.zeros((n, R, W))
            self.zw, self.hsum, self.hsig = np.zeros((n, R)), np.zeros((n, R)), np.zeros((n, R))
        self.rs[:, :, [HOLE, HOLED]] = -1
        # views of rs: hn = heavy-list length (newest survivors last); tail = append column (append
        # strategies), tail_w = slots written in it; ncol = columns in use (alive or dead below);
        # hole_col = reuse: first column with a free slot; holed = sparse_copy: the one holed column, -2 = several
        for name, f in _ROW_FIELDS.items():
            setattr(self, name, self.rs[:, :, f])
        self._rs_f = self.rs.reshape(-1, len(_ROW_FIELDS))
        self._occ_f, self._win_f, self._alive_f = self.occ.reshape(-1), self.win.reshape(-1), self.alive.reshape(-1)
        self._ring_f, self._heavy_f = self.ring.reshape(-1), self.heavy.reshape(-1)
        if self._scores:
            self._hv_f = self.hv.reshape(-1, 3)
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
        """decode_rows' arguments that hold from step to step (views of the slab, flags), in its order."""
        self._slab_args = (
            self._rs_f, self.occ.reshape(-1, cols), self.win.reshape(-1, cols), self.alive.reshape(-1, cols),
            self.ring.reshape(-1, self.ring.shape[2]), self.ntok, self._heavy_f, self.block_size, self.window,
            -1 if self.budget is None else int(self.budget), self.tracks_columns, self.append,
            self.strategy in _REUSE, self.strategy in _FREES, self.strategy in _COPY,
            self.strategy in _COMPACT, self.evict_leaving, self.scored)
        Hc = self.heavy.shape[2]
        if self.scored:
            self._scored_args = (self.h_local, self._inv_tau, self.h_content, Hc, self.hsig.reshape(-1),
                                 self.zw.reshape(-1), self.hsum.reshape(-1), self.eref.reshape(-1),
                                 self.ringA.reshape(-1), self.ringcw.reshape(-1), self._hv_f,
                                 self.cand.reshape(-1, KCAND, 4), self.thr.reshape(-1))
        else:
            self._scored_args = (_NONE_R, _NONE_R, _NONE_R, Hc, _NONE, _NONE, _NONE, _NONE, _NONE, _NONE, _NONE_HV,
                                 _NONE_CAND, _NONE)

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

    _SCORED = ("hv", "eref", "ringA", "ringcw", "zw", "hsum", "hsig", "cand", "thr")

    def _grow(self, n: int | None = None, cols: int | None = None) -> None:
        old = {k: getattr(self, k) for k in ("occ", "win", "alive", "ring", "heavy", "rs", "ntok", "prefilled",
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

    # ----- scheduler-facing surface ------------------------------------------------------------
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
        return 0

    # ----- allocation ----------------------------------------------------------------------------
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

    def _typical_copy(self, S) -> np.ndarray:
        """holed_copy rows whose holes are all in one page other than the tail (the steady state; the
        kernel rewrites them). sparse_copy rewrites whole rows: none is typical."""
        h = self.holed[S]
        if self.strategy == "sparse_copy":
            return np.zeros(h.shape, dtype=bool)
        return (h >= 0) & (h != self.tail[S]) & (self.window >= self.block_size)

    def _need_rows(self, S: np.ndarray) -> np.ndarray:
        """int [len(S), rows]: pages the next one-token write of each row takes (sparse copy included)."""
        bs = self.block_size
        if self.strategy in _REUSE:
            return (self.pages[S] * bs - self.live[S] < 1).astype(np.int64)
        need = ((self.tail_w[S] >= bs) | (self.ncol[S] == 0)).astype(np.int64)
        if self.strategy not in _COPY:
            return need
        qP = (S[:, None] * self.rows + self._row_ids) * self.occ.shape[2]
        holed = self.holed[S]
        typical = self._typical_copy(S)
        moved = self._occ_f[qP + np.maximum(holed, 0)] + self._occ_f[qP + self.tail[S]]
        dst = -(-moved // bs)
        need = np.where(typical, dst + (dst * bs - moved < 1), need)
        for i in np.flatnonzero(((holed != -1) & ~typical).any(axis=1)):
            s = int(S[i])
            rows = (self.holed[s] != -1) & ~typical[i]
            dirty = self._dirty(s)
            moved = (self.occ[s] * dirty).sum(axis=1)
            dst = -(-moved // bs)
            need[i] = np.where(rows, dst + (dst * bs - moved < 1), need[i])
        return need

    def _update_need(self, S: np.ndarray, need_rows: np.ndarray | None = None) -> None:
        """Pages each slot's next token takes, from its rows' [len(S), rows] needs."""
        self.need_next[S] = (self._need_rows(S) if need_rows is None else need_rows).sum(axis=1)
        self._need_l = self.need_next.tolist()

    def _dirty(self, s) -> np.ndarray:
        """sparse_copy: bool [rows, cols] pages to rewrite (holed pages, plus the tail of a holed row)."""
        bs = self.block_size
        cols = self.occ.shape[2]
        written = np.where(np.arange(cols)[None, :] == self.tail[s][:, None], self.tail_w[s][:, None], bs)
        dirty = self.alive[s] & (self.occ[s] < written)
        if self.strategy == "sparse_copy":              # the whole row of a holed row
            return self.alive[s] & dirty.any(axis=1)[:, None]
        r = np.flatnonzero(dirty.any(axis=1))
        dirty[r, self.tail[s][r]] = True
        return dirty

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
        if self.strategy in _REUSE:              # a chunked prefill leaves the last page open
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

    def _release_slot(self, req, s) -> None:
        del self.slot_of[req]
        for a in (self.occ, self.win, self.alive, self.ring, self.heavy, self.rs):
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

    # ----- per step --------------------------------------------------------------------------------
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
                        req.extra["kv_evicted_tokens"] = req.extra.get("kv_evicted_tokens", 0.0) + k / self.rows
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
            req.extra["kv_evicted_tokens"] = req.extra.get("kv_evicted_tokens", 0.0) + n / self.rows

    # ----- prompt cut --------------------------------------------------------------------------------
    def _finish_prefill(self, s: int) -> None:
        bs, R = self.block_size, self.rows
        L = int(self.ntok[s])
        W = min(self.window, L)
        cols = -(-L // bs)
        pos_page = np.arange(L) // bs
        if self.window and self.tracks_columns:
            wpos = np.arange(L - W, L)
            self.ring[s][:, wpos % self.window] = (wpos // bs)[None, :]
            self.win[s, :, :cols] = np.bincount(wpos // bs, minlength=cols)[None, :]
        scored = self.cut_scored and self.tracks_columns
        W = min(self.cut_window, L)
        kept_pos = self._score_prompt(s, L, W) if scored else None
        if self.cut_budget is not None and L > self.cut_budget:
            cand = L - W
            keep = self.cut_budget - W
            protect = min(self.sink, cand, keep)
            per_page = np.bincount(pos_page[protect:cand], minlength=cols)
            k = keep - protect
            if not self.tracks_columns:
                self.live[s] = self.cut_budget
                self.plan.evicted_tokens += R * (cand - keep)
                kept = None
            elif scored:
                listed = np.bincount((np.arange(R)[:, None] * cols + kept_pos // bs).ravel(), minlength=R * cols)
                kept = per_page[None, :] - (np.bincount(pos_page[:cand], minlength=cols)[None, :]
                                            - listed.reshape(R, cols))
            elif self.age_weight == "oldest":
                kept = np.bincount(pos_page[cand - k:cand], minlength=cols)[None, :].repeat(R, 0)
            else:
                kept = self.rng.multivariate_hypergeometric(per_page, k, size=R, method="marginals")
            if kept is not None:
                evict = per_page[None, :] - kept
                self.occ[s, :, :cols] -= evict.astype(np.int32)
                self.live[s] = self.cut_budget
                self.plan.evicted_tokens += int(evict.sum())
        self.prefilled[s] = True
        self._prefilled_l[s] = True
        if self.prompt_only:                     # no decode evictions: no candidate list to keep
            self.hn[s] = 0
        self._settle_generic(s, np.arange(R))
        if not scored:                           # scored lists are built by _score_prompt (and remapped by compaction)
            self._rebuild_heavy(s, np.arange(R))
        self._update_need(np.array([s]))

    def _settle_generic(self, s: int, rows: np.ndarray) -> None:
        """Exact count-based slot strategy for some rows of slot s (any number of holed pages)."""
        bs = self.block_size
        occ, alive = self.occ[s, rows], self.alive[s, rows]
        if self.strategy in _FREES:
            empty = alive & (occ == 0)
            if self.strategy not in _REUSE:          # keep an append tail with unwritten slots
                tail = self.tail[s, rows]
                open_tail = self.tail_w[s, rows] < bs
                empty[np.arange(rows.size)[open_tail], tail[open_tail]] = False
            self._drop(s, rows, empty)
        if self.strategy in _COMPACT:
            self._compact_rows(s, rows)
        if self.strategy in _REUSE:
            self._rescan_holes(s, rows)
        if self.strategy in _COPY:
            self._mark_holed(s, rows)

    def _drop(self, s: int, rows: np.ndarray, cols_mask: np.ndarray) -> None:
        n = int(cols_mask.sum())
        if not n:
            return
        self.alive[s, rows] &= ~cols_mask
        self.pages[s, rows] -= cols_mask.sum(axis=1).astype(np.int32)
        self.pool.give(n)
        self.plan.blocks_freed_by_eviction += n

    def _compact_rows(self, s: int, rows: np.ndarray) -> None:
        """Survivors of each row's last pages move into holes of its first ceil(live/bs) pages."""
        bs = self.block_size
        occ, alive, win = self.occ[s, rows], self.alive[s, rows], self.win[s, rows]
        keep = -(-self.live[s, rows] // bs)
        rank = np.cumsum(alive, axis=1)
        kept = alive & (rank <= keep[:, None])
        gone = alive & ~kept
        moved = (occ * gone).sum(axis=1)
        if not gone.any():
            return
        self.plan.bytes_moved += int(round(moved.sum() * self.bytes_per_token_row))
        holes = np.where(kept, bs - occ, 0)
        before = np.cumsum(holes, axis=1) - holes
        add = np.minimum(np.maximum(moved[:, None] - before, 0), holes)
        self.occ[s, rows] = np.where(kept, occ + add, 0)
        # moved tokens are the newest ones: window counts follow them into the filled holes
        wmoved = (win * gone).sum(axis=1)
        self.win[s, rows] = np.where(kept, win + np.minimum(np.maximum(wmoved[:, None] - (np.cumsum(add, axis=1) - add), 0),
                                                           add), 0)
        n = int(gone.sum())
        self.alive[s, rows] = kept
        self.pages[s, rows] = keep.astype(np.int32)
        self.pool.give(n)
        self.plan.blocks_freed_by_eviction += n
        self._rebuild_ring(s, rows)
        if self.prefilled[s]:
            self._rebuild_heavy(s, rows)

    def _rebuild_ring(self, s: int, rows: np.ndarray) -> None:
        """Window tokens are the newest live ones: place them by each column's window count, in column order."""
        if not self.window:
            return
        win = self.win[s, rows]
        cw = np.cumsum(win, axis=1)
        nwin = cw[:, -1]
        t = int(self.ntok[s])
        k = np.arange(self.window)
        pos = t - self.window + k                                   # window positions, oldest first
        first = self.window - nwin                                  # rows with fewer window tokens
        idx = k[None, :] - first[:, None]
        # column of the k-th window token = how many prefix counts are <= k: one searchsorted over all
        # rows, each row's (nondecreasing, <= window) prefix counts shifted above the previous row's
        n, P = cw.shape
        row = np.arange(n)[:, None]
        shift = row * (self.window + 1)
        col = np.searchsorted((cw + shift).ravel(), np.maximum(idx, 0) + shift, side="right") - row * P
        col = np.minimum(col, P - 1)
        ring = self.ring[s, rows]
        ring[:, pos % self.window] = col
        self.ring[s, rows] = ring
        n = self.ncol[s, rows]
        hi = np.where(self.alive[s, rows].any(axis=1),
                      win.shape[1] - np.argmax(self.alive[s, rows][:, ::-1], axis=1), 0)
        self.ncol[s, rows] = np.minimum(n, hi)

    def _rescan_holes(self, s: int, rows: np.ndarray) -> None:
        free = self.alive[s, rows] & (self.occ[s, rows] < self.block_size)
        self.hole_col[s, rows] = np.where(free.any(axis=1), np.argmax(free, axis=1), -1)

    def _mark_holed(self, s: int, rows: np.ndarray) -> None:
        bs = self.block_size
        cols = self.occ.shape[2]
        written = np.where(np.arange(cols)[None, :] == self.tail[s, rows][:, None], self.tail_w[s, rows][:, None], bs)
        holed = self.alive[s, rows] & (self.occ[s, rows] < written)
        cnt = holed.sum(axis=1)
        self.holed[s, rows] = np.where(cnt == 0, -1, np.where(cnt == 1, np.argmax(holed, axis=1), -2))

    # ----- one batched decode step ----------------------------------------------------------------
    def _step(self, S: np.ndarray) -> list[int]:
        """Write one token per row of every slot in S, move the window, evict, apply the slot strategy.
        Returns the (token, row) evictions per slot. Pages were taken from the pool by allocate_slots.
        Runs as one compiled kernel (fast_kernels.decode_rows) where numba is installed, else in numpy
        (`_step_numpy`, its twin: the same state, draw for draw)."""
        sparse = self.strategy in _COPY
        if decode_rows is None:
            if sparse:
                self._sparse_copy(S)
            return self._step_numpy(S)
        if sparse:                               # rows with several holed pages; the kernel rewrites the rest
            self._densify_generic(S, self._typical_copy(S))
        R, nS = self.rows, S.size
        m = nS * R
        P = self.occ.shape[2]
        if self._ncol_hi >= P:
            self._ncol_hi = int(self.ncol.max())
            self._ensure_cols(self._ncol_hi + 1)
            P = self.occ.shape[2]
        track = self.tracks_columns
        draw = self.budget is not None and track
        u = self.rng.random(m) if draw and not self.scored else _NONE
        z = self.rng.standard_normal(m) if draw and self.scored else _NONE
        evicted, left = np.empty(nS, np.int64), np.empty(nS, np.int64)
        compact = self.strategy in _COMPACT
        m_new, n_evicted, n_freed, n_copied, copied, n_compacted, n_left = decode_rows(
            S, R, *self._slab_args, u, z, *self._scored_args, evicted, left, self.need_next, self.slot_live,
            self.slot_pages)
        if m_new:
            self._ncol_hi += 1
        self.plan.evicted_tokens += n_evicted
        if n_freed:
            self.pool.give(n_freed)
            self.plan.blocks_freed_by_eviction += n_freed
        if n_copied:
            self.pool.give(2 * n_copied)
            self.plan.bytes_moved += int(round(copied * self.bytes_per_token_row))
        if n_compacted:
            self.pool.give(n_compacted)
            self.plan.blocks_freed_by_eviction += n_compacted
            self.plan.bytes_moved += int(round(n_compacted * self.bytes_per_token_row))
        if n_left:
            rest = S[left > 0]
            if compact:                          # rows with more spare pages: the exact path, then recount
                for s in rest.tolist():
                    rows = np.flatnonzero(self.pages[s] - -(-self.live[s] // self.block_size) > 0)
                    self._compact_rows(s, rows)
                    self._rescan_holes(s, rows)
                self._restat(rest)
            self.need_next[rest] = self._need_rows(rest).sum(axis=1)
        if self.strategy == "sparse_copy":       # the kernel's page need assumes holed_copy's rewrite
            self.need_next[S] = self._need_rows(S).sum(axis=1)
        self._mirror_counts()
        return evicted.tolist()

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
        st = self._rs_f[q]
        tail, tw, ncol, pages, live, hole, _, hn = st.T        # column views (field order of _ROW_FIELDS)
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
        if self.strategy in _REUSE:
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
        self._rs_f[q] = st
        if self.strategy in _COMPACT:
            self._compact_step(S, q, col)
        if self.strategy in _COMPACT or self.strategy in _COPY:   # pages moved: recount from the slab
            self._update_need(S)
            self._restat(S)
        else:                                    # the gathered row state is final
            need = (tw >= bs) | (ncol == 0) if self.append else pages * bs <= live
            self._update_need(S, need.reshape(nS, R))
            self._restat(S, live.reshape(nS, R), pages.reshape(nS, R))
        return [0] * nS if evicted is None else evicted

    def _after_fill(self, qP, st, at, col) -> None:
        """Reuse strategies: a filled page moves the first-hole pointer (in `st`) on."""
        advance_first_free_np(self.occ.reshape(-1, self.occ.shape[2]), qP, col, st[:, HOLE], st[:, PAGES],
                              st[:, LIVE], st[:, NCOL], self.block_size)

    def _first_free(self, qP: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """First column with a free slot in [start, stop) of each flat row (given as its first page
        id qP = row * cols). Callers pass rows with room (a free slot exists) and their old first-free
        pointer + 1 as start: every column before it is full, so the first free column is found in the
        range (check_invariants verifies the pointers). Reuse strategies hold no empty page (an
        emptied page is freed at once; check_invariants verifies it), so a free slot is 0 < occ < bs."""
        if qP.size == 0:
            return start
        return first_free_np(self.occ.reshape(-1, self.occ.shape[2]), qP, start, stop, self.block_size)

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

    def _pick(self, q, over, ex, ec, hn) -> np.ndarray:
        """Column of the token each over-budget row evicts (flat over the step's rows; `hn` is updated
        in place); tokens leaving the window (`ex`, column `ec`) that stay join the row's heavy list.
        The list holds exactly the columns of a row's live non-window tokens (check_invariants
        verifies it), so a drawn entry is always a live token. "oldest" evicts the leaving token,
        "uniform" a uniformly drawn listed one, "young" (H2O) goes through _pick_scored."""
        if self.scored:
            return self._pick_scored(q, over, ex, ec, hn)
        Hc = self.heavy.shape[2]
        heavy_f = self._heavy_f
        qH = q * Hc
        take_exit = over & ex & self.evict_leaving
        heavy_f[qH + hn] = ec                    # the exiting token's column: listed where it is kept
        hn += ex & ~take_exit
        draw = over & ~take_exit
        idx = np.minimum((self.rng.random(q.size) * hn).astype(np.int64), np.maximum(hn - 1, 0))
        hidx = qH + idx
        col = heavy_f[hidx]
        last = qH + np.maximum(hn - 1, 0)
        heavy_f[np.where(draw, hidx, last)] = heavy_f[last]     # the drawn entry leaves the list
        hn -= draw
        return np.where(take_exit, ec, col)

    def _pick_scored(self, q, over, ex, ec, hn) -> np.ndarray:
        """H2O: evict the candidate (listed token or the one leaving the window) with the lowest
        attention accumulated under the synthetic importance model, in closed form. The newest query
        at position t_q gives token t  l (1 - d) d^(t_q - t)  (local, d = exp(-1/tau)) plus
        c w_t / Zw(t_q)  (content: c = 1 - sink share - local share, w_t = exp(sigma z) drawn once,
        Zw = the sum of w over all positions so far), so what token t has accumulated since its first
        observed query a0 (t, or the first prefill observation query) is

            l (d^(a0 - t) - d^(t_q + 1 - t)) + c w_t (H(t_q) - H(a0 - 1)),   H(q) = sum of 1/Zw to q,

        the static part A = l d^(a0 - t) - c w_t H(a0 - 1) fixed when the token is written. Sink
        tokens (the first NUM_SINK) are never evicted. The local part of a listed token is kept as
        E = l d^(eref - t) against a per-row reference position eref, so its value after query t_q is
        E g with g = d^(t_q + 1 - eref): the list scan (fast_kernels._evict_lowest_row) needs no exp.
        eref moves to the newest token (E rescaled) before d^(t_q - eref) could overflow."""
        R, W, Hc = self.rows, self.window, self.heavy.shape[2]
        m = q.size
        l, inv_tau, c = self._row_consts
        t_new = self.ntok[q // R] - 1                          # the newest token = this step's query
        return scored_step_np(q, t_new, self.rng.standard_normal(m), l, inv_tau, c, W, Hc, over,
                              ex if isinstance(ex, np.ndarray) else np.full(m, ex), ec, hn, self.hsig.reshape(-1),
                              self.zw.reshape(-1), self.hsum.reshape(-1), self.eref.reshape(-1),
                              self.ringA.reshape(-1), self.ringcw.reshape(-1), self._heavy_f, self._hv_f,
                              self.cand.reshape(-1, KCAND, 4), self.thr.reshape(-1))

    def _reset_candidates(self, s: int) -> None:
        self.cand[s, :, :, 0] = -1
        self.thr[s] = -np.inf                    # the first eviction scans the whole list

    def _score_prompt(self, s: int, L: int, W: int) -> np.ndarray:
        """H2O's prompt cut under the importance model: draw the prompt's content weights, score the
        candidates by the last obs_window prefill queries, list the kept ones (with their score
        terms) and put the window tokens' terms in the ring. Returns the kept positions [rows, keep]."""
        R, bs = self.rows, self.block_size
        obs = min(self.obs_window, L)
        sig = self.h_sigma * np.exp(self.sigma_jitter * self.rng.standard_normal(R))
        self.hsig[s] = sig
        cand = L - W
        keep = min(cand, self.cut_budget - W)
        self.zw[s], self.hsum[s], kept, terms, win_A, win_cw = score_prompt(
            self.rng.standard_normal((R, L)), sig, self.h_local, self.h_tau, self.h_content, obs, cand, keep, NUM_SINK,
            W)
        if W and self.window:
            at = np.arange(L - W, L) % W
            self.ringA[s][:, at] = win_A
            self.ringcw[s][:, at] = win_cw
        self.heavy[s, :, :keep] = kept // bs
        self.hv[s, :, :keep] = terms
        self.eref[s] = L - 1
        self.hn[s] = keep
        self._reset_candidates(s)
        return kept

    def _rebuild_heavy(self, s: int, rows: np.ndarray) -> None:
        """The heavy list of some rows from their per-column non-window counts (column order = age order)."""
        if self.budget is None or rows.size == 0 or not self.tracks_columns:
            return
        cnt = (np.maximum(self.occ[s, rows] - self.win[s, rows], 0) * self.alive[s, rows]).astype(np.int64)
        if self.scored and self.prefilled[s]:
            self._remap_heavy(s, rows, cnt)
            return
        cap = self.heavy.shape[2]
        tot = cnt.sum(axis=1)
        if (tot > cap).any():
            raise AssertionError("fast mode: more non-window tokens than the budget allows")
        cols = np.repeat(np.tile(np.arange(cnt.shape[1]), rows.size), cnt.ravel())
        row_of = np.repeat(np.arange(rows.size), tot)
        start = np.cumsum(tot) - tot
        idx = np.arange(cols.size) - start[row_of]
        self.heavy[s, rows[row_of], idx] = cols
        self.hn[s, rows] = tot

    def _remap_heavy(self, s: int, rows: np.ndarray, cnt: np.ndarray) -> None:
        """Scored lists after tokens moved between columns (compaction, sparse copy): entries keep their
        score terms; an entry stays in its column while the column holds that many non-window tokens,
        the rest take the columns' remaining places in order."""
        k, Hc = rows.size, self.heavy.shape[2]
        P = cnt.shape[1]
        col = self.heavy[s, rows].astype(np.int64)
        valid = np.arange(Hc)[None, :] < self.hn[s, rows][:, None]
        if (valid.sum(axis=1) != cnt.sum(axis=1)).any():
            raise AssertionError("fast mode: heavy list length differs from the non-window tokens")
        key = np.where(valid, np.arange(k)[:, None] * P + col, k * P).ravel()
        order = np.argsort(key, kind="stable")
        sk = key[order]
        rank = np.empty_like(key)
        rank[order] = np.arange(key.size) - np.searchsorted(sk, sk)
        stays = valid.ravel() & (rank < np.append(cnt.ravel(), 0)[key])
        cap = cnt.ravel() - np.bincount(key[stays], minlength=k * P)[:k * P]
        moved = np.flatnonzero(valid.ravel() & ~stays)
        new = col.ravel()
        new[moved] = np.repeat(np.arange(k * P), cap) % P
        self.heavy[s, rows] = new.reshape(k, Hc)

    def _after_evict(self, over, ev, ev_at, st) -> np.ndarray | None:
        """The slot strategy's answer to this step's evictions (column ev of each over-budget row),
        on the gathered row scalars `st`. Returns the rows whose first-hole pointer must be searched for."""
        tail, tw, ncol, pages, _, hole = st.T[:HOLED]
        empty = None
        if self.strategy in _FREES:
            empty = over & (self._occ_f[ev_at] == 0)
            if self.append:
                empty &= (tail != ev) | (tw >= self.block_size)
            if np.count_nonzero(empty):
                self._alive_f[ev_at[empty]] = False
                pages -= empty
                ncol -= empty & (ncol == ev + 1)
                n = int(np.count_nonzero(empty))
                self.pool.give(n)
                self.plan.blocks_freed_by_eviction += n
                if self.strategy in _REUSE:
                    hole[empty & (hole == ev)] = -1
            else:
                empty = None
        if self.strategy in _REUSE:
            kept = over if empty is None else over & ~empty
            np.copyto(hole, np.where(hole < 0, ev, np.minimum(hole, ev)), where=kept)
            return None if empty is None else empty & (hole < 0)
        if self.strategy in _COPY:
            holed = st[:, HOLED]
            holed[:] = np.where(over, np.where(holed == -1, ev, np.where(holed == ev, holed, -2)), holed)
        return None

    def _compact_step(self, S, q, col) -> None:
        """Compaction after the step's evictions: a row holding one page more than its live tokens
        need, whose newest token (just written at column col) sits alone in its last page with a hole
        before it, moves that token into the hole and frees the page; other rows with spare pages go
        through the exact count-based path."""
        bs, R, W = self.block_size, self.rows, self.window
        st = self._rs_f[q]
        pages, live, ncol, hc = st[:, PAGES], st[:, LIVE], st[:, NCOL], st[:, HOLE]
        extra = pages - -(-live // bs)
        if not (extra > 0).any():
            return
        P = self.occ.shape[2]
        occ_f, win_f, alive_f = self._occ_f, self._win_f, self._alive_f
        last = np.maximum(ncol - 1, 0)
        at_last = q * P + last
        simple = (extra == 1) & (occ_f[at_last] == 1) & (hc >= 0) & (hc < last) & alive_f[at_last]
        if W:
            simple &= col == last                # the newest token is the one alone in the last page
        if simple.any():
            r2, l = q[simple], at_last[simple]
            h = r2 * P + hc[simple]
            occ_f[h] += 1
            occ_f[l] = 0
            win_f[h] += 1
            win_f[l] = 0
            if W:
                t = np.repeat(self.ntok[S] - 1, R)[simple]
                self._ring_f[r2 * W + t % W] = hc[simple]
            alive_f[l] = False
            pages -= simple
            ncol[simple] = last[simple]
            n = int(r2.size)
            self.pool.give(n)
            self.plan.blocks_freed_by_eviction += n
            self.plan.bytes_moved += int(round(n * self.bytes_per_token_row))
            moved = st[simple]                   # a filled hole moves the first-free pointer on
            advance_first_free_np(self.occ.reshape(-1, P), r2 * P, hc[simple], moved[:, HOLE], moved[:, PAGES],
                                  moved[:, LIVE], moved[:, NCOL], bs)
            st[simple] = moved
            self._rs_f[q] = st
        hard = ((extra > 0) & ~simple).reshape(S.size, R)
        for i in np.flatnonzero(hard.any(axis=1)):
            rows = np.flatnonzero(hard[i])
            self._compact_rows(int(S[i]), rows)
            self._rescan_holes(int(S[i]), rows)

    def _sparse_copy(self, S) -> None:
        """Rewrite each holed row's holed page and tail densely into fresh pages, then free the old ones."""
        bs, W = self.block_size, self.window
        typical = self._typical_copy(S)
        si, ri = np.nonzero(typical)
        if si.size:
            # flat row ids and page ids (row q = slot * rows + row, page = q * cols + column)
            P, rs = self.occ.shape[2], self._rs_f
            s = S[si]
            q = s * self.rows + ri
            hc, t = rs[q, HOLED], rs[q, TAIL]
            ph, pt = q * P + hc, q * P + t
            occ_f, win_f = self._occ_f, self._win_f
            oh, ot = occ_f[ph], occ_f[pt]
            moved = oh + ot
            dst = -(-moved // bs)
            p0 = self.ntok[s] - ot                          # the tail holds the newest ot tokens
            k = np.where(dst == 2, bs - oh, ot)             # tail tokens that move into the holed page's column
            kk = np.maximum(k, 0).astype(np.int64)
            e = np.repeat(np.arange(kk.size), kk)          # one entry per moved tail token (window slots differ)
            if e.size:
                j = np.arange(e.size) - np.repeat(np.cumsum(kk) - kk, kk)
                self._ring_f[q[e] * W + (p0[e] + j) % W] = hc[e]
            wk = np.minimum(k, win_f[pt])
            win_f[ph] += wk
            win_f[pt] -= wk
            kept = np.minimum(moved, bs)
            occ_f[ph] = kept
            occ_f[pt] = moved - kept
            one = dst == 1
            self._alive_f[pt[one]] = False
            st = rs[q]
            top = one & (st[:, NCOL] == t + 1)
            st[top, NCOL] = t[top]
            st[one, TAIL] = hc[one]
            st[:, TAILW] = np.where(one, moved, moved - bs)
            st[:, PAGES] += (dst - 2).astype(np.int32)
            st[:, HOLED] = -1
            rs[q] = st
            self.pool.give(2 * si.size)
            self.plan.bytes_moved += int(round(moved.sum() * self.bytes_per_token_row))
        self._densify_generic(S, typical)

    def _densify_generic(self, S, typical) -> None:
        """sparse_copy's rows with several holed pages (or holed at the tail) go through _densify."""
        generic = (self.holed[S] != -1) & ~typical
        for i in np.flatnonzero(generic.any(axis=1)):
            self._densify(int(S[i]), np.flatnonzero(generic[i]))

    def _densify(self, s: int, rows: np.ndarray) -> None:
        """sparse_copy, any number of holed pages: their live tokens (and the tail's) go densely, in
        order, into new columns after the row's last one."""
        bs = self.block_size
        dirty = self._dirty(s)[rows]
        occ, win = self.occ[s, rows], self.win[s, rows]
        moved = (occ * dirty).sum(axis=1)
        wmoved = (win * dirty).sum(axis=1)
        dst = -(-moved // bs)
        n_old = int(dirty.sum())
        self.occ[s, rows] = np.where(dirty, 0, occ)
        self.win[s, rows] = np.where(dirty, 0, win)
        self.alive[s, rows] &= ~dirty
        self.pages[s, rows] += (dst - dirty.sum(axis=1)).astype(np.int32)
        self.pool.give(n_old)
        # a whole-row rewrite (sparse_copy) starts again at column 0, holed pages go after the last column
        whole = ~(self.alive[s, rows]).any(axis=1)
        base = np.where(whole, 0, self.ncol[s, rows]).astype(np.int64)
        self._ensure_cols(int((base + dst).max()))
        if dst.size and dst.max() > 0:           # new page j of a row holds its moved tokens j*bs .. (j+1)*bs - 1
            start = np.arange(int(dst.max()))[None, :] * bs
            m = start < dst[:, None] * bs
            cnt = np.minimum(np.maximum(moved[:, None] - start, 0), bs)
            lo = (moved - wmoved)[:, None]           # window tokens are the last wmoved ones
            wcnt = np.maximum(np.minimum(start + cnt, moved[:, None]) - np.maximum(start, lo), 0)
            r, c = np.broadcast_to(rows[:, None], m.shape)[m], (base[:, None] + start // bs)[m]
            self.occ[s, r, c] = cnt[m]
            self.alive[s, r, c] = True
            self.win[s, r, c] = wcnt[m]
        has = dst > 0
        self.tail[s, rows] = np.where(has, base + dst - 1, self.tail[s, rows])
        self.tail_w[s, rows] = np.where(has, moved - (dst - 1) * bs, bs)
        self.ncol[s, rows] = base + dst
        self._ncol_hi = max(self._ncol_hi, int((base + dst).max()))
        self.plan.bytes_moved += int(round(moved.sum() * self.bytes_per_token_row))
        self.holed[s, rows] = -1
        self._rebuild_ring(s, rows)
        self._rebuild_heavy(s, rows)

    # ----- bookkeeping ---------------------------------------------------------------------------
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
        if self.strategy in _REUSE:                 # first-free pointers: the first column with a free slot
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
