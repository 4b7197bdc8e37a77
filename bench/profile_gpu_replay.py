"""Where a real-backend step's time goes: a closed batch replayed twice (cold, then warm) with random
weights at a catalog shape, the warm run under torch.profiler and cProfile.

Prints the decode/prefill step medians of both runs (the cold run pays Triton's JIT compiles), how
many compiled variants each Triton kernel holds (a kernel recompiled per step shows up here), the
top operators by device and by host time, and the top Python functions by own time.

    python bench/profile_gpu_replay.py [--model llama-3.1-8b] [--batch 8] [--context 1024]
                                       [--outputs 32] [--device cuda] [--layers N] [--no-stats]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import numpy as np
import torch

from kvsim.gpu.replay import ReplayOptions, build_model, run_replay
from kvsim.sim.config import load_config
from kvsim.traces.synthetic import closed_batch


def step_medians(steps) -> str:
    dec = steps[steps["num_prefill_seqs"] == 0]["duration_s"]
    pre = steps[steps["num_prefill_seqs"] > 0]["duration_s"]
    return (f"decode median {1e3 * dec.median():.2f} ms (min {1e3 * dec.min():.2f}, max {1e3 * dec.max():.2f}, "
            f"{len(dec)} steps); prefill median {1e3 * pre.median():.2f} ms ({len(pre)} steps); predicted decode "
            f"{1e3 * steps[steps['num_prefill_seqs'] == 0]['predicted_s'].median():.2f} ms")


def triton_variants() -> dict[str, int]:
    """Compiled variants per Triton kernel of kvsim.gpu.kernels (0 where none was launched)."""
    import triton
    from kvsim.gpu.kernels import cache_ops, paged_attention, quant_attention, split_kv
    counts = {}
    for mod in (cache_ops, paged_attention, quant_attention, split_kv):
        for name, fn in vars(mod).items():
            if isinstance(fn, triton.runtime.jit.JITFunction) and name.endswith("kernel"):
                caches = getattr(fn, "device_caches", {}) or {}
                counts[name] = sum(len(c[0]) for c in caches.values())
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--outputs", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--no-stats", action="store_true", help="no attention statistics at the end of prefills")
    args = ap.parse_args()
    blocks = args.batch * (-(-(args.context + args.outputs) // 16)) + 1
    cfg = load_config(None, {"model": args.model, "engine.block_size": 16, "engine.num_gpu_blocks": blocks,
                             "engine.max_num_batched_tokens": max(8192, args.batch * args.context)})
    opts = ReplayOptions(device=args.device, weights="random", layers=args.layers,
                         attention_stats=not args.no_stats)
    model = build_model(cfg, opts)
    trace = closed_batch(args.batch, args.context, args.outputs)

    def replay():
        return run_replay(cfg, model=model, trace=trace, options=opts)
    print(f"{args.model} ({model.config.layers} layers) on {args.device}, batch {args.batch} x {args.context} "
          f"prompt tokens, {args.outputs} outputs")
    print("cold:", step_medians(replay().steps))
    print("warm:", step_medians(replay().steps))
    print("Triton variants compiled:", triton_variants())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        res = replay()
    print("profiled:", step_medians(res.steps))
    sort = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    pr = cProfile.Profile()
    pr.enable()
    res = replay()
    pr.disable()
    print("cProfile run:", step_medians(res.steps))
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    print(buf.getvalue())
    print("Triton variants compiled after all runs:", triton_variants())
    print("total measured step time per run:", f"{res.steps['duration_s'].sum():.3f} s,",
          "numpy", np.__version__, "torch", torch.__version__)


if __name__ == "__main__":
    main()
