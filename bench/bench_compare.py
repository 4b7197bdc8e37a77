"""kvsim against a second command, interleaved over rounds: CPU time (user + sys) and peak RSS.

On a shared machine wall time measures the neighbours; CPU time of the child process much less
so, and interleaving the two commands round by round spreads what load there is over both.
Prints min / median / max CPU seconds and peak RSS of each, and their ratio of medians.

    python bench/bench_compare.py [--rounds 5] [-- KVSIM ARGS ...] [--vs "OTHER COMMAND"]

Default kvsim command: the main command (`kvsim simulate --trace azure-conv-2023 --model
llama-3.1-8b --gpu h100`), writing to a temporary folder. `--vs` takes a shell command (e.g.
another checkout's kvsim, or Vidur, see docs/results.md); without it kvsim runs alone.
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

MAIN = ["simulate", "--trace", "azure-conv-2023", "--model", "llama-3.1-8b", "--gpu", "h100"]


def kvsim_command() -> list[str]:
    """This interpreter's kvsim (the checkout it imports), not whichever `kvsim` is first on PATH."""
    return [sys.executable, "-c", "import sys; from kvsim.sim.entry import main; sys.argv[0] = 'kvsim'; main()"]


def measure(cmd: list[str] | str) -> tuple[float, float]:
    """(CPU seconds, peak RSS MiB) of one run of `cmd` (a shell string or an argument list)."""
    proc = subprocess.Popen(cmd, shell=isinstance(cmd, str), stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"{cmd!r} failed with status {status}")
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def stats(values: list[float]) -> str:
    return f"{min(values):7.2f} {statistics.median(values):7.2f} {max(values):7.2f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vs", help="a second command (shell syntax), run after kvsim in every round")
    ap.add_argument("kvsim_args", nargs="*", help="kvsim arguments (default: the main command)")
    args = ap.parse_args(argv)
    out = tempfile.mkdtemp(prefix="kvsim-bench-compare-")
    kvsim = kvsim_command() + (args.kvsim_args or MAIN) + ["--out", os.path.join(out, "run"), "--quiet"]
    runs: dict[str, list[tuple[float, float]]] = {"kvsim": []}
    if args.vs:
        runs["other"] = []
    try:
        for i in range(args.rounds):
            shutil.rmtree(os.path.join(out, "run"), ignore_errors=True)
            runs["kvsim"].append(measure(kvsim))
            if args.vs:
                runs["other"].append(measure(args.vs))
            print(f"round {i + 1}: " + "  ".join(f"{k} {v[-1][0]:.2f} s" for k, v in runs.items()),
                  file=sys.stderr)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"{'command':8} {'CPU s min':>9} {'median':>7} {'max':>7} {'peak RSS MiB':>13}")
    for name, values in runs.items():
        cpu = [c for c, _ in values]
        print(f"{name:8} {stats(cpu)}   {max(r for _, r in values):10.0f}")
    if args.vs:
        med = [statistics.median(c for c, _ in v) for v in runs.values()]
        print(f"kvsim / other (medians): {med[0] / med[1]:.3f}x")
    print(f"kvsim: {shlex.join(args.kvsim_args or MAIN)}; other: {args.vs or '-'}; {args.rounds} rounds, "
          "CPU = user + sys of the child process")


if __name__ == "__main__":
    main()
