"""Benchmark: `kvsim plan` at scale (issue 49's planning target): >= 500 candidate fleet configurations
in <= 5 minutes of wall time on a 2-core machine, and the pruned search against the exhaustive one.

    python bench/bench_planning.py [--skip-small] [--skip-large] [--low-fi 0.125] [--jobs 2] [--mixed-pools 1]

`--mixed-pools N` (default 1) lets each disaggregated role mix up to N pool types in both spaces (`kvsim plan
--mixed-pools`; the small space's disaggregated part is then 64 fleets).

1. **Small space (48 configurations, exhaustive vs pruned).** Llama-3.1-8B on H100 / A100-80GB at TP 1
   and 2 with 1-8 replicas (32 aggregated), and 1-2 replicas of H100 / A100 TP 1 prefill and decode pools
   (16 disaggregated), on a 12-second slice of the Azure conversation trace's busiest period at 8x its
   rate (tests/test_plan_scale.py's space). Runs the exhaustive search, then the pruned one (capacity
   bounds, dominance, cheapest first) and the pruned one with the low-fidelity pass, each on a fresh
   store, in this process; prints simulations, CPU and wall time, and checks the answers are equal.
2. **Large space (`kvsim plan` as a user runs it).** Llama-3.1-8B and Llama-3.1-70B, Azure conversation
   trace at 2x its rate (the default sample: its busiest 8 minutes), SLO p99 TTFT <= 2 s and p99 TPOT
   <= 100 ms; GPUs H100, H200, A100-80GB, L4 x TP 1, 2, 4, 8 x 1-16 replicas (512 aggregated
   configurations) and H100/H200 prefill x decode pools at TP 1, 2, 4, 8 with 1-8 replicas each
   (disaggregated), with the answer's range (3 windows, the profile band), on `--jobs` workers.
   Prints wall time, CPU time (the command and its workers), what was ruled out, simulated in low or
   full fidelity, and the answers.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL_SLO = "ttft_p99<=1s,tpot_p99<=100ms"
LARGE_SLO = "ttft_p99<=2s,tpot_p99<=100ms"


def cpu_s(children: bool = False) -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def small(low_fi: float, mixed_pools: int = 1) -> None:
    from kvsim.sim.config import load_config
    from kvsim.sim.planning.capacity import parse_slo
    from kvsim.sim.planning.disaggregated import DisaggSpace, plan_disaggregated
    from kvsim.sim.planning.plan import PlanSpace, _Runner, plan_capacity
    from kvsim.sim.planning.sweep import _serial

    base = load_config(None, {"trace": "azure-conv-2023", "trace_options.start_s": 1586.0,
                              "trace_options.end_s": 1598.0, "trace_options.rate_scale": 8.0,
                              "model": "llama-3.1-8b"})
    slo = parse_slo(SMALL_SLO)
    pools = [("h100", 1), ("a100-80gb", 1)]
    print(f"small space: llama-3.1-8b, 12 s of azure-conv-2023 at 8x ({SMALL_SLO}); "
          f"32 aggregated + {16 if mixed_pools == 1 else 64} disaggregated configurations"
          f"{'' if mixed_pools == 1 else f' (pool types mixed up to {mixed_pools} a role)'}")
    answers = {}
    for label, kw in (("exhaustive", {"exhaustive": True}), ("pruned", {}), (f"pruned, low-fi {low_fi:g}",
                                                                            {"low_fi": low_fi})):
        with tempfile.TemporaryDirectory() as store:
            t0, c0 = time.perf_counter(), cpu_s()
            agg = plan_capacity(base, slo, PlanSpace(["llama-3.1-8b"], ["h100", "a100-80gb"], [1, 2], max_replicas=8,
                                                     **kw), store=store, width=2)
            dis = plan_disaggregated(base, slo, DisaggSpace(["llama-3.1-8b"], pools, pools, max_pool_replicas=2,
                                                            exhaustive=kw.get("exhaustive", False),
                                                            mixed_pools=mixed_pools),
                                     _Runner(slo, _serial, Path(store)), width=2)
            wall, cpu = time.perf_counter() - t0, cpu_s() - c0
        a = agg.cheapest["llama-3.1-8b"]
        d = dis.cheapest["llama-3.1-8b"]
        c = agg.counts
        answers[label] = (a.cand.usd_per_replica_hour * a.hi_ok, d.usd_per_hour)
        print(f"  {label:<20s} aggregated: {c.full_runs:2d} full + {c.low_fi_runs:2d} low-fi runs, "
              f"{c.below_bound:2d} counts below a bound; disaggregated: {len(dis.points):2d} runs, "
              f"{dis.below_bound['llama-3.1-8b']:2d} below a bound | {wall:5.1f} s wall, {cpu:5.1f} s CPU | "
              f"{a.cand.gpu} TP{a.cand.tp} x {a.hi_ok} (${answers[label][0]:.2f}/h); {d.label} "
              f"(${d.usd_per_hour:.2f}/h)", flush=True)
    same = len(set(answers.values())) == 1
    print(f"  answers equal to the exhaustive search's (cost of the cheapest of each form): {same}")
    if not same:
        sys.exit(1)


def large(jobs: int, low_fi: float, mixed_pools: int = 1) -> None:
    models, gpus = "llama-3.1-8b,llama-3.1-70b", "h100,h200,a100-80gb,l4"
    print(f"large space: {models} on {gpus} x TP 1,2,4,8 x 1-16 replicas, + h100/h200 prefill x decode pools "
          f"x TP 1,2,4,8 x 1-8 replicas each; azure-conv-2023 at 2x ({LARGE_SLO}); -j {jobs}")
    for label, extra in (("pruned", []), (f"pruned, low-fi {low_fi:g}", ["--low-fi", str(low_fi)])):
        with tempfile.TemporaryDirectory() as store:
            cmd = [sys.executable, "-c", "from kvsim.sim.entry import main; main()", "plan",
                   "--trace", "azure-conv-2023", "--rate-scale", "2", "--slo", LARGE_SLO, "--models", models, "--gpus", gpus, "--tps", "1,2,4,8",
                   "--max-replicas", "16", "--disaggregated", "--prefill-gpus", "h100,h200",
                   "--decode-gpus", "h100,h200", "--max-pool-replicas", "8", "-j", str(jobs), "-q",
                   "--out", store, *extra, *(["--mixed-pools", str(mixed_pools)] if mixed_pools > 1 else [])]
            t0, c0 = time.perf_counter(), cpu_s(children=True)
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
            wall, cpu = time.perf_counter() - t0, cpu_s(children=True) - c0
            if res.returncode:
                print(res.stdout[-3000:], res.stderr[-3000:])
                sys.exit(res.returncode)
            agg = json.loads((Path(store) / "plan-result.json").read_text())
            dis = json.loads((Path(store) / "plan-disaggregated.json").read_text())
        c = agg["counts"]
        grid, below = sum(dis["grid"].values()), sum(dis["below_bound"].values())
        implied = sum(dis["implied_fail"].values())
        total = c["configurations"] + grid
        print(f"  {label}: {total:,} configurations ({c['configurations']} aggregated + {grid:,} disaggregated) in "
              f"{wall:.0f} s wall, {cpu:.0f} s CPU (command + workers; load average "
              f"{os.getloadavg()[0]:.1f})", flush=True)
        print(f"    aggregated: {c['cannot_run']} cannot run, {c['below_bound']} below a capacity bound, "
              f"{c['low_fi_runs']} low-fidelity runs, {c['full_runs']} full simulations (search), "
              f"{agg['simulations'] - c['full_runs'] - c['low_fi_runs']} for the answers' range")
        print(f"    disaggregated: {below:,} below a pool's bound, {len(dis['points'])} simulated, {implied:,} implied "
              f"to fail, {dis['simulations']} simulations with the range")
        for model, cfg in agg["cheapest"].items():
            s = next(x for x in agg["searches"] if x["config"] == cfg)
            print(f"    {model}: aggregated {cfg} x {s['fewest_replicas']} (${s['usd_per_hour']:.2f}/h); "
                  f"disaggregated {dis['cheapest'][model]['fleet']} (${dis['cheapest'][model]['usd_per_hour']:.2f}/h)"
                  if model in dis["cheapest"] else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-small", action="store_true")
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument("--low-fi", type=float, default=0.125, help="the low-fidelity window's share of the sample")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--mixed-pools", type=int, default=1, help="pool types a disaggregated role may mix")
    args = ap.parse_args()
    if not args.skip_small:
        small(args.low_fi, args.mixed_pools)
    if not args.skip_large:
        large(args.jobs, args.low_fi, args.mixed_pools)


if __name__ == "__main__":
    main()
