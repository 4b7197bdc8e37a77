"""CPU timing of SmolLM2-135M through the replay path (`gpu.replay.run_replay`: shared scheduler, KV
manager and policies, real executor), as the step log measures it:

- decode step time at batch 1/8/32 with 512-token contexts (policy none, shared layout, bs 16),
- prefill of one 512-token prompt,
- per-step host overhead of each slot strategy (h2o, per_head layout: 30 layers x 3 KV heads = 90
  block tables per request): the executor's KV-plan application + metadata preparation + policy time
  per decode step, next to the forward time,
- the same per decode step for leankv (mixed-precision K8V4/K4V2 pages, quantized writes, precision group
  moves) and quest (selective decode attention, budget = the h2o budget, pages of 16), plus h2o
  free_block for reference.

The machine is shared: the load average is printed with the figures. Usage:
    python bench/bench_gpu_replay.py [--context 512] [--batches 1 8 32] [--strategy-batch 4] [--threads N]
                                     [--parts prefill decode strategies policies]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from kvsim.gpu.replay import run_replay
from kvsim.gpu.weights import load_smollm2
from kvsim.sim.config import load_config
from kvsim.sim.kv.slots import SLOT_STRATEGIES
from kvsim.traces.synthetic import closed_batch
from kvsim.traces.trace import Trace

BASE = {"model": "smollm2-135m", "gpu": "cpu-2core", "profile": "cpu-2core", "engine.block_size": 16}


def load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def decode_steps(steps, batch: int):
    return steps[(steps["num_prefill_seqs"] == 0) & (steps["batch_size"] == batch)]


def bench_decode(model, context: int, batches: list[int], outputs: int) -> None:
    print(f"\ndecode, policy none, shared layout, {context}-token prompts, {outputs} outputs each")
    print(f"{'batch':>6} {'decode step ms (median)':>24} {'min':>8} {'predicted ms':>13} {'tok/s':>8} {'load':>18}")
    for b in batches:
        blocks = b * (-(-(context + outputs) // 16)) + 1
        cfg = load_config(None, {**BASE, "engine.num_gpu_blocks": blocks, "engine.max_num_batched_tokens": 8192})
        res = run_replay(cfg, model=model, trace=closed_batch(b, context, outputs), options=None)
        d = decode_steps(res.steps, b)
        med = float(np.median(d["duration_s"]))
        print(f"{b:>6} {1e3 * med:>24.1f} {1e3 * d['duration_s'].min():>8.1f} "
              f"{1e3 * float(np.median(d['predicted_s'])):>13.1f} {b / med:>8.1f} {load():>18}")


def bench_prefill(model, context: int, repeats: int) -> None:
    cfg = load_config(None, {**BASE, "engine.num_gpu_blocks": repeats * (context // 16 + 2)})
    tr = Trace.from_columns(arrival_time_s=np.arange(repeats) * 1000.0,   # one at a time: idle gaps are skipped
                            prompt_tokens=[context] * repeats, output_tokens=[1] * repeats, name="prefill")
    res = run_replay(cfg, model=model, trace=tr)
    p = res.steps[res.steps["prefill_tokens"] == context]["duration_s"]
    print(f"\nprefill of {context} tokens (batch 1, {repeats} runs): median {1e3 * p.median():.1f} ms, "
          f"min {1e3 * p.min():.1f} ms, {context / p.median():.0f} tok/s; predicted "
          f"{1e3 * res.steps['predicted_s'].median():.1f} ms; load {load()}")


def bench_strategies(model, context: int, batch: int, outputs: int, budget: int) -> None:
    print(f"\nslot strategies: h2o budget {budget}, per_head layout (90 rows), batch {batch}, "
          f"{context}-token prompts, {outputs} outputs; medians per decode step:")
    runs = [(s, {"kv.policy": "h2o", "kv.budget": budget, "kv.slot_strategy": s}) for s in SLOT_STRATEGIES]
    per_decode_step(model, context, batch, outputs, runs)


def bench_policies(model, context: int, batch: int, outputs: int, budget: int) -> None:
    print(f"\nleankv and quest at the same setting (per_head, batch {batch}, {context}-token prompts, "
          f"{outputs} outputs); medians per decode step:")
    runs = [("h2o free_block", {"kv.policy": "h2o", "kv.budget": budget, "kv.slot_strategy": "free_block"}),
            ("leankv", {"kv.policy": "leankv", "kv.slot_strategy": "free_block"}),
            ("leankv compact", {"kv.policy": "leankv", "kv.slot_strategy": "compact"}),
            (f"quest {budget}", {"kv.policy": "quest", "kv.budget": budget})]
    per_decode_step(model, context, batch, outputs, runs)


def per_decode_step(model, context: int, batch: int, outputs: int, runs) -> None:
    print(f"{'run':>17} {'step ms':>9} {'forward ms':>11} {'kv ops ms':>10} {'prepare ms':>11} "
          f"{'policy ms':>10} {'MB moved':>9} {'frag':>6} {'kv tok read':>12} {'load':>18}")
    blocks = batch * (-(-(context + outputs) // 16)) + 4
    for name, kv in runs:
        cfg = load_config(None, {**BASE, "engine.num_gpu_blocks": blocks, "kv.layout": "per_head", **kv})
        res = run_replay(cfg, model=model, trace=closed_batch(batch, context, outputs), options=None)
        steps = res.steps
        d = decode_steps(steps, batch)
        parts = [res.executor.step_times[i] for i in d.index]
        t = {k: 1e3 * float(np.median([p[k] for p in parts])) for k in ("forward_s", "kv_ops_s", "prepare_s", "policy_s")}
        print(f"{name:>17} {1e3 * d['duration_s'].median():>9.1f} {t['forward_s']:>11.1f} "
              f"{t['kv_ops_s']:>10.2f} {t['prepare_s']:>11.2f} {t['policy_s']:>10.2f} "
              f"{steps['bytes_moved'].sum() / 2**20:>9.2f} {d['fragmentation'].mean():>6.3f} "
              f"{d['kv_tokens_read'].median():>12.0f} {load():>18}")


PARTS = {"prefill": bench_prefill, "decode": bench_decode, "strategies": bench_strategies, "policies": bench_policies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--outputs", type=int, default=6, help="output tokens per request (decode steps + 1)")
    parser.add_argument("--prefill-runs", type=int, default=3)
    parser.add_argument("--strategy-batch", type=int, default=4)
    parser.add_argument("--strategy-budget", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS), help="what to measure")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = load_smollm2()
    print(f"SmolLM2-135M fp32 on cpu ({os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads), loaded in {time.perf_counter() - t0:.1f} s; load average {load()}")
    print("no GPU here: the CUDA path (synchronized timing, Triton kernels) is coded but not measured")
    if "prefill" in args.parts:
        bench_prefill(model, args.context, args.prefill_runs)
    if "decode" in args.parts:
        bench_decode(model, args.context, args.batches, args.outputs)
    for part in ("strategies", "policies"):
        if part in args.parts:
            PARTS[part](model, args.context, args.strategy_batch, args.outputs, args.strategy_budget)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; load average {load()}")


if __name__ == "__main__":
    main()
