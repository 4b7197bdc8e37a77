"""Length distributions of synthetic workloads (token counts of prompts and outputs), as specs on the command
line and in workload specs: ``fixed:L``, ``uniform:LO,HI``, ``lognormal:MEAN,CV[,MAX]`` (traces/synthetic.py
documents them). No pandas and no trace loading here: traces/workload.py builds on it too."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvsim.traces.arrivals import check_positive
from kvsim.traces.errors import TraceError


MAX_LENGTH = 100_000_000      # tokens of one prompt or output: far beyond any model's context
MAX_LOGNORMAL_CV = 100.0       # sigma^2 = ln(1 + cv^2) stays finite (a cv of 1e300 overflows it)


# ---- length distributions ----------------------------------------------------------------------
@dataclass(frozen=True)
class Fixed:
    tokens: int

    def __post_init__(self):
        if not 1 <= self.tokens <= MAX_LENGTH:
            raise TraceError(None, None, f"fixed length must be in 1..{MAX_LENGTH:,}, got {self.tokens}")

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.tokens, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    low: int
    high: int

    def __post_init__(self):
        if not 1 <= self.low <= self.high <= MAX_LENGTH:
            raise TraceError(None, None, f"uniform lengths need 1 <= low <= high <= {MAX_LENGTH:,}, got {self.low},{self.high}")

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)


@dataclass(frozen=True)
class LogNormal:
    mean: float
    cv: float
    max_tokens: int | None = None

    def __post_init__(self):
        check_positive("lognormal mean", self.mean)
        check_positive("lognormal cv", self.cv)
        if self.mean > MAX_LENGTH or self.cv > MAX_LOGNORMAL_CV:
            raise TraceError(None, None, f"lognormal:{self.mean:g},{self.cv:g}: expected a mean of at most "
                                         f"{MAX_LENGTH:,} tokens and a cv of at most {MAX_LOGNORMAL_CV:g}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise TraceError(None, None, f"lognormal max must be >= 1, got {self.max_tokens}")

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        sigma2 = math.log1p(self.cv**2)
        mu = math.log(self.mean) - sigma2 / 2
        values = np.maximum(np.rint(rng.lognormal(mu, math.sqrt(sigma2), size=n)), 1).astype(np.int64)
        return values if self.max_tokens is None else np.minimum(values, self.max_tokens)


LengthDist = Fixed | Uniform | LogNormal


def parse_length_spec(spec: str | int | LengthDist) -> LengthDist:
    """``fixed:L`` | ``uniform:LO,HI`` | ``lognormal:MEAN,CV[,MAX]`` (a bare integer means fixed)."""
    if isinstance(spec, (Fixed, Uniform, LogNormal)):
        return spec
    if isinstance(spec, (int, np.integer)):
        return Fixed(int(spec))
    kind, _, args = str(spec).strip().partition(":")
    try:
        if kind.isdigit() and not args:
            return Fixed(int(kind))
        values = [a.strip() for a in args.split(",")] if args else []
        if kind == "fixed" and len(values) == 1:
            return Fixed(int(values[0]))
        if kind == "uniform" and len(values) == 2:
            return Uniform(int(values[0]), int(values[1]))
        if kind == "lognormal" and len(values) in (2, 3):
            return LogNormal(float(values[0]), float(values[1]), int(values[2]) if len(values) == 3 else None)
    except TraceError:
        raise
    except ValueError:
        pass
    raise TraceError(None, None, f"length spec {spec!r}: expected fixed:L, uniform:LO,HI or lognormal:MEAN,CV[,MAX]")
