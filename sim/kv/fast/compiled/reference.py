"""Numpy twins of fast mode's compiled kernels (sim.kv.fast.compiled.kernels), vectorized over rows.

They run where numba is absent (or KVSIM_NO_NUMBA=1) and are what the kernels are tested against
(tests/test_kv_fast_kernels.py): same state, same decisions, ties to the first entry in both. Each
scored row holds a list of its live non-window tokens: page column, static score part A, content
coefficient CW and local-decay term E (see sim/kv/fast/scoring.py Scorer.pick_scored).
"""
from __future__ import annotations

import numpy as np

from .layout import A, CW, E, REBASE, DecodeRows, ExitScores, PromptRows, RowConsts, ScoreArrays, StepFlags


def scored_step_np(rows: DecodeRows, consts: RowConsts, flags: StepFlags, list_len, heavy, sc: ScoreArrays):
    """One H2O decode step of fast mode's scored rows (the kernel's per-row twin is `_scored_exit` +
    `_evict_lowest_row`): per row i (flat row rows.q[i], query position rows.t_new[i], content draw
    rows.z[i] ~ N(0, 1), head constants consts[i]) the new token's content weight exp(sigma z) updates
    the row's normalizer and H = sum of 1/normalizer; its score terms enter the window ring
    (flags.window > 0) and the token leaving it comes out; then `evict_lowest_np` on the rows' lists
    (flags.list_cap entries each, list_len in place)."""
    q, t_new = rows.q, rows.t_new
    local, inv_tau, content = consts
    window, list_cap = flags.window, flags.list_cap
    m = q.size
    weight = np.exp(sc.sigma[q] * rows.z)
    h_before = sc.hsum[q]
    norm = sc.norm[q] + weight
    sc.norm[q] = norm
    h_now = h_before + 1.0 / norm
    sc.hsum[q] = h_now
    cw_new = content * weight
    a_new = local - cw_new * h_before
    ref = sc.eref[q]
    aged = (t_new - ref) * inv_tau > REBASE
    if aged.any():
        aged_rows, new = q[aged], t_new[aged].astype(np.float64)
        scale = np.exp((ref[aged] - new) * inv_tau[aged])
        sc.terms.reshape(-1, list_cap, 3)[aged_rows, :, E] *= scale[:, None]
        sc.cand[aged_rows, :, 1 + E] *= scale[:, None]
        sc.eref[aged_rows] = new
        ref = ref.copy()
        ref[aged] = new
    decay_now = np.exp((ref - t_new - 1) * inv_tau)
    if window:
        at = q * window + t_new % window
        a_exit, cw_exit = sc.ring_static[at], sc.ring_content[at]
        sc.ring_static[at], sc.ring_content[at] = a_new, cw_new
        pos_exit = t_new - window
    else:                                       # no window: the new token is a candidate at once
        a_exit, cw_exit, pos_exit = a_new, cw_new, t_new
        rows = rows._replace(exits=np.ones(m, bool))
    e_exit = local * np.exp((pos_exit - ref) * inv_tau)
    score_exit = np.where(rows.exits, a_exit + cw_exit * h_now - e_exit * decay_now, np.inf)
    scores = ExitScores(h_now, decay_now, score_exit, np.stack([a_exit, cw_exit, e_exit], axis=1))
    return evict_lowest_np(rows, scores, list_cap, list_len, heavy, sc.terms)


def evict_lowest_np(rows: DecodeRows, scores: ExitScores, list_cap: int, list_len, heavy, terms):
    """Per row i (flat row rows.q[i], list at q[i] * list_cap of length list_len[i], updated in place;
    its tokens' columns in `heavy`, score terms (A, CW, E) in terms [entries, 3]): if rows.over[i],
    evict the candidate with the lowest score — the listed entry minimizing A + CW H[i] - E g[i], or
    the leaving token (rows.exits[i], score scores.score[i], column rows.exit_col[i]) when its score is
    not higher; a leaving token that stays is appended (its column, terms scores.terms[i]); the evicted
    entry's place takes the list's last entry. Returns the evicted column per row (exit_col for rows
    not over budget: unused). Scans every row's whole list (the kernel's candidates are its own
    bookkeeping)."""
    q, over, exits, exit_col = rows.q, rows.over, rows.exits, rows.exit_col
    h_now, decay_now, score_exit, exit_terms = scores
    list_at = q * list_cap
    m = q.size
    longest = int(list_len.max()) if m else 0
    if longest:
        entry_at = list_at[:, None] + np.arange(longest)
        v = terms[entry_at]
        score = v[..., A] + v[..., CW] * h_now[:, None] - v[..., E] * decay_now[:, None]
        score[np.arange(longest)[None, :] >= list_len[:, None]] = np.inf
        lowest = np.argmin(score, axis=1)
        score_min = score[np.arange(m), lowest]
    else:
        lowest, score_min = np.zeros(m, np.int64), np.full(m, np.inf)
    take_exit = over & exits & (score_exit <= score_min)
    add = exits & ~take_exit
    if add.any():
        add_at = (list_at + list_len)[add]
        heavy[add_at] = exit_col[add]
        terms[add_at] = exit_terms[add]
        list_len += add
    draw = over & ~take_exit
    drawn_at = list_at + lowest
    col = heavy[drawn_at]
    if draw.any():
        src_at, dst_at = (list_at + list_len - 1)[draw], drawn_at[draw]    # the last entry fills the place
        heavy[dst_at] = heavy[src_at]
        terms[dst_at] = terms[src_at]
        list_len -= draw
    return np.where(take_exit, exit_col, col)


def first_free_np(occ, first_page, start, stop, block_size):
    """First column in [start, stop) of each flat row (page ids first_page = row * cols of occ [rows,
    cols]) holding 0 < occ < block_size tokens: a page with a free slot (callers guarantee one in the
    range; the kernel's per-row twin is `_scan_free`)."""
    cols = occ.shape[1]
    lo, hi = int(start.min()), int(stop.max())
    shifted = occ[first_page // cols, lo:hi] - 1
    return lo + (shifted.view(np.uint32) < block_size - 1).argmax(axis=1)


def advance_first_free_np(occ, first_page, col, hole, pages, live, ncol, block_size):
    """Reuse strategies after each row i wrote a token at column col[i]: if that filled the page, move
    the row's first-free pointer hole[i] on (to -1 when the row has no free slot: pages * bs <= live)."""
    at = first_page + col
    full = occ.reshape(-1)[at] >= block_size
    if not full.any():
        return
    np.copyto(hole, -1, where=full)
    search = full & (pages * block_size > live)
    if search.any():
        hole[search] = first_free_np(occ, first_page[search], col[search] + 1, ncol[search], block_size)


def prompt_terms_np(p: PromptRows, obs: int, cand: int, num_sink: int):
    """H2O's prompt scoring per row: the content normalizer and H after the prompt [rows], each
    position's static part A, content coefficient CW and local term E [rows, L], and the scores of
    the first `cand` positions after the last observation query [rows, cand] (sinks: inf)."""
    weight, decay = p.weight, p.decay
    rows, length = weight.shape
    norm = np.cumsum(weight, axis=1)
    q0 = length - obs
    h_obs = np.cumsum(1.0 / norm[:, q0:], axis=1)              # H(q), q = q0 .. L-1
    h_prev = np.zeros((rows, length))                           # H(a0 - 1), a0 = max(t, q0)
    h_prev[:, q0 + 1:] = h_obs[:, :-1]
    local, content, top, shift = p.local[:, None], p.content[:, None], p.top[:, None], p.shift[:, None]
    cw = content * weight
    static = local * np.minimum(decay * top, 1.0) - cw * h_prev
    static[:, :num_sink] = np.inf
    local_term = local * decay
    score = static[:, :cand] + cw[:, :cand] * h_obs[:, -1:] - local_term[:, :cand] * shift
    return norm[:, -1], h_obs[:, -1], static, cw, local_term, score


def top_positions(score: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """int [rows, max(keep)]: per row the keep[row] highest-scored positions (ties to the lower
    position) in position order, padded with -1."""
    rows, cand = score.shape
    most = int(keep.max()) if rows else 0
    rank = np.empty((rows, cand), np.int64)
    np.put_along_axis(rank, np.argsort(-score, axis=1, kind="stable"), np.arange(cand)[None, :], axis=1)
    take = rank < keep[:, None]
    kept = np.full((rows, most), -1, np.int64)
    row, pos = np.nonzero(take)
    kept[row, (np.cumsum(take, axis=1) - 1)[take]] = pos
    return kept


def prompt_cut_np(p: PromptRows, obs: int, cand: int, keep, num_sink: int, window: int):
    """numpy twin of `kernels.prompt_cut`: H2O's prompt scores and each row's top keep[row]
    (kept positions and their terms padded with -1 / 0 past a row's keep)."""
    length = p.weight.shape[1]
    norm, h_obs, static, cw, local_term, score = prompt_terms_np(p, obs, cand, num_sink)
    keep = np.minimum(keep, cand)
    kept = top_positions(score, keep)
    at = np.maximum(kept, 0)
    kept_terms = np.stack([np.take_along_axis(x, at, axis=1) for x in (static, cw, local_term)], axis=2)
    kept_terms[kept < 0] = 0.0
    return norm, h_obs, kept, kept_terms, static[:, length - window:], cw[:, length - window:]
