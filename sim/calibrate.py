"""Fit a hardware profile (cost-model efficiency factors and overheads) to measured step times.

The cost model (`sim/cost_model.py`) predicts a step as a sum of terms, each linear in one
unknown (an inverse efficiency 1/eff or an overhead in seconds), except the two roofline max()es.
With the active branch of each max fixed per step, time = A @ x is linear; we solve a weighted
non-negative least-squares problem (rows weighted by 1/measured, so the relative error is what is
minimized and small decode steps count as much as long prefills), re-pick the branches under the
new factors, and repeat until they stop changing. Efficiencies are kept in (0, 1] (x >= 1) and
overheads >= 0 by solving for x - lower_bound >= 0.

Factors whose features are zero in every step (no swap, tp=1 all-reduce, no copies) cannot be
identified from the data: they keep the base profile's value and are listed as `not fitted`.

The padded-attention counts (`kv_tokens_padded`, `attn_pairs_prefill_padded`: each step's widest
block table) are not in the engine's step log; for a replay directory `load_step_logs` recomputes
them by simulating the replay in recorded mode (same config, workload, decisions and measured
times, hence the same batches and block tables; checked step by step). A bare steps.parquet without
them leaves the two padding factors unfitted.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from .core.step import BatchShape
from .cost_model import FACTOR_OF_FEATURE, FEATURE_NAMES, CostModel, HardwareProfile, load_profile

# Step-log columns the fit reads (-> BatchShape field); optional ones default to 0 when absent.
REQUIRED_COLUMNS = ("duration_s", "batch_size", "prefill_tokens", "decode_tokens", "kv_tokens_read")
OPTIONAL_COLUMNS = ("attn_pairs_prefill", "bytes_moved", "swap_bytes", "block_table_entries", "kv_tokens_padded",
                    "attn_pairs_prefill_padded")
# BatchShape fields the engine's step log does not carry: for a replay directory they are recomputed
# by simulating the replay in recorded mode, which schedules the very same batches.
SHAPE_COLUMNS = ("kv_tokens_padded", "attn_pairs_prefill_padded")
FACTORS: tuple[str, ...] = tuple(dict.fromkeys(f for f, _ in FACTOR_OF_FEATURE.values()))
EFFICIENCY_FACTORS = frozenset(f for f, how in FACTOR_OF_FEATURE.values() if how == "div")
STEP_KINDS = ("prefill", "decode", "mixed")


class CalibrationError(ValueError):
    """Unusable step log or fit input; the message names the file and column."""


# ---- input ------------------------------------------------------------------------------------
def load_step_logs(paths: list[str | Path], *, recompute_shapes: bool = True) -> pd.DataFrame:
    """Concatenate step logs (Parquet) into one table with a `source` column; checks the columns.

    A replay directory whose step log lacks `kv_tokens_padded` (the engine does not log it) gets it
    recomputed by simulating the replay in recorded mode (`crosscheck.replay_shape_columns`), unless
    `recompute_shapes` is False; a bare steps.parquet then prices it as kv_tokens_read.

    An entry `DIR1,DIR2,...` names repeated replays of one workload: their step logs must schedule the
    same batches with the same memory state (checked step by step), and each step's `duration_s` is the
    median over them (`repeats` and `duration_spread` columns: N and (slowest - fastest) / median)."""
    if not paths:
        raise CalibrationError("no step logs given")
    frames = []
    for p in paths:
        group = [q for q in str(p).split(",") if q]
        if len(group) > 1:
            frames.append(_median_of_repeats(group, recompute_shapes))
        else:
            frames.append(_load_one(p, recompute_shapes))
    return pd.concat(frames, ignore_index=True)


def _step_log_path(p: str | Path) -> Path:
    path = Path(p)
    if path.is_dir():
        path = path / "steps.parquet"
    if not path.is_file():
        raise CalibrationError(f"{p}: no such step log (expected a steps.parquet file or a run directory)")
    return path


def _read_step_log(path: Path) -> pd.DataFrame:
    try:
        df = pd.read_parquet(path)
    except Exception as exc:   # pyarrow raises several types for non-Parquet input
        raise CalibrationError(f"{path}: not a readable Parquet step log ({exc})") from None
    check_step_columns(df, str(path))
    return df


def _with_shapes(df: pd.DataFrame, path: Path, recompute_shapes: bool) -> pd.DataFrame:
    if recompute_shapes and not set(SHAPE_COLUMNS) <= set(df.columns) and (path.parent / "config.yaml").is_file():
        from .crosscheck import CrosscheckError, replay_shape_columns, with_shape_columns
        try:
            df = with_shape_columns(df, replay_shape_columns(path.parent), str(path))
        except CrosscheckError as exc:
            raise CalibrationError(str(exc)) from None
    return df


def _load_one(p: str | Path, recompute_shapes: bool) -> pd.DataFrame:
    path = _step_log_path(p)
    return _with_shapes(_read_step_log(path), path, recompute_shapes).assign(source=str(path))


def _median_of_repeats(group: list[str], recompute_shapes: bool) -> pd.DataFrame:
    from .crosscheck import first_divergence
    paths = [_step_log_path(q) for q in group]
    logs = [_read_step_log(path) for path in paths]
    for path, df in zip(paths[1:], logs[1:]):
        same = first_divergence(logs[0], df)
        if not same["identical"]:
            f = same["first_divergence"]
            raise CalibrationError(f"{path}: not a repeat of {paths[0]}: it schedules differently from step "
                                   f"{f['step']} on ({f['column']}: {f['real']} vs {f['sim']})")
    durations = np.stack([df["duration_s"].to_numpy(dtype=np.float64) for df in logs])
    median = np.median(durations, axis=0)
    first = _with_shapes(logs[0], paths[0], recompute_shapes)
    return first.assign(duration_s=median, repeats=len(logs),
                        duration_spread=(durations.max(axis=0) - durations.min(axis=0)) / median,
                        source=",".join(str(q) for q in paths))


def check_step_columns(df: pd.DataFrame, where: str) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise CalibrationError(f"{where}: step log lacks column(s) {missing}; expected the kvsim step-log "
                               f"schema (sim/metrics.py STEP_COLUMNS)")
    if len(df) and not np.isfinite(df["duration_s"].to_numpy(dtype=float)).all():
        raise CalibrationError(f"{where}: column duration_s has NaN/inf values (a simulated log has no "
                               f"measured times; calibrate needs a replay step log)")


def shape_of_steps(df: pd.DataFrame) -> BatchShape:
    """The cost model's input for every row of a step log."""
    def col(name: str) -> np.ndarray:
        if name in df.columns:
            return df[name].to_numpy(dtype=np.float64)
        return np.zeros(len(df))
    padded = None
    if "kv_tokens_padded" in df.columns:      # NaN (not known for that step): priced as kv_tokens_read
        padded = df["kv_tokens_padded"].to_numpy(dtype=np.float64)
        padded = np.where(np.isnan(padded), col("kv_tokens_read"), padded)
    pairs_padded = None
    if "attn_pairs_prefill_padded" in df.columns:
        pairs_padded = df["attn_pairs_prefill_padded"].to_numpy(dtype=np.float64)
        pairs_padded = np.where(np.isnan(pairs_padded), col("attn_pairs_prefill"), pairs_padded)
    return BatchShape(num_seqs=col("batch_size"), num_prefill_tokens=col("prefill_tokens"),
                      num_decode_tokens=col("decode_tokens"), attn_pairs_prefill=col("attn_pairs_prefill"),
                      kv_tokens_read=col("kv_tokens_read"), bytes_moved=col("bytes_moved"),
                      swap_bytes=col("swap_bytes"), block_table_entries=col("block_table_entries"),
                      kv_tokens_padded=padded, attn_pairs_prefill_padded=pairs_padded)


def step_kind(df: pd.DataFrame) -> np.ndarray:
    """'prefill' (only prompt tokens), 'decode' (only decode tokens) or 'mixed', per row."""
    p = df["prefill_tokens"].to_numpy() > 0
    d = df["decode_tokens"].to_numpy() > 0
    return np.where(p & d, "mixed", np.where(p, "prefill", "decode"))


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


def fit_errors(measured: np.ndarray, predicted: np.ndarray, kinds: np.ndarray) -> dict[str, dict[str, float]]:
    """Relative error of predictions per step kind and overall."""
    out = {}
    for kind in (*STEP_KINDS, "all"):
        m = np.ones(len(measured), bool) if kind == "all" else kinds == kind
        if not m.any():
            continue
        rel = (predicted[m] - measured[m]) / measured[m]
        ape = np.abs(rel)
        out[kind] = {"count": int(m.sum()), "mape": float(ape.mean()), "median_ape": float(np.median(ape)),
                     "p90_ape": float(np.percentile(ape, 90)), "bias": float(np.median(rel))}
    return out


DECODE_BATCH_MIN_STEPS = 10     # decode steps of one batch size needed for its decode_batch_factors entry
DECODE_BATCH_ROUNDS = 4


def fit_profile(steps: pd.DataFrame, model: str, gpu: str, *, base_profile: str | HardwareProfile = "default",
                tp: int = 1, name: str = "fitted", description: str = "", max_iter: int = 25,
                trim: float = 0.0, decode_batch_factors: bool = False) -> FitReport:
    """Fit the profile's factors to `steps` (a step log with measured duration_s).

    `trim`: after a first fit, drop this share of the steps with the largest relative residual
    (timing outliers: page faults, other processes) and refit; errors are reported on all steps.
    `decode_batch_factors`: also fit the per-batch-size decode table: alternately, each batch size's
    factor is the median measured / predicted of its pure-decode steps (sizes with at least
    DECODE_BATCH_MIN_STEPS steps), and the factors are refitted on the times divided by it.
    """
    base = load_profile(base_profile).model_copy(update={"decode_batch_factors": {}})
    report = _fit_factors(steps, model, gpu, base, tp, name, description, max_iter, trim)
    if not decode_batch_factors:
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
        report = _fit_factors(steps.assign(duration_s=y / k), model, gpu, base, tp, name, description, max_iter, trim)
    profile = report.profile.model_copy(update={"decode_batch_factors": table})
    pred = np.atleast_1d(CostModel(model, gpu, profile, tp=tp).predict(shape))
    return replace(report, profile=profile, errors=fit_errors(y, pred, step_kind(steps)))


def _fit_factors(steps: pd.DataFrame, model, gpu, base: HardwareProfile, tp: int, name: str, description: str,
                 max_iter: int, trim: float) -> FitReport:
    steps = steps[steps["duration_s"] > 0].reset_index(drop=True)
    if len(steps) < len(FACTORS):
        raise CalibrationError(f"need at least {len(FACTORS)} steps with a positive duration_s, got {len(steps)}")
    cost = CostModel(model, gpu, base, tp=tp)
    shape = shape_of_steps(steps)
    features = cost.feature_matrix(shape)
    y = steps["duration_s"].to_numpy(dtype=np.float64)
    kinds = step_kind(steps)
    for column, feature in (("kv_tokens_padded", "attn_padded"), ("attn_pairs_prefill_padded", "attn_prefill_padded")):
        if column not in steps.columns:      # no padded counts logged: the factor is not identifiable
            features[:, FEATURE_NAMES.index(feature)] = 0.0
    present = np.array([any(np.any(features[:, FEATURE_NAMES.index(n)] > 0)
                            for n, (f, _) in FACTOR_OF_FEATURE.items() if f == factor) for factor in FACTORS])
    lower = np.array([1.0 if f in EFFICIENCY_FACTORS else 0.0 for f in FACTORS])

    def solve(rows: np.ndarray, x_prev: np.ndarray, profile: HardwareProfile):
        branch = cost_with(profile).active_branches(shape)
        cl = np.atleast_1d(branch["linear_compute_bound"])
        ca = np.atleast_1d(branch["attn_compute_bound"])
        a = _unknown_columns(features, cl, ca)
        fixed = ~present | ~np.any(a[rows] > 0, axis=0)   # unidentifiable in this branch assignment
        x0 = np.where(fixed, x_prev, lower)
        w = 1.0 / y[rows]
        rhs = (y[rows] - a[rows] @ x0) * w
        free = ~fixed
        x = x0.copy()
        x[free] = lower[free] + nnls(a[rows][:, free] * w[:, None], rhs)
        return x, (cl, ca)

    def cost_with(profile: HardwareProfile) -> CostModel:
        return CostModel(cost.model, cost.gpu, profile, tp=tp)

    def loss(profile: HardwareProfile, rows: np.ndarray) -> float:
        pred = np.atleast_1d(cost_with(profile).predict(shape))
        return float(np.sum(((pred[rows] - y[rows]) / y[rows]) ** 2))

    def alternate(rows: np.ndarray, start: HardwareProfile):
        profile, x = start, _x_of_profile(start)
        best = (loss(profile, rows), profile)
        seen = None
        for it in range(1, max_iter + 1):
            x, branches = solve(rows, x, profile)
            profile = _profile_of_x(base, x)
            cur = loss(profile, rows)
            if cur < best[0]:
                best = (cur, profile)
            key = tuple(b.tobytes() for b in branches)
            if key == seen:
                return best[1], it, True
            seen = key
        return best[1], max_iter, False

    rows = np.arange(len(y))
    profile, iterations, converged = alternate(rows, base)
    if trim > 0:
        pred = np.atleast_1d(cost_with(profile).predict(shape))
        ape = np.abs(pred - y) / y
        keep = ape <= np.quantile(ape, 1 - trim)
        profile, it2, converged = alternate(np.flatnonzero(keep), profile)
        iterations += it2
    pred = np.atleast_1d(cost_with(profile).predict(shape))
    branch = cost_with(profile).active_branches(shape)
    x = _x_of_profile(profile)
    a_any = _unknown_columns(features, np.atleast_1d(branch["linear_compute_bound"]),
                             np.atleast_1d(branch["attn_compute_bound"]))
    identified = np.any(a_any > 0, axis=0)
    fitted = [f for f, ok in zip(FACTORS, identified) if ok]
    not_fitted = [f for f, ok in zip(FACTORS, identified) if not ok]
    at_bound = [f for f, v in zip(FACTORS, x) if f in EFFICIENCY_FACTORS and f in fitted and v <= 1.0 + 1e-12]
    errors = fit_errors(y, pred, kinds)
    profile = profile.model_copy(update={"name": name, "description": description or base.description})
    return FitReport(profile=profile, iterations=iterations, converged=converged, fitted=fitted,
                     not_fitted=not_fitted, at_bound=at_bound, errors=errors,
                     branches={"linear_compute": float(np.mean(branch["linear_compute_bound"])),
                               "attn_compute": float(np.mean(branch["attn_compute_bound"]))})


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


def calibration_profile(report: FitReport, path: str | Path, meta: dict) -> Path:
    """Write the fitted profile (YAML) with its provenance."""
    return report.profile.model_copy(update={"meta": meta}).to_yaml(path)


# ---- importance model -------------------------------------------------------------------------
ATTENTION_COLUMNS = ("request_id", "layer", "head", "num_keys", "keys_95", "sink_share", "recent_share")
RECENT_WINDOW = 64     # recent_share is the mass on the last 64 tokens (RECORDED FORMAT)


def load_attention_stats(path: str | Path) -> pd.DataFrame:
    """attention_stats.parquet (RECORDED FORMAT in sim/kv/importance.py), or a replay directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "attention_stats.parquet"
    if not p.is_file():
        raise CalibrationError(f"{path}: no attention statistics (expected attention_stats.parquet or a replay "
                               f"directory holding it)")
    df = pd.read_parquet(p)
    missing = [c for c in ATTENTION_COLUMNS if c not in df.columns]
    if missing:
        raise CalibrationError(f"{p}: lacks column(s) {missing}; expected {list(ATTENTION_COLUMNS)}")
    if not len(df):
        raise CalibrationError(f"{p}: no rows")
    bad = df[(df["keys_95"] < 1) | (df["keys_95"] > df["num_keys"])]
    if len(bad):
        raise CalibrationError(f"{p}: row {int(bad.index[0])}: keys_95 must lie in 1..num_keys")
    return df


@dataclass
class ImportanceFit:
    spec: dict                         # the YAML mapping ImportanceModelSpec.load reads
    measured: dict[str, float]         # summary statistics of the measured heads
    synthetic: dict[str, float]        # the same statistics of the fitted model
    correlation: "CorrelationFit | None" = None   # content correlation fitted to recorded evictions

    def table(self) -> str:
        lines = [f"{'statistic':<26} {'measured':>9} {'fitted':>9}"]
        for k, v in self.measured.items():
            lines.append(f"{k:<26} {v:>9.3f} {self.synthetic.get(k, float('nan')):>9.3f}")
        if self.correlation is not None:
            lines += ["", self.correlation.table()]
        return "\n".join(lines)

    def with_correlation(self, fit: "CorrelationFit") -> "ImportanceFit":
        spec = {k: v for k, v in self.spec.items() if k not in ("content_correlation", "correlation_length")}
        if fit.content_correlation > 0:
            spec["content_correlation"] = round(fit.content_correlation, 4)
            spec["correlation_length"] = round(fit.correlation_length, 4)
        return ImportanceFit(spec=spec, measured=self.measured, synthetic=self.synthetic, correlation=fit)

    def write(self, path: str | Path, *, command: str | None = None, source: str | None = None) -> Path:
        import yaml
        head = ["# Synthetic per-head attention model (sim/kv/importance.py) fitted by `kvsim calibrate --attention`"]
        if source:
            head.append(f"# to {source}")
        if command:
            head.append(f"# regenerate: {command}")
        head.append("# measured vs fitted: " + ", ".join(f"{k} {self.measured[k]:.3g}/{self.synthetic[k]:.3g}"
                                                       for k in self.measured))
        if self.correlation is not None:
            c = self.correlation
            head.append(f"# content correlation fitted to the evictions recorded in {', '.join(map(str, c.sources))}: "
                        f"blocks freed by eviction {c.measured.blocks_freed}/{c.synthetic.blocks_freed} "
                        f"(uncorrelated {c.uncorrelated.blocks_freed}), prefill-cut mean evicted run "
                        f"{c.measured.mean_run:.3g}/{c.synthetic.mean_run:.3g} (uncorrelated {c.uncorrelated.mean_run:.3g})")
        path = Path(path)
        path.write_text("\n".join(head) + "\n" + yaml.safe_dump(self.spec, sort_keys=False, default_flow_style=None))
        return path


def _head_summary(stats: pd.DataFrame) -> dict[str, float]:
    frac = stats["keys_95"] / stats["num_keys"]
    per_head = stats.assign(log_k=np.log(stats["keys_95"])).groupby(["layer", "head"])["log_k"]
    out = {"keys95_p10": float(np.percentile(stats["keys_95"], 10)),
           "keys95_median": float(np.median(stats["keys_95"])),
           "keys95_p90": float(np.percentile(stats["keys_95"], 90)),
           "keys95_frac_median": float(np.median(frac)),
           "sink_share_median": float(stats["sink_share"].median()),
           "recent_share_median": float(stats["recent_share"].median())}
    if stats["request_id"].nunique() > 1:
        out["request_log_keys95_std"] = float(per_head.std().median())
    return out


def _classify_heads(heads: pd.DataFrame) -> np.ndarray:
    """Head type per (layer, head) from its mean statistics, in HEAD_TYPES terms."""
    frac = heads["keys_95"] / heads["num_keys"]
    return np.where(frac >= 0.4, "spread", np.where(heads["sink_share"] >= 0.5, "sink",
                    np.where(heads["recent_share"] >= 0.5, "local", "heavy")))


def fit_importance(stats: pd.DataFrame, *, name: str = "fitted", seed: int = 0, iterations: int = 8,
                   base: str = "smollm2-135m") -> ImportanceFit:
    """Fit SyntheticImportance parameters to measured per-head attention statistics.

    Structure from the data directly: dense leading layers (95% mass needs more than twice the
    typical share of keys), head-type mix (spread / sink / local / heavy by the heads' mean
    shares), per-type sink and local share ranges (p10..p90 of the heads of that type).
    Then by simulation (bisection, the synthetic model's own statistics): each type's content
    concentration sigma to match the type's median keys_95, and the per-request jitter to match
    how much keys_95 of one head varies across requests.
    """
    from .kv.importance import HEAD_TYPES, ImportanceModelSpec, SyntheticImportance, attention_stats
    from .kv.policy import PolicyContext

    base_spec = ImportanceModelSpec.load(base)
    layers, kv_heads = int(stats["layer"].max()) + 1, int(stats["head"].max()) + 1
    num_tokens = int(np.median(stats["num_keys"]))
    heads = stats.groupby(["layer", "head"], as_index=False)[["num_keys", "keys_95", "sink_share",
                                                               "recent_share"]].mean()
    layer_frac = (heads["keys_95"] / heads["num_keys"]).groupby(heads["layer"]).mean().to_numpy()
    dense = 0
    while dense < layers - 1 and layer_frac[dense] > 2 * np.median(layer_frac):
        dense += 1
    sparse = heads[heads["layer"] >= dense].reset_index(drop=True)
    kinds = _classify_heads(sparse)
    mix = {t: round(float(np.mean(kinds == t)), 4) for t in HEAD_TYPES}
    mix[max(mix, key=mix.get)] += round(1.0 - sum(mix.values()), 6)
    types = {}
    for t in HEAD_TYPES:
        bp = base_spec.types[t]
        h = sparse[kinds == t]
        if len(h) < 2:      # too few heads of this type to fit: keep the base model's ranges
            types[t] = {"sink_share": [float(v) for v in bp.sink_share], "local_share": [float(v) for v in bp.local_share],
                        "tau": [float(v) for v in bp.tau], "sigma": [float(v) for v in bp.sigma]}
            continue
        s = np.clip(np.percentile(h["sink_share"], [10, 90]), 0.0, 0.95)
        n = h["num_keys"].to_numpy()
        content = (1 - h["sink_share"].to_numpy()) * RECENT_WINDOW / n
        l_est = np.clip((h["recent_share"].to_numpy() - content) / (1 - RECENT_WINDOW / n), 0.0, 1.0)
        l = np.percentile(l_est, [10, 90])
        l = np.minimum(l, 0.98 - s[1])
        types[t] = {"sink_share": [round(float(s[0]), 4), round(float(max(s[1], s[0])), 4)],
                    "local_share": [round(float(l[0]), 4), round(float(max(l[1], l[0])), 4)],
                    "tau": [float(v) for v in bp.tau], "sigma": [float(v) for v in bp.sigma]}
    spec = {"name": name, "dense_layers": dense, "request_sigma_jitter": base_spec.request_sigma_jitter,
            "sink_weights": [round(float(w), 4) for w in base_spec.sink_weights], "head_mix": mix, "head_types": types}
    ctx = PolicyContext("per_head", layers, kv_heads, kv_heads, 16, layers * kv_heads)
    num_requests = int(min(max(stats["request_id"].nunique(), 2), 4))

    def simulate(spec_dict: dict) -> tuple[pd.DataFrame, np.ndarray]:
        sp = _spec_from_dict(spec_dict)
        st = attention_stats(ctx, sp, num_tokens=num_tokens, num_requests=num_requests, seed=seed)
        head_type = np.asarray(HEAD_TYPES)[SyntheticImportance(ctx, sp, seed).head_type]
        rows = ctx.rows
        df = pd.DataFrame({"request_id": np.repeat(np.arange(num_requests), rows),
                           "layer": st["layer"], "head": np.tile(ctx.row_head, num_requests),
                           "num_keys": num_tokens, "keys_95": st["keys_95"], "sink_share": st["sink_share"],
                           "recent_share": st["recent_share"]})
        return df, np.tile(head_type, num_requests)

    # sigma per type: keys_95 falls as sigma grows; bisect log(sigma) per type, all types at once
    target = {t: float(np.median(sparse.loc[kinds == t, "keys_95"])) for t in HEAD_TYPES if (kinds == t).sum() >= 2}
    lo = {t: np.log(0.2) for t in target}
    hi = {t: np.log(8.0) for t in target}
    for _ in range(iterations):
        for t in target:
            mid = np.exp((lo[t] + hi[t]) / 2)
            width = (types[t]["sigma"][1] - types[t]["sigma"][0]) / 2
            types[t]["sigma"] = [round(float(max(mid - width, 0.05)), 4), round(float(mid + width), 4)]
        df, head_type = simulate(spec)
        for t in target:
            got = float(np.median(df.loc[(head_type == t) & (df["layer"] >= dense), "keys_95"])) \
                if ((head_type == t) & (df["layer"] >= dense)).any() else target[t]
            mid = (lo[t] + hi[t]) / 2
            if got > target[t]:
                lo[t] = mid       # too spread: concentrate more
            else:
                hi[t] = mid
    measured = _head_summary(stats)
    if "request_log_keys95_std" in measured:
        lo_j, hi_j = 0.0, 1.0
        for _ in range(max(iterations - 2, 3)):
            spec["request_sigma_jitter"] = round((lo_j + hi_j) / 2, 4)
            got = _head_summary(simulate(spec)[0])["request_log_keys95_std"]
            if got < measured["request_log_keys95_std"]:
                lo_j = spec["request_sigma_jitter"]
            else:
                hi_j = spec["request_sigma_jitter"]
    synthetic = _head_summary(simulate(spec)[0])
    return ImportanceFit(spec=spec, measured=measured, synthetic=synthetic)


def _spec_from_dict(d: dict):
    import tempfile
    import yaml
    from .kv.importance import ImportanceModelSpec
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(d, f)
    try:
        return ImportanceModelSpec.load(f.name)
    finally:
        os.unlink(f.name)


# ---- content correlation: how clustered the real model's evictions are ----------------------------
# SyntheticImportance's content weights may be positionally correlated (content_correlation rho,
# correlation_length ell; see sim/kv/importance.py). The per-head attention statistics cannot see that
# (keys_95 and the shares are blind to where the heavy keys sit), but a score-driven eviction policy's
# recorded decisions can: H2O on real attention evicts runs of neighbouring tokens and empties whole
# pages. The fit simulates each recorded replay (its own config.yaml and workload, kv.importance = the
# candidate model) in token-level mode and compares two statistics of the evictions with the replay's:
#   - the mean run length of the prefill cuts' evicted positions (evicted tokens / maximal runs of
#     consecutive evicted positions, pooled over requests): how far the correlation reaches;
#   - the blocks freed by eviction (whole pages emptied, summed over all steps): what the memory
#     metrics and the padded-attention cost depend on.
# The loss is the sum of the two squared log ratios; (rho, ell) is the best point of a grid, refined
# once around it. Budgets that evict most of the prompt and budgets that keep most of it respond
# differently to rho and ell, so give replays at several budgets.
CORRELATION_GRID = ((0.0, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9), (2.0, 4.0, 8.0, 16.0, 32.0, 64.0))


@dataclass
class EvictionClustering:
    evicted_tokens: int                 # all evictions (token x row)
    blocks_freed: int                   # blocks freed by eviction (step log)
    prefill_evicted: int                # tokens evicted by the prefill cuts
    prefill_runs: int                   # maximal runs of consecutive evicted positions in those cuts

    @property
    def mean_run(self) -> float:
        return self.prefill_evicted / max(self.prefill_runs, 1)

    def __add__(self, other: "EvictionClustering") -> "EvictionClustering":
        return EvictionClustering(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, int, int, int]:
        return self.evicted_tokens, self.blocks_freed, self.prefill_evicted, self.prefill_runs


def prefill_cut_runs(decisions: pd.DataFrame) -> tuple[int, int]:
    """(evicted positions, maximal runs of consecutive positions) over the prefill cuts (step -1, the
    policy's own trigger) in a decisions table (RECORDED FORMAT), per request, event, layer and head."""
    cut = decisions[(decisions["step"] == -1) & (decisions["action"] == "evict")]
    if "reason" in cut.columns:
        cut = cut[cut["reason"] == "policy"]
    if not len(cut):
        return 0, 0
    keys = [c for c in ("request_id", "event", "layer", "head") if c in cut.columns]
    cut = cut.sort_values([*keys, "position"], kind="stable")
    same = np.ones(len(cut), dtype=bool)
    for k in keys:
        v = cut[k].to_numpy()
        same[1:] &= v[1:] == v[:-1]
    pos = cut["position"].to_numpy()
    starts = ~same
    starts[0] = True
    starts[1:] |= np.diff(pos) != 1
    return len(cut), int(starts.sum())


def _eviction_replay(replay_dir: str | Path):
    """(config, steps, decisions) of a replay whose policy evicts by attention scores."""
    from .config import ConfigError, load_config
    d = Path(replay_dir)
    for f in ("config.yaml", "steps.parquet", "requests.parquet", "decisions.parquet"):
        if not (d / f).is_file():
            raise CalibrationError(f"{d}: missing {f} (expected a `kvsim replay` directory of a score-driven "
                                   f"eviction policy, e.g. kv.policy=h2o)")
    try:
        cfg = load_config(d / "config.yaml")
    except ConfigError as exc:
        raise CalibrationError(f"{d / 'config.yaml'}: {exc}") from None
    from .kv.build import policy_params
    from .kv.policy import get_policy
    policy = get_policy(cfg.kv.policy, **policy_params(cfg.kv))
    if not (policy.evicts and policy.needs_scores) or cfg.kv.mode != "token":
        raise CalibrationError(f"{d / 'config.yaml'}: kv.policy={cfg.kv.policy} (mode {cfg.kv.mode}); the content "
                               f"correlation fit needs a token-level replay of a score-driven eviction policy "
                               f"(h2o, snapkv, ...)")
    return cfg, pd.read_parquet(d / "steps.parquet"), pd.read_parquet(d / "decisions.parquet")


def _clustering(steps: pd.DataFrame, decisions: pd.DataFrame) -> EvictionClustering:
    evicted, runs = prefill_cut_runs(decisions)
    return EvictionClustering(int(steps["evicted_tokens"].sum()), int(steps["blocks_freed_by_eviction"].sum()),
                              evicted, runs)


def recorded_clustering(replay_dir: str | Path) -> EvictionClustering:
    """The eviction statistics of a real replay (its step log and decisions.parquet)."""
    _, steps, decisions = _eviction_replay(replay_dir)
    return _clustering(steps, decisions)


def simulated_clustering(replay_dir: str | Path, importance: str | Path) -> EvictionClustering:
    """The same statistics of the simulator on the replay's config and workload, token-level, with the
    synthetic importance model `importance` (name or YAML)."""
    from .crosscheck import Run, trace_of_replay
    cfg, _, _ = _eviction_replay(replay_dir)
    cfg = cfg.model_copy(update={"kv": cfg.kv.model_copy(update={"importance": str(importance)})})
    return _clustering(*simulate_evictions(cfg, trace_of_replay(Run.load(replay_dir, "real").requests)))


def simulate_evictions(cfg, trace, out_dir: str | Path | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Simulate `trace` under `cfg`; (step log, every eviction applied as a decisions table: request_id,
    event, step (-1 = the prefill cut), layer, head (row indices; -1 in the shared layout), position,
    action, num_tokens). With `out_dir`, the run's outputs and decisions.parquet are written there."""
    from . import simulate as sim_mod
    tables = []

    def record(kv, executor):
        finish, ctx = kv.finish_step, kv.ctx

        def finish_step(scheduled):
            plan = finish(scheduled)
            for rid, rows, positions, decode_steps, num_tokens in plan.decisions:
                per_head = ctx.layout == "per_head"
                tables.append(pd.DataFrame({
                    "request_id": np.int64(rid), "step": np.int32(decode_steps if decode_steps > 0 else -1),
                    "layer": (ctx.row_layer[rows] if per_head else np.full(rows.size, -1)).astype(np.int16),
                    "head": (ctx.row_head[rows] if per_head else np.full(rows.size, -1)).astype(np.int16),
                    "position": positions.astype(np.int64), "action": "evict", "num_tokens": np.int64(num_tokens),
                    "event": np.int64(len(tables))}))
            return plan
        kv.finish_step = finish_step
        return kv, executor

    res = sim_mod.run_simulation(cfg, out_dir, trace=trace, wrap_kv=record)
    columns = ["request_id", "step", "layer", "head", "position", "action", "num_tokens", "event"]
    decisions = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=columns)
    if out_dir is not None:
        decisions.to_parquet(Path(out_dir) / "decisions.parquet", index=False)
    steps = res.steps if res.steps is not None else pd.read_parquet(Path(out_dir) / "steps.parquet")
    return steps, decisions


def clustering_loss(sim: EvictionClustering, real: EvictionClustering) -> float:
    """Squared log ratios of the mean prefill-cut run length and the blocks freed by eviction (+1 each)."""
    return float(np.log((sim.mean_run + 1) / (real.mean_run + 1)) ** 2
                 + np.log((sim.blocks_freed + 1) / (real.blocks_freed + 1)) ** 2)


@dataclass
class CorrelationFit:
    content_correlation: float
    correlation_length: float
    measured: EvictionClustering
    synthetic: EvictionClustering
    uncorrelated: EvictionClustering        # the model without correlation, for comparison
    grid: pd.DataFrame                      # every point tried: rho, ell, statistics, loss
    sources: list[str] = field(default_factory=list)

    def table(self) -> str:
        lines = [f"{'eviction statistic':<28} {'measured':>9} {'rho=0':>9} {'fitted':>9}"]
        for label, attr in (("evicted tokens", "evicted_tokens"), ("blocks freed by eviction", "blocks_freed"),
                            ("prefill-cut mean run", "mean_run")):
            lines.append(f"{label:<28} {getattr(self.measured, attr):>9.4g} {getattr(self.uncorrelated, attr):>9.4g} "
                         f"{getattr(self.synthetic, attr):>9.4g}")
        lines.append(f"fitted content_correlation {self.content_correlation:g}, correlation_length "
                     f"{self.correlation_length:g} tokens ({len(self.grid)} grid points)")
        return "\n".join(lines)


def fit_content_correlation(replay_dirs: list[str | Path], spec: dict, *,
                            rhos: tuple[float, ...] = CORRELATION_GRID[0],
                            lengths: tuple[float, ...] = CORRELATION_GRID[1], refine: bool = True) -> CorrelationFit:
    """Fit `spec`'s content_correlation and correlation_length (see the section comment above) to the
    evictions recorded in `replay_dirs`. `spec` is an importance YAML mapping; it is not modified."""
    import tempfile
    import yaml
    from .kv.importance import MAX_CORRELATION_LENGTH
    if not replay_dirs:
        raise CalibrationError("no replay directories with recorded evictions given")
    measured = sum((recorded_clustering(d) for d in replay_dirs[1:]), recorded_clustering(replay_dirs[0]))
    if measured.prefill_evicted == 0:
        raise CalibrationError(f"{', '.join(map(str, replay_dirs))}: no prefill-cut evictions recorded (budget above "
                               f"every prompt?); the content correlation cannot be fitted from them")
    rows, seen = [], {}

    def evaluate(rho: float, ell: float) -> EvictionClustering:
        key = (round(float(rho), 4), round(float(ell), 4) if rho > 0 else 0.0)
        if key not in seen:
            d = {k: v for k, v in spec.items() if k not in ("content_correlation", "correlation_length")}
            if key[0] > 0:
                d.update(content_correlation=key[0], correlation_length=key[1])
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "importance.yaml"
                path.write_text(yaml.safe_dump(d))
                got = [simulated_clustering(r, path) for r in replay_dirs]
            seen[key] = sum(got[1:], got[0])
            rows.append({"content_correlation": key[0], "correlation_length": key[1],
                         "blocks_freed": seen[key].blocks_freed, "mean_run": seen[key].mean_run,
                         "loss": clustering_loss(seen[key], measured)})
        return seen[key]

    def best(points):
        return min(points, key=lambda p: (clustering_loss(evaluate(*p), measured), p))

    uncorrelated = evaluate(0.0, 0.0)
    rho, ell = best([(0.0, 0.0)] + [(r, e) for r in rhos if r > 0 for e in lengths])
    if refine and rho > 0:
        step = float(np.min(np.diff(sorted(rhos)))) / 2 if len(rhos) > 1 else 0.05
        near = [(min(max(rho + dr, 0.0), 0.97), min(ell * f, MAX_CORRELATION_LENGTH)) for dr in (-step, 0.0, step)
                for f in (2 ** -0.5, 1.0, 2 ** 0.5)]
        rho, ell = best([(rho, ell)] + [p for p in near if p[0] > 0])
    return CorrelationFit(content_correlation=float(rho), correlation_length=float(ell) if rho > 0 else 0.0,
                          measured=measured, synthetic=evaluate(rho, ell), uncorrelated=uncorrelated,
                          grid=pd.DataFrame(rows), sources=[str(d) for d in replay_dirs])
