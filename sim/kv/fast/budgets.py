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

import numpy as np


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


class CutBudgetMixin:
    """FastKVManager's per-row prompt-cut budgets (see the module doc)."""

    def _init_cut_budgets(self, profile) -> None:
        self._cut_budgets = profile.cut_budgets
        self.cut_sharing = profile.cut_sharing
        self.share_floor = float(profile.floor)
        if self.cut_sharing not in (None, "layer", "blocks"):
            raise ValueError(f"fast mode: unknown cut_sharing {self.cut_sharing!r}")

    def _budget_order_key(self) -> np.ndarray | None:
        """Real rows' budgets for a long prompt (the strata follow them when they differ per row)."""
        if self._cut_budgets is None:
            return None
        key = np.asarray(self._cut_budgets(1 << 20, self.ctx))
        return key if (key != key[0]).any() else None

    def _row_keep(self, num_tokens: int, window: int) -> np.ndarray:
        """int [rows]: candidates (tokens before the window) each simulated row keeps before sharing."""
        cand = num_tokens - window
        if self._cut_budgets is None:
            keep = cand if self.cut_budget is None or num_tokens <= self.cut_budget else self.cut_budget - window
            return np.full(self.rows, keep, np.int64)
        real = np.asarray(self._cut_budgets(num_tokens, self.ctx), dtype=np.int64)
        return np.minimum(stratum_budgets(real, self._strata), cand)

    def _share(self, score: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """The policy's sharing of the kept total among rows, from the candidates' scores [rows, cand]."""
        if self.cut_sharing == "layer":
            return share_by_layer(score, keep, self.share_floor)
        if self.cut_sharing == "blocks":
            return share_by_blocks(score, keep, self.block_size)
        return keep
