"""Published vLLM runs on real GPUs (tests/data/published_runs/runs.yaml) simulated by kvsim: prints
each figure, kvsim's value and the relative error (docs/gpu-profiles.md; figures in docs/results.md).

    python bench/bench_published_runs.py [--run ID]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvsim.sim.calibration.published_runs import compare_published, comparison_table

RUNS = Path(__file__).resolve().parents[1] / "tests" / "data" / "published_runs" / "runs.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", help="only this run id")
    args = ap.parse_args()
    t0 = time.process_time()
    rows = compare_published(RUNS, only=args.run)
    print(comparison_table(rows))
    print(f"\n{len(rows)} figures; |error| median {sorted(abs(r.error) for r in rows)[len(rows) // 2]:.1%}, "
          f"max {max(abs(r.error) for r in rows):.1%}; {time.process_time() - t0:.1f} s CPU")


if __name__ == "__main__":
    main()
