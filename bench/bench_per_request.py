"""CPU per request on issue 49's steady-load workload, against BLIS's figures (and, optionally, another kvsim).

The workload: Llama-2-7B on one H100, fixed 575-token prompts and 248-token outputs, Poisson arrivals
(seed 0) at 8 req/s (4,800, 12,000 and 48,000 requests) and at 20 req/s (12,000 requests: past the
engine's capacity, KV-bound, with preemptions). Each trace is written once with `kvsim trace synth`;
each `kvsim simulate` of it runs in a fresh process (this interpreter's checkout), and its CPU time
(user + sys of the child: what a shared machine's neighbours disturb least) and peak RSS are read
from `wait4`. Printed per workload: min / median CPU over `--rounds`, CPU per request, peak RSS, and
the ratio of the median to BLIS's CPU on the same workload.

BLIS (inference-sim/inference-sim, a Go simulator of vLLM) is not built here (no Go toolchain): its
figures are those issue 49 measured side by side with kvsim on the same machine class (2-core VM,
interleaved rounds): 3.28 s at 4,800 requests, 8.84 s at 12,000 @ 20 req/s, 31.3 s at 48,000. The
12,000 @ 8 req/s row's BLIS figure is interpolated from those two 8 req/s runs per request (marked ~).

    python bench/bench_per_request.py [--rounds 3] [--only 12000@20,48000@8] [--vs "OTHER KVSIM"]

`--vs` takes a shell command that runs another kvsim (e.g. a baseline checkout's
`/path/venv/bin/kvsim`); it is given the same `simulate ...` arguments and runs after this checkout's
kvsim in every round (interleaved), and its medians and the ratio of the two are printed too.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench_compare import kvsim_command, measure

# (requests, rate req/s) -> BLIS's CPU seconds (issue 49); None: interpolated per request (see below)
BLIS_S = {(4800, 8.0): 3.28, (12000, 20.0): 8.84, (48000, 8.0): 31.3, (12000, 8.0): None}
WORKLOADS = [(4800, 8.0), (12000, 8.0), (12000, 20.0), (48000, 8.0)]
PROMPT, OUTPUT, MODEL, GPU = 575, 248, "llama-2-7b", "h100"


def blis_seconds(n: int, rate: float) -> tuple[float, bool]:
    """BLIS's CPU seconds for the workload, and whether interpolated (per request, between the 8 req/s runs)."""
    known = BLIS_S.get((n, rate))
    if known is not None:
        return known, False
    lo, hi = BLIS_S[(4800, 8.0)] / 4800, BLIS_S[(48000, 8.0)] / 48000
    return n * (lo + (hi - lo) * (n - 4800) / (48000 - 4800)), True


def parse_only(text: str) -> list[tuple[int, float]]:
    out = []
    for item in text.split(","):
        try:
            n, rate = item.strip().split("@")
            out.append((int(n), float(rate)))
        except ValueError:
            raise SystemExit(f"--only: expected REQUESTS@RATE items like 12000@20, got {item!r}") from None
    return out


def synth(path: str, n: int, rate: float) -> None:
    cmd = kvsim_command() + ["trace", "synth", path, "-n", str(n), "--rate", f"{rate:g}", "--prompt",
                             f"fixed:{PROMPT}", "--output", f"fixed:{OUTPUT}", "--seed", "0"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", help="comma-separated REQUESTS@RATE workloads (default: all four)")
    ap.add_argument("--vs", help="another kvsim as a shell command, given the same simulate arguments")
    args = ap.parse_args(argv)
    workloads = parse_only(args.only) if args.only else WORKLOADS
    tmp = tempfile.mkdtemp(prefix="kvsim-bench-per-request-")
    rows = []
    try:
        for n, rate in workloads:
            trace = os.path.join(tmp, f"steady-{n}-{rate:g}.parquet")
            synth(trace, n, rate)
            sim = ["simulate", "--trace", trace, "--model", MODEL, "--gpu", GPU,
                   "--out", os.path.join(tmp, "run"), "--overwrite", "--quiet"]
            runs: dict[str, list[tuple[float, float]]] = {"kvsim": []}
            if args.vs:
                runs["other"] = []
            for i in range(args.rounds):
                runs["kvsim"].append(measure(kvsim_command() + sim))
                if args.vs:
                    runs["other"].append(measure(f"{args.vs} {shlex.join(sim)}"))
                print(f"{n}@{rate:g} round {i + 1}: " + "  ".join(f"{k} {v[-1][0]:.2f} s" for k, v in runs.items()),
                      file=sys.stderr)
            rows.append((n, rate, runs))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'workload':>12} {'command':7} {'CPU s min':>9} {'median':>7} {'ms/req':>7} {'peak RSS MiB':>12} "
          f"{'BLIS s':>7} {'/BLIS':>6}")
    for n, rate, runs in rows:
        blis, interpolated = blis_seconds(n, rate)
        for name, values in runs.items():
            cpu = [c for c, _ in values]
            med = statistics.median(cpu)
            print(f"{n:>7}@{rate:<4g} {name:7} {min(cpu):9.2f} {med:7.2f} {1000 * med / n:7.3f} "
                  f"{max(r for _, r in values):12.0f} {('~' if interpolated else '') + f'{blis:.2f}':>7} "
                  f"{med / blis:6.3f}")
        if args.vs:
            a, b = (statistics.median(c for c, _ in v) for v in runs.values())
            print(f"{'':12} kvsim / other (medians): {a / b:.3f}x")
    print(f"{args.rounds} rounds; CPU = user + sys of each fresh `kvsim simulate` process (start-up and output "
          f"writing included); {MODEL} on {GPU}, prompts {PROMPT}, outputs {OUTPUT}, Poisson arrivals, seed 0; "
          f"BLIS: issue 49's figures (~: interpolated); other: {args.vs or '-'}")


if __name__ == "__main__":
    main()
