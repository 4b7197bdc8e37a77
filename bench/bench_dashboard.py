"""CPU seconds of each dashboard page's own script on a run directory (default: the README's main
command's run, `kvsim simulate --trace azure-conv-2023 --model llama-3.1-8b --gpu h100`).

    python bench/bench_dashboard.py [RUN_DIR] [--cold-process] [--rounds N]   # default: the README's main command

Each page is driven with streamlit's AppTest in this process, opened by link (`?run=`) as a user
would; the figure is the process CPU time of the page's script run (reading the run, shaping the
data, building the figures), the first visit (cold: the run is read from Parquet) and a second one
(warm: the run is cached, as when a user moves between pages). The browser's drawing is excluded.

A running dashboard has imported its modules and scanned streamlit's components before a user opens
a run, so each page is first opened on a small warm-up run (100 requests of the same trace, made by
`kvsim simulate` here) in the same AppTest: what the first visit of the measured run then costs is that
run's own work (its tables and figures). `--cold-process` leaves the warm-up out (the process's one-time
imports then count in the first page visited). `--rounds N` (default 1) measures N first visits of each
page, each on its own copy of the run (a copy is a new run to the dashboard: read and shaped anew), and
prints the median and the range: on a shared machine one visit's CPU time varies by tens of percent.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
PAGES = ("simulate", "memory", "timeseries")


def page_cpu(page: str, run: str, warm_up: str | None) -> tuple[float, float]:
    """(CPU s of the first script run on `page` showing `run`, CPU s of the next); the page is opened
    on the `warm_up` run first when one is given."""
    at = AppTest.from_file(APP, default_timeout=300)
    if warm_up:
        at.query_params["run"] = warm_up
        at.switch_page(f"pages/{page}.py").run()
        assert not at.exception, [e.value for e in at.exception]
    at.query_params["run"] = run
    out = []
    for _ in range(2):
        start = time.process_time()
        at.switch_page(f"pages/{page}.py").run()
        out.append(time.process_time() - start)
        assert not at.exception, [e.value for e in at.exception]
        assert len(at.get("plotly_chart")) >= 1, f"{page}: no chart drawn"
    return out[0], out[1]


def spread(values: list[float]) -> str:
    """'0.42 s' for one value; 'median 0.42 (0.40-0.47) s' for several."""
    if len(values) == 1:
        return f"{values[0]:5.2f} s"
    return f"median {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}) s"


def simulate(out: Path, *more: str) -> None:
    """The README's main command (plus `more`) into `out`."""
    subprocess.run([str(Path(sys.executable).with_name("kvsim")), "simulate", "--trace", "azure-conv-2023", "--model", "llama-3.1-8b",
                    "--gpu", "h100", "--out", str(out), "--quiet", *more], check=True)


def main(argv: list[str]) -> int:
    cold = "--cold-process" in argv
    argv = [a for a in argv if a != "--cold-process"]
    rounds = 1
    if "--rounds" in argv:
        at = argv.index("--rounds")
        try:
            rounds = int(argv[at + 1])
        except (IndexError, ValueError):
            sys.exit("--rounds: expected a whole number of rounds (e.g. --rounds 3)")
        if rounds < 1:
            sys.exit(f"--rounds {rounds}: expected at least 1")
        del argv[at:at + 2]
    with tempfile.TemporaryDirectory(prefix="kvsim-dash-bench-") as tmp:
        if argv:
            shutil.copytree(Path(argv[0]), Path(tmp) / "main")
        else:
            simulate(Path(tmp) / "main")
        for i in range(1, rounds):
            shutil.copytree(Path(tmp) / "main", Path(tmp) / f"main{i}")
        src = argv[0] if argv else "the README's main command"
        if not cold:
            simulate(Path(tmp) / "warmup", "--max-requests", "100")
        os.environ["KVSIM_DATA_ROOT"] = tmp
        from kvsim.dashboard.data import load_run_dir
        start = time.process_time()
        run = load_run_dir(Path(tmp) / "main")
        read_s = time.process_time() - start
        print(f"run: {src} ({len(run.requests):,} requests, {len(run.steps):,} steps); reading it: {read_s:.2f} s CPU")
        for page in PAGES:
            visits = [page_cpu(page, "main" if i == 0 else f"main{i}", None if cold else "warmup") for i in range(rounds)]
            print(f"{page:11s} first visit {spread([v[0] for v in visits])} CPU   "
                  f"next visit {spread([v[1] for v in visits])} CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
