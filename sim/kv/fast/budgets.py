"""Fast mode's per-row prompt-cut budgets: how many candidates each simulated row keeps at the cut.

A policy's profile gives them as a uniform `budget`, or as `cut_budgets(num_tokens, ctx)`: the
tokens each real row (layer x KV head) keeps outside the protected window (SnapKV with a
compression rate, PyramidKV's per-layer schedule, KV-Compress's target). A simulated row stands
for `unit` real rows (its stratum): it keeps their mean, rounded by largest remainder so the
simulated rows keep exactly the real rows' total / unit. `cut_sharing` then redistributes that
total among the simulated rows by the importance model's prompt scores, as the policy does among
real rows:

- "layer" (Ada-KV): each row first keeps its top floor x budget candidates, the rest of the total
  goes to the best remaining (row, token) pairs over all simulated rows jointly (token level: over
  the KV heads of each layer; the simulated rows are a stratified sample of all heads);
- "blocks" (KV-Compress): each row's candidates, sorted by score, are cut into groups of
  block_size; the groups with the smallest largest score go first, over all rows, until the
  evicted token-rows reach the excess over the target (rounded up to whole groups).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..policy import FastModeProfile, PolicyContext
from .settings import FastSettings


def stratum_budgets(real_budgets: np.ndarray, strata: np.ndarray) -> np.ndarray:
    """int [strata]: each stratum's mean budget (strata [rows, unit] of real row ids), rounded by
    largest remainder so the result sums to the real total / unit (rounded down)."""
    unit = strata.shape[1]
    sums = real_budgets[strata].sum(axis=1).astype(np.int64)
    out = sums // unit
    rest = int(sums.sum() // unit - out.sum())
    if rest > 0:
        out[np.argsort(-(sums % unit), kind="stable")[:rest]] += 1
    return out


def share_by_layer(score: np.ndarray, keep: np.ndarray, floor: float) -> np.ndarray:
    """Ada-KV's sharing: int [rows] candidates kept per row, summing to keep.sum(), from the
    candidates' scores [rows, cand]: each row's top int(floor x its keep), then the best of the
    rest jointly (ties to the lower row, then position)."""
    rows, cand = score.shape
    guaranteed = np.minimum((floor * keep).astype(np.int64), cand)
    left = int(min(keep.sum(), rows * cand) - guaranteed.sum())
    if left <= 0 or cand == 0:
        return guaranteed
    ranked = -np.sort(-score, axis=1, kind="stable")                    # each row's scores, highest first
    rest = np.where(np.arange(cand)[None, :] >= guaranteed[:, None], ranked, -np.inf)
    chosen = np.argsort(-rest.ravel(), kind="stable")[:left]
    return guaranteed + np.bincount(chosen // cand, minlength=rows)


def share_by_blocks(score: np.ndarray, keep: np.ndarray, block_size: int) -> np.ndarray:
    """KV-Compress's sharing: int [rows] candidates kept per row after evicting ceil(excess /
    block_size) groups of block_size lowest-scored candidates, chosen over all rows by their
    largest score (excess = candidates - keep.sum())."""
    rows, cand = score.shape
    excess = rows * cand - int(keep.sum())
    groups = cand // block_size
    if excess <= 0 or groups == 0:
        return np.full(rows, cand, np.int64)
    ranked = np.sort(score, axis=1, kind="stable")
    group_key = ranked[:, block_size - 1:groups * block_size:block_size]    # [rows, groups]
    chosen = np.argsort(group_key.ravel(), kind="stable")[:min(-(-excess // block_size), rows * groups)]
    return cand - block_size * np.bincount(chosen // groups, minlength=rows)


def budget_order_key(cut_budgets, ctx) -> np.ndarray | None:
    """Real rows' budgets for a long prompt, when they differ per row (the strata follow them)."""
    if cut_budgets is None:
        return None
    key = np.asarray(cut_budgets(1 << 20, ctx))
    return key if (key != key[0]).any() else None


class CutBudgets:
    """How many candidates each simulated row keeps at a cut (the prompt cut and the decode-time
    re-cuts, see recut.py), and when a re-cut fires. Reads the profile's `cut_budgets`,
    `cut_sharing` and `floor`, the context `cut_budgets` takes, the strata (real rows of each
    simulated row) and the settings' rows, cut budget, window, block size and re-cut trigger."""

    def __init__(self, settings: FastSettings, profile: FastModeProfile, ctx: PolicyContext, strata: np.ndarray):
        self.settings, self.ctx, self.strata = settings, ctx, strata
        self.real_budgets = profile.cut_budgets        # (tokens, ctx) -> int [real rows], or None
        self.sharing = profile.cut_sharing
        self.floor = float(profile.floor)
        self.cut_len: dict[int, int] = {}              # slot -> tokens at its prompt cut (re-cut intervals)

    def row_keep(self, num_tokens: int, window: int) -> np.ndarray:
        """int [rows]: candidates (tokens before the window) each simulated row keeps before sharing."""
        cand = num_tokens - window
        if self.real_budgets is None:
            cut_budget = self.settings.cut_budget
            keep = cand if cut_budget is None or num_tokens <= cut_budget else cut_budget - window
            return np.full(self.settings.rows, keep, np.int64)
        real = np.asarray(self.real_budgets(num_tokens, self.ctx), dtype=np.int64)
        return np.minimum(stratum_budgets(real, self.strata), cand)

    def share(self, score: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """The policy's sharing of the kept total among rows, from the candidates' scores [rows, cand]."""
        if self.sharing == "layer":
            return share_by_layer(score, keep, self.floor)
        if self.sharing == "blocks":
            return share_by_blocks(score, keep, self.settings.block_size)
        return keep

    def recut_keep(self, s: int, num_tokens: int, num_listed: Callable[[int], np.ndarray]) -> np.ndarray | None:
        """After slot s's decode step: each row's keep when its re-cut fires, else None
        (`num_listed(s)`: its rows' live tokens outside the window, asked only for over_budget)."""
        cfg = self.settings
        if cfg.recut == "every_n" and (num_tokens - self.cut_len[s]) % cfg.recut_interval:
            return None
        keep = self.row_keep(num_tokens, cfg.window)
        if cfg.recut == "over_budget" and not (num_listed(s) > keep).any():
            return None
        return keep
