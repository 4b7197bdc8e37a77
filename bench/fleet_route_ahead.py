"""Fleets routed ahead (sim.engine.loop.RoutedAhead) against the engine as it was (every replica's decode
run ending at every arrival of the fleet): the same outputs and the CPU each takes, on several fleets.

For each fleet, `run_simulation` writes its outputs twice in this process: routed ahead (today's engine)
and with `sim.engine.assembly.routes_ahead` answering False (the engine before routing ahead: the same
arrival process and router, each replica's next arrival the fleet's next one). Printed per run: CPU
seconds (time.process_time: user + system of this process), the sha256 of requests.parquet and
steps.parquet, and of the step rows sorted by (replica, step) (a fleet's steps.parquet holds its rows in
row groups of 65,536 in the order the replicas appended them, each group sorted by (replica, step): longer
decode runs append some rows earlier, so a file of several groups can group them differently while
holding the same rows, as fast-forward on and off already did). `same` compares requests.parquet's bytes
and the sorted step rows.

Usage: python bench/fleet_route_ahead.py [--max-requests N] [--repeats N]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

import pandas as pd

from kvsim.sim.config import load_config
from kvsim.sim.engine import assembly
from kvsim.sim.simulator.simulate import run_simulation

BASE = {"trace": "azure-conv-2023", "model": "llama-3.1-8b", "gpu": "h100", "router": "round_robin"}
FLEETS = {
    "16 replicas": {"replicas": 16},
    "16 replicas, CPU tier 64 GiB": {"replicas": 16, "kv_offload.cpu_gib": 64},
    "4 replicas, sync scheduling, 2x rate": {"replicas": 4, "engine.async_scheduling": False,
                                             "trace_options.rate_scale": 2.0},
    "8 replicas, prefix caching off, CPU tier 8 GiB, 4x rate": {
        "replicas": 8, "engine.enable_prefix_caching": False, "kv_offload.cpu_gib": 8, "trace_options.rate_scale": 4.0},
}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def run(sets: dict, out: Path, ahead: bool) -> dict:
    real = assembly.routes_ahead
    if not ahead:
        assembly.routes_ahead = lambda name: False
    try:
        cfg = load_config(None, sets)
        cpu = time.process_time()
        summary = run_simulation(cfg, out, overwrite=True).summary
        cpu = time.process_time() - cpu
    finally:
        assembly.routes_ahead = real
    steps = pd.read_parquet(out / "steps.parquet").sort_values(["replica", "step"]).reset_index(drop=True)
    rows = hashlib.sha256(pd.util.hash_pandas_object(steps, index=False).to_numpy().tobytes()).hexdigest()[:16]
    return {"cpu_s": round(cpu, 2), "steps": summary["num_steps"], "requests_sha": sha(out / "requests.parquet"),
            "steps_sha": sha(out / "steps.parquet"), "sorted_step_rows_sha": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fleet-route-ahead-"))
    for name, fleet in FLEETS.items():
        sets = {**BASE, **fleet}
        if args.max_requests:
            sets["trace_options.max_requests"] = args.max_requests
        best: dict = {}
        for _ in range(args.repeats):          # interleaved: a shared machine's load hits both alike
            for ahead in (False, True):
                r = run(sets, tmp / ("ahead" if ahead else "before"), ahead)
                if ahead not in best or r["cpu_s"] < best[ahead]["cpu_s"]:
                    best[ahead] = r
        before, after = best[False], best[True]
        same = (before["requests_sha"] == after["requests_sha"]
                and before["sorted_step_rows_sha"] == after["sorted_step_rows_sha"])
        print(json.dumps({"fleet": name, "before": before, "routed_ahead": after, "same": same,
                          "steps_file_bytes_same": before["steps_sha"] == after["steps_sha"],
                          "cpu_ratio": round(after["cpu_s"] / before["cpu_s"], 3)}), flush=True)


if __name__ == "__main__":
    main()
