"""Eviction benchmark: wall time of token-level and fast mode per slot strategy.

1,000 ShareGPT requests arriving at t=0, Llama-3.1-8B on 1x L4 (24 GB), h2o keeping 256 tokens per
KV head (one eviction per head per step), per_head layout. Prints one row per (strategy, mode)
with wall time, simulated steps and the simulated fragmentation, KV utilization and throughput;
with --token-requests, also token-level mode and fast mode on that many requests, and fast mode's
relative difference to token-level on each metric.

    python bench/bench_eviction.py                     # fast mode, 1,000 requests, all strategies
    python bench/bench_eviction.py --token-requests 100  # also token-level mode on the first 100
    python bench/bench_eviction.py --repeats 3           # each fast run 3 times: best and median wall time
    KVSIM_NO_NUMBA=1 python bench/bench_eviction.py      # the kernels' numpy twins instead

The machine's speed drifts by up to ~25% between back-to-back runs (a shared VM), so --repeats
interleaves the strategies (round r runs every strategy once) and reports the best and the median.
"""
from __future__ import annotations

import argparse
import time

from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation

STRATEGIES = ("noop", "free_block", "slot_reuse", "sparse_copy", "holed_copy", "compact", "parallel_compact")


def bench(strategy: str, mode: str, requests: int) -> dict:
    cfg = load_config(None, {
        "trace": "sharegpt-8k-filtered", "trace_options.max_requests": requests, "model": "llama-3.1-8b", "gpu": "l4",
        "kv.policy": "h2o", "kv.budget": 256, "kv.layout": "per_head", "kv.slot_strategy": strategy,
        "kv.mode": mode})
    t0 = time.perf_counter()
    s = run_simulation(cfg).summary
    return {"strategy": strategy, "mode": mode, "requests": requests, "wall_s": time.perf_counter() - t0,
            "frag": s["fragmentation_mean"], "kv_util": s["kv_util_mean"],
            "tok_s": s["throughput_output_tok_s"], "preempt": s["preemptions"], "bytes_moved": s.get("bytes_moved", 0),
            "steps": s.get("num_steps", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="fast-mode requests (0: skip)")
    ap.add_argument("--token-requests", type=int, default=0, help="also run token-level mode on this many")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--repeats", type=int, default=1, help="fast-mode runs per strategy, interleaved (best and median)")
    args = ap.parse_args()
    if args.repeats > 1:
        return repeated(args)
    print(f"{'strategy':<17}{'mode':<6}{'reqs':>6}{'wall s':>9}{'steps':>8}{'frag':>8}{'kv util':>9}"
          f"{'out tok/s':>11}{'preempt':>9}{'GB moved':>10}")
    for strategy in args.strategies.split(","):
        runs = ([("fast", args.requests)] if args.requests else []) + \
            ([("token", args.token_requests), ("fast", args.token_requests)] if args.token_requests else [])
        out = {}
        for mode, n in runs:
            r = out[mode, n] = bench(strategy, mode, n)
            print(f"{r['strategy']:<17}{r['mode']:<6}{r['requests']:>6}{r['wall_s']:>9.2f}{r['steps']:>8}"
                  f"{r['frag']:>8.3f}{r['kv_util']:>9.3f}{r['tok_s']:>11.1f}{r['preempt']:>9}"
                  f"{r['bytes_moved'] / 1e9:>10.2f}", flush=True)
        if args.token_requests:
            tok, fast = out["token", args.token_requests], out["fast", args.token_requests]
            diff = {k: (fast[k] - tok[k]) / tok[k] if tok[k] else 0.0 for k in ("frag", "kv_util", "tok_s")}
            print(f"{'':<17}fast vs token: frag {diff['frag']:+.1%}  kv util {diff['kv_util']:+.1%}  "
                  f"throughput {diff['tok_s']:+.1%}  speed-up {tok['wall_s'] / fast['wall_s']:.0f}x", flush=True)


def repeated(args) -> None:
    strategies = args.strategies.split(",")
    walls = {st: [] for st in strategies}
    for r in range(args.repeats):
        for st in strategies:
            res = bench(st, "fast", args.requests)
            walls[st].append(res["wall_s"])
            print(f"round {r + 1}: {st:<17}{res['wall_s']:>7.2f} s  {res['steps']} steps", flush=True)
    print(f"{'strategy':<17}{'best s':>8}{'median s':>10}{'worst s':>9}")
    for st, w in walls.items():
        w = sorted(w)
        print(f"{st:<17}{w[0]:>8.2f}{w[len(w) // 2]:>10.2f}{w[-1]:>9.2f}")


if __name__ == "__main__":
    main()
