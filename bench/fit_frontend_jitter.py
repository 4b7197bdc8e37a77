"""Fit the per-request variation of the frontend's fixed latency (`frontend_jitter: auto`, sim/data/frontends.yaml's
`request_jitter`) to a published run's spread of TTFT over requests, then check the run's median and p99.

    python bench/fit_frontend_jitter.py [--run h100-qwen3-0.6b] [--point 16]

What is fitted to what: sigma (request i's fixed latency is request_s x exp(sigma z_i - sigma^2/2)) so that
kvsim's TTFT standard deviation over the requests, averaged over the run's seeds, equals the published one
(`request_jitter.fitted_to.std_ttft_ms` in frontends.yaml: the per-seed `std_ttft_ms` of the kvcached H100
Qwen3-0.6B result files at 16 req/s). The run's TTFT median and p99 (tests/data/published_runs) are not
fitted: they are printed as checks, with the deterministic frontend's beside them. The L4 closed-loop run
is neither fitted nor read here. Bisection on sigma in [0, 1] (the std grows with sigma).
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from kvsim.sim.calibration import published_runs as pr
from kvsim.sim.simulator.client import fitted_jitter

RUNS = Path(__file__).resolve().parents[1] / "tests" / "data" / "published_runs" / "runs.yaml"
CHECKS = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "request_throughput")


def point_run(run: pr.PublishedRun, value: float, std_ms: float) -> pr.PublishedRun:
    """`run` cut to its point `value`, with the published TTFT std as a figure beside its checks."""
    (key, values), = run.points.items()
    i = [float(v) for v in values].index(value)
    measured = {f: [run.measured[f][i]] for f in CHECKS if f in run.measured}
    measured["ttft_std_ms"] = [std_ms]
    return dataclasses.replace(run, points={key: [values[i]]}, measured=measured)


def figures(run: pr.PublishedRun, sigma: float) -> dict[str, pr.Comparison]:
    return {c.figure: c for c in pr.compare_run(run, frontend_jitter=sigma)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="h100-qwen3-0.6b")
    ap.add_argument("--point", type=float, default=16.0)
    ap.add_argument("--iterations", type=int, default=12)
    args = ap.parse_args()
    t0 = time.process_time()
    target = fitted_jitter()["fitted_to"]
    std_ms = float(np.mean(target["std_ttft_ms"]))
    base = next(r for r in pr.load_published_runs(RUNS) if r.id == args.run)
    run = point_run(base, args.point, std_ms)
    lo, hi = 0.0, 1.0
    for _ in range(args.iterations):
        mid = (lo + hi) / 2
        if figures(run, mid)["ttft_std_ms"].predicted < std_ms:
            lo = mid
        else:
            hi = mid
    sigma = round((lo + hi) / 2, 3)
    print(f"{args.run} at {args.point:g}: published TTFT std {std_ms:.2f} ms (mean of {len(target['std_ttft_ms'])} "
          f"seeds) -> sigma {sigma}")
    before, after = figures(run, 0.0), figures(run, sigma)
    print(f"{'figure':<20} {'measured':>9} {'sigma 0':>9} {'error':>7} {f'sigma {sigma}':>11} {'error':>7}")
    for name, c in before.items():
        a = after[name]
        print(f"{name:<20} {c.measured:>9.2f} {c.predicted:>9.2f} {c.error:>+7.1%} {a.predicted:>11.2f} {a.error:>+7.1%}")
    print(f"{time.process_time() - t0:.1f} s CPU")


if __name__ == "__main__":
    main()
