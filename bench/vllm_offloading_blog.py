"""Issue 44's check against vLLM's own CPU offloading results: the vLLM blog "Inside vLLM's New Offloading Connector:
Smarter Memory Transfer for Maximizing Inference Throughput" (Or Ozeri, Danny Harnik, IBM Research; blog.vllm.ai,
source vllm-project/vllm-project.github.io _posts/2025-12-29-offloading-connector.md, merged in that repository's
PR #149, January 2026).

Their setup: one NVIDIA H100 80GB HBM3, Intel Xeon Sapphire Rapids (8 cores), 500 GB DRAM, vLLM at commit 2a1776b7
(0.12+ with the contiguous cross-layer block layout, PRs #29870 and #31341), FlashAttention, GPU prefix caching
disabled (so that hits come from the CPU), GPU and CPU blocks of 16 tokens, no (de)tokenization, the
OffloadingConnector's CPU backend copying with cudaMemcpyAsync (DMA: ~50 GB/s one way for 2 MB blocks, 83.4 GB/s
both ways). Published (the figures are plots; the text gives):

1. single-request TTFT, Llama-3.1-8B-Instruct: loading the prompt's KV from CPU instead of computing it cuts TTFT
   "by X2-X22, depending on the prompt size" (Figure 1); a miss's TTFT is barely affected (stores are async);
2. concurrent throughput, Llama-3.1-8B-Instruct, 10,000 unique 512-token prefill requests at once, the CPU cache
   warmed first (its time omitted), GPU cache unused: throughput rises with the CPU hit rate, "up to X9"
   (Figure 2).

kvsim's runs: Llama-3.1-8B on one H100 (`h100`: PCIe 5.0 x16, 64 GB/s, x the profile's pcie_eff 0.8 = 51.2 GB/s a
direction, the catalog's figure, close to the blog's measured DMA rate; not fitted), `kv_offload` as vLLM's
OffloadingConnector (sim/cluster/connectors/offload.py), `engine.enable_prefix_caching: false`, 16-token blocks,
requests built with explicit prefix ids so that a request's blocks are the warm-up's.

Assumptions (the blog does not state them; each is printed, and how the answer moves is in docs/kv-tiers.md):
- the prompt sizes of Figure 1: 1K to 90K tokens (the range the blog names for its Llama-3.2-1B twin, Figure 5);
  the check compares the ends of kvsim's range with X2 and X22;
- "X9" is the 100% hit-rate end of Figure 2 (with a partial hit rate the computed tokens cap the gain far lower);
  a hit rate h means each request's first h x 512 tokens were stored by the warm-up (the last block is always
  recomputed, as vLLM does); the CPU tier holds all of it (10,000 x 512 tokens x 128 KiB = 671 GB: more than the
  blog's 500 GB of DRAM, which the blog leaves open);
- one output token per request (prefill requests), all 10,000 at t=0 after the warm-up.

Usage: python bench/vllm_offloading_blog.py [--requests 10000] [--sizes 1024 ... 90000]
"""
from __future__ import annotations

import argparse
import time

from kvsim.sim.cluster.connectors.offload import cpu_tier_spec, offload_connectors
from kvsim.sim.config import load_config
from kvsim.sim.core.request import Request
from kvsim.sim.engine.assembly import build_engine
from kvsim.sim.engine.resolved_run import resolve_run
from kvsim.sim.results.metrics import StepLog
from kvsim.sim.simulator.executor import replica_parts

PUBLISHED_TTFT_CUT = (2.0, 22.0)      # X2 (smallest prompt) .. X22 (largest), Figure 1
PUBLISHED_THROUGHPUT_GAIN = 9.0       # "up to X9", Figure 2
BLOCK = 16


def run(requests: list[Request], cpu_gib: float | None, max_len: int) -> list[Request]:
    sets = {"model": "llama-3.1-8b", "gpu": "h100", "engine.enable_prefix_caching": False,
            "engine.max_model_len": max_len, "trace_options.max_requests": 1}
    if cpu_gib:
        sets["kv_offload.cpu_gib"] = cpu_gib
    cfg = load_config(None, sets)
    plan = resolve_run(cfg)
    factory = offload_connectors(cpu_tier_spec(cfg.kv_offload, plan), BLOCK) if cpu_gib else None
    engine = build_engine(plan, requests, StepLog(None), lambda i: replica_parts(plan, i), connector=factory)
    assert engine.drive(catch=()) is None
    return requests


def prompt(rid: int, tokens: int, ids_from: int, arrival: float, ids: int | None = None) -> Request:
    """A request of `tokens` prompt tokens whose first `ids` blocks (all, by default) are content ids_from.. ."""
    n = tokens // BLOCK if ids is None else ids
    return Request(request_id=rid, arrival_time=arrival, prompt_tokens=tokens, max_output_tokens=1,
                   prefix_hash_ids=tuple(range(ids_from, ids_from + n)), prefix_block_tokens=BLOCK)


def ttft_check(sizes: list[int]) -> list[tuple[int, float, float]]:
    """Per prompt size: TTFT computed (the first request) and loaded from CPU (the same prompt, later)."""
    out = []
    for size in sizes:
        first, again = prompt(0, size, 0, 0.0), prompt(1, size, 0, 600.0)
        run([first, again], cpu_gib=64, max_len=max(sizes) + 16)
        assert again.num_external_computed_tokens > 0, "the second request must load its prompt from CPU"
        out.append((size, first.token_times[0] - first.arrival_time, again.token_times[0] - again.arrival_time))
    return out


def throughput(n: int, hit: float, offload: bool) -> float:
    """Prompt tokens/s of `n` unique 512-token prefill requests sent at once, after a warm-up that stored the
    first `hit` x 512 tokens of each (its time omitted)."""
    warm_blocks = int(round(hit * 512 / BLOCK))
    reqs = []
    if offload and warm_blocks:
        reqs += [prompt(n + i, warm_blocks * BLOCK, 1000 * i, 0.0) for i in range(n)]
    start = 10_000.0                                  # after the warm-up has ended and its stores landed
    batch = [prompt(i, 512, 1000 * i, start) for i in range(n)]
    done = run(reqs + batch, cpu_gib=800 if offload else None, max_len=2048)
    end = max(r.finish_time for r in done if r.request_id < n)
    assert min(r.finish_time for r in done if r.request_id >= n) < start if reqs else True
    return 512 * n / (end - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--sizes", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384, 32768, 65536, 90000])
    ap.add_argument("--hits", type=float, nargs="*", default=[0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    args = ap.parse_args()
    t0 = time.process_time()
    print("1. Single-request TTFT, Llama-3.1-8B on H100: computed vs loaded from the CPU tier")
    print("| prompt tokens | TTFT computed ms | TTFT loaded ms | cut |")
    print("|---:|---:|---:|---:|")
    rows = ttft_check(args.sizes)
    for size, computed, loaded in rows:
        print(f"| {size:,} | {computed * 1e3:,.1f} | {loaded * 1e3:,.1f} | x{computed / loaded:.1f} |")
    low, high = rows[0][1] / rows[0][2], rows[-1][1] / rows[-1][2]
    print(f"\nkvsim x{low:.1f} .. x{high:.1f} against published X2 .. X22: "
          f"{low / PUBLISHED_TTFT_CUT[0] - 1:+.0%} / {high / PUBLISHED_TTFT_CUT[1] - 1:+.0%}\n")
    print(f"2. Throughput, {args.requests:,} unique 512-token prefill requests at once, CPU hit rate h")
    base = throughput(args.requests, 0.0, offload=False)
    print(f"without offloading: {base:,.0f} prompt tok/s\n")
    print("| CPU hit rate | prompt tok/s | x without offloading |")
    print("|---:|---:|---:|")
    best = 0.0
    for hit in args.hits:
        tps = throughput(args.requests, hit, offload=True)
        best = max(best, tps / base)
        print(f"| {hit:.0%} | {tps:,.0f} | x{tps / base:.2f} |")
    print(f"\nkvsim up to x{best:.2f} against published up to X9: {best / PUBLISHED_THROUGHPUT_GAIN - 1:+.0%}")
    print(f"({time.process_time() - t0:.1f} s of CPU)")


if __name__ == "__main__":
    main()
