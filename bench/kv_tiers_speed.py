"""Issue 44's speed check: the CPU cost of a 16-replica fleet with CPU offload and precise prefix-cache
routing on the Azure conversation trace, against the same trace on one replica without them (the main
command: `kvsim simulate --trace azure-conv-2023 --model llama-3.1-8b --gpu h100`). Target: at most 3x.

Each run is `run_simulation` in this process with its outputs written (as `kvsim simulate` writes them),
timed in CPU seconds of this process (time.process_time: user + system, so other jobs on a shared machine
do not count) and wall seconds. The fleet: 16 replicas, `router: precise_prefix`, `kv_offload.cpu_gib: 64`
per replica. The Azure trace has no prefix ids: every prompt block is its request's own, so the CPU tier
stores every prompt (its store path is exercised in full) and hits only within a request (after a
preemption); the router reads every replica's prefix cache for every request. Its replicas' state is read
lazily (sim.engine.loop.LazyRouting: the outstanding counts and prefix-cache hits are read from each
replica's planned decode run, which goes on past the fleet's arrivals). A third run takes the same fleet
with round-robin routing, which reads no replica state and is routed ahead (sim.engine.loop.RoutedAhead:
each replica's decode runs stop at its own arrivals only). `--eager` adds the precise prefix fleet with lazy
state off (every replica's run cut at every arrival: the engine before it) and checks that its
requests.parquet and tiers.parquet are the lazy run's, byte for byte.

Usage: python bench/kv_tiers_speed.py [--repeats N] [--max-requests N] [--eager] [OUTDIR]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

from kvsim.sim.config import load_config
from kvsim.sim.engine import assembly
from kvsim.sim.simulator.simulate import run_simulation

BASE = {"trace": "azure-conv-2023", "model": "llama-3.1-8b", "gpu": "h100"}
FLEET = {"replicas": 16, "router": "precise_prefix", "kv_offload.cpu_gib": 64}
ROUND_ROBIN = {"replicas": 16, "router": "round_robin", "kv_offload.cpu_gib": 64}


EAGER = "eager"         # a run's marker: lazy replica state off


def timed(sets: dict, out: Path) -> dict:
    sets = dict(sets)
    eager = sets.pop(EAGER, False)
    cfg = load_config(None, sets)
    lazily = assembly.reads_lazily
    if eager:
        assembly.reads_lazily = lambda cfg: False
    try:
        cpu, wall = time.process_time(), time.perf_counter()
        s = run_simulation(cfg, out, overwrite=True).summary
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        assembly.reads_lazily = lazily
    o = s.get("kv_offload") or {}
    return {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "requests": s["num_requests"],
            "steps": s["num_steps"], "ttft_p50_s": round(s["ttft_p50_s"], 4),
            "blocks_stored": o.get("blocks_stored", 0), "gib_to_cpu": round(o.get("bytes_to_tier", 0) / 2**30, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--eager", action="store_true", help="also the precise prefix fleet with lazy replica state off")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kv-tiers-speed-"))
    base = dict(BASE)
    if args.max_requests:
        base["trace_options.max_requests"] = args.max_requests
    runs = {"one replica": base, "16 replicas, offload, precise_prefix": {**base, **FLEET},
            "16 replicas, offload, round_robin (routed ahead)": {**base, **ROUND_ROBIN}}
    if args.eager:
        runs["16 replicas, offload, precise_prefix, lazy state off"] = {**base, **FLEET, EAGER: True}
    rows: dict[str, list] = {name: [] for name in runs}
    for _ in range(args.repeats):        # interleaved: a shared machine's load hits all alike
        for i, (name, sets) in enumerate(runs.items()):
            rows[name].append(timed(sets, out / f"run{i}"))
    for name, timings in rows.items():
        print(json.dumps({"run": name, **min(timings, key=lambda r: r["cpu_s"])}), flush=True)
    one, fleet, ahead, *eager = (min(r["cpu_s"] for r in timings) for timings in rows.values())
    verdict = {"cpu_ratio": round(fleet / one, 2), "target": 3.0, "meets": fleet / one <= 3.0,
               "round_robin_cpu_ratio": round(ahead / one, 2)}
    if eager:
        digest = lambda run, name: hashlib.sha256((out / run / name).read_bytes()).hexdigest()[:16]  # noqa: E731
        verdict.update(lazy_off_cpu_ratio=round(eager[0] / one, 2), lazy_vs_off_cpu=round(fleet / eager[0], 3),
                       same_outputs={name: digest("run1", name) == digest("run3", name)
                                     for name in ("requests.parquet", "tiers.parquet")})
    print(json.dumps(verdict))


if __name__ == "__main__":
    main()
