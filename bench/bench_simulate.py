"""Simulator speed on the full Azure conv 2023 trace (19,366 requests), Llama-3.1-8B, no eviction.

Times `kvsim simulate` as a child process (process start to results written) and reads its peak
RSS; prints wall time, engine steps per second and simulated seconds per wall second, on 1x H100
(little memory pressure) and 1x L4 (preemptions). Usage: python bench/bench_simulate.py [gpu ...]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def run(gpu: str, extra: list[str]) -> dict:
    out = tempfile.mkdtemp(prefix=f"kvsim-bench-{gpu}-")
    cmd = ["kvsim", "simulate", "--trace", "azure-conv-2023", "--model", "llama-3.1-8b", "--gpu", gpu,
           "--out", out, "--quiet", *extra]
    t0 = time.perf_counter()
    pid = subprocess.Popen(cmd).pid
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    if status:
        raise SystemExit(f"{' '.join(cmd)} failed with status {status}")
    s = json.load(open(os.path.join(out, "summary.json")))
    return {"gpu": gpu, "wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "steps": s["num_steps"],
            "steps_per_s": s["num_steps"] / wall, "sim_s_per_wall_s": s["makespan_s"] / wall,
            "preemptions": s["preemptions"], "finished": s["num_finished"], "blocks": s["num_gpu_blocks"],
            "ttft_p50_ms": 1e3 * s["ttft_p50_s"], "tpot_p50_ms": 1e3 * s["tpot_p50_s"]}


def main() -> None:
    gpus = sys.argv[1:] or ["h100", "l4"]
    print(f"{'gpu':6} {'wall s':>7} {'peak MiB':>9} {'steps':>8} {'steps/s':>9} {'sim s/wall s':>12} "
          f"{'preempt':>8} {'TTFT p50 ms':>11} {'TPOT p50 ms':>11}")
    for gpu in gpus:
        r = run(gpu, [])
        print(f"{r['gpu']:6} {r['wall_s']:7.2f} {r['peak_rss_mib']:9.0f} {r['steps']:8d} {r['steps_per_s']:9.0f} "
              f"{r['sim_s_per_wall_s']:12.0f} {r['preemptions']:8d} {r['ttft_p50_ms']:11.1f} {r['tpot_p50_ms']:11.1f}")


if __name__ == "__main__":
    main()
