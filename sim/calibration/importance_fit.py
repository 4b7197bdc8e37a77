"""Fit the synthetic importance model (sim/kv/importance.py) to measured per-head attention statistics."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from kvsim.sim.calibration.correlation_fit import CorrelationFit
from kvsim.sim.calibration.errors import CalibrationError
from kvsim.sim.kv.importance import HEAD_TYPES, ImportanceModelSpec, SyntheticImportance, attention_stats
from kvsim.sim.kv.policy import PolicyContext

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
    correlation: CorrelationFit | None = None   # content correlation fitted to recorded evictions

    def table(self) -> str:
        lines = [f"{'statistic':<26} {'measured':>9} {'fitted':>9}"]
        for k, v in self.measured.items():
            lines.append(f"{k:<26} {v:>9.3f} {self.synthetic.get(k, float('nan')):>9.3f}")
        if self.correlation is not None:
            lines += ["", self.correlation.table()]
        return "\n".join(lines)

    def with_correlation(self, fit: CorrelationFit) -> ImportanceFit:
        spec = {k: v for k, v in self.spec.items() if k not in ("content_correlation", "correlation_length")}
        if fit.content_correlation > 0:
            spec["content_correlation"] = round(fit.content_correlation, 4)
            spec["correlation_length"] = round(fit.correlation_length, 4)
        return ImportanceFit(spec=spec, measured=self.measured, synthetic=self.synthetic, correlation=fit)

    def write(self, path: str | Path, *, command: str | None = None, source: str | None = None) -> Path:
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
                        f"{c.measured.mean_run:.3g}/{c.synthetic.mean_run:.3g} "
                        f"(uncorrelated {c.uncorrelated.mean_run:.3g})")
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
    base_spec = ImportanceModelSpec.load(base)
    layers, kv_heads = int(stats["layer"].max()) + 1, int(stats["head"].max()) + 1
    heads = stats.groupby(["layer", "head"], as_index=False)[["num_keys", "keys_95", "sink_share",
                                                               "recent_share"]].mean()
    dense = _dense_layers(heads, layers)
    sparse = heads[heads["layer"] >= dense].reset_index(drop=True)
    kinds = _classify_heads(sparse)
    mix = {t: round(float(np.mean(kinds == t)), 4) for t in HEAD_TYPES}
    mix[max(mix, key=mix.get)] += round(1.0 - sum(mix.values()), 6)
    spec = {"name": name, "dense_layers": dense, "request_sigma_jitter": base_spec.request_sigma_jitter,
            "sink_weights": [round(float(w), 4) for w in base_spec.sink_weights], "head_mix": mix,
            "head_types": {t: _type_ranges(sparse[kinds == t], base_spec.types[t]) for t in HEAD_TYPES}}
    ctx = PolicyContext("per_head", layers, kv_heads, kv_heads, 16, layers * kv_heads)
    simulate = partial(_simulated_stats, ctx=ctx, num_tokens=int(np.median(stats["num_keys"])),
                       num_requests=int(min(max(stats["request_id"].nunique(), 2), 4)), seed=seed)
    target = {t: float(np.median(sparse.loc[kinds == t, "keys_95"])) for t in HEAD_TYPES if (kinds == t).sum() >= 2}
    _fit_sigmas(spec, target, simulate, iterations)
    measured = _head_summary(stats)
    if "request_log_keys95_std" in measured:
        _fit_jitter(spec, measured["request_log_keys95_std"], simulate, iterations)
    synthetic = _head_summary(simulate(spec)[0])
    return ImportanceFit(spec=spec, measured=measured, synthetic=synthetic)


def _dense_layers(heads: pd.DataFrame, layers: int) -> int:
    """Leading layers whose 95% mass needs more than twice the median layer's share of keys."""
    layer_frac = (heads["keys_95"] / heads["num_keys"]).groupby(heads["layer"]).mean().to_numpy()
    dense = 0
    while dense < layers - 1 and layer_frac[dense] > 2 * np.median(layer_frac):
        dense += 1
    return dense


def _type_ranges(h: pd.DataFrame, bp) -> dict[str, list[float]]:
    """One head type's sink and local share ranges (p10..p90 of its heads `h`); tau and sigma from the
    base model's type `bp` (sigma is fitted later). Too few heads to fit: the base model's ranges."""
    base = {"tau": [float(v) for v in bp.tau], "sigma": [float(v) for v in bp.sigma]}
    if len(h) < 2:
        return {"sink_share": [float(v) for v in bp.sink_share], "local_share": [float(v) for v in bp.local_share],
                **base}
    s = np.clip(np.percentile(h["sink_share"], [10, 90]), 0.0, 0.95)
    n = h["num_keys"].to_numpy()
    content = (1 - h["sink_share"].to_numpy()) * RECENT_WINDOW / n
    l_est = np.clip((h["recent_share"].to_numpy() - content) / (1 - RECENT_WINDOW / n), 0.0, 1.0)
    l = np.percentile(l_est, [10, 90])
    l = np.minimum(l, 0.98 - s[1])
    return {"sink_share": [round(float(s[0]), 4), round(float(max(s[1], s[0])), 4)],
            "local_share": [round(float(l[0]), 4), round(float(max(l[1], l[0])), 4)], **base}


def _simulated_stats(spec_dict: dict, *, ctx: PolicyContext, num_tokens: int, num_requests: int,
                     seed: int) -> tuple[pd.DataFrame, np.ndarray]:
    """The synthetic model's per-head statistics (ATTENTION_COLUMNS) and each row's head type."""
    sp = _spec_from_dict(spec_dict)
    st = attention_stats(ctx, sp, num_tokens=num_tokens, num_requests=num_requests, seed=seed)
    head_type = np.asarray(HEAD_TYPES)[SyntheticImportance(ctx, sp, seed).head_type]
    df = pd.DataFrame({"request_id": np.repeat(np.arange(num_requests), ctx.rows),
                       "layer": st["layer"], "head": np.tile(ctx.row_head, num_requests),
                       "num_keys": num_tokens, "keys_95": st["keys_95"], "sink_share": st["sink_share"],
                       "recent_share": st["recent_share"]})
    return df, np.tile(head_type, num_requests)


def _fit_sigmas(spec: dict, target: dict[str, float], simulate, iterations: int) -> None:
    """Each type's sigma range (its width kept) to match the type's median keys_95 (`target`): keys_95
    falls as sigma grows, so bisect log(sigma) per type, all types in one simulation per round."""
    types, dense = spec["head_types"], spec["dense_layers"]
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


def _fit_jitter(spec: dict, target: float, simulate, iterations: int) -> None:
    """The per-request sigma jitter to match how much log keys_95 of one head varies across requests."""
    lo_j, hi_j = 0.0, 1.0
    for _ in range(max(iterations - 2, 3)):
        spec["request_sigma_jitter"] = round((lo_j + hi_j) / 2, 4)
        got = _head_summary(simulate(spec)[0])["request_log_keys95_std"]
        if got < target:
            lo_j = spec["request_sigma_jitter"]
        else:
            hi_j = spec["request_sigma_jitter"]


def _spec_from_dict(d: dict):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(d, f)
    try:
        return ImportanceModelSpec.load(f.name)
    finally:
        os.unlink(f.name)
