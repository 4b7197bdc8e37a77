"""Benchmark: a 48-run sweep over the Azure conversation trace, timed on the local process pool
(serial and all cores) and on a 2-worker Dask cluster; checks the three stores are identical.

    python bench/bench_sweep.py [--max-requests 500] [--skip-serial]

Axes: block size x max_num_seqs x token budget x arrival-rate scale (2 x 2 x 2 x 6). Replace them
with kv.policy / kv.budget once eviction policies are configurable; nothing else changes.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pandas as pd

from kvsim.sim.planning.sweep import SweepRunOptions, parse_spec, read_store, run_sweep


def make_spec(max_requests: int, grid: str = "policies") -> dict:
    if grid == "policies":     # the sweep: policies x budgets x rate scales (x slot strategy)
        return {
            "name": "bench-azure-conv-48-policies",
            "fixed": {"trace": "azure-conv-2023", "model": "llama-3.1-8b", "gpu": "h100",
                      "trace_options.max_requests": max_requests, "kv.layout": "per_head", "kv.mode": "fast"},
            # h2o's budget and streaming's window are each policy's kept-token budget
            "runs": [{"kv.policy": "h2o", "kv.budget": b} for b in (128, 256, 512, 1024)]
                    + [{"kv.policy": "streaming", "kv.params.window": b} for b in (128, 256, 512, 1024)],
            "grid": {"kv.slot_strategy": ["free_block", "slot_reuse"], "trace_options.rate_scale": [0.5, 1, 2]},
        }
    return {
        "name": "bench-azure-conv-48",
        "fixed": {"trace": "azure-conv-2023", "model": "llama-3.1-8b", "gpu": "h100",
                  "trace_options.max_requests": max_requests},
        "grid": {"engine.block_size": [16, 32], "engine.max_num_seqs": [64, 256],
                 "engine.max_num_batched_tokens": [2048, 8192],
                 "trace_options.rate_scale": [0.5, 1, 2, 3, 4, 6]},
    }


def timed(label: str, fn) -> tuple[str, float]:
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    print(f"{label:<34s} {wall:7.1f} s", flush=True)
    return label, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-requests", type=int, default=None,
                    help="requests per run (default 60 for the policy grid, 500 for the engine grid)")
    ap.add_argument("--grid", choices=["policies", "engine"], default="policies")
    ap.add_argument("--skip-serial", action="store_true")
    args = ap.parse_args()
    if args.max_requests is None:
        args.max_requests = 60 if args.grid == "policies" else 500
    plan = parse_spec(make_spec(args.max_requests, args.grid))
    assert len(plan.runs) == 48, len(plan.runs)
    root = Path(tempfile.mkdtemp(prefix="kvsim-bench-sweep-"))
    print(f"48 runs, {args.max_requests} requests each, stores under {root}")
    stores = {}

    def local(name: str, jobs: int | None):
        stores[name] = root / name
        return lambda: run_sweep(plan, stores[name], SweepRunOptions(jobs=jobs), progress=False)

    def dask():
        from distributed import Client, LocalCluster
        stores["dask"] = root / "dask"
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                          host="127.0.0.1") as cluster, Client(cluster) as client:
            t0 = time.perf_counter()
            run_sweep(plan, stores["dask"], SweepRunOptions("dask", scheduler=client.scheduler.address),
                      progress=False)
            print(f"  (cluster start excluded: sweep alone {time.perf_counter() - t0:.1f} s)")

    results = []
    if not args.skip_serial:
        results.append(timed("local, 1 process (serial)", local("serial", 1)))
    results.append(timed("local, process pool (all cores)", local("local", None)))
    results.append(timed("dask LocalCluster, 2 workers", dask))
    results.append(timed("re-run on finished store (resume)", lambda: run_sweep(plan, stores["local"],
                                                                                progress=False)))

    frames = {k: read_store(v).drop(columns="wall_s") for k, v in stores.items()}
    ref = frames["local"]
    for name, df in frames.items():
        pd.testing.assert_frame_equal(df, ref, obj=f"{name} store")
    print(f"stores identical across {', '.join(frames)} ({len(ref)} rows, {int((ref.status == 'ok').sum())} ok)")
    sims = read_store(stores["local"])["wall_s"]
    print(f"per-run simulate wall time: mean {sims.mean():.2f} s, max {sims.max():.2f} s")
    best = ref.loc[(ref["ttft_p99_s"] <= 2.0) & (ref["tpot_p99_s"] <= 0.1)].sort_values("usd_per_m_output_tok").head(3)
    axes = [c for c in plan.axes if c in ref.columns] if hasattr(plan, "axes") else []
    axes = axes or [c for c in ("kv.policy", "kv.budget", "kv.params.window", "kv.slot_strategy",
                                "engine.block_size", "engine.max_num_seqs", "engine.max_num_batched_tokens",
                                "trace_options.rate_scale") if c in ref.columns and ref[c].nunique(dropna=True) > 1]
    cols = axes + ["throughput_output_tok_s", "ttft_p99_s", "fragmentation_p99", "usd_per_m_output_tok"]
    print("cheapest configs meeting TTFT p99 <= 2 s, TPOT p99 <= 100 ms:")
    print(best[cols].to_string(index=False))


if __name__ == "__main__":
    main()
