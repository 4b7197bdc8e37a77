"""Fit the importance model's age profile (`age_profile` in sim/kv/importance.py: the `shared`
layout's head-averaged row) to the real backend's attention.

Measured on full attention matrices (`real_attention`: SmolLM2-135M through the real backend's
model, real weights): for a few late queries q of each text, the head-averaged attention (each
(layer, KV head) row renormalized, then the mean over rows, as SpvLLM's H2O scores) is summarized as

- the median log attention of the non-sink keys in each age bin (AGE_BINS: 0, 1, 2-3, 4-7, ...,
  512-999 tokens): where the mass falls by age, so where the lowest scores sit;
- the standard deviation of log attention within each bin of 4 tokens or more: how much content
  moves a key's score against the age trend;
- the sink share (mass on the first 4 tokens).

The fit chooses the row's sink_share, local_share, local decay tau, age exponent and sigma minimizing the squared differences of these statistics between the real
and the model's attention of the same queries (Nelder-Mead on the model's own statistics, its
content draws fixed by the seed). Nothing downstream (evictions, fragmentation) enters the fit.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import yaml

from kvsim.sim.kv.importance import AGE_PROFILE_FIELDS, NUM_SINK, AgeProfile, ImportanceModelSpec, SyntheticImportance
from kvsim.sim.kv.policy import PolicyContext
from kvsim.sim.kv.state import TokenState

AGE_BINS = np.array([0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000])
QUERY_OFFSETS = (400, 300, 200, 100, 0)    # queries at T-1 minus these
SHARED = PolicyContext("shared", 30, 3, 9, 16, 1)   # SmolLM2-135M shape: the base mean head


@dataclass(frozen=True)
class AgeStats:
    median_log: np.ndarray      # [bins]
    log_sd: np.ndarray          # [bins]
    sink_share: float

    def loss(self, other: AgeStats) -> float:
        return float(np.mean((self.median_log - other.median_log) ** 2) + np.nanmean((self.log_sd - other.log_sd) ** 2)
                     + 10 * (self.sink_share - other.sink_share) ** 2)


def age_stats(rows: list[tuple[int, np.ndarray]]) -> AgeStats:
    """Statistics of head-averaged attention rows (q, attention over keys 0..q), see the module doc."""
    med, sd, sink = [], [], []
    for q, a in rows:
        age = q - np.arange(q + 1)
        log_a = np.log(np.maximum(a, 1e-12))
        in_bin = [(age >= lo) & (age < hi) & (np.arange(q + 1) >= NUM_SINK) for lo, hi in zip(AGE_BINS[:-1], AGE_BINS[1:], strict=True)]
        med.append([np.median(log_a[m]) if m.any() else np.nan for m in in_bin])
        sd.append([np.std(log_a[m]) if m.sum() > 2 else np.nan for m in in_bin])
        sink.append(a[:NUM_SINK].sum())
    with warnings.catch_warnings():        # bins of fewer than 3 keys have no spread (nan)
        warnings.simplefilter("ignore", RuntimeWarning)
        return AgeStats(np.nanmean(med, axis=0), np.nanmean(sd, axis=0), float(np.mean(sink)))


def head_averaged_rows(attn: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """attn [rows, T, T] (full-cache attention) -> the head-averaged rows of the fit's queries."""
    T = attn.shape[1]
    out = []
    for q in (T - 1 - o for o in QUERY_OFFSETS if T - 1 - o > AGE_BINS[-2]):
        a = attn[:, q, :q + 1].astype(np.float64)
        out.append((q, (a / a.sum(axis=1, keepdims=True)).mean(axis=0)))
    return out


def model_rows(spec: ImportanceModelSpec, num_tokens: int, requests: int, seed: int = 0) -> list[tuple[int, np.ndarray]]:
    """The importance model's shared-layout row at the fit's queries, `requests` requests."""
    model = SyntheticImportance(SHARED, spec, seed)
    out = []
    for req in range(requests):
        st = TokenState.dense(1, num_tokens)
        model.on_write(req, st, np.arange(1), np.arange(num_tokens)[None, :], np.arange(num_tokens))
        a = model.prefill_scores(req, st, max(QUERY_OFFSETS) + 1)[:, 0]          # [queries, T]
        for o in QUERY_OFFSETS:
            q = num_tokens - 1 - o
            if q > AGE_BINS[-2]:
                out.append((q, a[len(a) - 1 - o, :q + 1].astype(np.float64)))
        model.release(req)
    return out


@dataclass
class AgeProfileFit:
    profile: AgeProfile
    measured: AgeStats
    fitted: AgeStats
    unfitted: AgeStats          # the base model's shared row (the mean head)

    def table(self) -> str:
        lines = [f"{'age bin':<12}{'real':>8}{'fitted':>8}{'base':>8}   log-sd {'real':>6}{'fitted':>8}{'base':>8}"]
        for i, (lo, hi) in enumerate(zip(AGE_BINS[:-1], AGE_BINS[1:], strict=True)):
            lines.append(f"{f'{lo}-{hi}':<12}{self.measured.median_log[i]:>8.2f}{self.fitted.median_log[i]:>8.2f}"
                         f"{self.unfitted.median_log[i]:>8.2f}          {self.measured.log_sd[i]:>6.2f}"
                         f"{self.fitted.log_sd[i]:>8.2f}{self.unfitted.log_sd[i]:>8.2f}")
        lines.append(f"{'sink share':<12}{self.measured.sink_share:>8.3f}{self.fitted.sink_share:>8.3f}"
                     f"{self.unfitted.sink_share:>8.3f}")
        return "\n".join(lines)


def fit_age_profile(real: list[tuple[int, np.ndarray]], base: str | Path = "smollm2-135m", *, num_tokens: int = 1000,
                    requests: int = 3, seed: int = 0) -> AgeProfileFit:
    """Fit the age profile to head-averaged real rows (`head_averaged_rows` of each text)."""
    from scipy.optimize import minimize

    base_spec = ImportanceModelSpec.load(base)
    target = age_stats(real)

    def stats(x) -> AgeStats | None:
        s, l, log_tau, alpha, sigma = x
        if not (s > 0 and l >= 0 and s + l < 0.98 and 0 <= alpha <= 4 and 0.01 <= sigma <= 8 and -3 < log_tau < 8):
            return None
        prof = AgeProfile(exponent=alpha, sigma=sigma, sink_share=s, local_share=l, tau=float(np.exp(log_tau)))
        return age_stats(model_rows(replace(base_spec, age_profile=prof), num_tokens, requests, seed))

    def loss(x) -> float:
        got = stats(x)
        return 1e9 if got is None else got.loss(target)

    start = [target.sink_share, 0.1, np.log(2.0), 0.8, 0.8]
    x = minimize(loss, start, method="Nelder-Mead", options={"maxiter": 400, "xatol": 1e-3, "fatol": 1e-5}).x
    s, l, log_tau, alpha, sigma = (float(v) for v in x)
    profile = AgeProfile(exponent=round(alpha, 4), sigma=round(sigma, 4), sink_share=round(s, 4),
                         local_share=round(l, 4), tau=round(float(np.exp(log_tau)), 4))
    fitted = age_stats(model_rows(replace(base_spec, age_profile=profile), num_tokens, requests, seed))
    unfitted = age_stats(model_rows(replace(base_spec, age_profile=None), num_tokens, requests, seed))
    return AgeProfileFit(profile, target, fitted, unfitted)


def write_age_profile(fit: AgeProfileFit, base: str | Path, out: str | Path, *, name: str, command: str) -> Path:
    """The base model's YAML with the fitted `age_profile` section (and `name`)."""
    path = Path(base)
    if not path.suffix:
        path = Path(__file__).resolve().parent.parent / "data" / "importance" / f"{base}.yaml"
    data = yaml.safe_load(path.read_text())
    data["name"] = name
    data["age_profile"] = {k: getattr(fit.profile, k) for k in AGE_PROFILE_FIELDS}
    m, f = fit.measured, fit.fitted
    head = [f"# Synthetic importance model {path.stem!r} with the shared layout's row fitted to SmolLM2-135M's",
            "# head-averaged attention (real weights, the real backend's model; sim/calibration/age_profile.py)",
            f"# regenerate: {command}",
            "# median log attention by age bin 0, 1, 2-3, 4-7, ..., 512-999, real / fitted: "
            + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(m.median_log, f.median_log, strict=True)),
            "# log-sd by age bin 4-7, ..., 512-999, real / fitted: "
            + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(m.log_sd, f.log_sd, strict=True) if np.isfinite(a)),
            f"# sink share real / fitted: {m.sink_share:.3f}/{f.sink_share:.3f}"]
    out = Path(out)
    out.write_text("\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    return out
