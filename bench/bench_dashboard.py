"""CPU seconds of each dashboard page's own script on a run directory (default: the README's main
command's run, `kvsim simulate --trace azure-conv-2023 --model llama-3.1-8b --gpu h100`).

    python bench/bench_dashboard.py [RUN_DIR]     # copies RUN_DIR under a temporary data root

Each page is driven with streamlit's AppTest in this process, opened by link (`?run=`) as a user
would; the figure is the process CPU time of the page's script run (reading the run, shaping the
data, building the figures), the first visit (cold: the run is read from Parquet) and a second one
(warm: the run is cached, as when a user moves between pages). The browser's drawing is excluded.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
PAGES = ("simulate", "memory", "timeseries")


def page_cpu(page: str, run: str) -> tuple[float, float]:
    """(CPU s of the first script run on `page` showing `run`, CPU s of the next)."""
    at = AppTest.from_file(APP, default_timeout=300)
    at.query_params["run"] = run
    out = []
    for _ in range(2):
        start = time.process_time()
        at.switch_page(f"pages/{page}.py").run()
        out.append(time.process_time() - start)
        assert not at.exception, [e.value for e in at.exception]
        assert len(at.get("plotly_chart")) >= 1, f"{page}: no chart drawn"
    return out[0], out[1]


def main(argv: list[str]) -> int:
    src = Path(argv[0] if argv else "/work/baseline/azure-h100")
    with tempfile.TemporaryDirectory(prefix="kvsim-dash-bench-") as tmp:
        shutil.copytree(src, Path(tmp) / "main")
        os.environ["KVSIM_DATA_ROOT"] = tmp
        from kvsim.dashboard.data import load_run_dir
        start = time.process_time()
        run = load_run_dir(Path(tmp) / "main")
        read_s = time.process_time() - start
        print(f"run: {src} ({len(run.requests):,} requests, {len(run.steps):,} steps); reading it: {read_s:.2f} s CPU")
        for page in PAGES:
            cold, warm = page_cpu(page, "main")
            print(f"{page:11s} first visit {cold:5.2f} s CPU   next visit {warm:5.2f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
