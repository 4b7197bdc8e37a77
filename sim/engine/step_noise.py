"""Step-time variance: a seeded multiplicative noise on the simulator's step durations.

Real engine steps of one shape do not take one time: clocks, host scheduling, the Python
scheduler, garbage collection and the API server sharing the host spread them. kvsim's cost model
prices a step's mean; with `step_variance` set, step i of replica r lasts

    price_i * exp(sigma * z_{r,i} - sigma**2 / 2),      z_{r,i} ~ N(0, 1)

a mean-one lognormal factor (means, and so throughput, are kept in expectation; the tails widen).
z is drawn from a counter-based stream: block b of BLOCK_STEPS values of replica r comes from
`PCG64(SeedSequence([seed, r, b]))`, so step i's factor depends on (seed, replica, i) alone. A
decode fast-forward that prices a run of steps in bulk, or a run that admits arrivals and prices
its steps one stretch at a time, multiplies by the very same factors stepping would: the results
stay bit-identical with and without fast-forward (tests/test_step_noise.py).

`step_variance: 0` (the default) is the deterministic mode: no factor at all, today's results
byte for byte. `auto` takes the GPU's sigma from sim/data/step_variance.yaml (fitted values and
where they come from: docs/gpu-profiles.md, "Step-time variance").
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import yaml

BLOCK_STEPS = 4096
_DATA = Path(__file__).resolve().parents[1] / "data" / "step_variance.yaml"


class StepNoise:
    """The factors of one replica's steps (see the module docstring)."""

    def __init__(self, sigma: float, seed: int, replica: int):
        if not (sigma >= 0 and math.isfinite(sigma)):
            raise ValueError(f"step variance sigma must be a finite number >= 0, got {sigma!r}")
        self.sigma = float(sigma)
        self.seed, self.replica = int(seed), int(replica)
        self._blocks: dict[int, np.ndarray] = {}

    def _block(self, b: int) -> np.ndarray:
        block = self._blocks.get(b)
        if block is None:
            if len(self._blocks) > 4:           # steps move forward: keep the few blocks around the clock
                for old in [k for k in self._blocks if k < b - 1]:
                    del self._blocks[old]
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, self.replica, b])))
            s = self.sigma
            block = self._blocks[b] = np.exp(s * rng.standard_normal(BLOCK_STEPS) - s * s / 2)
        return block

    def factor(self, step: int) -> float:
        """The factor of step `step` (0-based, within the replica)."""
        b, i = divmod(step, BLOCK_STEPS)
        return float(self._block(b)[i])

    def factors(self, first: int, n: int) -> np.ndarray:
        """The factors of steps first .. first + n - 1 (float64)."""
        if n <= 0:
            return np.empty(0)
        b0, i0 = divmod(first, BLOCK_STEPS)
        b1 = (first + n - 1) // BLOCK_STEPS
        if b0 == b1:
            return self._block(b0)[i0:i0 + n].copy()
        parts = np.concatenate([self._block(b) for b in range(b0, b1 + 1)])
        return parts[i0:i0 + n]


def fitted_sigmas() -> dict:
    """sim/data/step_variance.yaml: GPU name -> {sigma, source}."""
    return yaml.safe_load(_DATA.read_text())["gpus"]


def resolve_sigma(setting: float | str, gpu_name: str) -> float:
    """The sigma of a run: the configured number, or (`auto`) the GPU's fitted one (the `default`
    entry for a GPU without its own)."""
    if setting != "auto":
        return float(setting)
    table = fitted_sigmas()
    entry = table.get(gpu_name.lower()) or table["default"]
    return float(entry["sigma"])
