"""The figures of docs/results.md (2026-12-07, issue 44: KV offload and routers): CPU offload sizes, and the routers, on a
document-QA workload whose documents outnumber what the GPU's prefix cache holds.

The workload (written as a Mooncake JSONL trace, seeded): 400 requests, Poisson at 2 req/s, each a
question about one of 40 documents of 4-16K tokens (hash ids per 512 tokens; document popularity
Zipf-like) plus its own 50-300-token question; answers of 100-300 tokens. Llama-3.1-8B on H100 with a
GPU pool of 4,000 blocks (64K tokens), so documents leave the GPU's prefix cache between reuses.

Usage: python bench/kv_tiers_figures.py [OUTDIR]   (prints one line per run)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation


def write_trace(path: Path, n: int = 400, docs: int = 40, rate: float = 2.0, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(8, 33, docs)                     # 512-token blocks: 4-16K tokens
    weights = 1.0 / np.arange(1, docs + 1) ** 0.8
    weights /= weights.sum()
    t = 0.0
    with path.open("w") as f:
        for i in range(n):
            t += float(rng.exponential(1.0 / rate))
            d = int(rng.choice(docs, p=weights))
            question = int(rng.integers(50, 300))
            ids = [d * 1000 + b for b in range(int(sizes[d]))] + [10**6 + i]
            f.write(json.dumps({"timestamp": int(t * 1000), "input_length": int(sizes[d]) * 512 + question,
                                "output_length": int(rng.integers(100, 300)), "hash_ids": ids}) + "\n")


def run(trace: Path, out: Path, **sets) -> dict:
    cfg = load_config(None, {"trace": str(trace), "trace_options.format": "mooncake", "engine.num_gpu_blocks": 4000,
                             **sets})
    s = run_simulation(cfg, out, overwrite=True).summary
    o = s.get("kv_offload") or {}
    return {"ttft_mean_s": round(s["ttft_mean_s"], 3), "ttft_p90_s": round(s["ttft_p90_s"], 3),
            "throughput_total_tok_s": round(s["throughput_total_tok_s"]),
            "gpu_prefix_hit_rate": round(s["prefix_hit_rate"], 3),
            "cpu_hit_rate": round(o.get("external_prefix_cache_hit_rate", 0.0), 3),
            "gib_to_cpu": round(o.get("bytes_to_tier", 0) / 2**30, 1),
            "gib_from_cpu": round(o.get("bytes_from_tier", 0) / 2**30, 1), "wall_s": round(s["wall_s"], 1)}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "docs.jsonl"
    write_trace(trace)
    for cpu in (None, 16, 64):
        sets = {} if cpu is None else {"kv_offload.cpu_gib": cpu}
        print(json.dumps({"run": f"1 replica, cpu {cpu or 0} GiB", **run(trace, out / f"offload-{cpu}", **sets)}), flush=True)
    for router in ("round_robin", "least_outstanding", "queue_depth", "kv_usage", "prefix_affinity", "precise_prefix",
                   "weighted"):
        sets = {"replicas": 4, "router": router, "trace_options.rate_scale": 4.0}
        print(json.dumps({"run": f"4 replicas, {router}", **run(trace, out / f"router-{router}", **sets)}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kv-tiers"))
