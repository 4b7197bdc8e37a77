"""Fast mode's compiled kernels (numba); their numpy twins are in sim.kv.fast.compiled.reference.

`decode_rows` is a whole decode step of FastKVManager (write, window exit, eviction, slot strategy)
for every (request, row) of the batch; its twin is the numpy step (step.py `FastStep.step_numpy`), which
uses the twins; the kernel's per-row parts (`_scored_exit`, `_evict_lowest_row`, `_scan_free`)
match `scored_step_np`, `evict_lowest_np` and `first_free_np`. Per decode step a scored row over its
budget evicts the lowest-scored candidate — a listed token, score A + CW H - E g, or the token
leaving the recent window — and a leaving token that stays joins the list. The list scan is
O(list) per row: ~130 entries x ~200 rows per step on the benchmark, which numpy pays for with a
dozen [rows, list] temporaries per step; the kernel keeps a few candidates per row and rescans a
list only when they cannot hold the minimum. The module also holds the prompt cut's scoring
(`prompt_inputs`, `prompt_cut`). numba is optional: without it (the real backend's machines need not
have it), or with KVSIM_NO_NUMBA=1 set, the twins run, same results.
"""
from __future__ import annotations

import os

import numpy as np

from .layout import A, CW, E, NUM_CANDIDATES, REBASE, PromptRows, ScoreArrays, SlabArrays, StepFlags, StepOutputs
from .reference import prompt_cut_np

try:
    from numba import njit
except ImportError:          # pragma: no cover - exercised where numba is absent
    njit = None
if os.environ.get("KVSIM_NO_NUMBA"):    # the numpy twins only (benchmarks, debugging)
    njit = None

K = NUM_CANDIDATES


def _scored_exit(row, t, z, local, inv_tau, content, window, list_cap, exits_window, sc: ScoreArrays):
    """One scored row's part of a decode step before the eviction (see `scored_step_np`): the new
    token's content weight updates the normalizer and H, its terms enter the ring, the leaving token's
    come out. Returns H, g, the leaving token's score (inf when none leaves), whether one leaves, and
    its terms A, CW, E."""
    weight = np.exp(sc.sigma[row] * z)
    h_before = sc.hsum[row]
    norm = sc.norm[row] + weight
    sc.norm[row] = norm
    h_now = h_before + 1.0 / norm
    sc.hsum[row] = h_now
    cw_new = content * weight
    a_new = local - cw_new * h_before
    ref = sc.eref[row]
    if (t - ref) * inv_tau > REBASE:
        scale = np.exp((ref - t) * inv_tau)
        for e in range(list_cap):
            sc.terms[row * list_cap + e, E] *= scale
        for k in range(K):
            sc.cand[row, k, 1 + E] *= scale
        ref = float(t)
        sc.eref[row] = ref
    decay_now = np.exp((ref - t - 1) * inv_tau)
    if window:
        at = row * window + t % window
        a_exit, cw_exit = sc.ring_static[at], sc.ring_content[at]
        sc.ring_static[at], sc.ring_content[at] = a_new, cw_new
        pos_exit = t - window
        exits = exits_window
    else:
        a_exit, cw_exit, pos_exit = a_new, cw_new, t
        exits = True
    e_exit = local * np.exp((pos_exit - ref) * inv_tau)
    score_exit = a_exit + cw_exit * h_now - e_exit * decay_now if exits else np.inf
    return h_now, decay_now, score_exit, exits, a_exit, cw_exit, e_exit


def _lowest_candidate(cand_row, h_now, decay_now):
    """(score, list index) of the lowest-scored of a row's candidates (index -1 when it has none)."""
    best, lowest = np.inf, -1
    for k in range(K):
        e = int(cand_row[k, 0])
        if e >= 0:
            score = cand_row[k, 1] + cand_row[k, 2] * h_now - cand_row[k, 3] * decay_now
            if score < best or (score == best and e < lowest):
                best, lowest = score, e
    return best, lowest


def _rescan(row, n, list_cap, h_now, decay_now, sc: ScoreArrays, buf, top):
    """Score a row's whole list (n entries), keep its K lowest as the candidates and set the row's
    threshold to the lowest score left out. Returns (score, list index) of the lowest."""
    base = row * list_cap
    terms = sc.terms
    for e in range(n):
        buf[e] = terms[base + e, A] + terms[base + e, CW] * h_now - terms[base + e, E] * decay_now
    top[:] = -1
    threshold = np.inf
    for e in range(n):
        score = buf[e]
        if top[K - 1] >= 0:
            if score >= buf[top[K - 1]]:
                threshold = min(threshold, score)
                continue
            threshold = min(threshold, buf[top[K - 1]])
        k = K - 1
        while k > 0 and (top[k - 1] < 0 or buf[top[k - 1]] > score):
            top[k] = top[k - 1]
            k -= 1
        top[k] = e
    sc.thr[row] = threshold
    cand_row = sc.cand[row]
    for k in range(K):
        e = top[k]
        cand_row[k, 0] = e
        if e >= 0:
            cand_row[k, 1], cand_row[k, 2], cand_row[k, 3] = terms[base + e, A], terms[base + e, CW], terms[base + e, E]
    return buf[top[0]], top[0]


def _add_candidate(row, n, lowest, h_now, decay_now, score_new, a_new, cw_new, e_new, sc: ScoreArrays):
    """A leaving token just listed at index n scores below the row's threshold: make it a candidate
    (in a free place, or in place of the worst one, which then bounds the threshold)."""
    cand_row = sc.cand[row]
    free, worst, worst_score = -1, -1, -np.inf
    for k in range(K):
        e = int(cand_row[k, 0])
        if e < 0:
            free = k
        elif e != lowest:
            score = cand_row[k, 1] + cand_row[k, 2] * h_now - cand_row[k, 3] * decay_now
            if score > worst_score:
                worst, worst_score = k, score
    if free < 0 and worst >= 0 and worst_score > score_new:
        free = worst
        sc.thr[row] = min(sc.thr[row], worst_score)      # the one left out scores >= this from now on
    if free >= 0:
        cand_row[free, 0], cand_row[free, 1], cand_row[free, 2], cand_row[free, 3] = n, a_new, cw_new, e_new
    else:
        sc.thr[row] = min(sc.thr[row], score_new)


def _evict_lowest_row(row, n, list_cap, over, exits, h_now, decay_now, score_exit, exit_col, a_exit, cw_exit,
                      e_exit, heavy, sc: ScoreArrays, buf, top):
    """`evict_lowest_np` for one row (flat row `row`, list length n; scratch buf [list_cap], top [K]).
    Returns the evicted column (exit_col when not over budget: unused) and the new list length. It
    scans the row's whole list only when its K candidates (cand [rows, K, 4]: list index, -1 = empty,
    and a copy of the entry's terms, so the common step reads one small record per row) cannot hold
    the minimum (their best score is above thr, the lowest score an entry had when it was left out):
    exact, as scores only grow."""
    base = row * list_cap
    best, lowest = np.inf, -1
    if over:
        best, lowest = _lowest_candidate(sc.cand[row], h_now, decay_now)
        if n > 0 and (lowest < 0 or best > sc.thr[row]):
            best, lowest = _rescan(row, n, list_cap, h_now, decay_now, sc, buf, top)
    take_exit = over and exits and score_exit <= best
    if exits and not take_exit:                            # the leaving token joins the list at n
        heavy[base + n] = exit_col
        sc.terms[base + n, A], sc.terms[base + n, CW], sc.terms[base + n, E] = a_exit, cw_exit, e_exit
        if score_exit < sc.thr[row]:                       # it may be the lowest soon: a candidate
            _add_candidate(row, n, lowest, h_now, decay_now, score_exit, a_exit, cw_exit, e_exit, sc)
        n += 1
    if take_exit or not over:
        return exit_col, n
    at, last = base + lowest, base + n - 1
    out = heavy[at]
    heavy[at] = heavy[last]
    sc.terms[at, A], sc.terms[at, CW], sc.terms[at, E] = sc.terms[last, A], sc.terms[last, CW], sc.terms[last, E]
    cand_row = sc.cand[row]
    for k in range(K):                                    # the evicted entry leaves; the last one moved
        if cand_row[k, 0] == lowest:
            cand_row[k, 0] = -1
        elif cand_row[k, 0] == n - 1:
            cand_row[k, 0] = lowest
    return out, n - 1


def _scan_free(occ_row, col, stop, block_size):
    """The first column from `col` whose page has a free slot (0 < occ < bs), at most stop - 1."""
    while col < stop - 1 and not 0 < occ_row[col] < block_size:
        col += 1
    return col


def prompt_inputs(z, sigma, tau, obs):
    """The prompt's content weights exp(sigma z) and decays d^(L-1-t) [rows, L], and per row
    top = d^-(obs-1) and shift = d (the vectorized exps of the prompt scoring)."""
    length = z.shape[1]
    weight = np.exp(sigma[:, None] * z)
    decay = np.exp((np.arange(length) - (length - 1)) / tau[:, None])     # d^(L - 1 - t)
    return weight, decay, np.exp((obs - 1) / tau), np.exp(-1.0 / tau)


def _prompt_cut_loop(p: PromptRows, obs, cand, keep, num_sink, window):
    weight, decay, local, content, top, shift = p
    rows, length = weight.shape
    q0 = length - obs
    num_kept = 0
    for r in range(rows):
        num_kept = max(num_kept, min(keep[r], cand))
    kept, kept_terms = np.full((rows, num_kept), -1, np.int64), np.zeros((rows, num_kept, 3))
    win_static, win_cw = np.empty((rows, window)), np.empty((rows, window))
    norm_last, h_last = np.empty(rows), np.empty(rows)
    static, cw, local_term, score = np.empty(length), np.empty(length), np.empty(length), np.empty(cand)
    for r in range(rows):
        norm, h_obs, h_prev = 0.0, 0.0, 0.0
        for t in range(length):
            norm += weight[r, t]
            cw[t] = content[r] * weight[r, t]
            local_term[t] = local[r] * decay[r, t]
            static[t] = np.inf if t < num_sink else local[r] * min(decay[r, t] * top[r], 1.0) - cw[t] * h_prev
            if t >= q0:                     # H over the observation queries; H(a0 - 1) of the next token
                h_obs += 1.0 / norm
                h_prev = h_obs
        norm_last[r], h_last[r] = norm, h_obs
        for j in range(window):
            win_static[r, j], win_cw[r, j] = static[length - window + j], cw[length - window + j]
        row_keep = min(keep[r], cand)
        if row_keep >= cand:
            for t in range(cand):
                kept[r, t] = t
        elif row_keep > 0:
            for t in range(cand):
                score[t] = static[t] + cw[t] * h_obs - local_term[t] * shift[r]
            v = -np.partition(-score, row_keep - 1)[row_keep - 1]
            ties = row_keep
            for t in range(cand):
                ties -= score[t] > v
            k = 0
            for t in range(cand):
                if score[t] > v or (score[t] == v and ties > 0):
                    ties -= score[t] == v
                    kept[r, k] = t
                    k += 1
        for k in range(row_keep):
            t = kept[r, k]
            kept_terms[r, k, 0], kept_terms[r, k, 1], kept_terms[r, k, 2] = static[t], cw[t], local_term[t]
    return norm_last, h_last, kept, kept_terms, win_static, win_cw


def _rewrite_holed_page(slab: SlabArrays, q, pos, holed, tail, block_size, window):
    """sparse_copy, one holed page (the steady state): it and the tail are rewritten densely (the
    tail's oldest tokens fill the holed page's column). Returns the tail's new column and written
    slots, the change in pages, whether the tail column was freed, and the tokens moved."""
    occ, win, ring = slab.occ, slab.win, slab.ring
    occ_holed, occ_tail = occ[q, holed], occ[q, tail]
    moved = occ_holed + occ_tail
    dst = -(-moved // block_size)
    k = block_size - occ_holed if dst == 2 else occ_tail      # tail tokens that move into the holed page
    for j in range(max(k, 0)):
        ring[q, (pos - occ_tail + j) % window] = holed
    moved_window = min(k, win[q, tail])
    win[q, holed] += moved_window
    win[q, tail] -= moved_window
    occ[q, holed] = min(moved, block_size)
    occ[q, tail] = moved - min(moved, block_size)
    if dst == 1:
        slab.alive[q, tail] = False
        return holed, moved, dst - 2, True, moved
    return tail, moved - block_size, dst - 2, False, moved


def _decode_rows_loop(S, R, slab: SlabArrays, flags: StepFlags, u, z, sc: ScoreArrays, out: StepOutputs):  # noqa: C901  a numba kernel: one compiled loop per row, kept whole (calls inside it cost)
    bs, W, budget = flags.block_size, flags.window, flags.budget
    append, reuse, sparse, list_cap = flags.append, flags.reuse, flags.sparse, flags.list_cap
    thr = flags.copy_threshold        # batched copy: a holed row waits until it holds more holes than this
    rs, occ, win, alive, ring, heavy = slab.row_state, slab.occ, slab.win, slab.alive, slab.ring, slab.heavy
    m_new, n_evicted, n_freed, n_copied, copied, n_compacted, n_left = 0, 0, 0, 0, 0, 0, 0
    buf, top = np.empty(max(list_cap, 1)), np.empty(K, np.int64)
    for si in range(S.size):
        s = S[si]
        pos = slab.num_tokens[s]
        ev_count, need_s, live_s, pages_s, generic = 0, 0, 0, 0, 0
        for r in range(R):
            q, i = s * R + r, si * R + r
            tail, tw, ncol, pages, live, hole, holed, hn = (rs[q, 0], rs[q, 1], rs[q, 2], rs[q, 3], rs[q, 4],
                                                             rs[q, 5], rs[q, 6], rs[q, 7])
            # holes = written slots - live (append strategies: every page but the tail is full)
            if sparse and holed >= 0 and holed != tail and bs <= W and (thr == 0 or pages * bs - (bs - tw) - live > thr):
                old_tail = tail
                tail, tw, page_change, tail_freed, moved = _rewrite_holed_page(slab, q, pos, holed, tail, bs, W)
                if tail_freed and ncol == old_tail + 1:
                    ncol = old_tail
                pages += page_change
                holed = -1
                n_copied += 1
                copied += moved
            # write the new token: into the tail page, the first hole, or a page opened at column ncol
            new = (tw >= bs or ncol == 0) if append else hole < 0
            col = ncol if new else (tail if append else hole)
            if new:
                m_new += 1
                alive[q, col] = True
                pages += 1
                ncol += 1
                if append:
                    tw = 0
                else:
                    hole = col
            if append:
                tail = col
                tw += 1
            if flags.track:
                occ[q, col] += 1
            live += 1
            # the window moves on: the token at pos - W leaves it
            ex, ec = False, col
            if W and flags.track:
                ex = pos >= W
                ec = ring[q, pos % W]
                if ex:
                    win[q, ec] -= 1
                win[q, col] += 1
                ring[q, pos % W] = col
            if reuse and occ[q, col] >= bs:                     # a filled page moves the first-free pointer on
                hole = _scan_free(occ[q], col + 1, ncol, bs) if pages * bs > live else -1
            # evict
            if budget >= 0:
                over = live > budget
                if over:
                    live -= 1
                    n_evicted += 1
                    ev_count += 1
                if flags.track:
                    if flags.scored:
                        h_now, decay_now, s_exit, exits, a_e, cw_e, e_e = _scored_exit(
                            q, pos, z[i], sc.local[r], sc.inv_tau[r], sc.content[r], W, list_cap, ex, sc)
                        ev, hn = _evict_lowest_row(q, hn, list_cap, over, exits, h_now, decay_now, s_exit, ec, a_e,
                                                   cw_e, e_e, heavy, sc, buf, top)
                    else:
                        base = q * list_cap
                        take_exit = over and ex and flags.evict_leaving
                        heavy[base + hn] = ec
                        if ex and not take_exit:
                            hn += 1
                        draw = over and not take_exit
                        idx = min(int(u[i] * hn), max(hn - 1, 0))
                        ev = heavy[base + idx]
                        last = base + max(hn - 1, 0)
                        heavy[base + idx if draw else last] = heavy[last]
                        if draw:
                            hn -= 1
                        if take_exit:
                            ev = ec
                    if over:
                        occ[q, ev] -= 1
                        empty = False
                        if flags.frees:
                            empty = occ[q, ev] == 0 and (not append or tail != ev or tw >= bs)
                            if empty:
                                alive[q, ev] = False
                                pages -= 1
                                if ncol == ev + 1:
                                    ncol -= 1
                                n_freed += 1
                                if reuse and hole == ev:
                                    hole = -1
                        if reuse:
                            if not empty:
                                hole = ev if hole < 0 else min(hole, ev)
                            elif hole < 0 and pages * bs > live:
                                hole = _scan_free(occ[q], ev + 1, ncol, bs)
                        if sparse:
                            holed = ev if holed == -1 else (holed if holed == ev else -2)
            if flags.compact and pages - -(-live // bs) > 0:
                # one page more than the live tokens need, the newest token alone in the last page with a
                # hole before it: that token moves into the hole and the page is freed; else the caller's
                # exact count-based path (generic)
                last = max(ncol - 1, 0)
                if (pages - -(-live // bs) == 1 and occ[q, last] == 1 and 0 <= hole < last and alive[q, last]
                        and (W == 0 or col == last)):
                    occ[q, hole] += 1
                    occ[q, last] = 0
                    win[q, hole] += 1
                    win[q, last] = 0
                    if W:
                        ring[q, pos % W] = hole
                    alive[q, last] = False
                    pages -= 1
                    ncol = last
                    n_compacted += 1
                    if occ[q, hole] >= bs:
                        hole = _scan_free(occ[q], hole + 1, ncol, bs) if pages * bs > live else -1
                else:
                    generic += 1
            rs[q, 0], rs[q, 1], rs[q, 2], rs[q, 3], rs[q, 4], rs[q, 5], rs[q, 6], rs[q, 7] = (
                tail, tw, ncol, pages, live, hole, holed, hn)
            if not append:
                need_s += pages * bs <= live
            elif sparse and holed != -1 and thr > 0 and pages * bs - (bs - tw) - live <= thr:
                need_s += tw >= bs or ncol == 0              # not due for its rewrite: appends as noop
            elif sparse and holed >= 0 and holed != tail and bs <= W:  # the next step rewrites two pages
                moved_next = occ[q, holed] + occ[q, tail]
                dst = -(-moved_next // bs)
                need_s += dst + (dst * bs - moved_next < 1)
            elif sparse and holed != -1:
                generic += 1                                 # several holed pages: counted in numpy
            else:
                need_s += tw >= bs or ncol == 0
            live_s += live
            pages_s += pages
        slab.num_tokens[s] = pos + 1
        out.evicted[si], out.left[si] = ev_count, generic
        out.need_next[s], out.slot_live[s], out.slot_pages[s] = need_s, live_s, pages_s
        n_left += generic > 0
    return m_new, n_evicted, n_freed, n_copied, copied, n_compacted, n_left


if njit is not None:
    _scan_free = njit(cache=True, nogil=True)(_scan_free)
    _scored_exit = njit(cache=True, nogil=True)(_scored_exit)
    _lowest_candidate = njit(cache=True, nogil=True)(_lowest_candidate)
    _rescan = njit(cache=True, nogil=True)(_rescan)
    _add_candidate = njit(cache=True, nogil=True)(_add_candidate)
    _evict_lowest_row = njit(cache=True, nogil=True)(_evict_lowest_row)
    _rewrite_holed_page = njit(cache=True, nogil=True)(_rewrite_holed_page)
    prompt_cut = njit(cache=True, nogil=True)(_prompt_cut_loop)
    decode_rows = njit(cache=True, nogil=True)(_decode_rows_loop)
else:
    decode_rows = None          # the numpy path of FastStep.step is its twin
    prompt_cut = prompt_cut_np
prompt_cut.__doc__ = """The prompt cut's scoring and top-k (see scoring.py Scorer.score_prompt) from a `PromptRows`
(content weights and decays d^(L-1-t) [rows, L], per-row local, content, top = d^-(obs-1) and
shift = d): the content normalizer and H after the prompt, the kept positions and their terms, and
the window's terms."""
if decode_rows is not None:
    decode_rows.__doc__ = """One whole fast-mode decode step for the rows of the slots in S (R rows each; flat row
q = slot * R + row): per row the write (tail page, first hole or a page opened at column ncol), the
window exit (sparse_copy first rewrites a row's one holed page and its tail), the reuse
strategies' first-free pointer, the eviction (scored: `_scored_exit` and `_evict_lowest_row` with
normal draw z[i]; else the leaving token or the listed entry drawn by u[i]) and the slot strategy's
answer to it (an emptied page freed, the first-free pointer, sparse_copy's holed column) and
compaction's common case (the newest token moves into the first hole and its page is freed), on
the slab (`SlabArrays`, row scalars in layout.ROW_FIELDS order). Writes to `out` (`StepOutputs`);
returns (rows that opened a page, evicted tokens, pages freed, rows sparse-copied, tokens they
copied, rows compacted, slots with rows left to the caller). Its twin is FastStep.step_numpy
(same state, tests/test_kv_fast_kernels.py)."""
