"""Page building blocks shared by the dashboard pages (Streamlit calls live here and in pages/)."""
from __future__ import annotations

import math
import time

import pandas as pd
import streamlit as st

from .data import DataError, RunRecord, load_run_dir
from .jobs import Job

RUNS_KEY = "kvsim_runs"          # label -> RunRecord, every run this session (newest last)
POLL_S = 0.25

SUMMARY_COLUMNS = {   # summary key -> (table header, scale, format)
    "num_finished": ("finished", 1, "{:.0f}"), "num_rejected": ("rejected", 1, "{:.0f}"),
    "throughput_req_s": ("req/s", 1, "{:.3f}"), "throughput_output_tok_s": ("output tok/s", 1, "{:.1f}"),
    "ttft_p50_s": ("TTFT p50 ms", 1e3, "{:.1f}"), "ttft_p99_s": ("TTFT p99 ms", 1e3, "{:.1f}"),
    "tpot_p50_s": ("TPOT p50 ms", 1e3, "{:.2f}"), "tpot_p99_s": ("TPOT p99 ms", 1e3, "{:.2f}"),
    "e2e_p50_s": ("E2E p50 s", 1, "{:.2f}"), "e2e_p99_s": ("E2E p99 s", 1, "{:.2f}"),
    "goodput_req_s": ("goodput req/s", 1, "{:.3f}"), "slo_attainment": ("SLO attainment", 1, "{:.3f}"),
    "kv_util_mean": ("KV util mean", 1, "{:.3f}"), "fragmentation_mean": ("fragmentation mean", 1, "{:.3f}"),
    "fragmentation_p99": ("fragmentation p99", 1, "{:.3f}"), "preemptions": ("preemptions", 1, "{:.0f}"),
    "batch_size_mean": ("batch mean", 1, "{:.1f}"), "makespan_s": ("makespan s", 1, "{:.1f}"),
}


def saved_runs() -> dict[str, RunRecord]:
    return st.session_state.setdefault(RUNS_KEY, {})


def save_runs(records: list[RunRecord]) -> None:
    runs = saved_runs()
    for r in records:
        runs.pop(r.label, None)
        runs[r.label] = r


def start_job(key: str, runs: list | None = None, **job) -> None:
    """Start simulating `runs` ([(label, SimConfig)]) or a Job(task=...) in the background."""
    st.session_state[key] = Job(runs or [], **job).start()


def follow_job(key: str) -> Job | None:
    """Show progress of the job under `key` until it ends (page stays live); then its records.

    The loop only sleeps and updates the progress bar, so Streamlit streams each update to the
    browser; any widget interaction reruns the page, which picks the same job up again here."""
    job: Job | None = st.session_state.get(key)
    if job is None:
        return None
    if not job.done:
        slot = st.empty()
        with slot.container():
            if st.button("Cancel", key=f"{key}_cancel"):
                job.cancel_requested = True
            bar = st.progress(job.fraction, text=job.status_text())
        while not job.done:
            time.sleep(POLL_S)
            bar.progress(job.fraction, text=job.status_text())
        slot.empty()
    del st.session_state[key]
    if job.error:
        st.error(f"Simulation stopped: {job.error}" if job.error != "cancelled" else "Simulation cancelled.")
    save_runs(job.records)
    return job


def summary_row(run: RunRecord) -> dict:
    row = {"run": run.label}
    for key, (name, scale, _) in SUMMARY_COLUMNS.items():
        value = run.summary.get(key)
        row[name] = None if value is None else value * scale
    return row


def summary_table(runs: list[RunRecord]) -> pd.DataFrame:
    return pd.DataFrame([summary_row(r) for r in runs])


def show_summary_metrics(run: RunRecord) -> None:
    s = run.summary
    cells = [
        ("Finished / rejected", f"{s['num_finished']} / {s['num_rejected']}"),
        ("Throughput", f"{s['throughput_output_tok_s']:.0f} out tok/s"),
        ("TTFT p50 / p99", f"{_ms(s['ttft_p50_s'])} / {_ms(s['ttft_p99_s'])}"),
        ("TPOT p50 / p99", f"{_ms(s['tpot_p50_s'])} / {_ms(s['tpot_p99_s'])}"),
        ("SLO attainment", "-" if s.get("slo_attainment") is None else f"{s['slo_attainment']:.1%}"),
        ("KV util mean / max", f"{s.get('kv_util_mean', 0):.0%} / {s.get('kv_util_max', 0):.0%}"),
        ("Fragmentation mean", f"{s.get('fragmentation_mean', 0):.1%}"),
        ("Preemptions", f"{s.get('preemptions', 0)}"),
    ]
    for row in (cells[:4], cells[4:]):
        for col, (label, value) in zip(st.columns(len(row)), row):
            col.metric(label, value)


def _ms(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    return f"{seconds * 1e3:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def pick_run(prefix: str, label: str = "Results to show") -> RunRecord | None:
    """A run from this session, or a `kvsim simulate --out` directory read from disk."""
    runs = saved_runs()
    options = list(reversed(runs)) + ["Load a run directory..."]
    choice = st.selectbox(label, options, key=f"{prefix}pick")
    if choice != "Load a run directory...":
        return runs[choice]
    path = st.text_input("Run directory (the --out of `kvsim simulate`)", key=f"{prefix}run_dir").strip()
    if not path:
        st.info("Enter a directory holding summary.json, requests.parquet and steps.parquet.")
        return None
    try:
        record = load_run_dir(path)
    except DataError as exc:
        st.error(str(exc))
        return None
    save_runs([record])
    return record
