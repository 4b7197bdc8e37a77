"""Seeded arrival processes (Poisson, Gamma, closed batch) shared by the synthetic workloads and the
length-only trace loader, and the argument checks they share with the length distributions.

Every function takes a ``seed`` and returns the same times for the same arguments on any machine
(numpy's PCG64 via ``np.random.default_rng``).
"""
from __future__ import annotations

import math

import numpy as np

from kvsim.traces.errors import TraceError


def check_positive(name: str, value: float) -> float:
    """`value` as a float, or a TraceError naming `name` unless it is a finite number > 0."""
    if value is None or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise TraceError(None, None, f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_count(n: int) -> int:
    """`n` as an int, or a TraceError unless it is a request count (an integer >= 1)."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise TraceError(None, None, f"number of requests must be an integer >= 1, got {n!r}")
    return int(n)


def poisson_arrivals(n: int, rate: float, seed: int | np.random.SeedSequence = 0) -> np.ndarray:
    """``n`` arrival times (s) of a Poisson process of ``rate`` req/s; the first arrives at t=0."""
    return gamma_arrivals(n, rate, cv=1.0, seed=seed)


def gamma_arrivals(n: int, rate: float, cv: float, seed: int | np.random.SeedSequence = 0) -> np.ndarray:
    """``n`` arrival times (s) with Gamma inter-arrival gaps of mean ``1/rate`` and coefficient of
    variation ``cv`` (cv=1 is Poisson; cv>1 is burstier); the first request arrives at t=0."""
    n, rate, cv = check_count(n), check_positive("rate", rate), check_positive("cv", cv)
    rng = np.random.default_rng(seed)
    if cv == 1.0:
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    else:
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def arrivals(n: int, *, rate: float | None, cv: float | None = None,
             seed: int | np.random.SeedSequence = 0) -> tuple[np.ndarray, str]:
    """Arrival times and a description: Poisson (cv None or 1), Gamma (cv), or all at 0 (rate None)."""
    if rate is None:
        if cv is not None:
            raise TraceError(None, None, "cv needs a rate: give rate= (req/s) to draw bursty arrivals")
        return np.zeros(check_count(n)), "closed batch, every request arrives at t=0 (no rate given)"
    if cv is None or cv == 1.0:
        return poisson_arrivals(n, rate, seed), f"Poisson, {rate:g} req/s, seed {_seed_text(seed)}"
    return gamma_arrivals(n, rate, cv, seed), f"Gamma, {rate:g} req/s, inter-arrival CV {cv:g}, seed {_seed_text(seed)}"


def _seed_text(seed) -> str:
    return str(seed.entropy) if isinstance(seed, np.random.SeedSequence) else str(seed)


def vllm_bench_arrivals(n: int, request_rate: float, burstiness: float = 1.0,
                        seed: int | np.random.SeedSequence = 0) -> np.ndarray:
    """``n`` send times (s) as ``vllm bench serve --request-rate R --burstiness B`` draws them.

    Every request, the first included, waits a Gamma gap of shape ``B`` and mean ``1/R`` (B=1 is
    Poisson, B<1 burstier, B>1 more regular, B=inf a constant gap) after the previous one; the
    cumulative times are then rescaled so the last request is sent at exactly ``n / R`` (vLLM does
    this to remove the 1-2% spread of the sum between seeds). ``R = inf`` sends every request at
    t=0 (vLLM's default). Times are measured from the benchmark's start, so the first one is > 0.
    The draws come from ``np.random.default_rng(seed)``, not vLLM's global numpy state: the same
    distribution, not the same numbers as a vLLM run with that seed."""
    n = check_count(n)
    if request_rate is None or not request_rate > 0:
        raise TraceError(None, None, f"request rate must be > 0 (inf: all at once), got {request_rate!r}")
    if burstiness is None or not burstiness > 0:
        raise TraceError(None, None, f"burstiness must be > 0, got {burstiness!r}")
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / request_rate) / times[-1]
    return times
