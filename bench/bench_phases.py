"""Where a `kvsim simulate` process spends its CPU, phase by phase, optionally against another checkout.

Runs the `kvsim` console script (kvsim.sim.entry, as installed) in a child process that notes its own
CPU time (user + sys) at each phase's end:

  imports     interpreter start and the CLI's imports (numpy, pandas, pyarrow, pydantic, typer, ...)
  cli         option parsing, the config and its checks, the simulator's own imports
  setup       run_simulation up to the engine: trace, run plan, requests, engine
  engine      EngineRun.drive (the engine loop, the step log's Parquet writes)
  results     after the engine: request table, summaries, requests.parquet, summary.json, config.yaml
  exit        after the command: the interpreter's shutdown and the process's exit (from wait4)

and prints the median of each over `--rounds`. `--vs PYTHON` runs the same command with another
environment's interpreter (e.g. a checkout of main installed in its own venv) interleaved round by
round, alternating which goes first; the outputs of the last round are compared (requests.parquet,
steps.parquet, summary.json without wall_s).

    python bench/bench_phases.py [--rounds 5] [--vs /path/to/other/venv/bin/python] [-- KVSIM ARGS ...]

Default kvsim arguments: the main command (`simulate --trace azure-conv-2023 --model llama-3.1-8b --gpu h100`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

MAIN = ["simulate", "--trace", "azure-conv-2023", "--model", "llama-3.1-8b", "--gpu", "h100"]
PHASES = ("imports", "cli", "setup", "engine", "results", "exit")

# The child: kvsim's console script with CPU marks. gc.freeze is first called by kvsim.sim.entry
# right after the CLI's imports; the simulator's modules are wrapped as they are imported.
CHILD = r'''
import gc, importlib.util, json, os, sys, time
marks, cpu = {}, time.process_time
_freeze = gc.freeze
def freeze():
    marks.setdefault("imports", cpu())
    _freeze()
gc.freeze = freeze
def timed(fn, start, end):
    def run(*args, **kwargs):
        marks[start] = cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            marks[end] = cpu()
    return run
def patch_simulate(m):
    m.run_simulation = timed(m.run_simulation, "run_start", "run_end")
def patch_assembly(m):
    m.EngineRun.drive = timed(m.EngineRun.drive, "drive_start", "drive_end")
PATCH = {"kvsim.sim.simulator.simulate": patch_simulate, "kvsim.sim.engine.assembly": patch_assembly}
class Wrap:
    def find_spec(self, name, path=None, target=None):
        if name not in PATCH:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        load = spec.loader.exec_module
        def exec_module(module):
            load(module)
            PATCH[name](module)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Wrap())
from kvsim.sim.entry import main
sys.argv[0] = "kvsim"
try:
    main()
finally:
    marks["end"] = cpu()
    with open(os.environ["KVSIM_PHASE_MARKS"], "w") as f:
        json.dump(marks, f)
'''


def run_once(python: str, args: list[str], out: str) -> dict[str, float]:
    """CPU seconds of each phase of one `kvsim` run with `python`, writing into `out`."""
    shutil.rmtree(out, ignore_errors=True)
    marks_file = out + ".marks.json"
    env = dict(os.environ, KVSIM_PHASE_MARKS=marks_file)
    proc = subprocess.Popen([python, "-c", CHILD, *args, "--out", out, "--quiet"], env=env,
                            stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"{python} kvsim {' '.join(args)} failed with status {status}")
    with open(marks_file) as f:
        m = json.load(f)
    total = usage.ru_utime + usage.ru_stime
    return {"imports": m["imports"], "cli": m["run_start"] - m["imports"],
            "setup": m["drive_start"] - m["run_start"], "engine": m["drive_end"] - m["drive_start"],
            "results": m["end"] - m["drive_end"], "exit": total - m["end"], "total": total}


def output_digest(out: str) -> str:
    """sha256 prefixes of requests.parquet, steps.parquet and summary.json without wall_s."""
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    summary.pop("wall_s", None)
    parts = []
    for name in ("requests.parquet", "steps.parquet"):
        with open(os.path.join(out, name), "rb") as f:
            parts.append(hashlib.sha256(f.read()).hexdigest()[:12])
    parts.append(hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:12])
    return " ".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vs", help="another environment's python, run interleaved with this one")
    ap.add_argument("kvsim_args", nargs="*", help="kvsim arguments (default: the main command)")
    args = ap.parse_args(argv)
    pythons = {"this": sys.executable, **({"other": args.vs} if args.vs else {})}
    kvsim_args = args.kvsim_args or MAIN
    tmp = tempfile.mkdtemp(prefix="kvsim-bench-phases-")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in pythons}
    try:
        for i in range(args.rounds):
            order = list(pythons) if i % 2 == 0 else list(reversed(pythons))
            for name in order:
                runs[name].append(run_once(pythons[name], kvsim_args, os.path.join(tmp, name)))
            print(f"round {i + 1}: " + "  ".join(f"{n} {runs[n][-1]['total']:.2f} s" for n in pythons),
                  file=sys.stderr)
        digests = {name: output_digest(os.path.join(tmp, name)) for name in pythons}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    columns = (*PHASES, "total")
    print(f"{'median CPU s':12} " + " ".join(f"{c:>8}" for c in columns))
    for name, values in runs.items():
        print(f"{name:12} " + " ".join(f"{statistics.median(v[c] for v in values):8.3f}" for c in columns))
    for name, digest in digests.items():
        print(f"{name}: {pythons[name]}; outputs {digest}")
    if args.vs:
        print("outputs " + ("identical" if len(set(digests.values())) == 1 else "DIFFER"))
    print(f"kvsim {' '.join(kvsim_args)}; CPU = user + sys")


if __name__ == "__main__":
    main()
