"""Page building blocks shared by the dashboard pages (Streamlit calls live here and in pages/)."""
from __future__ import annotations

import math
import time

import pandas as pd
import streamlit as st

from .data import DataError, RunRecord, data_root, load_run_dir, resolve_user_path
from .jobs import Job

RUNS_KEY = "kvsim_runs"          # label -> RunRecord, every run this session (newest last)
JOB_KEY = "kvsim_job"            # the session's background job (one at a time)
POLL_S = 0.1

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


def running_job() -> Job | None:
    """The session's job while it runs (one at a time: every page's Run button is disabled meanwhile)."""
    job: Job | None = st.session_state.get(JOB_KEY)
    return job if job is not None and not job.done else None


def start_job(page: str, runs: list | None = None, **job) -> None:
    """Start simulating `runs` ([(label, SimConfig)]) or a Job(task=...) in the background, once they
    pass the dashboard's limits and memory estimate (dashboard/guard.py)."""
    from kvsim.sim.config import ConfigError

    from .guard import check_runs
    try:
        check_runs(runs or [])
    except ConfigError as exc:
        st.error(str(exc))
        return
    if running_job() is None:
        st.session_state[JOB_KEY] = Job(runs or [], page=page, **job).start()


def run_button(label: str, key: str, page: str, blocked: bool = False) -> bool:
    """The page's primary button; disabled on invalid input (`blocked`) or while a job runs."""
    busy = running_job()
    clicked = st.button(label, type="primary", disabled=blocked or busy is not None, key=key)
    if busy is not None and busy.page != page:
        st.info(f"A simulation started on the {busy.page} page is running ({busy.status_text()}); "
                "Run is disabled until it ends.")
    return clicked


def follow_job(page: str) -> Job | None:
    """Show progress of this page's job until it ends (page stays live); then the finished job, once.

    The loop only sleeps and updates the progress bar, so Streamlit streams each update to the
    browser; any widget interaction reruns the page, which picks the same job up again here. Runs
    finished by a job of another page are added to the session's runs on whichever page is shown."""
    job: Job | None = st.session_state.get(JOB_KEY)
    if job is None:
        return None
    if job.done and not job.saved:
        save_runs(job.records)
        job.saved = True
    if job.page != page:
        return None
    if not job.done:
        _show_progress(job)
        save_runs(job.records)
        job.saved = True
    del st.session_state[JOB_KEY]
    if job.error:
        st.error("Simulation cancelled." if job.error == "cancelled" else f"Simulation stopped: {job.error}")
    return job


def _show_progress(job: Job) -> None:
    slot = st.empty()
    with slot.container():
        st.button("Cancel", key=f"{job.page}_cancel", on_click=job.cancel)   # runs first thing on the rerun
        bar = st.progress(job.fraction, text=job.status_text())
    while not job.done:
        time.sleep(POLL_S)
        bar.progress(job.fraction, text=job.status_text())
    slot.empty()


def keep_widget(key: str) -> None:
    """Let a widget's value survive navigation to other pages (Streamlit drops the state of widgets
    a page run did not draw); call before drawing the widget."""
    store = f"_kept_{key}"
    if key in st.session_state:
        st.session_state[store] = st.session_state[key]
    elif store in st.session_state:
        st.session_state[key] = st.session_state[store]


def summary_row(run: RunRecord) -> dict:
    row = {"run": run.label}
    for key, (name, scale, _) in SUMMARY_COLUMNS.items():
        value = run.summary.get(key)
        row[name] = None if value is None else value * scale
    return row


def summary_table(runs: list[RunRecord]) -> pd.DataFrame:
    return pd.DataFrame([summary_row(r) for r in runs])


def summary_column_config() -> dict:
    """Streamlit column formats of summary_table (the printf formats of SUMMARY_COLUMNS)."""
    return {name: st.column_config.NumberColumn(name, format=fmt.replace("{:", "%").replace("}", ""))
            for name, _, fmt in SUMMARY_COLUMNS.values()}


def show_summary_metrics(run: RunRecord) -> None:
    s = run.summary
    cells = [
        ("Finished / rejected", f"{s['num_finished']} / {s['num_rejected']}"),
        ("Output throughput", f"{s['throughput_output_tok_s']:.0f} tok/s"),
        ("TTFT p50", _ms(s["ttft_p50_s"])), ("TTFT p99", _ms(s["ttft_p99_s"])),
        ("TPOT p50", _ms(s["tpot_p50_s"])), ("TPOT p99", _ms(s["tpot_p99_s"])),
        ("SLO attainment", "-" if s.get("slo_attainment") is None else f"{s['slo_attainment']:.1%}"),
        ("KV util mean / max", f"{s.get('kv_util_mean', 0):.0%} / {s.get('kv_util_max', 0):.0%}"),
        ("Fragmentation mean", f"{s.get('fragmentation_mean', 0):.1%}"),
        ("Preemptions", f"{s.get('preemptions', 0)}"),
    ]
    for row in (cells[:5], cells[5:]):
        for col, (label, value) in zip(st.columns(len(row)), row):
            col.metric(label, value)


def _ms(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    return f"{seconds * 1e3:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


LOAD_CHOICE = "Load a run directory..."


def pick_run(prefix: str, label: str = "Results to show") -> RunRecord | None:
    """A run from this session (the newest selected whenever a run was added), or a
    `kvsim simulate --out` directory read from under the data root."""
    run_from_link()
    runs = saved_runs()
    options = list(reversed(runs)) + [LOAD_CHOICE]
    _select_newest(f"{prefix}pick", options[0])
    choice = st.selectbox(label, options, key=f"{prefix}pick")
    if choice != LOAD_CHOICE:
        return runs[choice]
    path = st.text_input(f"Run directory (under {data_root()})", key=f"{prefix}run_dir").strip()
    if not path:
        st.info("Enter a directory holding summary.json, requests.parquet and steps.parquet "
                "(a run saved by kvsim's simulate command).")
        return None
    try:
        record = load_run_dir(resolve_user_path(path))
    except DataError as exc:
        st.error(str(exc))
        return None
    save_runs([record])
    return record


def run_from_link() -> None:
    """`?run=DIR` in the page's address (DIR under the data root) opens that run directory: a link to a result."""
    text = st.query_params.get("run")
    if not text or st.session_state.get("_linked_run") == text:
        return
    st.session_state["_linked_run"] = text
    try:
        save_runs([load_run_dir(resolve_user_path(text))])
    except DataError as exc:
        st.error(str(exc))


def _select_newest(key: str, newest: str) -> None:
    seen = f"{key}_newest"
    if st.session_state.get(seen) != newest:
        st.session_state[seen] = newest
        st.session_state[key] = newest
