"""Fast mode's compiled kernels, each with its numpy twin.

`decode_rows` is a whole decode step of FastKVManager (write, window exit, eviction, slot strategy)
for every (request, row) of the batch; its twin is the manager's numpy step, which uses the numpy
functions here (`scored_step_np`, `evict_lowest_np`, `first_free_np`, `advance_first_free_np`);
the kernel's per-row parts (`_scored_exit`, `_evict_lowest_row`, `_scan_free`) match them. Each
simulated row holds a list of its live non-window tokens: page column, static score part A, content
coefficient cw and local-decay term E (see FastKVManager._pick_scored). Per decode step a row over
its budget evicts the lowest-scored candidate — a listed token, score A + cw H - E g, or the token
leaving the recent window (score `s_exit`) — and a leaving token that stays joins the list. The list
scan is O(list) per row: ~130 entries x ~200 rows per step on the benchmark, which numpy pays for
with a dozen [rows, list] temporaries per step; the kernel keeps a few candidates per row and
rescans a list only when they cannot hold the minimum. The module also holds the prompt cut's
scoring (`score_prompt`, `prompt_cut` and its twin). The tests (tests/test_kv_fast_kernels.py)
compare kernels and twins (ties go to the first entry in both). numba is optional: without it (the
real backend's machines need not have it), or with KVSIM_NO_NUMBA=1 set, the twins run, same
results.
"""
from __future__ import annotations

import os

import numpy as np

try:
    from numba import njit
except ImportError:          # pragma: no cover - exercised where numba is absent
    njit = None
if os.environ.get("KVSIM_NO_NUMBA"):    # the numpy twins only (benchmarks, debugging)
    njit = None


K = 8                        # candidates the kernel keeps per row between full scans
A, CW, E = range(3)          # fields of a listed token's score terms (hv[..., field])
REBASE = 500.0               # rebase a row's local terms when (t - eref) / tau passes this (exp(500) fits)


def scored_step_np(q, t_new, z, l, inv_tau, c, W, Hc, over, ex, ec, hn, hsig, zw, hsum, eref, ringA, ringcw,
                   heavy, hv, cand, thr):
    """One H2O decode step of fast mode's scored rows in numpy (FastKVManager's numpy step; the kernel's
    per-row twin is `_scored_exit` + `_evict_lowest_row`): per row i (flat row q[i], query position
    t_new[i], content draw z[i] ~ N(0, 1), head constants l, inv_tau, c) the new token's content
    weight exp(hsig z) updates the row's normalizer zw and H = sum of 1/zw; its score terms enter the
    window ring (W > 0) and the token leaving it comes out; then `evict_lowest_np`."""
    m = q.size
    w = np.exp(hsig[q] * z)
    h_before = hsum[q]
    zq = zw[q] + w
    zw[q] = zq
    H = h_before + 1.0 / zq
    hsum[q] = H
    cw_new = c * w
    A_new = l - cw_new * h_before
    ref = eref[q]
    aged = (t_new - ref) * inv_tau > REBASE
    if aged.any():
        rows, new = q[aged], t_new[aged].astype(np.float64)
        scale = np.exp((ref[aged] - new) * inv_tau[aged])
        hv.reshape(-1, Hc, 3)[rows, :, E] *= scale[:, None]
        cand[rows, :, 1 + E] *= scale[:, None]
        eref[rows] = new
        ref = ref.copy()
        ref[aged] = new
    g = np.exp((ref - t_new - 1) * inv_tau)
    if W:
        at = q * W + t_new % W
        A_e, cw_e = ringA[at], ringcw[at]
        ringA[at], ringcw[at] = A_new, cw_new
        pos_e = t_new - W
    else:                                       # no window: the new token is a candidate at once
        A_e, cw_e, pos_e, ex = A_new, cw_new, t_new, np.ones(m, bool)
    E_e = l * np.exp((pos_e - ref) * inv_tau)
    s_exit = np.where(ex, A_e + cw_e * H - E_e * g, np.inf)
    return evict_lowest_np(q, Hc, hn, over, ex, H, g, s_exit, ec, np.stack([A_e, cw_e, E_e], axis=1),
                           heavy, hv, cand, thr)


def _scored_exit(r, t, z, l, inv_tau, c, W, Hc, ex, hsig, zw, hsum, eref, ringA, ringcw, hv, cand):
    """One scored row's part of a decode step before the eviction (see `scored_step_np`): the new token's
    content weight updates the normalizer and H, its terms enter the ring, the leaving token's come
    out. Returns H, g, the leaving token's score (inf when none leaves), whether one leaves, and its
    terms A, CW, E."""
    w = np.exp(hsig[r] * z)
    h_before = hsum[r]
    zq = zw[r] + w
    zw[r] = zq
    H = h_before + 1.0 / zq
    hsum[r] = H
    cw_new = c * w
    A_new = l - cw_new * h_before
    ref = eref[r]
    if (t - ref) * inv_tau > REBASE:
        scale = np.exp((ref - t) * inv_tau)
        for e in range(Hc):
            hv[r * Hc + e, E] *= scale
        for k in range(K):
            cand[r, k, 1 + E] *= scale
        ref = float(t)
        eref[r] = ref
    g = np.exp((ref - t - 1) * inv_tau)
    if W:
        at = r * W + t % W
        A_e, cw_e = ringA[at], ringcw[at]
        ringA[at], ringcw[at] = A_new, cw_new
        pos_e = t - W
        exits = ex
    else:
        A_e, cw_e, pos_e = A_new, cw_new, t
        exits = True
    E_e = l * np.exp((pos_e - ref) * inv_tau)
    s_exit = A_e + cw_e * H - E_e * g if exits else np.inf
    return H, g, s_exit, exits, A_e, cw_e, E_e


def evict_lowest_np(q, Hc, hn, over, ex, H, g, s_exit, ec, new, heavy, hv, cand, thr):
    """Per row i (flat row q[i], list at q[i] * Hc of length hn[i], updated in place; its tokens'
    columns in `heavy`, score terms (A, CW, E) in hv [entries, 3]): if over[i], evict the candidate
    with the lowest score — the listed entry minimizing A + CW H[i] - E g[i], or the leaving token
    (ex[i], score s_exit[i], column ec[i]) when its score is not higher; a leaving token that stays is
    appended (column ec[i], terms new[i]); the evicted entry's place takes the list's last entry.
    Returns the evicted column per row (ec for rows not over budget: unused). Scans every row's
    whole list; `cand` and `thr` are the kernel's own bookkeeping (`_evict_lowest_row`) and are left
    alone."""
    qH = q * Hc
    m = q.size
    hm = int(hn.max()) if m else 0
    if hm:
        at2 = qH[:, None] + np.arange(hm)
        v = hv[at2]
        score = v[..., A] + v[..., CW] * H[:, None] - v[..., E] * g[:, None]
        score[np.arange(hm)[None, :] >= hn[:, None]] = np.inf
        j = np.argmin(score, axis=1)
        s_min = score[np.arange(m), j]
    else:
        j, s_min = np.zeros(m, np.int64), np.full(m, np.inf)
    take_exit = over & ex & (s_exit <= s_min)
    add = ex & ~take_exit
    if add.any():
        at_add = (qH + hn)[add]
        heavy[at_add] = ec[add]
        hv[at_add] = new[add]
        hn += add
    draw = over & ~take_exit
    hidx = qH + j
    col = heavy[hidx]
    if draw.any():
        src_at, dst_at = (qH + hn - 1)[draw], hidx[draw]    # the last entry fills the evicted one's place
        heavy[dst_at] = heavy[src_at]
        hv[dst_at] = hv[src_at]
        hn -= draw
    return np.where(take_exit, ec, col)


def _evict_lowest_row(r, n, Hc, over, ex, h, gg, s_exit, ec, nA, nCW, nE, heavy, hv, cand, thr, buf, top):
    """`evict_lowest_np` for one row (flat row r, list length n; scratch buf [Hc], top [K]). Returns
    the evicted column (ec when not over budget: unused) and the new list length. It scans the row's
    whole list only when its K candidates (cand [rows, K, 4]: list index, -1 = empty, and a copy of
    the entry's terms, so the common step reads one small record per row) cannot hold the minimum
    (their best score is above thr, the lowest score an entry had when it was left out): exact, as
    scores only grow."""
    base = r * Hc
    c = cand[r]                            # [K, 4]: list index (-1 = empty), A, CW, E
    # the lowest-scored listed entry: among the candidates, valid while not above the threshold
    # (every other entry scored >= thr when it was left out, and scores never decrease)
    best, j = np.inf, -1
    if over:
        for k in range(K):
            e = int(c[k, 0])
            if e >= 0:
                sc = c[k, 1] + c[k, 2] * h - c[k, 3] * gg
                if sc < best or (sc == best and e < j):
                    best, j = sc, e
        if n > 0 and (j < 0 or best > thr[r]):          # full scan: the K lowest become the candidates
            for e in range(n):
                buf[e] = hv[base + e, A] + hv[base + e, CW] * h - hv[base + e, E] * gg
            top[:] = -1
            t = np.inf
            for e in range(n):
                sc = buf[e]
                if top[K - 1] >= 0:
                    if sc >= buf[top[K - 1]]:
                        t = min(t, sc)
                        continue
                    t = min(t, buf[top[K - 1]])
                k = K - 1
                while k > 0 and (top[k - 1] < 0 or buf[top[k - 1]] > sc):
                    top[k] = top[k - 1]
                    k -= 1
                top[k] = e
            thr[r] = t
            for k in range(K):
                e = top[k]
                c[k, 0] = e
                if e >= 0:
                    c[k, 1], c[k, 2], c[k, 3] = hv[base + e, A], hv[base + e, CW], hv[base + e, E]
            best, j = buf[top[0]], top[0]
    take_exit = over and ex and s_exit <= best
    if ex and not take_exit:                            # the leaving token joins the list at n
        heavy[base + n] = ec
        hv[base + n, A], hv[base + n, CW], hv[base + n, E] = nA, nCW, nE
        if s_exit < thr[r]:                             # it may be the lowest soon: a candidate
            free, worst, worst_sc = -1, -1, -np.inf
            for k in range(K):
                e = int(c[k, 0])
                if e < 0:
                    free = k
                elif e != j:
                    sc = c[k, 1] + c[k, 2] * h - c[k, 3] * gg
                    if sc > worst_sc:
                        worst, worst_sc = k, sc
            if free < 0 and worst >= 0 and worst_sc > s_exit:
                free = worst
                thr[r] = min(thr[r], worst_sc)          # the one left out scores >= this from now on
            if free >= 0:
                c[free, 0], c[free, 1], c[free, 2], c[free, 3] = n, nA, nCW, nE
            else:
                thr[r] = min(thr[r], s_exit)
        n += 1
    if take_exit or not over:
        return ec, n
    at, last = base + j, base + n - 1
    out = heavy[at]
    heavy[at] = heavy[last]
    hv[at, A], hv[at, CW], hv[at, E] = hv[last, A], hv[last, CW], hv[last, E]
    for k in range(K):                                  # the evicted entry leaves; the last one moved
        if c[k, 0] == j:
            c[k, 0] = -1
        elif c[k, 0] == n - 1:
            c[k, 0] = j
    return out, n - 1


def first_free_np(occ, qP, start, stop, bs):
    """First column in [start, stop) of each flat row (page ids qP = row * cols of occ [rows, cols])
    holding 0 < occ < bs tokens: a page with a free slot (callers guarantee one in the range; the
    kernel's per-row twin is `_scan_free`)."""
    P = occ.shape[1]
    lo, hi = int(start.min()), int(stop.max())
    o = occ[qP // P, lo:hi] - 1
    return lo + (o.view(np.uint32) < bs - 1).argmax(axis=1)


def _scan_free(row, col, stop, bs):
    """The first column from `col` whose page has a free slot (0 < occ < bs), at most stop - 1."""
    while col < stop - 1 and not 0 < row[col] < bs:
        col += 1
    return col


def score_prompt(z, sig, l, tau, c, obs, cand, keep, num_sink, W):
    """H2O's prompt cut for fast mode's scored rows (see FastKVManager._score_prompt): from the
    prompt's content draws z [rows, L] and head parameters, per row: the content normalizer and H
    after the prompt, the `keep` highest-scored of the first `cand` positions (ties to the lower
    position, in position order) and their score terms A, CW, E [rows, keep, 3], and the terms A and
    CW of the last W positions (the window) [rows, W]. The sinks (the first num_sink) score inf. The two
    exps per token run in numpy (vectorized, faster than a compiled scalar loop), the rest in
    `prompt_cut`."""
    L = z.shape[1]
    w = np.exp(sig[:, None] * z)
    decay = np.exp((np.arange(L) - (L - 1)) / tau[:, None])     # d^(L - 1 - t)
    return prompt_cut(w, decay, l, c, np.exp((obs - 1) / tau), np.exp(-1.0 / tau), obs, cand, keep, num_sink, W)


def prompt_cut_np(w, decay, l, c, top, shift, obs, cand, keep, num_sink, W):
    """numpy twin of `prompt_cut`."""
    R, L = w.shape
    zw = np.cumsum(w, axis=1)
    q0 = L - obs
    hq = np.cumsum(1.0 / zw[:, q0:], axis=1)               # H(q), q = q0 .. L-1
    h_prev = np.zeros((R, L))                               # H(a0 - 1), a0 = max(t, q0)
    h_prev[:, q0 + 1:] = hq[:, :-1]
    l, c, top, shift = l[:, None], c[:, None], top[:, None], shift[:, None]
    cw = c * w
    A = l * np.minimum(decay * top, 1.0) - cw * h_prev
    A[:, :num_sink] = np.inf
    E = l * decay
    score = A[:, :cand] + cw[:, :cand] * hq[:, -1:] - E[:, :cand] * shift
    if keep >= cand:
        kept = np.broadcast_to(np.arange(cand), (R, cand))
    else:                                   # the keep highest, ties to the lower position, in position order
        v = -np.partition(-score, keep - 1, axis=1)[:, keep - 1:keep]
        eq = score == v
        take = (score > v) | (eq & (np.cumsum(eq, axis=1) <= keep - (score > v).sum(axis=1, keepdims=True)))
        kept = np.nonzero(take)[1].reshape(R, keep)
    terms = np.stack([np.take_along_axis(x, kept, axis=1) for x in (A, cw, E)], axis=2)
    return zw[:, -1], hq[:, -1], kept, terms, A[:, L - W:], cw[:, L - W:]


def _prompt_cut_loop(w, decay, l, c, top, shift, obs, cand, keep, num_sink, W):
    R, L = w.shape
    q0 = L - obs
    nk = min(keep, cand)
    kept, terms = np.empty((R, nk), np.int64), np.empty((R, nk, 3))
    win_A, win_cw = np.empty((R, W)), np.empty((R, W))
    zw_last, hq_last = np.empty(R), np.empty(R)
    A, cw, E, score = np.empty(L), np.empty(L), np.empty(L), np.empty(cand)
    for r in range(R):
        zw, hq, h_prev = 0.0, 0.0, 0.0
        for t in range(L):
            zw += w[r, t]
            cw[t] = c[r] * w[r, t]
            E[t] = l[r] * decay[r, t]
            A[t] = np.inf if t < num_sink else l[r] * min(decay[r, t] * top[r], 1.0) - cw[t] * h_prev
            if t >= q0:                     # H over the observation queries; H(a0 - 1) of the next token
                hq += 1.0 / zw
                h_prev = hq
        zw_last[r], hq_last[r] = zw, hq
        for j in range(W):
            win_A[r, j], win_cw[r, j] = A[L - W + j], cw[L - W + j]
        if keep >= cand:
            for t in range(cand):
                kept[r, t] = t
        else:
            for t in range(cand):
                score[t] = A[t] + cw[t] * hq - E[t] * shift[r]
            v = -np.partition(-score, keep - 1)[keep - 1]
            ties = keep
            for t in range(cand):
                ties -= score[t] > v
            k = 0
            for t in range(cand):
                if score[t] > v or (score[t] == v and ties > 0):
                    ties -= score[t] == v
                    kept[r, k] = t
                    k += 1
        for k in range(nk):
            t = kept[r, k]
            terms[r, k, 0], terms[r, k, 1], terms[r, k, 2] = A[t], cw[t], E[t]
    return zw_last, hq_last, kept, terms, win_A, win_cw


def advance_first_free_np(occ, qP, col, hole, pages, live, ncol, bs):
    """Reuse strategies after each row i wrote a token at column col[i]: if that filled the page, move
    the row's first-free pointer hole[i] on (to -1 when the row has no free slot: pages * bs <= live)."""
    at = qP + col
    full = occ.reshape(-1)[at] >= bs
    if not full.any():
        return
    np.copyto(hole, -1, where=full)
    search = full & (pages * bs > live)
    if search.any():
        hole[search] = first_free_np(occ, qP[search], col[search] + 1, ncol[search], bs)


def _decode_rows_loop(S, R, rs, occ, win, alive, ring, ntok, heavy, bs, W, budget, track, append, reuse, frees,
                      sparse, compact, leaving, scored, u, z, l, inv_tau, c, Hc, hsig, zw, hsum, eref, ringA, ringcw, hv,
                      cand, thr, evicted, left, need_next, slot_live, slot_pages):
    m_new, n_evicted, n_freed, n_copied, copied, n_compacted, n_left = 0, 0, 0, 0, 0, 0, 0
    buf, top = np.empty(max(Hc, 1)), np.empty(K, np.int64)
    for si in range(S.size):
        s = S[si]
        pos = ntok[s]
        ev_count, need_s, live_s, pages_s, generic = 0, 0, 0, 0, 0
        for r in range(R):
            q, i = s * R + r, si * R + r
            tail, tw, ncol, pages, live, hole, holed, hn = (rs[q, 0], rs[q, 1], rs[q, 2], rs[q, 3], rs[q, 4],
                                                             rs[q, 5], rs[q, 6], rs[q, 7])
            if sparse and holed >= 0 and holed != tail and W >= bs:
                # sparse_copy, one holed page (the steady state): it and the tail are rewritten densely
                hc, t = holed, tail
                oh, ot = occ[q, hc], occ[q, t]
                moved = oh + ot
                dst = -(-moved // bs)
                k = bs - oh if dst == 2 else ot              # tail tokens that move into the holed page
                for j in range(max(k, 0)):
                    ring[q, (pos - ot + j) % W] = hc
                wk = min(k, win[q, t])
                win[q, hc] += wk
                win[q, t] -= wk
                occ[q, hc] = min(moved, bs)
                occ[q, t] = moved - min(moved, bs)
                if dst == 1:
                    alive[q, t] = False
                    if ncol == t + 1:
                        ncol = t
                    tail = hc
                    tw = moved
                else:
                    tw = moved - bs
                pages += dst - 2
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
            if track:
                occ[q, col] += 1
            live += 1
            # the window moves on: the token at pos - W leaves it
            ex, ec = False, col
            if W and track:
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
                if track:
                    if scored:
                        H, g, s_exit, exits, A_e, cw_e, E_e = _scored_exit(
                            q, pos, z[i], l[r], inv_tau[r], c[r], W, Hc, ex, hsig, zw, hsum, eref, ringA, ringcw,
                            hv, cand)
                        ev, hn = _evict_lowest_row(q, hn, Hc, over, exits, H, g, s_exit, ec, A_e, cw_e, E_e,
                                                   heavy, hv, cand, thr, buf, top)
                    else:
                        base = q * Hc
                        take_exit = over and ex and leaving
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
                        if frees:
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
            if compact and pages - -(-live // bs) > 0:
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
            elif sparse and holed >= 0 and holed != tail and W >= bs:  # the next step rewrites two pages
                mv = occ[q, holed] + occ[q, tail]
                d = -(-mv // bs)
                need_s += d + (d * bs - mv < 1)
            elif sparse and holed != -1:
                generic += 1                                 # several holed pages: counted in numpy
            else:
                need_s += tw >= bs or ncol == 0
            live_s += live
            pages_s += pages
        ntok[s] = pos + 1
        evicted[si], left[si] = ev_count, generic
        need_next[s], slot_live[s], slot_pages[s] = need_s, live_s, pages_s
        n_left += generic > 0
    return m_new, n_evicted, n_freed, n_copied, copied, n_compacted, n_left


if njit is not None:
    _scan_free = njit(cache=True, nogil=True)(_scan_free)
    _scored_exit = njit(cache=True, nogil=True)(_scored_exit)
    _evict_lowest_row = njit(cache=True, nogil=True)(_evict_lowest_row)
    prompt_cut = njit(cache=True, nogil=True)(_prompt_cut_loop)
    decode_rows = njit(cache=True, nogil=True)(_decode_rows_loop)
else:
    decode_rows = None          # the numpy path of FastKVManager._step is its twin
    prompt_cut = prompt_cut_np
prompt_cut.__doc__ = """The prompt cut's scoring and top-k (see score_prompt) from the content weights w and decays
d^(L-1-t) [rows, L], per-row l, c, top = d^-(obs-1) and shift = d: the content normalizer and H
after the prompt, the kept positions and their terms, and the window's terms."""
if decode_rows is not None:
    decode_rows.__doc__ = """One whole fast-mode decode step for the rows of the slots in S (R rows each; flat row
q = slot * R + row): per row the write (tail page, first hole or a page opened at column ncol), the
window exit (sparse_copy first rewrites a row's one holed page and its tail), the reuse
strategies' first-free pointer, the eviction (scored: `_scored_exit` and
`_evict_lowest_row` with normal draw z[i]; else the leaving token or the listed entry drawn by u[i])
and the slot strategy's answer to it (an emptied page freed, the first-free pointer, sparse_copy's
holed column) and compaction's common case (the newest token moves into the first hole and its
page is freed), on the row scalars rs [rows, 8] (fast.py's _ROW_FIELDS order) and the slab's
[rows, cols] occupancy arrays. Writes per slot of S its
evicted tokens and the rows it leaves to the caller (sparse_copy rows with several holed pages: their
need; rows to compact otherwise) to evicted / left [len(S)], and per slot s its next token's page
need, live tokens and pages to need_next / slot_live / slot_pages [s]; returns (rows that opened a
page, evicted tokens, pages freed, rows sparse-copied, tokens they copied, rows compacted, slots
with rows left to the caller). Its twin is FastKVManager's numpy step (same state,
tests/test_kv_fast_kernels.py)."""
