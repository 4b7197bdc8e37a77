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

from .budgets import CutBudgets
from .scoring import Heads
from .settings import FastSettings
from .slab import FastSlab, Ledger, note_evicted
from .slots import SlotStrategy


class Recut:
    """Decode-time re-cuts (see the module doc). Reads the settings, the slab, the ledger, the
    budgets (when a re-cut fires, what each row keeps), the slot strategy (how pages answer) and the
    heads' local decay (the listed tokens' scores now; None with noop, which tracks counts only)."""

    def __init__(self, settings: FastSettings, slab: FastSlab, ledger: Ledger, budgets: CutBudgets,
                 slots: SlotStrategy, heads: Heads | None):
        self.cfg, self.slab, self.ledger, self.budgets, self.slots = settings, slab, ledger, budgets, slots
        self.inv_tau = None if heads is None else heads.inv_tau

    def after_decode(self, dec) -> None:
        """After a decode step: re-cut the requests (slot, request) whose trigger fires."""
        for s, req in dec:
            keep = self.budgets.recut_keep(s, int(self.slab.ntok[s]), self.num_listed)
            if keep is None:
                continue
            if self.cfg.tracks_columns:
                self.recut_slot(s, req, keep)
            else:
                self.recut_counts(s, req, keep)

    def num_listed(self, s: int) -> np.ndarray:
        """int [rows]: live tokens outside the window (noop tracks counts only, no lists)."""
        if self.cfg.tracks_columns:
            return self.slab.hn[s].astype(np.int64)
        return np.maximum(self.slab.live[s].astype(np.int64) - min(self.cfg.window, int(self.slab.ntok[s])), 0)

    def recut_counts(self, s: int, req, keep: np.ndarray) -> None:
        """noop's re-cut: counts only (the pages stay whatever goes)."""
        evicted = np.maximum(self.num_listed(s) - keep, 0)
        total = int(evicted.sum())
        if not total:
            return
        self.slab.live[s] -= evicted.astype(np.int32)
        self.ledger.effects.evicted_tokens += total
        note_evicted(req, total, self.cfg.rows)
        self.slab.restat(np.array([s]))

    def listed_scores(self, s: int) -> np.ndarray:
        """float [rows, list_cap]: the closed-form score of each listed token now (-inf past a list)."""
        newest = float(self.slab.ntok[s] - 1)
        decay_now = np.exp((self.slab.eref[s] - newest - 1) * self.inv_tau)
        terms = self.slab.terms[s]
        score = terms[:, :, 0] + terms[:, :, 1] * self.slab.hsum[s][:, None] - terms[:, :, 2] * decay_now[:, None]
        listed = np.arange(terms.shape[1])[None, :] < self.slab.hn[s][:, None]
        return np.where(listed, score, -np.inf)

    def recut_slot(self, s: int, req, keep: np.ndarray) -> None:
        """Row r keeps its keep[r] highest-scored listed tokens (after the policy's sharing)."""
        score = self.listed_scores(s)
        num_listed = self.slab.hn[s].astype(np.int64)
        keep = np.minimum(self.budgets.share(score, keep), num_listed)
        if not (keep < num_listed).any():
            return
        rank = np.empty_like(score, dtype=np.int64)
        np.put_along_axis(rank, np.argsort(-score, axis=1, kind="stable"), np.arange(score.shape[1])[None, :], axis=1)
        evict = (rank >= keep[:, None]) & np.isfinite(score)
        order = np.argsort(evict, axis=1, kind="stable")          # survivors first, in list order
        gone = np.bincount((np.arange(self.cfg.rows)[:, None] * self.slab.occ.shape[2] + self.slab.heavy[s])[evict],
                           minlength=self.cfg.rows * self.slab.occ.shape[2]).reshape(self.cfg.rows, -1)
        self.slab.heavy[s] = np.take_along_axis(self.slab.heavy[s], order, axis=1)
        self.slab.terms[s] = np.take_along_axis(self.slab.terms[s], order[:, :, None], axis=1)
        evicted = evict.sum(axis=1)
        self.slab.hn[s] -= evicted.astype(np.int32)
        self.slab.occ[s] -= gone.astype(np.int32)
        self.slab.live[s] -= evicted.astype(np.int32)
        total = int(evicted.sum())
        self.ledger.effects.evicted_tokens += total
        note_evicted(req, total, self.cfg.rows)
        self.slab.reset_candidates(s)
        self.slots.settle_generic(s, np.arange(self.cfg.rows))
        self.slots.update_need(np.array([s]))
        self.slab.restat(np.array([s]))
