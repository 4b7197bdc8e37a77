"""Published vLLM runs on real GPUs (tests/data/published_runs/runs.yaml) simulated by kvsim: prints
each figure, kvsim's value and the relative error (docs/gpu-profiles.md; figures in docs/results.md).

    python bench/bench_published_runs.py [--run ID] [--step-variance auto|SIGMA] [--frontend NAME]
        [--frontend-jitter auto|SIGMA]

Each latency row also prints kvsim's mean, p50, p90 and p99 of that latency (the sources publish one
statistic); then the published medians and tails (p95 or p99, as each source gives them)
beside kvsim's, measured / kvsim / error per statistic. `--step-variance` runs the simulations with step-time variance (sim/engine/step_noise.py); `--frontend` the serve runs
with a named frontend (sim/data/frontends.yaml) instead of the GPU profile's client terms; `--frontend-jitter`
the serve runs with per-request variation of the frontend's fixed latency (sim/simulator/client.py).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvsim.sim.calibration.published_runs import compare_published, comparison_table, tails_table

RUNS = Path(__file__).resolve().parents[1] / "tests" / "data" / "published_runs" / "runs.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", help="only this run id")
    ap.add_argument("--step-variance", default="0", help="0 (deterministic), auto, or a lognormal sigma")
    ap.add_argument("--frontend", help="a named frontend (vllm-api, ...) for the serve runs; default: the profile's")
    ap.add_argument("--frontend-jitter", default="0", help="0 (every request alike), auto, or a lognormal sigma")
    args = ap.parse_args()
    t0 = time.process_time()
    variance = args.step_variance if args.step_variance == "auto" else float(args.step_variance)
    jitter = args.frontend_jitter if args.frontend_jitter == "auto" else float(args.frontend_jitter)
    rows = compare_published(RUNS, only=args.run, step_variance=variance, frontend=args.frontend,
                             frontend_jitter=jitter)
    print(comparison_table(rows))
    print("\npublished percentiles (measured, kvsim, error):")
    print(tails_table(rows))
    print(f"\n{len(rows)} figures; |error| median {sorted(abs(r.error) for r in rows)[len(rows) // 2]:.1%}, "
          f"max {max(abs(r.error) for r in rows):.1%}; {time.process_time() - t0:.1f} s CPU")


if __name__ == "__main__":
    main()
