"""Fit a hardware profile to a user's own `vllm bench serve` results (`kvsim calibrate --bench FILE...`).

A bench result saved with `--save-result --save-detailed` holds what the client measured per request
(TTFT, inter-token latencies, E2E latency) and the load it was sent with. There are no engine step times
in it, so the step-log fit (profile_fit.py) cannot run: this fit simulates every file as it was sent
(the file as the trace, its send times and --max-concurrency; traces/user_formats.py) and moves two
factors of a base profile until the simulated figures match the measured ones:

- `step_time_scale` K: every engine step's time x K (how much slower or faster the user's server steps
  than the base profile says), fitted to the median TPOT: TPOT is engine time (the time between two steps
  that produce a request's tokens), K scales it about proportionally, so K <- K x (measured / predicted)
  converges in a few rounds;
- `client.request_s` R (with the client terms on, the default): the fixed time from a client's send to the
  engine (HTTP, API server), which TTFT and E2E include and TPOT does not, fitted to the median TTFT:
  R <- R + (measured - predicted), kept >= 0.

Both are updated together each round from one simulation of every file (TTFT's engine share moves with K;
the next round corrects R for it). The fit error is the mean |relative error| over the files' reported
figures (mean/median/p99 TTFT, TPOT, ITL, E2EL, output throughput) at the fitted factors; with several
files, each file's held-out error is that of a fit to the other files only (leave-one-out), the error
to expect on a workload the fit has not seen.
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsim.sim.calibration.errors import CalibrationError
from kvsim.sim.model.cost_model import STEP_TIME_SCALE_RANGE, HardwareProfile

TPOT, TTFT = "median_tpot_ms", "median_ttft_ms"        # the figures the two factors are fitted to
REPORTED = tuple(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")) \
    + ("output_throughput",)
MAX_ROUNDS = 12
TOLERANCE = 1e-3        # stop when the TPOT log-ratio and the TTFT gap (relative to TTFT) are below it


@dataclass
class BenchFit:
    """The fitted profile and its errors: file -> figure -> (predicted - measured) / measured."""
    profile: HardwareProfile
    step_time_scale: float
    client_request_s: float
    rounds: int
    converged: bool
    errors: dict[str, dict[str, float]]
    held_out: dict[str, dict[str, float]] = field(default_factory=dict)
    held_out_factors: dict[str, tuple[float, float]] = field(default_factory=dict)
    figures: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)   # (measured, predicted)
    overrides: dict = field(default_factory=dict)       # the config the files were simulated with

    @property
    def fit_error(self) -> float:
        return mean_abs(self.errors)

    @property
    def held_out_error(self) -> float | None:
        return mean_abs(self.held_out) if self.held_out else None


def mean_abs(errors: dict[str, dict[str, float]]) -> float:
    values = [abs(e) for per in errors.values() for e in per.values()]
    return float(np.mean(values)) if values else math.nan


class _Files:
    """The bench files, loaded once, simulated under a candidate profile."""

    def __init__(self, paths: list[Path], overrides: dict, client: bool):
        from kvsim.traces import load_trace

        self.paths = [str(p) for p in paths]
        self.traces = {}
        for p in paths:
            trace = load_trace(Path(p))
            if not trace.measured:
                raise CalibrationError(f"{p}: not a vllm bench serve result (--save-result --save-detailed); "
                                       "expected its per-request input_lens, output_lens, ttfts, itls")
            self.traces[str(p)] = trace
        self.overrides, self.client = overrides, client
        self._tmp = tempfile.TemporaryDirectory(prefix="kvsim-bench-fit-")     # the candidate profiles' files
        self.tmp = Path(self._tmp.name)
        self.runs = 0

    def close(self) -> None:
        self._tmp.cleanup()

    def simulate(self, path: str, profile: HardwareProfile) -> dict:
        """The bench_comparison of one file under `profile`: figure -> {measured, predicted, error}."""
        from kvsim.sim.config import load_config
        from kvsim.sim.simulator.simulate import run_simulation

        self.runs += 1
        file = self.tmp / f"profile-{self.runs}.yaml"
        profile.to_yaml(file)
        cfg = load_config(None, {**self.overrides, "trace": path, "profile": str(file), "client_latency": self.client})
        agg = run_simulation(cfg, trace=self.traces[path], keep_steps=False).summary["bench_comparison"]
        missing = [k for k in (TPOT, TTFT) if not isinstance(agg.get(k), dict) or not agg[k].get("measured")]
        if missing:
            raise CalibrationError(f"{path}: no measured {' or '.join(missing)} (a file without ttfts/latencies, or "
                                   "only 1-token outputs): nothing to fit the step times to")
        return agg


def with_factors(base: HardwareProfile, scale: float, request_s: float) -> HardwareProfile:
    return base.model_copy(update={"step_time_scale": scale,
                                   "client": base.client.model_copy(update={"request_s": request_s})})


def _solve(files: _Files, paths: list[str], base: HardwareProfile, scale: float, request_s: float,
           fit_client: bool) -> tuple[float, float, dict[str, dict], int, bool]:
    """(K, R, the last round's comparisons by file, rounds, converged) fitted to `paths`."""
    low, high = STEP_TIME_SCALE_RANGE
    for rounds in range(1, MAX_ROUNDS + 1):
        profile = with_factors(base, scale, request_s)
        aggs = {p: files.simulate(p, profile) for p in paths}
        log_ratio = float(np.mean([math.log(a[TPOT]["predicted"] / a[TPOT]["measured"]) for a in aggs.values()]))
        gap_ms = float(np.mean([a[TTFT]["measured"] - a[TTFT]["predicted"] for a in aggs.values()]))
        ttft_ms = float(np.mean([a[TTFT]["measured"] for a in aggs.values()]))
        new_request_s = max(0.0, request_s + gap_ms / 1e3) if fit_client else request_s
        if abs(log_ratio) < TOLERANCE and abs(new_request_s - request_s) * 1e3 < TOLERANCE * ttft_ms:
            return scale, request_s, aggs, rounds, True
        scale = min(max(scale * math.exp(-log_ratio), low), high)
        request_s = new_request_s
    profile = with_factors(base, scale, request_s)
    return scale, request_s, {p: files.simulate(p, profile) for p in paths}, MAX_ROUNDS + 1, False


def _errors(agg: dict) -> dict[str, float]:
    return {k: float(agg[k]["error"]) for k in REPORTED if isinstance(agg.get(k), dict) and agg[k]["error"] is not None}


def fit_bench(paths: list[Path], overrides: dict, base: HardwareProfile, *, name: str, client: bool = True,
              held_out: bool = True) -> BenchFit:
    """Fit K (and R with `client`) of `base` to the bench result files `paths`, simulated with the config
    `overrides` (model, gpu, tp, engine); with several files and `held_out`, also each file's
    leave-one-out errors."""
    if not paths:
        raise CalibrationError("--bench: give one or more vllm bench serve result files")
    files = _Files(paths, overrides, client)
    try:
        return _fit(files, overrides, base, name=name, client=client, held_out=held_out)
    finally:
        files.close()


def _fit(files: _Files, overrides: dict, base: HardwareProfile, *, name: str, client: bool, held_out: bool) -> BenchFit:
    start_r = base.client.request_s if client else 0.0
    scale, request_s, aggs, rounds, converged = _solve(files, files.paths, base, base.step_time_scale, start_r,
                                                       client)
    profile = with_factors(base, scale, request_s).model_copy(update={"name": name})
    fit = BenchFit(profile, scale, request_s, rounds, converged, {p: _errors(a) for p, a in aggs.items()},
                   overrides={k: v for k, v in overrides.items() if v is not None},
                   figures={p: {k: (a[k]["measured"], a[k]["predicted"]) for k in REPORTED
                                if isinstance(a.get(k), dict) and a[k]["predicted"] is not None}
                            for p, a in aggs.items()})
    if held_out and len(files.paths) > 1:
        for p in files.paths:
            others = [q for q in files.paths if q != p]
            k, r, _, _, _ = _solve(files, others, base, scale, request_s, client)
            fit.held_out[p] = _errors(files.simulate(p, with_factors(base, k, r)))
            fit.held_out_factors[p] = (k, r)
    return fit


def bench_meta(fit: BenchFit, *, model: str, gpu: str, tp: int, base: str, command: str | None) -> dict:
    """The written profile's `meta`: what it was fitted on, the factors and both errors."""
    def rounded(errors):
        return {Path(p).name: {k: round(v, 5) for k, v in per.items()} for p, per in errors.items()}

    meta = {"fitted_on": {"model": model, "gpu": gpu, "tp": tp, "base_profile": base,
                          "vllm_bench_results": list(fit.errors),
                          "config": {k: v for k, v in fit.overrides.items() if k not in ("model", "gpu", "tp")}},
            "fitted": {"step_time_scale": round(fit.step_time_scale, 6),
                       "client_request_s": round(fit.client_request_s, 6)},
            "rounds": fit.rounds, "converged": fit.converged,
            "fit_error_mean_abs": round(fit.fit_error, 5), "fit_errors": rounded(fit.errors)}
    if fit.held_out:
        meta["held_out_error_mean_abs"] = round(fit.held_out_error, 5)
        meta["held_out_errors"] = rounded(fit.held_out)
    if command:
        meta["command"] = command
    return meta
