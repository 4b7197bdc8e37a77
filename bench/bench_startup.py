"""Start-up time of the `kvsim` command line: CPU seconds (user + system, so a loaded machine's waiting is
not counted) of `kvsim --help`, `kvsim models llama-3.1-8b`, `kvsim simulate --help` and a small simulate
(20 requests of azure-conv-2023, Llama-3.1-8B on H100, -q, into a temporary directory), each run several
times in a fresh process; prints the median and the minimum per command (target: `kvsim --help` <= 0.3 s).
The script runs whichever kvsim its python imports: run it with another checkout's python to compare.

    python bench/bench_startup.py [--runs 7]

Also prints the modules that take the most import time for `--help` (python -X importtime), the place to
look when the figure grows.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import shutil
import subprocess
import sys
import tempfile

SMALL_OUT = os.path.join(tempfile.gettempdir(), f"kvsim-bench-startup-{os.getpid()}")
COMMANDS = {"kvsim --help": ["--help"], "kvsim models llama-3.1-8b": ["models", "llama-3.1-8b"],
            "kvsim simulate --help": ["simulate", "--help"],
            "kvsim simulate (20 requests)": ["simulate", "--trace", "azure-conv-2023", "--max-requests", "20",
                                             "--model", "llama-3.1-8b", "--gpu", "h100", "-q", "--out", SMALL_OUT,
                                             "--overwrite"]}
ENTRY = "import sys; from kvsim.sim.entry import main; sys.argv = ['kvsim', *sys.argv[1:]]; main()"


def cpu_seconds(args: list[str]) -> float:
    """User + system CPU of one `kvsim ARGS` process (its children's rusage, taken around the run)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", ENTRY, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True, env={**os.environ, "COLUMNS": "120"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def slowest_imports(args: list[str], top: int = 8) -> list[tuple[float, str]]:
    """(cumulative seconds, module) of the top-level imports that take longest."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", ENTRY, *args], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "120"})
    rows = []
    for line in run.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            name = parts[2].rstrip()
            if len(name) - len(name.lstrip()) <= 3:              # a module imported by the entry itself
                rows.append((int(parts[1]) / 1e6, name.strip()))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    print(f"CPU seconds per process over {args.runs} runs (python {sys.version.split()[0]}, {os.cpu_count()} cores)")
    for label, argv in COMMANDS.items():
        cpu_seconds(argv)                                   # a warm-up run (page cache, .pyc files)
        times = [cpu_seconds(argv) for _ in range(args.runs)]
        print(f"  {label:28s} median {statistics.median(times):.3f} s   min {min(times):.3f} s")
    shutil.rmtree(SMALL_OUT, ignore_errors=True)
    print("slowest imports of `kvsim --help` (cumulative s, one run):")
    for seconds, name in slowest_imports(["--help"]):
        print(f"  {seconds:6.3f}  {name}")


if __name__ == "__main__":
    main()
