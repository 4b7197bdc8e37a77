"""Fast mode's eviction choice: H2O's closed-form accumulated attention under the importance model
(head sampling, prompt scoring, the heavy-hitter lists) and the uniform / oldest draws."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from ..importance import NUM_SINK, SyntheticImportance
from ..policy import PolicyContext
from .compiled import kernels
from .budgets import CutBudgets
from .compiled.layout import DecodeRows, PromptRows
from .compiled.reference import prompt_terms_np, scored_step_np
from .settings import FastSettings
from .slab import FastSlab


def first_of_run(sorted_keys: np.ndarray) -> np.ndarray:
    """For each element of a sorted array, the index of the first element equal to it
    (np.searchsorted(a, a) in one linear pass)."""
    change = np.ones(sorted_keys.size, bool)
    change[1:] = sorted_keys[1:] != sorted_keys[:-1]
    return np.flatnonzero(change)[np.cumsum(change) - 1]


@dataclass(frozen=True)
class Heads:
    """Attention parameters of the simulated rows (each the middle of its stratum of real rows)."""
    head_type: np.ndarray    # int [rows]
    local: np.ndarray        # local share l
    content: np.ndarray      # content share c = 1 - sink share - local share
    tau: np.ndarray          # local decay
    sigma: np.ndarray        # content concentration
    inv_tau: np.ndarray
    sigma_jitter: float      # per-request jitter of sigma
    obs_window: int          # prefill queries whose attention scores the prompt cut
    strata: np.ndarray       # int [rows, unit]: the real rows each simulated row stands for


def sample_heads(ctx: PolicyContext, importance, seed: int, shape: tuple[int, int], budget_key: np.ndarray | None,
                 obs_window: int) -> Heads:
    """A stratified sample (by budget where rows' budgets differ, then head type, then local decay)
    of the importance model's rows for this seed, i.e. the heads token-level mode scores with;
    shape = (simulated rows, real rows each stands for)."""
    rows, unit = shape
    model = SyntheticImportance(ctx, importance, seed)
    if model.spec.content_correlation > 0:
        warnings.warn(
            f"kv.mode=fast: importance model {model.spec.name!r} has content_correlation "
            f"{model.spec.content_correlation}, which fast mode ignores; its slot-strategy metrics can then "
            f"differ from token level by well over 5% (measured up to +19% fragmentation): compare slot "
            f"strategies with kv.mode=token", UserWarning, stacklevel=2)
    order = np.lexsort((model.tau, model.head_type) + (() if budget_key is None else (budget_key,)))
    pick = order[unit // 2::unit][:rows]
    tau = model.tau[pick]
    return Heads(head_type=model.head_type[pick], local=model.l[pick], content=1.0 - model.s[pick] - model.l[pick],
                 tau=tau, sigma=model.sigma[pick], inv_tau=1.0 / tau, sigma_jitter=model.spec.request_sigma_jitter,
                 obs_window=obs_window, strata=order[:rows * unit].reshape(rows, unit))


class Scorer:
    """Which token each over-budget row evicts (H2O's closed form, or the uniform / oldest draws),
    the prompt's scores and the heavy lists that make a choice O(1) or O(list). Reads the settings,
    the slab, the heads (None when unscored), the run's Generator and the budgets (their sharing)."""

    def __init__(self, settings: FastSettings, slab: FastSlab, heads: Heads | None, rng: np.random.Generator,
                 budgets: CutBudgets):
        self.settings, self.slab, self.heads, self.rng, self.budgets = settings, slab, heads, rng, budgets

    def pick(self, q, over, ex, ec, hn) -> np.ndarray:
        """Column of the token each over-budget row evicts (flat over the step's rows; `hn` is updated
        in place); tokens leaving the window (`ex`, column `ec`) that stay join the row's heavy list.
        The list holds exactly the columns of a row's live non-window tokens (check_invariants
        verifies it), so a drawn entry is always a live token. "oldest" evicts the leaving token,
        "uniform" a uniformly drawn listed one, "young" (H2O) goes through pick_scored."""
        if self.settings.scored:
            return self.pick_scored(q, over, ex, ec, hn)
        slab = self.slab
        Hc = slab.heavy.shape[2]
        heavy_f = slab.heavy_f
        qH = q * Hc
        take_exit = over & ex & self.settings.evict_leaving
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

    def pick_scored(self, q, over, ex, ec, hn) -> np.ndarray:
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
        slab = self.slab
        num_pairs = q.size
        t_new = slab.ntok[q // slab.rows] - 1                  # the newest token = this step's query
        exits = ex if isinstance(ex, np.ndarray) else np.full(num_pairs, ex)
        rows = DecodeRows(q, t_new, self.rng.standard_normal(num_pairs), over, exits, ec)
        return scored_step_np(rows, slab.row_consts, slab.flags, hn, slab.heavy_f, slab.score_arrays)

    def score_prompt(self, s: int, L: int, W: int, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """H2O's prompt cut under the importance model: draw the prompt's content weights, score the
        candidates by the last obs_window prefill queries, share the kept total among rows (the
        policy's cut_sharing), list the kept ones with their score terms (decode evictions need the
        list) and put the window tokens' terms in the ring. Returns the kept positions [rows, most]
        (-1 past a row's keep) and the candidates each row keeps [rows]."""
        slab, h, cfg = self.slab, self.heads, self.settings
        R, bs = cfg.rows, cfg.block_size
        obs = min(h.obs_window, L)
        sig = h.sigma * np.exp(h.sigma_jitter * self.rng.standard_normal(R))
        slab.sigma[s] = sig
        cand = L - W
        z = self.rng.standard_normal((R, L))
        # the two exps per token in numpy (vectorized, faster than a compiled scalar loop), the cut compiled
        weight, decay, top, shift = kernels.prompt_inputs(z, sig, h.tau, obs)
        prompt = PromptRows(weight, decay, h.local, h.content, top, shift)
        if self.budgets.sharing is None:
            keep = np.broadcast_to(np.asarray(keep, np.int64), sig.shape).copy()
        else:
            keep = self.budgets.share(prompt_terms_np(prompt, obs, cand, NUM_SINK)[5], keep)
        cut = kernels.prompt_cut(prompt, obs, cand, keep, NUM_SINK, W)
        slab.norm[s], slab.hsum[s], kept, terms, win_A, win_cw = cut
        if W and cfg.window:
            at = np.arange(L - W, L) % W
            slab.ring_static[s][:, at] = win_A
            slab.ring_content[s][:, at] = win_cw
        if not cfg.prompt_only:
            most = kept.shape[1]
            slab.ensure_list_cap(most + 2)
            slab.heavy[s, :, :most] = np.where(kept >= 0, kept // bs, 0)
            slab.terms[s, :, :most] = terms
            slab.hn[s] = keep
        slab.eref[s] = L - 1
        slab.reset_candidates(s)
        return kept, keep

    def rebuild_heavy(self, s, rows: np.ndarray) -> None:
        """The heavy list of some rows from their per-column non-window counts (column order = age
        order; s: a slot, or one slot per row, all prefilled or none)."""
        slab, cfg = self.slab, self.settings
        if cfg.budget is None or rows.size == 0 or not cfg.tracks_columns:
            return
        width = slab.used_width(s, rows)
        if cfg.scored and np.any(slab.prefilled[s]):        # listed entries may still name old columns
            width = max(width, int(slab.heavy[s, rows].max()) + 1)
        cnt = (np.maximum(slab.occ[s, rows, :width] - slab.win[s, rows, :width], 0)
               * slab.alive[s, rows, :width]).astype(np.int64)
        if cfg.scored and np.any(slab.prefilled[s]):
            self.remap_heavy(s, rows, cnt)
            return
        cap = slab.heavy.shape[2]
        tot = cnt.sum(axis=1)
        if (tot > cap).any():
            raise AssertionError("fast mode: more non-window tokens than the budget allows")
        cols = np.repeat(np.tile(np.arange(cnt.shape[1]), rows.size), cnt.ravel())
        row_of = np.repeat(np.arange(rows.size), tot)
        start = np.cumsum(tot) - tot
        idx = np.arange(cols.size) - start[row_of]
        slab.heavy[np.broadcast_to(s, rows.shape)[row_of], rows[row_of], idx] = cols
        slab.hn[s, rows] = tot

    def remap_heavy(self, s, rows: np.ndarray, cnt: np.ndarray) -> None:
        """Scored lists after tokens moved between columns (compaction, sparse copy): entries keep their
        score terms; an entry stays in its column while the column holds that many non-window tokens,
        the rest take the columns' remaining places in order."""
        slab = self.slab
        k, Hc = rows.size, slab.heavy.shape[2]
        P = cnt.shape[1]
        col = slab.heavy[s, rows].astype(np.int64)
        valid = np.arange(Hc)[None, :] < slab.hn[s, rows][:, None]
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
        slab.heavy[s, rows] = new.reshape(k, Hc)
