"""KV-policy benchmark at the papers' scale: wall time of one simulation per (workload, policy).

Workloads (closed batches, every request at t=0):
  A  256 prompts of 6,000 tokens, 500 output tokens, Llama-3.1-8B on 1x L4 (issue 17's targets: < 10 s)
  B  64 requests, 2,000-token prompts and 2,000-token outputs, Qwen2.5-32B on 2x L40 (tp 2)
Policies: kvcompress (per_head, compression rate 64, compress after prefill and under memory pressure,
compact), leankv (per_head, K8V4/K4V2 tiers), quest (shared, budget 512), snapkv (per_head, the
budget of rate 64: ceil(6000 / 64) - 8 window = 86 per KV head). Each runs in fast mode where the
policy has a fast-mode model (all four; leankv's is the token-level manager on sampled rows with
compiled decode steps, docs/kv-policies.md section 5), else in token mode, in a child process
stopped after --timeout seconds (printed as "> T"). Numba kernels compile on their first use after
an install (cached beside the source): run twice for the steady figure.

    python bench/bench_kv_policies.py                       # all rows, 120 s cap per run
    python bench/bench_kv_policies.py --only A:quest,A:snapkv --timeout 60
    python bench/bench_kv_policies.py --only B:leankv --busy-core 1 --repeat 3   # a core kept busy

--busy-core C keeps CPU C busy for the whole run (a `while True: pass` process pinned to C with
sched_setaffinity, as `taskset -c C python -c "while True: pass"`), the load a shared CI machine or a
laptop adds. Each row also prints its process's CPU time (user + sys) and the 1-minute load average
when it ended.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

WORKLOADS = {
    "A": {"n": 256, "prompt": 6000, "output": 500, "model": "llama-3.1-8b", "gpu": "l4", "tp": 1},
    "B": {"n": 64, "prompt": 2000, "output": 2000, "model": "qwen2.5-32b", "gpu": "l40", "tp": 2},
}
POLICIES = {
    "kvcompress": {"policy": "kvcompress", "layout": "per_head", "slot_strategy": "compact",
                   "trigger": "after_prefill+pressure", "params": {"compression_rate": 64}},
    "leankv": {"policy": "leankv", "layout": "per_head", "slot_strategy": "slot_reuse"},
    "quest": {"policy": "quest", "layout": "shared", "params": {"budget": 512}},
    "snapkv": {"policy": "snapkv", "layout": "per_head", "slot_strategy": "compact", "budget": 86},
}
ROWS = ("A:kvcompress", "A:quest", "A:snapkv", "B:leankv", "B:quest", "B:snapkv")


def one(row: str) -> dict:
    from kvsim.sim.config import load_config
    from kvsim.sim.kv.build import policy_params
    from kvsim.sim.kv.policy import get_policy
    from kvsim.sim.config import KVConfig
    from kvsim.sim.simulator.simulate import run_simulation
    from kvsim.traces.synthetic import closed_batch

    w, p = row.split(":")
    wl, kv = WORKLOADS[w], dict(POLICIES[p])
    mode = "fast" if get_policy(kv["policy"], **policy_params(KVConfig(**kv))).fast_mode_profile() else "token"
    kv["mode"] = mode
    cfg = load_config(None, {"model": wl["model"], "gpu": wl["gpu"], "tp": wl["tp"], "kv": kv,
                             "engine": {"max_num_seqs": 256}})
    t0 = time.perf_counter()
    s = run_simulation(cfg, trace=closed_batch(wl["n"], wl["prompt"], wl["output"])).summary
    return {"row": row, "mode": mode, "wall_s": time.perf_counter() - t0, "steps": s.get("num_steps", 0),
            "tok_s": s["throughput_output_tok_s"], "frag": s.get("fragmentation_mean", 0.0),
            "kv_util": s["kv_util_mean"], "preempt": s["preemptions"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(ROWS))
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each row")
    ap.add_argument("--busy-core", type=int, help="keep this CPU busy during the runs (see the module doc)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    spinner = None
    if args.busy_core is not None:
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(spinner.pid, {args.busy_core})
        print(f"CPU {args.busy_core} kept busy by process {spinner.pid} (pinned 'while True: pass')")
    try:
        print(f"{'workload:policy':<16}{'mode':<6}{'wall s':>9}{'cpu s':>8}{'load':>6}{'steps':>8}{'out tok/s':>11}"
              f"{'frag':>7}{'kv util':>9}{'preempt':>9}")
        for row in args.only.split(","):
            for _ in range(args.repeat):
                run_row(row, args.timeout)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_row(row: str, timeout: float) -> None:
    t0, cpu0 = time.perf_counter(), _children_cpu()
    try:
        out = subprocess.run([sys.executable, __file__, "--one", row], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{row:<16}{'':<6}{'> ' + format(timeout, '.0f'):>9}  (stopped; {time.perf_counter() - t0:.0f} s)",
              flush=True)
        return
    if out.returncode:
        print(f"{row:<16} failed: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}")
        return
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{row:<16}{r['mode']:<6}{r['wall_s']:>9.2f}{_children_cpu() - cpu0:>8.2f}{os.getloadavg()[0]:>6.2f}"
          f"{r['steps']:>8}{r['tok_s']:>11.1f}{r['frag']:>7.3f}{r['kv_util']:>9.3f}{r['preempt']:>9}", flush=True)


if __name__ == "__main__":
    main()
