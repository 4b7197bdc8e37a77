"""Fast mode's decode-time re-cuts (SnapKV family `decode_compression`: `every_n`, and `over_budget`
with a compression rate or per-row budgets): the prompt cut's selection again during decode.

Between re-cuts the decode kernel evicts nothing but keeps, per row, the list of its non-window live
tokens with their closed-form score terms (its budget is a sentinel no row reaches). A re-cut fires
after a request's decode step — `every_n`: every `recut_interval`-th decode step since its prompt
cut; `over_budget`: when a row holds more than its budget + window — and then each row keeps the
budget of the current length (`cut_budgets(T)`, per stratum, shared as at the prompt cut) of its
listed tokens, the highest-scored (score = A + CW H - E g, as H2O's); the rest are evicted and the
slot strategy answers as after the prompt cut.
"""
from __future__ import annotations

import numpy as np

BUDGET_SENTINEL = 1 << 30      # the decode kernel's budget when re-cuts do the evicting


class RecutMixin:
    """FastKVManager's decode-time re-cuts (see the module doc)."""

    def _init_recut(self, profile) -> None:
        self.recut = profile.recut
        self.recut_interval = int(profile.recut_interval)
        if self.recut not in (None, "every_n", "over_budget"):
            raise ValueError(f"fast mode: unknown recut {self.recut!r}")

    def _ensure_list_cap(self, entries: int) -> None:
        """Heavy lists hold at least `entries` per row (the kernel writes unchecked)."""
        if entries > self._list_cap:
            self._list_cap = max(entries, 2 * self._list_cap)
            self._grow()

    def _recut_step(self, dec) -> None:
        """After a decode step: re-cut the requests (slot, request) whose trigger fires."""
        for s, req in dec:
            num_tokens = int(self.ntok[s])
            if self.recut == "every_n" and (num_tokens - self._cut_len[s]) % self.recut_interval:
                continue
            keep = self._row_keep(num_tokens, self.window)
            if self.recut == "over_budget" and not (self._num_listed(s) > keep).any():
                continue
            if self.tracks_columns:
                self._recut_slot(s, req, keep)
            else:
                self._recut_counts(s, req, keep)

    def _num_listed(self, s: int) -> np.ndarray:
        """int [rows]: live tokens outside the window (noop tracks counts only, no lists)."""
        if self.tracks_columns:
            return self.hn[s].astype(np.int64)
        return np.maximum(self.live[s].astype(np.int64) - min(self.window, int(self.ntok[s])), 0)

    def _recut_counts(self, s: int, req, keep: np.ndarray) -> None:
        """noop's re-cut: counts only (the pages stay whatever goes)."""
        evicted = np.maximum(self._num_listed(s) - keep, 0)
        total = int(evicted.sum())
        if not total:
            return
        self.live[s] -= evicted.astype(np.int32)
        self.plan.evicted_tokens += total
        self._note_evicted(req, total)
        self._restat(np.array([s]))

    def _listed_scores(self, s: int) -> np.ndarray:
        """float [rows, list_cap]: the closed-form score of each listed token now (-inf past a list)."""
        newest = float(self.ntok[s] - 1)
        decay_now = np.exp((self.eref[s] - newest - 1) * self._inv_tau)
        terms = self.terms[s]
        score = terms[:, :, 0] + terms[:, :, 1] * self.hsum[s][:, None] - terms[:, :, 2] * decay_now[:, None]
        listed = np.arange(terms.shape[1])[None, :] < self.hn[s][:, None]
        return np.where(listed, score, -np.inf)

    def _recut_slot(self, s: int, req, keep: np.ndarray) -> None:
        """Row r keeps its keep[r] highest-scored listed tokens (after the policy's sharing)."""
        score = self._listed_scores(s)
        num_listed = self.hn[s].astype(np.int64)
        keep = np.minimum(self._share(score, keep), num_listed)
        if not (keep < num_listed).any():
            return
        rank = np.empty_like(score, dtype=np.int64)
        np.put_along_axis(rank, np.argsort(-score, axis=1, kind="stable"), np.arange(score.shape[1])[None, :], axis=1)
        evict = (rank >= keep[:, None]) & np.isfinite(score)
        order = np.argsort(evict, axis=1, kind="stable")          # survivors first, in list order
        gone = np.bincount((np.arange(self.rows)[:, None] * self.occ.shape[2] + self.heavy[s])[evict],
                           minlength=self.rows * self.occ.shape[2]).reshape(self.rows, -1)
        self.heavy[s] = np.take_along_axis(self.heavy[s], order, axis=1)
        self.terms[s] = np.take_along_axis(self.terms[s], order[:, :, None], axis=1)
        evicted = evict.sum(axis=1)
        self.hn[s] -= evicted.astype(np.int32)
        self.occ[s] -= gone.astype(np.int32)
        self.live[s] -= evicted.astype(np.int32)
        total = int(evicted.sum())
        self.plan.evicted_tokens += total
        self._note_evicted(req, total)
        self._reset_candidates(s)
        self._settle_generic(s, np.arange(self.rows))
        self._update_need(np.array([s]))
        self._restat(np.array([s]))
