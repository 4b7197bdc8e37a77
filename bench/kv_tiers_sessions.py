"""docs/kv-tiers.md's table (issue 44's "done when"): a 4-replica Llama-3.1-8B fleet on H100 under a multi-turn
workload (bench/configs/multi-turn-4x8b.yaml), with CPU offload of 0 / 100 / 400 GiB per GPU (TP 1: one GPU a
replica) and each router: TTFT and throughput from `kvsim simulate`, the GPU count under an SLO from `kvsim plan`
(the fewest replicas meeting it at this load), one command each, as printed.

Each row runs the two commands as a user types them (subprocesses); their CPU seconds (user + system of the
children) are summed per row. Prints the commands, then a markdown table.

Usage: python bench/kv_tiers_sessions.py [OUTDIR] [--slo "ttft_p90<=1s"] [--rows offload|routers|all]
"""
from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = Path(__file__).parent / "configs" / "multi-turn-4x8b.yaml"
ROWS = [("round_robin", "cpu:0"), ("round_robin", "cpu:100GiB"), ("round_robin", "cpu:400GiB"),
        ("session_affinity", "cpu:0"), ("session_affinity", "cpu:100GiB"), ("session_affinity", "cpu:400GiB"),
        ("least_outstanding", "cpu:100GiB"), ("queue_depth", "cpu:100GiB"), ("kv_usage", "cpu:100GiB"),
        ("prefix_affinity", "cpu:100GiB"), ("precise_prefix", "cpu:100GiB"), ("weighted", "cpu:100GiB")]


def kvsim() -> list[str]:
    return [sys.executable, "-m", "kvsim.sim.cli"]


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd: list[str]) -> str:
    print("$ kvsim " + " ".join(cmd[3:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"failed: {done.stderr[-2000:]}")
    return done.stdout


def row(router: str, offload: str, out: Path, slo: str) -> dict:
    cpu0 = cpu_children()
    sim_out = out / f"{router}-{offload.replace(':', '')}"
    run(kvsim() + ["simulate", "--config", str(CONFIG), "--router", router, "--kv-offload", offload,
                   "--out", str(sim_out), "--overwrite", "--quiet"])
    s = json.loads((sim_out / "summary.json").read_text())
    plan = run(kvsim() + ["plan", "--slo", slo, "--models", "llama-3.1-8b", "--gpus", "h100", "--tps", "1",
                          "--config", str(CONFIG), "--router", router, "--kv-offload", offload, "--repeats", "1",
                          "--no-band", "--jobs", "1", "--max-replicas", "8", "--quiet"])
    m = re.search(r"cheapest h100 TP1 x (\d+) replicas = (\d+) GPUs", plan)
    o = s.get("kv_offload") or {}
    return {"router": router, "cpu_offload": offload.removeprefix("cpu:"),
            "ttft_p50_ms": round(1000 * s["ttft_p50_s"]), "ttft_p90_ms": round(1000 * s["ttft_p90_s"]),
            "ttft_p99_ms": round(1000 * s["ttft_p99_s"]),
            "throughput_tok_s": round(s["throughput_total_tok_s"]),
            "gpu_prefix_hit": round(s["prefix_hit_rate"], 3),
            "cpu_hit": round(o.get("external_prefix_cache_hit_rate", 0.0), 3),
            "gpus_for_slo": int(m.group(2)) if m else "> 8",
            "cpu_s": round(cpu_children() - cpu0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--slo", default="ttft_p90<=1s")
    ap.add_argument("--rows", choices=("offload", "routers", "all"), default="all")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kv-tiers-sessions-"))
    rows = ROWS[:6] if args.rows == "offload" else ROWS[6:] if args.rows == "routers" else ROWS
    results = []
    for router, offload in rows:
        results.append(row(router, offload, out, args.slo))
        print(json.dumps(results[-1]), flush=True)
    keys = list(results[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in results:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    print(f"total CPU: {sum(r['cpu_s'] for r in results):.0f} s")


if __name__ == "__main__":
    main()
