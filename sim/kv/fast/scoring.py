"""Fast mode's eviction choice: H2O's closed-form accumulated attention under the importance model
(head sampling, prompt scoring, the heavy-hitter lists) and the uniform / oldest draws."""
from __future__ import annotations

import warnings

import numpy as np

from ..importance import NUM_SINK, SyntheticImportance
from . import kernels
from .reference import prompt_terms_np, scored_step_np


def first_of_run(sorted_keys: np.ndarray) -> np.ndarray:
    """For each element of a sorted array, the index of the first element equal to it
    (np.searchsorted(a, a) in one linear pass)."""
    change = np.ones(sorted_keys.size, bool)
    change[1:] = sorted_keys[1:] != sorted_keys[:-1]
    return np.flatnonzero(change)[np.cumsum(change) - 1]


class ScoringMixin:
    """Which token each over-budget row evicts, and the heavy lists that make it O(1) or O(list)."""

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
        budget_key = self._budget_order_key()          # rows with different budgets: strata by budget first
        order = np.lexsort((model.tau, model.head_type) + (() if budget_key is None else (budget_key,)))
        self._strata = order[:self.rows * self.unit].reshape(self.rows, self.unit)
        pick = order[self.unit // 2::self.unit][:self.rows]
        self.head_type = model.head_type[pick]
        self.h_local = model.l[pick]
        self.h_content = 1.0 - model.s[pick] - model.l[pick]
        self.h_tau = model.tau[pick]
        self.h_sigma = model.sigma[pick]
        self._inv_tau = 1.0 / self.h_tau
        self.sigma_jitter = model.spec.request_sigma_jitter
        self.obs_window = obs_window

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
        E g with g = d^(t_q + 1 - eref): the list scan (kernels._evict_lowest_row) needs no exp.
        eref moves to the newest token (E rescaled) before d^(t_q - eref) could overflow."""
        num_pairs = q.size
        local, inv_tau, content = self._row_consts
        t_new = self.ntok[q // self.rows] - 1                  # the newest token = this step's query
        exits = ex if isinstance(ex, np.ndarray) else np.full(num_pairs, ex)
        return scored_step_np(q, t_new, self.rng.standard_normal(num_pairs), local, inv_tau, content, self.window,
                              self.heavy.shape[2], over, exits, ec, hn, self._heavy_f, self._score_arrays)

    def _reset_candidates(self, s: int) -> None:
        self.cand[s, :, :, 0] = -1
        self.thr[s] = -np.inf                    # the first eviction scans the whole list

    def _score_prompt(self, s: int, L: int, W: int, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """H2O's prompt cut under the importance model: draw the prompt's content weights, score the
        candidates by the last obs_window prefill queries, share the kept total among rows (the
        policy's cut_sharing), list the kept ones with their score terms (decode evictions need the
        list) and put the window tokens' terms in the ring. Returns the kept positions [rows, most]
        (-1 past a row's keep) and the candidates each row keeps [rows]."""
        R, bs = self.rows, self.block_size
        obs = min(self.obs_window, L)
        sig = self.h_sigma * np.exp(self.sigma_jitter * self.rng.standard_normal(R))
        self.sigma[s] = sig
        cand = L - W
        z = self.rng.standard_normal((R, L))
        if self.cut_sharing is None:
            cut = kernels.score_prompt(z, sig, self.h_local, self.h_tau, self.h_content, obs, cand, keep, NUM_SINK, W)
        else:
            weight, decay, top, shift = kernels.prompt_inputs(z, sig, self.h_tau, obs)
            score = prompt_terms_np(weight, decay, self.h_local, self.h_content, top, shift, obs, cand, NUM_SINK)[5]
            keep = self._share(score, keep)
            cut = kernels.prompt_cut(weight, decay, self.h_local, self.h_content, top, shift, obs, cand, keep,
                                     NUM_SINK, W)
        self.norm[s], self.hsum[s], kept, terms, win_A, win_cw = cut
        if W and self.window:
            at = np.arange(L - W, L) % W
            self.ring_static[s][:, at] = win_A
            self.ring_content[s][:, at] = win_cw
        if not self.prompt_only:
            most = kept.shape[1]
            self._ensure_list_cap(most + 2)
            self.heavy[s, :, :most] = np.where(kept >= 0, kept // bs, 0)
            self.terms[s, :, :most] = terms
            self.hn[s] = keep
        self.eref[s] = L - 1
        self._reset_candidates(s)
        return kept, keep

    def _rebuild_heavy(self, s, rows: np.ndarray) -> None:
        """The heavy list of some rows from their per-column non-window counts (column order = age
        order; s: a slot, or one slot per row, all prefilled or none)."""
        if self.budget is None or rows.size == 0 or not self.tracks_columns:
            return
        width = self._used_width(s, rows)
        if self.scored and np.any(self.prefilled[s]):        # listed entries may still name old columns
            width = max(width, int(self.heavy[s, rows].max()) + 1)
        cnt = (np.maximum(self.occ[s, rows, :width] - self.win[s, rows, :width], 0)
               * self.alive[s, rows, :width]).astype(np.int64)
        if self.scored and np.any(self.prefilled[s]):
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
        self.heavy[np.broadcast_to(s, rows.shape)[row_of], rows[row_of], idx] = cols
        self.hn[s, rows] = tot

    def _remap_heavy(self, s, rows: np.ndarray, cnt: np.ndarray) -> None:
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
        rank[order] = np.arange(key.size) - first_of_run(sk)
        stays = valid.ravel() & (rank < np.append(cnt.ravel(), 0)[key])
        cap = cnt.ravel() - np.bincount(key[stays], minlength=k * P)[:k * P]
        moved = np.flatnonzero(valid.ravel() & ~stays)
        new = col.ravel()
        new[moved] = np.repeat(np.arange(k * P), cap) % P
        self.heavy[s, rows] = new.reshape(k, Hc)
