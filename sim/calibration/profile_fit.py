"""Fit a hardware profile (cost-model efficiency factors and overheads) to measured step times.

The cost model (`sim/model/cost_model.py`) predicts a step as a sum of terms, each linear in one
unknown (an inverse efficiency 1/eff or an overhead in seconds), except the two roofline max()es.
With the active branch of each max fixed per step, time = A @ x is linear; we solve a weighted
non-negative least-squares problem (rows weighted by 1/measured, so the relative error is what is
minimized and small decode steps count as much as long prefills), re-pick the branches under the
new factors, and repeat until they stop changing. Efficiencies are kept in (0, 1] (x >= 1) and
overheads >= 0 by solving for x - lower_bound >= 0.

Factors whose features are zero in every step (no swap, tp=1 all-reduce, no copies) cannot be
identified from the data: they keep the base profile's value and are listed as `not fitted`.

Without the padded-attention counts (`kv_tokens_padded`, `attn_pairs_prefill_padded`; see
`step_logs`) the two padding factors are not identifiable and stay unfitted.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from kvsim.sim.calibration.errors import CalibrationError
from kvsim.sim.model.cost_model import FACTOR_OF_FEATURE, FEATURE_NAMES, CostModel, HardwareProfile, load_profile
from kvsim.sim.crosscheck.comparison import fit_errors, shape_of_steps, step_kind

FACTORS: tuple[str, ...] = tuple(dict.fromkeys(f for f, _ in FACTOR_OF_FEATURE.values()))
EFFICIENCY_FACTORS = frozenset(f for f, how in FACTOR_OF_FEATURE.values() if how == "div")


# ---- solver -----------------------------------------------------------------------------------
def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set). Columns are rescaled inside."""
    m, n = a.shape
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    max_iter = max_iter or 3 * n + 30
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0)) * float(np.abs(b).max(initial=0))) * m
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        candidates = ~passive & (w > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15 * max(1.0, float(np.abs(x).max()))
            x[~passive] = 0.0
    return x / scale


# ---- fit --------------------------------------------------------------------------------------
@dataclass
class FitReport:
    profile: HardwareProfile
    iterations: int
    converged: bool
    fitted: list[str]                  # factors identified from the data
    not_fitted: list[str]              # kept at the base profile's value (feature always 0)
    at_bound: list[str]                # efficiencies clamped at 1 (faster than the catalog peak)
    errors: dict[str, dict[str, float]]   # per step kind (+ "all"): count, mape, median_ape, p90_ape, bias
    branches: dict[str, float] = field(default_factory=dict)   # share of steps on the compute side

    def table(self) -> str:
        lines = [f"{'kind':<8} {'steps':>6} {'MAPE':>7} {'median':>7} {'p90':>7} {'bias':>7}"]
        for kind, e in self.errors.items():
            lines.append(f"{kind:<8} {e['count']:>6d} {e['mape']:>6.1%} {e['median_ape']:>6.1%} "
                         f"{e['p90_ape']:>6.1%} {e['bias']:>+6.1%}")
        return "\n".join(lines)


def _unknown_columns(features: np.ndarray, compute_linear: np.ndarray, compute_attn: np.ndarray) -> np.ndarray:
    """Design matrix [steps, len(FACTORS)]: each feature goes to its factor's column unless its
    max() branch is inactive in that step."""
    idx = {name: i for i, name in enumerate(FEATURE_NAMES)}
    cols = np.zeros((features.shape[0], len(FACTORS)))
    keep = {
        "linear_compute_prefill": compute_linear, "linear_compute_decode": compute_linear,
        "linear_memory": ~compute_linear, "attn_compute": compute_attn, "attn_memory": ~compute_attn,
    }
    for name, (factor, _) in FACTOR_OF_FEATURE.items():
        f = features[:, idx[name]]
        if name in keep:
            f = np.where(keep[name], f, 0.0)
        cols[:, FACTORS.index(factor)] += f
    return cols


def _x_of_profile(p: HardwareProfile) -> np.ndarray:
    return np.array([1.0 / getattr(p, f) if f in EFFICIENCY_FACTORS else getattr(p, f) for f in FACTORS])


def _profile_of_x(base: HardwareProfile, x: np.ndarray, **extra) -> HardwareProfile:
    values = {f: (1.0 / v if f in EFFICIENCY_FACTORS else v) for f, v in zip(FACTORS, x.tolist())}
    return base.model_copy(update={**values, **extra})


DECODE_BATCH_MIN_STEPS = 10     # decode steps of one batch size needed for its decode_batch_factors entry
DECODE_BATCH_ROUNDS = 4


@dataclass(frozen=True)
class FitOptions:
    """How `fit_profile` fits and names a profile (`kvsim calibrate`'s --name, --trim, --decode-batch-factors)."""
    name: str = "fitted"                 # the fitted profile's name
    description: str = ""                # its description ("": the base profile's)
    max_iter: int = 25                   # most rounds of re-picking the roofline branches per fit
    trim: float = 0.0                    # share of steps with the largest residual left out of the refit
    decode_batch_factors: bool = False   # also fit the per-batch-size decode table


def fit_profile(steps: pd.DataFrame, model: str, gpu: str, *, base_profile: str | HardwareProfile = "default",
                tp: int = 1, options: FitOptions = FitOptions()) -> FitReport:
    """Fit the profile's factors to `steps` (a step log with measured duration_s), as `options` says.

    `options.trim`: after a first fit, drop this share of the steps with the largest relative residual
    (timing outliers: page faults, other processes) and refit; errors are reported on all steps.
    `options.decode_batch_factors`: also fit the per-batch-size decode table: alternately, each batch size's
    factor is the median measured / predicted of its pure-decode steps (sizes with at least
    DECODE_BATCH_MIN_STEPS steps), and the factors are refitted on the times divided by it.
    """
    # the step-log fit is of the plain roofline: an operator-fitted base keeps only its scalar factors
    base = load_profile(base_profile).model_copy(update={"decode_batch_factors": {}, "gemm_efficiency": None})
    report = _fit_factors(steps, model, gpu, base, tp, options)
    if not options.decode_batch_factors:
        return report
    steps = steps[steps["duration_s"] > 0].reset_index(drop=True)
    shape, y = shape_of_steps(steps), steps["duration_s"].to_numpy(dtype=np.float64)
    pure_decode = (steps["prefill_tokens"].to_numpy() == 0) & (steps["decode_tokens"].to_numpy() > 0)
    batch = steps["batch_size"].to_numpy()
    table: dict[int, float] = {}
    for _ in range(DECODE_BATCH_ROUNDS):
        ratio = y / np.atleast_1d(CostModel(model, gpu, report.profile, tp=tp).predict(shape))
        table = {int(b): round(float(np.median(ratio[pure_decode & (batch == b)])), 5)
                 for b in np.unique(batch[pure_decode]) if np.sum(pure_decode & (batch == b)) >= DECODE_BATCH_MIN_STEPS}
        if not table:
            return report
        # fit on the times the table would explain away (the factors divide pure-decode steps only)
        k = CostModel(model, gpu, base.model_copy(update={"decode_batch_factors": table}), tp=tp) \
            .decode_batch_factor(shape.num_seqs, shape.num_prefill_tokens)
        report = _fit_factors(steps.assign(duration_s=y / k), model, gpu, base, tp, options)
    profile = report.profile.model_copy(update={"decode_batch_factors": table})
    pred = np.atleast_1d(CostModel(model, gpu, profile, tp=tp).predict(shape))
    return replace(report, profile=profile, errors=fit_errors(y, pred, step_kind(steps)))


def _fit_factors(steps: pd.DataFrame, model, gpu, base: HardwareProfile, tp: int, options: FitOptions) -> FitReport:
    steps = steps[steps["duration_s"] > 0].reset_index(drop=True)
    if len(steps) < len(FACTORS):
        raise CalibrationError(f"need at least {len(FACTORS)} steps with a positive duration_s, got {len(steps)}")
    fit = _AlternatingFit(steps, CostModel(model, gpu, base, tp=tp), base, tp, options.max_iter)
    profile, iterations, converged = fit.alternate(np.arange(len(fit.y)), base)
    if options.trim > 0:
        ape = np.abs(fit.predict(profile) - fit.y) / fit.y
        keep = ape <= np.quantile(ape, 1 - options.trim)
        profile, it2, converged = fit.alternate(np.flatnonzero(keep), profile)
        iterations += it2
    profile = profile.model_copy(update={"name": options.name, "description": options.description or base.description})
    return fit.report(profile, iterations, converged, step_kind(steps))


class _AlternatingFit:
    """The factors of one step log: with each step's roofline branches fixed, a weighted NNLS on the
    relative error; then the branches re-picked under the new factors, until they stop changing."""

    def __init__(self, steps: pd.DataFrame, cost: CostModel, base: HardwareProfile, tp: int, max_iter: int):
        self.cost, self.base, self.tp, self.max_iter = cost, base, tp, max_iter
        self.shape = shape_of_steps(steps)
        self.features = cost.feature_matrix(self.shape)
        self.y = steps["duration_s"].to_numpy(dtype=np.float64)
        for column, feature in (("kv_tokens_padded", "attn_padded"),
                                ("attn_pairs_prefill_padded", "attn_prefill_padded")):
            if column not in steps.columns:      # no padded counts logged: the factor is not identifiable
                self.features[:, FEATURE_NAMES.index(feature)] = 0.0
        self.present = np.array([any(np.any(self.features[:, FEATURE_NAMES.index(n)] > 0)
                                     for n, (f, _) in FACTOR_OF_FEATURE.items() if f == factor) for factor in FACTORS])
        self.lower = np.array([1.0 if f in EFFICIENCY_FACTORS else 0.0 for f in FACTORS])

    def cost_with(self, profile: HardwareProfile) -> CostModel:
        return CostModel(self.cost.model, self.cost.gpu, profile, tp=self.tp)

    def predict(self, profile: HardwareProfile) -> np.ndarray:
        return np.atleast_1d(self.cost_with(profile).predict(self.shape))

    def design(self, profile: HardwareProfile) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The design matrix under `profile`'s roofline branches, and those branches per step (linear
        layers compute-bound, attention compute-bound)."""
        branch = self.cost_with(profile).active_branches(self.shape)
        cl = np.atleast_1d(branch["linear_compute_bound"])
        ca = np.atleast_1d(branch["attn_compute_bound"])
        return _unknown_columns(self.features, cl, ca), cl, ca

    def solve(self, rows: np.ndarray, x_prev: np.ndarray, profile: HardwareProfile):
        a, cl, ca = self.design(profile)
        fixed = ~self.present | ~np.any(a[rows] > 0, axis=0)   # unidentifiable in this branch assignment
        x0 = np.where(fixed, x_prev, self.lower)
        w = 1.0 / self.y[rows]
        rhs = (self.y[rows] - a[rows] @ x0) * w
        free = ~fixed
        x = x0.copy()
        x[free] = self.lower[free] + nnls(a[rows][:, free] * w[:, None], rhs)
        return x, (cl, ca)

    def loss(self, profile: HardwareProfile, rows: np.ndarray) -> float:
        pred = self.predict(profile)
        return float(np.sum(((pred[rows] - self.y[rows]) / self.y[rows]) ** 2))

    def alternate(self, rows: np.ndarray, start: HardwareProfile):
        """(best profile seen, iterations, whether the branches settled) fitting the steps `rows`."""
        profile, x = start, _x_of_profile(start)
        best = (self.loss(profile, rows), profile)
        seen = None
        for it in range(1, self.max_iter + 1):
            x, branches = self.solve(rows, x, profile)
            profile = _profile_of_x(self.base, x)
            cur = self.loss(profile, rows)
            if cur < best[0]:
                best = (cur, profile)
            key = tuple(b.tobytes() for b in branches)
            if key == seen:
                return best[1], it, True
            seen = key
        return best[1], self.max_iter, False

    def report(self, profile: HardwareProfile, iterations: int, converged: bool, kinds: np.ndarray) -> FitReport:
        """Which factors the steps identify under `profile`'s branches, and its errors on every step."""
        a_any, cl, ca = self.design(profile)
        identified = np.any(a_any > 0, axis=0)
        fitted = [f for f, ok in zip(FACTORS, identified) if ok]
        not_fitted = [f for f, ok in zip(FACTORS, identified) if not ok]
        x = _x_of_profile(profile)
        at_bound = [f for f, v in zip(FACTORS, x) if f in EFFICIENCY_FACTORS and f in fitted and v <= 1.0 + 1e-12]
        errors = fit_errors(self.y, self.predict(profile), kinds)
        return FitReport(profile=profile, iterations=iterations, converged=converged, fitted=fitted,
                         not_fitted=not_fitted, at_bound=at_bound, errors=errors,
                         branches={"linear_compute": float(np.mean(cl)), "attn_compute": float(np.mean(ca))})


def profile_meta(report: FitReport, *, model: str, gpu: str, sources: list[str], command: str | None = None,
                 extra: dict | None = None) -> dict:
    """What goes into the written profile's `meta`: provenance and the fit quality."""
    meta = {
        "fitted_on": {"model": model, "gpu": gpu, "step_logs": sources},
        "fit_errors": {k: {kk: (round(vv, 5) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                       for k, v in report.errors.items()},
        "fitted": report.fitted, "not_fitted": report.not_fitted, "at_bound": report.at_bound,
        "iterations": report.iterations, "converged": report.converged,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    if command:
        meta["command"] = command
    meta.update(extra or {})
    return meta
