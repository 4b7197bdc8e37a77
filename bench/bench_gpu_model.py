"""CPU timing of the real backend on SmolLM2-135M: prefill of 512 tokens and decode steps at
512-token contexts for batch 1/8/32 (paged cache, shared layout, block size 16). Prints figures."""
from __future__ import annotations

import argparse
import time

import torch

from kvsim.gpu.attention import AttentionMetadata
from kvsim.gpu.cache import PagedKVCache
from kvsim.gpu.prompts import prompt_token_ids
from kvsim.gpu.weights import load_smollm2


def fill_step(model, cache, seq: int, prompt: list[int], block_size: int, max_blocks: int):
    table = torch.arange(seq * max_blocks, (seq + 1) * max_blocks)
    pos = torch.arange(len(prompt))
    meta = AttentionMetadata(torch.tensor([0, len(prompt)]), torch.tensor([len(prompt)]),
                             table[pos // block_size] * block_size + pos % block_size, table[None])
    start = time.perf_counter()
    model.forward(torch.tensor(prompt), pos, meta, cache)
    return time.perf_counter() - start, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    t0 = time.perf_counter()
    model = load_smollm2()
    print(f"load {time.perf_counter() - t0:.2f} s, torch threads {torch.get_num_threads()}")
    bs, ctx = 16, args.context
    max_blocks = (ctx + args.steps + 1) // bs + 1
    cache = PagedKVCache.for_model(model.config, "shared", max(args.batches) * max_blocks, bs)
    tables = []
    for seq in range(max(args.batches)):
        elapsed, table = fill_step(model, cache, seq, prompt_token_ids(ctx, seed=seq), bs, max_blocks)
        tables.append(table)
        if seq < 2:
            print(f"prefill {ctx} tokens: {elapsed * 1e3:.0f} ms")
    for batch in args.batches:
        times = []
        for step in range(args.steps):
            pos = torch.full((batch,), ctx + step)
            slots = torch.tensor([int(tables[s][(ctx + step) // bs]) * bs + (ctx + step) % bs for s in range(batch)])
            meta = AttentionMetadata(torch.arange(batch + 1), torch.full((batch,), ctx + step + 1), slots,
                                     torch.stack(tables[:batch]))
            start = time.perf_counter()
            model.forward(torch.full((batch,), 42), pos, meta, cache)
            times.append(time.perf_counter() - start)
            cache.evict(slots)  # keep every step at the same context length
        times.sort()
        print(f"decode batch {batch:>2} @ {ctx} ctx: median {times[len(times) // 2] * 1e3:.1f} ms/step "
              f"(min {times[0] * 1e3:.1f})")


if __name__ == "__main__":
    main()
