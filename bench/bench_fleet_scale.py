"""Issue 49's fleet scale: CPU time and peak memory of a 64-replica fleet with a router and the CPU offload tier
as the request count grows (target: 1 M requests in <= 10 minutes of CPU and <= 2 GB; linear scaling at 4 sizes).

The workload: the Azure conversation trace (19,366 requests, Llama-3.1-8B on H100, the main command's
defaults) repeated back to back (`Trace.concat(..., how="sequential")`) and sped up 64x (`scale_rate(64)`),
so each of the 64 replicas sees about the load one replica sees in the main command; the first N requests
are simulated (N sets the simulated time: ~3,600 s of trace per 19,366 x 64 = 1.24 M requests). The fleet:
`replicas: 64`, `router` (default round_robin, routed ahead: sim.engine.loop.RoutedAhead) and
`kv_offload.cpu_gib` (default 64 GiB of CPU memory per replica). Outputs are written as `kvsim simulate`
writes them (to a temporary folder, removed).

Each size runs in a child process; prints CPU seconds (user + sys of the child: other jobs on a shared
machine do not count), requests per CPU second, ms of CPU per request and the child's peak RSS. Linear
scaling: CPU per request at the largest size within 15% of the smallest's; only then is 1 M requests
extrapolated from the largest size (printed as such: CPU at its CPU per request, memory growing per request as
between the two largest sizes).

Usage: python bench/bench_fleet_scale.py [N ...] [--router NAME] [--cpu-gib G] [--replicas R]
(default sizes 62,500 125,000 250,000 500,000).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

SIZES = [62_500, 125_000, 250_000, 500_000]
LINEAR_TOLERANCE = 0.15

CHILD = """
import json, math, sys
from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import Trace, load_trace
n, out, replicas, router, cpu_gib = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
base = load_trace("azure-conv-2023")
trace = Trace.concat([base] * math.ceil(n / len(base)), how="sequential").scale_rate(replicas).head(n)
sets = {"trace": "azure-conv-2023", "model": "llama-3.1-8b", "gpu": "h100", "replicas": replicas, "router": router}
if cpu_gib > 0:
    sets["kv_offload.cpu_gib"] = cpu_gib
s = run_simulation(load_config(None, sets), out, keep_steps=False, trace=trace).summary
o = s.get("kv_offload") or {}
print(json.dumps({"steps": s["num_steps"], "finished": s["num_finished"], "makespan_s": round(s["makespan_s"], 1),
                  "ttft_p50_ms": round(1e3 * s["ttft_p50_s"], 1), "tier_blocks_stored": o.get("blocks_stored", 0)}))
"""


def measure(n: int, replicas: int, router: str, cpu_gib: float) -> dict:
    out = tempfile.mkdtemp(prefix="kvsim-bench-fleet-scale-")
    try:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(n), os.path.join(out, "run"), str(replicas),
                                 router, str(cpu_gib)], stdout=subprocess.PIPE, text=True)
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        if status:
            raise SystemExit(f"{n} requests: the simulation failed with status {status}")
        row = json.loads(stdout.strip().splitlines()[-1])
        cpu = usage.ru_utime + usage.ru_stime
        return {"requests": n, "cpu_s": round(cpu, 1), "requests_per_cpu_s": round(n / cpu),
                "cpu_ms_per_request": round(1e3 * cpu / n, 3), "peak_rss_mib": round(usage.ru_maxrss / 1024), **row}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, metavar="N", help=f"request counts (default {SIZES})")
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--router", default="round_robin")
    parser.add_argument("--cpu-gib", type=float, default=64.0, help="CPU offload per replica, GiB (0: none)")
    args = parser.parse_args()
    sizes = sorted(args.sizes or SIZES)
    if any(n < 1 for n in sizes) or args.replicas < 1 or args.cpu_gib < 0:
        parser.error("request counts and --replicas must be positive, --cpu-gib >= 0")
    rows = []
    for n in sizes:
        rows.append(measure(n, args.replicas, args.router, args.cpu_gib))
        print(json.dumps(rows[-1]), flush=True)
    first, last = rows[0]["cpu_ms_per_request"], rows[-1]["cpu_ms_per_request"]
    linear = len(rows) >= 2 and abs(last / first - 1) <= LINEAR_TOLERANCE
    verdict = {"fleet": f"{args.replicas} replicas, {args.router}, CPU tier {args.cpu_gib:g} GiB",
               "cpu_per_request_largest_vs_smallest": round(last / first, 3), "linear": linear}
    if linear:        # 1 M requests at the largest size's CPU per request, memory growing as between the two largest
        # (the first sizes include the CPU tiers filling up: 64 x 32,768 blocks at the defaults)
        rss_per_req = (rows[-1]["peak_rss_mib"] - rows[-2]["peak_rss_mib"]) / (sizes[-1] - sizes[-2])
        verdict["extrapolated_1M_cpu_s"] = round(last * 1e3)
        verdict["extrapolated_1M_peak_rss_mib"] = round(rows[-1]["peak_rss_mib"] + rss_per_req * (1_000_000 - sizes[-1]))
    print(json.dumps(verdict))


if __name__ == "__main__":
    main()
