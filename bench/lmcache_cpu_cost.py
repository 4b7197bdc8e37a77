"""LMCache's CPU work on a cache miss, and how it moves kvsim's miss overhead against GPUStack's measured one.

What LMCache does on the CPU for a request it has never seen (LMCacheConnectorV1 without layer-wise mode, the
connector GPUStack ran with vLLM 0.10.1.1), read from LMCache's code (github.com/LMCache/LMCache,
lmcache/v1/token_database.py `ChunkedTokenDatabase.process_tokens`, `_prefix_hash`, `_hash_tokens`;
lmcache/v1/cache_engine.py `store`, `lookup`; lmcache/integration/vllm/vllm_v1_adapter.py `wait_for_save`):

- the scheduler's lookup (`get_num_new_matched_tokens`) hashes the prompt: its tokens cut into 256-token chunks,
  each chunk's hash taken over (the previous chunk's hash, the chunk's tokens as a tuple, extra keys) with the
  configured hash function (`pre_caching_hash_algorithm`, "builtin": Python's `hash`), the tokens of a torch
  tensor turned into a tuple (`tuple(tokens.cpu().tolist())`);
- every save (`wait_for_save` -> `store`, at the end of each step that fills chunks) hashes the request's tokens
  again from the first one (the chain), allocates a memory object per new chunk, copies the chunk off the GPU and
  puts it to the CPU backend.

This script measures the hashing on this machine with that operation (a torch tensor of token ids, sliced per
256 tokens, `tolist`, `tuple`, `hash` chained with the previous hash: the figure `kv_offload.lmcache_hash_s_per_token`
defaults to). The allocation and put are not run here (no LMCache install): their cost is LMCache's own logged
`put_time` of a store, 0.41-0.60 ms for 7,219 tokens (29 chunks) on TP 8 workers in LMCache PR #1413 (2025-08-21,
the vLLM 0.10 era), about 18 us a chunk (`kv_offload.lmcache_put_s_per_chunk`). Nothing here is fitted to GPUStack's
figures.

Then it runs GPUStack's cache-miss workloads (bench/lmcache_gpustack.py: `vllm bench serve --dataset-name random
--random-input-len L --random-output-len 128 --num-prompts 100`, Qwen3-8B on an RTX 4090) without LMCache, with
LMCache's transfers only (the CPU work set to 0), with them and the CPU work, and with the store copy at the
throughput LMCache's own logs report for its GPU-to-CPU offload (`--offload-gb-s`, default 12 and 18 GB/s: "Stored
... throughput" lines of LMCache issue #2262 and PR #1413; the 4090's host link is otherwise its PCIe 4.0 x16 x the
profile's pcie_eff, 25.6 GB/s): an assumption, shown as such.

Usage: python bench/lmcache_cpu_cost.py [--offload-gb-s 12 18] [--rounds 200]
"""
from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation

CHUNK = 256
PUBLISHED_MISSES = {1024: (579.86, 561.44), 8192: (77.87, 66.77), 20480: (22.97, 21.77)}   # output tok/s without, with


def chained_chunk_hashes(tokens, chunk: int = CHUNK) -> list[int]:
    """The prefix hash chain over a token tensor's chunks, as LMCache's token database takes it."""
    prefix, out = 0, []
    for start in range(0, len(tokens), chunk):
        prefix = hash((prefix, tuple(tokens[start:start + chunk].cpu().tolist()), None))
        out.append(prefix)
    return out


def hash_seconds_per_token(rounds: int, length: int = 8192) -> float:
    """CPU seconds (process time) per token of the hash chain over a `length`-token prompt."""
    import torch
    tokens = torch.randint(0, 150_000, (length,), dtype=torch.long, generator=torch.Generator().manual_seed(0))
    for _ in range(max(rounds // 10, 1)):
        chained_chunk_hashes(tokens)
    start = time.process_time()
    for _ in range(rounds):
        chained_chunk_hashes(tokens)
    return (time.process_time() - start) / (rounds * length)


def miss_overheads(offload_gb_s: list[float]) -> None:
    lmcache = {"kv_offload.cpu_gib": 50, "kv_offload.connector": "lmcache"}
    no_cpu = {"kv_offload.lmcache_hash_s_per_token": 0.0, "kv_offload.lmcache_put_s_per_chunk": 0.0}
    variants = [("transfers only", {**lmcache, **no_cpu}), ("+ CPU work", lmcache)]
    variants += [(f"+ CPU work, offload {g:g} GB/s", {**lmcache, "kv_offload.bandwidth_gb_s": g}) for g in offload_gb_s]
    print("| input tokens | published | " + " | ".join(name for name, _ in variants) + " | LMCache CPU s |")
    print("|---:|---:|" + "---:|" * (len(variants) + 1))
    with tempfile.TemporaryDirectory() as tmp:
        for length, (p0, p1) in PUBLISHED_MISSES.items():
            rand = {"trace": "random", "trace_options.random.input_len": length, "trace_options.random.output_len": 128,
                    "trace_options.max_requests": 100, "seed": 40, "model": "qwen3-8b", "gpu": "rtx-4090"}
            base = run_simulation(load_config(None, rand), Path(tmp) / f"b{length}").summary["output_throughput"]
            cells, cpu = [], 0.0
            for i, (_, sets) in enumerate(variants):
                s = run_simulation(load_config(None, {**rand, **sets}), Path(tmp) / f"v{i}-{length}").summary
                cells.append(f"{s['output_throughput'] / base - 1:+.2%}")
                if i == 1:
                    cpu = s["kv_offload"]["lmcache_cpu_s"]
            print(f"| {length:,} | {p1 / p0 - 1:+.1%} | " + " | ".join(cells) + f" | {cpu:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--offload-gb-s", type=float, nargs="*", default=[18.0, 12.0],
                    help="GPU-to-CPU store throughputs to try (LMCache's logged ones)")
    ap.add_argument("--rounds", type=int, default=200, help="hash chains over an 8K-token prompt to time")
    args = ap.parse_args()
    warnings.simplefilter("ignore")          # the random dataset's "all at t=0" notice: intended here
    per_token = hash_seconds_per_token(args.rounds)
    print(f"LMCache's chunk hash chain on this machine: {per_token * 1e9:.1f} ns per token, "
          f"{per_token * CHUNK * 1e6:.2f} us per {CHUNK}-token chunk (kv_offload.lmcache_hash_s_per_token "
          f"defaults to 3.2e-08)\n")
    print("Output tok/s with LMCache against without, random prompts that are never reused:")
    miss_overheads(args.offload_gb_s)


if __name__ == "__main__":
    main()
