"""Start-up time of the `kvsim` command line: CPU seconds (user + system, so a loaded machine's waiting is
not counted) of `kvsim --help`, `kvsim models llama-3.1-8b`, `kvsim simulate --help` and a small simulate
(the first 100 requests of azure-conv-2023, Llama-3.1-8B on H100, -q, into a temporary directory), each run
several times in a fresh process; prints the median and the minimum per command (issue 49's targets:
`kvsim --help` and `kvsim simulate --help` <= 0.3 s, the 100-request simulate <= 0.5 s).
The script runs whichever kvsim its python imports; `--baseline PYTHON` runs another checkout's python (its
virtualenv's, where that checkout is installed) in the same rounds, interleaved, for a before/after.

    python bench/bench_startup.py [--runs 7] [--baseline /path/to/other/venv/bin/python] [--only TEXT]
    python bench/bench_startup.py --parts [--runs 5]     # the 100-request simulate's CPU by part

The processes run without PYTHONDONTWRITEBYTECODE (the warm-up run writes the .pyc files, as an installed
package has them; with the variable set every kvsim module is compiled again in every process, ~0.1-0.2 s).
Also prints the modules that take the most import time for `--help` (python -X importtime), the place to
look when the figure grows.
"""
from __future__ import annotations

import argparse
import json
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
            "kvsim simulate (100 requests)": ["simulate", "--trace", "azure-conv-2023", "--max-requests", "100",
                                             "--model", "llama-3.1-8b", "--gpu", "h100", "-q", "--out", SMALL_OUT,
                                             "--overwrite"]}
ENTRY = "import sys; from kvsim.sim.entry import main; sys.argv = ['kvsim', *sys.argv[1:]]; main()"
# --parts: the 100-request simulate's CPU by part, in one process: each group imported in the order a run
# imports it (what an earlier group imported is not counted again), then the command itself
PARTS = {"Python and site": "",
         "typer, rich, pydantic, kvsim.sim.cli": "import typer, typer.main, pydantic, kvsim.sim.cli\n"
                                                 "try:\n    import typer._adapters\nexcept ImportError:\n    pass",
         "kvsim.sim.cli.simulate (options, vllm_args)": "import kvsim.sim.cli.simulate",
         "numpy": "import numpy",
         "kvsim.sim.config (pydantic models, catalogs, policies)": "import kvsim.sim.config",
         "pyarrow, pyarrow.parquet": "import pyarrow, pyarrow.parquet",
         "pandas": "import pandas",
         "the rest of kvsim (engine, results, traces, simpy)": "import kvsim.sim.simulator.simulate",
         "the command (parse, catalogs, trace, simulate, write)":
             "from kvsim.sim.cli import app\ngc.freeze(); gc.enable()\ntry:\n"
             "    app(sys.argv[1:], prog_name='kvsim')\nexcept SystemExit:\n    pass"}
PARTS_CODE = "\n".join(
    ["import gc, json, os, sys, time", "os.environ.setdefault('NUMPY_MADVISE_HUGEPAGE', '0')",
     "os.environ.setdefault('PYDANTIC_DISABLE_PLUGINS', '__all__')", "gc.disable()", "marks = [time.process_time()]",
     *(f"{code}\nmarks.append(time.process_time())" for code in list(PARTS.values())[1:]),
     "print('PARTS=' + json.dumps(marks), file=sys.stderr)"])


def child_env() -> dict[str, str]:
    env = {**os.environ, "COLUMNS": "120"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def cpu_seconds(args: list[str], python: str = sys.executable) -> float:
    """User + system CPU of one `kvsim ARGS` process (its children's rusage, taken around the run)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([python, "-c", ENTRY, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True, env=child_env())
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def part_seconds(args: list[str], python: str = sys.executable) -> list[float]:
    """CPU seconds of each of PARTS in one process running `kvsim ARGS` (process_time: user + system)."""
    run = subprocess.run([python, "-c", PARTS_CODE, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, check=True, env=child_env())
    marks = json.loads(run.stderr.rsplit("PARTS=", 1)[1])
    return [marks[0], *(b - a for a, b in zip(marks[:-1], marks[1:], strict=True))]


def slowest_imports(args: list[str], top: int = 8) -> list[tuple[float, str]]:
    """(cumulative seconds, module) of the top-level imports that take longest."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", ENTRY, *args], capture_output=True, text=True,
                         env=child_env())
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
    ap.add_argument("--baseline", metavar="PYTHON", help="another checkout's python, run in the same rounds")
    ap.add_argument("--only", metavar="TEXT", help="only the commands whose label contains TEXT")
    ap.add_argument("--parts", action="store_true", help="only the 100-request simulate's CPU by part (this python)")
    args = ap.parse_args()
    if args.parts:
        argv = COMMANDS["kvsim simulate (100 requests)"]
        part_seconds(argv)                                  # a warm-up run
        runs = [part_seconds(argv) for _ in range(args.runs)]
        print(f"CPU seconds by part of a 100-request simulate over {args.runs} runs (load average "
              f"{os.getloadavg()[0]:.1f}): median, min-max")
        for i, label in enumerate([*PARTS, "total"]):
            values = [sum(run) for run in runs] if label == "total" else [run[i] for run in runs]
            print(f"  {label:55s} {statistics.median(values):.3f}   {min(values):.3f}-{max(values):.3f}")
        shutil.rmtree(SMALL_OUT, ignore_errors=True)
        return
    pythons = {"": sys.executable} if not args.baseline else {"this ": sys.executable, "baseline ": args.baseline}
    print(f"CPU seconds per process over {args.runs} runs (python {sys.version.split()[0]}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f})")
    for label, argv in COMMANDS.items():
        if args.only and args.only not in label:
            continue
        times: dict[str, list[float]] = {name: [] for name in pythons}
        for python in pythons.values():
            cpu_seconds(argv, python)                       # a warm-up run (page cache, .pyc files)
        for _ in range(args.runs):                          # interleaved: both see the same load
            for name, python in pythons.items():
                times[name].append(cpu_seconds(argv, python))
        for name, values in times.items():
            print(f"  {name + label:37s} median {statistics.median(values):.3f} s   min {min(values):.3f} s")
    shutil.rmtree(SMALL_OUT, ignore_errors=True)
    print("slowest imports of `kvsim --help` (cumulative s, one run):")
    for seconds, name in slowest_imports(["--help"]):
        print(f"  {seconds:6.3f}  {name}")


if __name__ == "__main__":
    main()
