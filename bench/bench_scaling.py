"""CPU time and peak RSS of `kvsim simulate` as the request count grows: the Azure conv 2023 trace
(19,366 requests, Llama-3.1-8B on 1x H100, the main command's defaults) repeated back to back
(`Trace.concat(..., how="sequential")`) to about 20 k / 80 k / 320 k / 1 M requests.

Each size runs in a child process (trace built, simulated, results written to a temporary folder);
prints CPU seconds (user + sys), ms of CPU per request and the child's peak RSS, so linear CPU and
memory per request can be read off. Past ~40 k requests the request table is streamed to its file
(sim/results/request_log.py), so peak RSS grows only by the per-request state the engine keeps (its Request
objects). Usage: python bench/bench_scaling.py [N ...] (default the four sizes; the 1 M point takes
several minutes of CPU).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

SIZES = [20_000, 80_000, 320_000, 1_000_000]

CHILD = """
import math, sys
from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import Trace, load_trace
n, out = int(sys.argv[1]), sys.argv[2]
base = load_trace("azure-conv-2023")
trace = Trace.concat([base] * math.ceil(n / len(base)), how="sequential").head(n)
cfg = load_config(None, {"trace": "azure-conv-2023", "model": "llama-3.1-8b", "gpu": "h100"})
run_simulation(cfg, out, keep_steps=False, trace=trace)
"""


def measure(n: int) -> tuple[float, float]:
    out = tempfile.mkdtemp(prefix="kvsim-bench-scaling-")
    try:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(n), os.path.join(out, "run")])
        _, status, usage = os.wait4(proc.pid, 0)
        if status:
            raise SystemExit(f"{n} requests: the simulation failed with status {status}")
        return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, metavar="N", help=f"request counts (default {SIZES})")
    sizes = parser.parse_args().sizes or SIZES
    if any(n < 1 for n in sizes):
        parser.error("request counts must be positive")
    print(f"{'requests':>9} {'CPU s':>8} {'ms/request':>10} {'peak RSS MiB':>13}")
    for n in sizes:
        cpu, rss = measure(n)
        print(f"{n:9d} {cpu:8.2f} {1e3 * cpu / n:10.3f} {rss:13.0f}", flush=True)


if __name__ == "__main__":
    main()
