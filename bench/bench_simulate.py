"""Simulator speed on the full Azure conv 2023 trace (19,366 requests), Llama-3.1-8B, no eviction.

Times `kvsim simulate` (this interpreter's checkout) as a child process, process start to results
written, and reads its CPU time (user + sys: what a shared machine's neighbours disturb least) and
peak RSS; prints min / median CPU over `--repeat` runs, wall time, engine steps per CPU second and
simulated seconds per CPU second, on 1x H100 (little memory pressure) and 1x L4 (preemptions).
Usage: python bench/bench_simulate.py [--repeat N] [gpu ...]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KVSIM = [sys.executable, "-c", "import sys; from kvsim.sim.entry import main; sys.argv[0] = 'kvsim'; main()"]


def run(gpu: str, extra: list[str]) -> dict:
    out = tempfile.mkdtemp(prefix=f"kvsim-bench-{gpu}-")
    cmd = [*KVSIM, "simulate", "--trace", "azure-conv-2023", "--model", "llama-3.1-8b", "--gpu", gpu,
           "--out", os.path.join(out, "run"), "--quiet", *extra]
    try:
        t0 = time.perf_counter()
        pid = subprocess.Popen(cmd, stdout=subprocess.DEVNULL).pid
        _, status, usage = os.wait4(pid, 0)
        wall = time.perf_counter() - t0
        if status:
            raise SystemExit(f"{' '.join(cmd)} failed with status {status}")
        s = json.loads(Path(out, "run", "summary.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mib": usage.ru_maxrss / 1024,
            "steps": s["num_steps"], "makespan_s": s["makespan_s"], "preemptions": s["preemptions"],
            "ttft_p50_ms": 1e3 * s["ttft_p50_s"], "tpot_p50_ms": 1e3 * s["tpot_p50_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per GPU (min and median CPU are printed)")
    ap.add_argument("gpus", nargs="*", default=["h100", "l4"])
    args = ap.parse_args()
    print(f"{'gpu':6} {'CPU s min':>9} {'median':>7} {'wall s':>7} {'peak MiB':>9} {'steps':>8} {'steps/CPU s':>11} "
          f"{'sim s/CPU s':>11} {'preempt':>8} {'TTFT p50 ms':>11} {'TPOT p50 ms':>11}")
    for gpu in args.gpus:
        runs = [run(gpu, []) for _ in range(args.repeat)]
        cpu = [r["cpu_s"] for r in runs]
        r, best = runs[0], min(cpu)
        print(f"{gpu:6} {best:9.2f} {statistics.median(cpu):7.2f} {statistics.median(x['wall_s'] for x in runs):7.2f} "
              f"{max(x['peak_rss_mib'] for x in runs):9.0f} {r['steps']:8d} {r['steps'] / best:11.0f} "
              f"{r['makespan_s'] / best:11.0f} {r['preemptions']:8d} {r['ttft_p50_ms']:11.1f} {r['tpot_p50_ms']:11.1f}")
    print(f"{args.repeat} runs per GPU; CPU = user + sys of the kvsim process")


if __name__ == "__main__":
    main()
