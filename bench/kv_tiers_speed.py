"""Issue 44's speed check: the CPU cost of a 16-replica fleet with CPU offload and precise prefix-cache
routing on the Azure conversation trace, against the same trace on one replica without them (the main
command: `kvsim simulate --trace azure-conv-2023 --model llama-3.1-8b --gpu h100`). Target: at most 3x.

Each run is `run_simulation` in this process with its outputs written (as `kvsim simulate` writes them),
timed in CPU seconds of this process (time.process_time: user + system, so other jobs on a shared machine
do not count) and wall seconds. The fleet: 16 replicas, `router: precise_prefix`, `kv_offload.cpu_gib: 64`
per replica. The Azure trace has no prefix ids: every prompt block is its request's own, so the CPU tier
stores every prompt (its store path is exercised in full) and hits only within a request (after a
preemption); the router reads every replica's prefix cache for every request. A third run takes the same
fleet with round-robin routing, which reads no replica state and is routed ahead (sim.engine.loop.RoutedAhead:
each replica's decode runs stop at its own arrivals only); the precise prefix router must read every
replica's state at every arrival, so every replica's run still ends at every arrival of the fleet.

Usage: python bench/kv_tiers_speed.py [--repeats N] [--max-requests N] [OUTDIR]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation

BASE = {"trace": "azure-conv-2023", "model": "llama-3.1-8b", "gpu": "h100"}
FLEET = {"replicas": 16, "router": "precise_prefix", "kv_offload.cpu_gib": 64}
ROUND_ROBIN = {"replicas": 16, "router": "round_robin", "kv_offload.cpu_gib": 64}


def timed(sets: dict, out: Path) -> dict:
    cfg = load_config(None, sets)
    cpu, wall = time.process_time(), time.perf_counter()
    s = run_simulation(cfg, out, overwrite=True).summary
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    o = s.get("kv_offload") or {}
    return {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "requests": s["num_requests"],
            "steps": s["num_steps"], "ttft_p50_s": round(s["ttft_p50_s"], 4),
            "blocks_stored": o.get("blocks_stored", 0), "gib_to_cpu": round(o.get("bytes_to_tier", 0) / 2**30, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-requests", type=int, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kv-tiers-speed-"))
    base = dict(BASE)
    if args.max_requests:
        base["trace_options.max_requests"] = args.max_requests
    runs = {"one replica": base, "16 replicas, offload, precise_prefix": {**base, **FLEET},
            "16 replicas, offload, round_robin (routed ahead)": {**base, **ROUND_ROBIN}}
    rows: dict[str, list] = {name: [] for name in runs}
    for _ in range(args.repeats):        # interleaved: a shared machine's load hits all alike
        for i, (name, sets) in enumerate(runs.items()):
            rows[name].append(timed(sets, out / f"run{i}"))
    for name, timings in rows.items():
        print(json.dumps({"run": name, **min(timings, key=lambda r: r["cpu_s"])}), flush=True)
    one, fleet, ahead = (min(r["cpu_s"] for r in timings) for timings in rows.values())
    print(json.dumps({"cpu_ratio": round(fleet / one, 2), "target": 3.0, "meets": fleet / one <= 3.0,
                      "round_robin_cpu_ratio": round(ahead / one, 2)}))


if __name__ == "__main__":
    main()
