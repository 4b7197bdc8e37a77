"""Fit a GPU profile's client-side and CPU terms to published `vllm bench serve` runs (the procedure
behind the `client` / `step_overhead_s` constants in sim/calibration/regenerate_gpu_profiles.py;
docs/gpu-profiles.md says which figures each was fitted to).

    python bench/fit_client_terms.py --run l4-qwen2.5-0.5b --fit request_s,request_serial_s,output_token_s
    python bench/fit_client_terms.py --run h100-qwen3-0.6b --fit step_overhead_s,request_s,request_serial_s,output_token_s
    python bench/fit_client_terms.py --run h100-qwen3-0.6b --fit request_s,request_serial_s \
        --hold prompt_token_s=1.9e-6,output_token_s=2e-5        # sim/data/frontends.yaml's vllm-api

The loss leaves out the published tails (p95/p99 figures): they are checked, not fitted.
`--hold NAME=VALUE,...` fixes terms taken from measurements (not fitted) while the others are fitted
(`shared_loop=true`: the API server's one queue for entries and outputs).

Coordinate descent over a multiplicative grid, minimizing the mean squared log error of the run's
figures; prints the fitted values and the run's table under them.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from kvsim.sim.calibration import published_runs as pr
from kvsim.sim.model.cost_model import load_profile

RUNS = Path(__file__).resolve().parents[1] / "tests" / "data" / "published_runs" / "runs.yaml"
TAILS = ("_p95_ms", "_p99_ms")
START = {"request_s": 0.01, "request_serial_s": 0.002, "prompt_token_s": 2e-6, "output_token_s": 5e-5,
         "step_overhead_s": 8e-4}


def with_values(profile, values: dict):
    client = {k: v for k, v in values.items() if k != "step_overhead_s"}
    update = {"client": profile.client.model_copy(update=client)}
    if "step_overhead_s" in values:
        update["step_overhead_s"] = values["step_overhead_s"]
    return profile.model_copy(update=update)


def loss(run, profile, tmp: Path) -> tuple[float, list]:
    path = tmp / "fit.yaml"
    profile.to_yaml(path)
    rows = pr.compare_run(run, profile=str(path))
    fitted = [r for r in rows if not r.figure.endswith(TAILS)]     # the tails are checked, never fitted
    return float(np.mean([np.log(r.predicted / r.measured) ** 2 for r in fitted])), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--fit", required=True, help="comma-separated: " + ", ".join(START))
    ap.add_argument("--hold", default="", help="NAME=VALUE,... terms fixed at measured values (not fitted)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    run = next(r for r in pr.load_published_runs(RUNS) if r.id == args.run)
    base = load_profile("auto", gpu=run.setup["gpu"])
    held = {k: v.lower() == "true" if v.lower() in ("true", "false") else float(v)
            for k, _, v in (item.partition("=") for item in args.hold.split(",") if item)}
    base = with_values(base, held)
    names = args.fit.split(",")
    values = {n: START[n] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        best, rows = loss(run, with_values(base, values), Path(tmp))
        for step in (4.0, 2.0, 1.41, 1.19)[:args.rounds + 1]:
            for name in names:
                for factor in (step, 1 / step):
                    trial = dict(values, **{name: values[name] * factor})
                    value, trial_rows = loss(run, with_values(base, trial), Path(tmp))
                    if value < best:
                        best, values, rows = value, trial, trial_rows
            print(f"step x{step}: loss {best:.4f} " + ", ".join(f"{k}={v:.3g}" for k, v in values.items()), flush=True)
    print(pr.comparison_table(rows))


if __name__ == "__main__":
    main()
