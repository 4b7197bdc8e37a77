"""Regenerate the shipped CPU calibration data: replay generated calibration workloads on the real
backend (SmolLM2-135M), fit `sim/data/profiles/cpu-smollm2.yaml` and
`sim/data/importance/smollm2-135m-fitted.yaml`, then cross-check on a held-out Azure conv slice
with policy none and h2o + slot_reuse. Prints the figures and the load average.

Calibration workloads (all generated, none from the cross-check's trace):
- `replay-sweep`, policy none: closed batches (batch sizes 1-8 x prompt lengths), plus batches of
  mixed prompt lengths (the CPU attention pads every sequence to the step's widest block table);
  batches stop at 8: at 16 tokens the CPU GEMMs switch to a faster kernel (decode steps of 16
  sequences ran 12-18% below a fit that covers 1-8), which a per-token linear term cannot follow;
- `replay-staggered`, policy none: a first request, then requests that arrive while its prefill runs,
  so they are prefilled together with its first decode (mixed prefill + decode steps, as any open
  arrival process produces; the closed batches above never do). The arrivals fall well inside the
  first prefill (>= 3 s long), so the schedule does not depend on the measured times;
- `replay-long-decode` (policy none): batches of 4-5 mixed prompts of 512-1,100 tokens decoding 40
  tokens each: long decode runs at ~1,000-token contexts over block tables of unequal width (the
  sweep's decodes are 12 tokens long, mostly over equal prompts).
- `replay-irregular` (policy none): batches of 1-5 prompts of irregular lengths (47-1,087 tokens,
  none a multiple of 16) decoding 20 tokens: the other workloads use round lengths (64, 256, 1,024)
  while real prompts are arbitrary (against the profile fitted without it, these replays' batched
  prefills of unequal prompts ran 5-8% slower than predicted).
- `replay-h2o-b{128,256,512}`, h2o at budgets 128, 256 and 512 + slot_reuse: the policy's evictions
  leave holes in the blocks that attention still scans (how many depends on the budget), and its
  scoring runs every decode step.

Repeats (`--repeats N`, default 3): every workload is replayed N times (repeat r > 1 in `NAME-rR`),
interleaved so that the repeats of one workload run at different moments; the schedules must come
out identical and the fit uses each step's median measured time (`kvsim calibrate DIR1,DIR2,...`).
The cross-checks replay their trace `--crosscheck-repeats` times (default 3, `kvsim crosscheck
--repeats`).

Steps are timed with the thread's CPU time (`--clock cpu`, 1 torch thread) by default, so other
processes on the machine do not inflate them; the cross-checks use the same clock.

glibc malloc returns large freed blocks to the kernel, so every step's big temporaries (prefill
attention scores: tens of MB per layer) come back as fresh pages: a 987-token prefill took 11.6 s
of which 3.8 s system time in 1.85 M page faults. `--malloc tuned` (default) re-executes the script
with MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_/MALLOC_TOP_PAD_ set so freed memory stays in the
heap (the same prefill: 8.2 s, no page faults; vLLM's CPU backend recommends a caching allocator,
tcmalloc, for the same reason). Calibration and cross-check replays run under the same setting.

The importance file's per-head statistics come from `replay-sweep`'s attention statistics and its
content correlation from the evictions recorded in the `replay-h2o-b*` replays (`kvsim calibrate
--attention ... --decisions ...`); the simulated h2o cross-check uses that fitted model
(`kv.importance=smollm2-135m-fitted`). Each cross-check replay is preceded by an unmeasured warm-up
prompt (`kvsim crosscheck --warmup`, the default). Until gpu.replay collected the previous replay's
KV cache before allocating the next (it sits in reference cycles), the first step of the second
replay in a process (after the warm-up, or repeat 2 without one) read 10-30% slower: the cycle
collection landed there and the allocator faulted ~2 GB of fresh pages (515k page faults).

Run from the repository root (the fitted files record the replay directories as given; docs/calibration.md
says when to regenerate):

    python -m kvsim.sim.calibration.regenerate_cpu_profile --out runs/calibration [--repeats 3]
        [--crosscheck-repeats 3] [--threads 1] [--clock cpu] [--reuse] [--replay-only] [--skip-crosscheck]
        [--skip-fit] [--crosschecks none h2o] [--crosscheck-suffix=-run2] [--fit-also runs/earlier-calibration]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from kvsim.sim.config import load_config
from kvsim.traces.synthetic import closed_batch
from kvsim.traces.trace import Trace

SIM_DIR = Path(__file__).resolve().parent.parent
SHIPPED_PROFILE = SIM_DIR / "data" / "profiles" / "cpu-smollm2.yaml"
SHIPPED_IMPORTANCE = SIM_DIR / "data" / "importance" / "smollm2-135m-fitted.yaml"
# glibc malloc: keep freed memory in the heap (no per-step page faults for large temporaries)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "68719476736",
              "MALLOC_TOP_PAD_": "1073741824"}
BASE_CONFIG = {"model": "smollm2-135m", "gpu": "cpu-2core", "profile": "cpu-2core"}


# ---- calibration workloads ----------------------------------------------------------------------
def calibration_trace(batches, prompts, output_tokens: int, gap_s: float = 1e4):
    """Closed batches (all requests of one batch at once), one after another with idle gaps."""
    parts = []
    for i, (b, p) in enumerate((b, p) for p in prompts for b in batches):
        t = closed_batch(b, p, output_tokens)
        t.df["arrival_time_s"] = i * gap_s
        parts.append(t)
    return Trace.concat(parts, how="overlay", name="calibration-sweep")


def mixed_trace(groups, output_tokens: int, gap_s: float = 1e4, name: str = "calibration-mixed"):
    """One batch per group of prompt lengths, all its requests arriving together."""
    prompts = [p for g in groups for p in g]
    arrivals = [i * gap_s for i, g in enumerate(groups) for _ in g]
    return Trace.from_columns(arrival_time_s=arrivals, prompt_tokens=prompts,
                              output_tokens=[output_tokens] * len(prompts), name=name)


def staggered_trace(groups, output_tokens: int, delay_s: float = 1.5, gap_s: float = 1e4):
    """Per group: its first prompt at the group's start, the others `delay_s` later (during the first
    one's prefill: they join its first decode step)."""
    arrivals, prompts = [], []
    for i, (first, later) in enumerate(groups):
        arrivals += [i * gap_s] + [i * gap_s + delay_s] * len(later)
        prompts += [first, *later]
    return Trace.from_columns(arrival_time_s=arrivals, prompt_tokens=prompts,
                              output_tokens=[output_tokens] * len(prompts), name="calibration-staggered")


def parse_staggered(text: str) -> tuple[int, list[int]]:
    first, _, later = text.partition(":")
    return int(first), [int(p) for p in later.split(",") if p]


def parse_batches(texts: list[str]) -> list[list[int]]:
    """Comma-separated prompt lengths, one batch per text."""
    return [[int(p) for p in g.split(",")] for g in texts]


def shifted(trace, offset_s: float):
    trace.df["arrival_time_s"] = trace.df["arrival_time_s"] + offset_s
    return trace


def calibration_runs(args) -> dict[str, tuple]:
    """Every calibration workload by replay name: (config, trace)."""
    base = {**BASE_CONFIG, "engine.num_gpu_blocks": args.num_gpu_blocks}
    sweep = calibration_trace(args.batches, args.prompts, args.output_tokens)
    n_sweep = len(args.batches) * len(args.prompts)
    mixed = shifted(mixed_trace(parse_batches(args.mixed), args.output_tokens + 4), n_sweep * 1e4)
    runs = {"replay-sweep": (load_config(None, base),
                             Trace.concat([sweep, mixed], how="overlay", name="calibration-sweep")),
            "replay-staggered": (load_config(None, base),
                                 staggered_trace([parse_staggered(g) for g in args.staggered], args.output_tokens)),
            "replay-long-decode": (load_config(None, base),
                                   mixed_trace(parse_batches(args.long_decode), args.long_decode_tokens,
                                               name="calibration-long-decode")),
            "replay-irregular": (load_config(None, base),
                                 mixed_trace(parse_batches(args.irregular), args.irregular_tokens,
                                             name="calibration-irregular"))}
    for budget in args.h2o_budgets:
        runs[f"replay-h2o-b{budget}"] = (
            load_config(None, {**base, "kv.policy": "h2o", "kv.budget": budget, "kv.slot_strategy": "slot_reuse"}),
            mixed_trace(parse_batches(args.h2o), args.h2o_output_tokens, name=f"calibration-h2o-b{budget}"))
    return runs


def earlier_repeats(earlier: Path, name: str) -> list[Path]:
    """The replays of workload `name` in an earlier calibration output directory (every repeat)."""
    return sorted(earlier.glob(name)) + sorted(earlier.glob(f"{name}-r*"))


def repeat_dir(out: Path, name: str, repeat: int) -> Path:
    """Replay directory of one repeat of a calibration workload (repeat 1: the plain name)."""
    return out / (name if repeat == 1 else f"{name}-r{repeat}")


# ---- steps ---------------------------------------------------------------------------------------
def kvsim(*args: str) -> None:
    print("$ kvsim " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-c", "from kvsim.sim.cli import main; main()", *args], check=True)


def replay_all(runs: dict[str, tuple], args) -> None:
    """Replay every workload `args.repeats` times, the repeats interleaved so that each workload's repeats run at
    different moments."""
    # gpu.replay imports torch: only this step needs it, and only after the malloc re-exec
    from kvsim.gpu.replay import ReplayOptions, run_replay
    opts = ReplayOptions(device="cpu", clock=args.clock)
    for r in range(1, args.repeats + 1):
        for name, (cfg, trace) in runs.items():
            d = repeat_dir(args.out, name, r)
            if args.reuse and (d / "steps.parquet").is_file():
                print(f"{d}: reused", flush=True)
                continue
            res = run_replay(cfg, d, trace=trace, options=opts, progress=True)
            print(f"{d.name}: {len(res.steps)} steps, load average after: {os.getloadavg()}", flush=True)


def fit(runs: dict[str, tuple], args) -> None:
    """`kvsim calibrate` of the shipped profile (every workload, each step at its median over the repeats
    and --fit-also) and of the shipped importance model (per-head statistics from the sweep, the content
    correlation from the h2o replays' recorded evictions)."""
    groups = [",".join([str(repeat_dir(args.out, name, r)) for r in range(1, args.repeats + 1)]
                       + [str(d) for extra in args.fit_also for d in earlier_repeats(extra, name)])
              for name in runs]
    kvsim("calibrate", *groups, "--out", str(SHIPPED_PROFILE), "--model", "smollm2-135m", "--gpu", "cpu-2core")
    h2o_dirs = [a for name in runs if name.startswith("replay-h2o") for a in ("--decisions", str(args.out / name))]
    kvsim("calibrate", "--attention", str(args.out / "replay-sweep"), *h2o_dirs, "--out", str(SHIPPED_IMPORTANCE))


def crosscheck(args) -> None:
    """`kvsim crosscheck` of the shipped profile on a held-out Azure conv slice, per policy in --crosschecks."""
    # Prompts beyond 1,100 tokens are rejected (and outputs capped) so the CPU replay of the full
    # 30-layer model stays within minutes.
    common = ["--trace", "azure-conv-2023", "--profile", str(SHIPPED_PROFILE),
              "--num-gpu-blocks", str(args.num_gpu_blocks), "--start-s", "2400",
              "--max-requests", str(args.crosscheck_requests), "--rate-scale", "0.5",
              "--set", "engine.max_model_len=1100", "--threads", str(args.threads), "--clock", args.clock,
              "--repeats", str(args.crosscheck_repeats)]
    # The simulated h2o run scores tokens with the fitted importance model (the calibration's product),
    # not the hand-seeded default.
    policies = {"none": [], "h2o": ["--set", "kv.policy=h2o", "--set", "kv.budget=256", "--set",
                                    "kv.slot_strategy=slot_reuse", "--set", f"kv.importance={SHIPPED_IMPORTANCE.stem}"]}
    for policy in args.crosschecks:
        out = args.out / f"crosscheck-{policy}{args.crosscheck_suffix}"
        reals = [out / ("real" if r == 1 else f"real-{r}") for r in range(1, args.crosscheck_repeats + 1)]
        reuse = []
        if args.reuse and all((d / "steps.parquet").is_file() for d in reals):
            print(f"{out}: replays reused", flush=True)
            reuse = [a for d in reals for a in ("--real", str(d))]
        kvsim("crosscheck", *common, *policies[policy], *reuse, "--out", str(out))


# ---- command line --------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kvsim.sim.calibration.regenerate_cpu_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/calibration"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="cpu",
                    help="replay step timer (cpu: the thread's CPU time; needs --threads 1)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 256, 768, 1024])
    ap.add_argument("--mixed", type=str, nargs="+", default=["64,768", "32,256,1024", "128,128,512,896",
                                                              "64,256,256,640,1024,48,96,384"],
                    help="batches of mixed prompt lengths (comma-separated), policy none")
    ap.add_argument("--staggered", type=str, nargs="+", default=["512:64", "1024:200,300,900", "768:128,640",
                                                                   "1024:96,512", "640:48,256,384,1024"],
                    help="FIRST:LATER,... groups: LATER prompts arrive during FIRST's prefill, policy none")
    ap.add_argument("--h2o", type=str, nargs="+", default=["256", "768", "256,256,256,256", "160,512,768,1024",
                                                            "96,200,300,400,500,600,700,800"],
                    help="batches (comma-separated prompt lengths) replayed with h2o + slot_reuse")
    ap.add_argument("--long-decode", type=str, nargs="+", default=["640,880,1024,1024", "512,768,960,1100,1100"],
                    help="batches of mixed long prompts decoding --long-decode-tokens tokens each (policy none)")
    ap.add_argument("--long-decode-tokens", type=int, default=40)
    ap.add_argument("--irregular", type=str, nargs="+", default=["413", "157,1039", "61,702,877", "229,541,93,1003",
                                                                  "338,817,125,659,971", "1087,47,590,283"],
                    help="batches of irregular prompt lengths (no multiples of 16), policy none")
    ap.add_argument("--irregular-tokens", type=int, default=20)
    ap.add_argument("--h2o-budgets", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--h2o-output-tokens", type=int, default=24)
    ap.add_argument("--output-tokens", type=int, default=12)
    ap.add_argument("--num-gpu-blocks", type=int, default=1200)
    ap.add_argument("--crosscheck-requests", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3, help="replays of each calibration workload (median per step)")
    ap.add_argument("--crosscheck-repeats", type=int, default=3, help="kvsim crosscheck --repeats")
    ap.add_argument("--reuse", action="store_true", help="keep replays already in --out (their steps.parquet)")
    ap.add_argument("--fit-also", type=Path, nargs="*", default=[],
                    help="earlier calibration output directories whose replays of the same workloads join the fit "
                         "(each step at its median over all their repeats: replays from other sessions average "
                         "the VM's slow speed drift)")
    ap.add_argument("--replay-only", action="store_true", help="stop after the calibration replays")
    ap.add_argument("--skip-crosscheck", action="store_true")
    ap.add_argument("--skip-fit", action="store_true", help="keep the shipped profile and importance files (only "
                                                           "run the cross-checks)")
    ap.add_argument("--crosschecks", nargs="+", choices=["none", "h2o"], default=["none", "h2o"])
    ap.add_argument("--crosscheck-suffix", default="",
                    help="cross-check directories crosscheck-{none,h2o}SUFFIX (several runs side by side; a value "
                         "starting with - needs =, e.g. --crosscheck-suffix=-run2)")
    ap.add_argument("--malloc", choices=["tuned", "default"], default="tuned",
                    help="tuned: rerun under MALLOC_ENV (glibc keeps freed memory; see the module doc)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.malloc == "tuned" and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], {**os.environ, **MALLOC_ENV})
    # torch is imported only here, after the malloc re-exec: the settings must be in place when it loads
    import torch
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}, torch threads {torch.get_num_threads()}, clock {args.clock}, "
          f"malloc {args.malloc}", flush=True)
    runs = calibration_runs(args)
    replay_all(runs, args)
    if args.replay_only:
        return
    if not args.skip_fit:
        fit(runs, args)
    if not args.skip_crosscheck:
        crosscheck(args)


if __name__ == "__main__":
    main()
