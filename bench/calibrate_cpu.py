"""Regenerate the shipped CPU calibration: replay a generated sweep of closed batches on the real
backend (SmolLM2-135M), fit `sim/data/profiles/cpu-smollm2.yaml` and
`sim/data/importance/smollm2-135m-fitted.yaml`, then cross-check on a held-out Azure conv slice
with policy none and h2o + slot_reuse. Prints the figures and the load average.

    python bench/calibrate_cpu.py --out runs/calibration [--threads 2] [--skip-crosscheck]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def calibration_trace(batches, prompts, output_tokens: int, gap_s: float = 1e4):
    """Closed batches (all requests of one batch at once), one after another with idle gaps."""
    from traces.synthetic import closed_batch
    from traces.trace import Trace
    parts = []
    for i, (b, p) in enumerate((b, p) for p in prompts for b in batches):
        t = closed_batch(b, p, output_tokens)
        t.df["arrival_time_s"] = i * gap_s
        parts.append(t)
    return Trace.concat(parts, how="overlay", name="calibration-sweep")


def kvsim(*args: str) -> None:
    print("$ kvsim " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-c", "from sim.cli import main; main()", *args], check=True, cwd=ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "calibration")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 256, 768])
    ap.add_argument("--output-tokens", type=int, default=12)
    ap.add_argument("--num-gpu-blocks", type=int, default=1200)
    ap.add_argument("--crosscheck-requests", type=int, default=6)
    ap.add_argument("--skip-crosscheck", action="store_true")
    args = ap.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    from gpu.replay import ReplayOptions, run_replay
    from sim.config import load_config

    print(f"load average before: {os.getloadavg()}, torch threads {torch.get_num_threads()}", flush=True)
    trace = calibration_trace(args.batches, args.prompts, args.output_tokens)
    cfg = load_config(None, {"model": "smollm2-135m", "gpu": "cpu-2core", "profile": "cpu-2core",
                             "engine.num_gpu_blocks": args.num_gpu_blocks})
    cal_dir = args.out / "replay-sweep"
    res = run_replay(cfg, cal_dir, trace=trace, options=ReplayOptions(device="cpu"), progress=True)
    print(f"calibration replay: {len(res.steps)} steps, load average after: {os.getloadavg()}", flush=True)
    profile = ROOT / "sim" / "data" / "profiles" / "cpu-smollm2.yaml"
    importance = ROOT / "sim" / "data" / "importance" / "smollm2-135m-fitted.yaml"
    kvsim("calibrate", str(cal_dir), "--out", str(profile), "--model", "smollm2-135m", "--gpu", "cpu-2core")
    kvsim("calibrate", "--attention", str(cal_dir), "--out", str(importance))
    if args.skip_crosscheck:
        return
    # A held-out Azure conv slice; prompts beyond 1,100 tokens are rejected (and outputs capped) so
    # the CPU replay of the full 30-layer model stays within minutes.
    common = ["--trace", "azure-conv-2023", "--profile", str(profile), "--num-gpu-blocks", str(args.num_gpu_blocks),
              "--start-s", "2400", "--max-requests", str(args.crosscheck_requests), "--rate-scale", "0.5",
              "--set", "engine.max_model_len=1100", "--threads", str(args.threads)]
    kvsim("crosscheck", *common, "--out", str(args.out / "crosscheck-none"))
    kvsim("crosscheck", *common, "--set", "kv.policy=h2o", "--set", "kv.budget=256",
          "--set", "kv.slot_strategy=slot_reuse", "--out", str(args.out / "crosscheck-h2o"))


if __name__ == "__main__":
    main()
