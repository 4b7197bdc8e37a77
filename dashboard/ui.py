"""Page building blocks shared by the dashboard pages (Streamlit calls live here and in pages/)."""
from __future__ import annotations

import math
import time
from pathlib import Path

import pandas as pd
import streamlit as st
import yaml

from .data import (LABEL_FILE, DataError, RunRecord, cli_command, config_headline, data_root, list_run_dirs,
                   load_run_dir, partial_note, resolve_user_path, run_label, run_zip)
from .jobs import Job

RUNS_KEY = "kvsim_runs"          # label -> RunRecord, every run this session (newest last)
JOB_KEY = "kvsim_job"            # the session's background job (one at a time)
FINISHED_KEY = "kvsim_finished"  # a job that just ended, for its page's next run
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
    "evicted_tokens": ("evicted tokens", 1, "{:,.0f}"), "bytes_moved": ("MiB moved by slots", 2**-20, "{:,.1f}"),
    "blocks_freed_by_eviction": ("block-equivalents freed", 1, "{:,.0f}"),
    "compression_ratio": ("compression ratio", 1, "{:.2f}"),
    "attention_mass_retained_mean": ("attention mass kept", 1, "{:.3f}"),
}
# summary figures counted per (layer, KV head) page in per-head runs: divided by the pages per block
PER_PAGE_FIGURES = ("blocks_freed_by_eviction",)


def saved_runs() -> dict[str, RunRecord]:
    """Runs of this session that have no run directory (none the pages make; kept for records handed in)."""
    return st.session_state.setdefault(RUNS_KEY, {})


def save_runs(records: list[RunRecord]) -> None:
    runs = saved_runs()
    for r in records:
        if r.path is None:
            runs.pop(r.label, None)
            runs[r.label] = r


def available_runs() -> dict[str, Path | RunRecord]:
    """Every run the pages can show, newest first: label -> run directory under the data root (the
    dashboard's runs and any `kvsim simulate --out` there: they survive a reload), then runs of this
    session held only in memory. A CLI run's label is its path under the data root."""
    root = data_root()
    out: dict[str, Path | RunRecord] = {}
    for d in list_run_dirs(root) if root.is_dir() else []:
        label = run_label(d) if (d / LABEL_FILE).exists() else str(d.relative_to(root))
        out[label if label not in out else f"{label} [{d.relative_to(root)}]"] = d
    for label, record in reversed(saved_runs().items()):
        out.setdefault(label, record)
    return out


@st.cache_resource(show_spinner=False, max_entries=24)
def _read_run(path: str, mtime: float, label: str) -> RunRecord:
    return load_run_dir(Path(path), label)


def get_run(label: str, runs: dict | None = None) -> RunRecord:
    where = (runs or available_runs())[label]
    if isinstance(where, RunRecord):
        return where
    return _read_run(str(where), (where / "summary.json").stat().st_mtime, label)


def get_runs(labels: list[str], runs: dict) -> list[RunRecord]:
    """The runs of `labels` that can be read; each damaged run directory is an error naming its file."""
    records = []
    for label in labels:
        try:
            records.append(get_run(label, runs))
        except DataError as exc:
            st.error(f"{label}: {exc}")
    return records


def relative_path(d: Path) -> str:
    root = data_root()
    return str(d.relative_to(root)) if root in d.parents else str(d)


def running_job() -> Job | None:
    """The session's job while it runs (one at a time: every page's Run button is disabled meanwhile)."""
    job: Job | None = st.session_state.get(JOB_KEY)
    return job if job is not None and not job.done else None


def start_job(page: str, runs: list | None = None, **job) -> None:
    """Start simulating `runs` ([(label, SimConfig)]), each into a run directory under the data root,
    or a Job(task=...), in the background, once they pass the dashboard's limits and memory estimate
    (dashboard/guard.py); then rerun the page so that every Run button is drawn disabled while it goes."""
    from kvsim.sim.config import ConfigError

    from .guard import check_runs
    try:
        check_runs(runs or [])
    except ConfigError as exc:
        st.error(str(exc))
        return
    if running_job() is None:
        if runs:
            job = {"out_root": data_root(), "taken": set(available_runs()), **job}
        st.session_state[JOB_KEY] = Job(runs or [], page=page, **job).start()
        st.rerun()


def run_button(label: str, key: str, page: str, blocked: bool = False) -> bool:
    """The page's primary button; disabled on invalid input (`blocked`) or while a job runs."""
    busy = running_job()
    clicked = st.button(label, type="primary", disabled=blocked or busy is not None, key=key)
    if busy is not None and busy.page != page:
        st.info(f"A simulation started on the {busy.page} page is running ({busy.status_text()}); "
                "Run is disabled until it ends.")
    return clicked


SLOW_RUN_S = 60.0
ESTIMATES_KEY = "kvsim_estimates"     # config JSON -> measured wall seconds (this session)


def fast_mode_hint(configs: list, key: str) -> None:
    """Before Run, for eviction in token mode (every (token, layer, KV head) the policy scores is
    simulated): a button that measures how long the run(s) will take here (each simulated for 2 s after
    its first step, the token rate extrapolated), and, when that is minutes, the hint to use
    kv.mode=fast (the same policy on sampled rows)."""
    slow = [c for c in configs if c is not None and c.kv.policy != "none" and c.kv.mode == "token"]
    if not slow:
        return
    from kvsim.sim.io.progress import format_duration

    from .jobs import estimate_run_s
    known = st.session_state.setdefault(ESTIMATES_KEY, {})
    wanted = [c.model_dump_json() for c in slow]
    if st.button("Estimate the run time", key=f"{key}_estimate", disabled=running_job() is not None,
                 help="simulates each token-mode run for 2 s after its first step and extrapolates its token rate"):
        with st.spinner("Measuring (2 s of each run after its first step)..."):
            for config in wanted:
                if config not in known:
                    known[config] = estimate_run_s(type(slow[0]).model_validate_json(config))
    if not all(c in known for c in wanted):
        st.caption("Token mode simulates every (token, layer, KV head) the policy scores: a long workload takes "
                   "minutes. Estimate the run time before running, or set kv.mode=fast (sampled rows).")
        return
    total = sum(known[c] or 0.0 for c in wanted)
    what = "this run" if len(configs) == 1 else f"the {len(slow)} token-mode run(s)"
    if total >= SLOW_RUN_S:
        st.warning(f"Estimated time: about {format_duration(total)} for {what} on this machine (measured on 2 s "
                   "of each). kv.mode=fast (under KV eviction policy) runs the same policy on sampled rows, "
                   "usually in seconds (docs/kv-policies.md).")
    else:
        st.caption(f"Estimated time: about {format_duration(total)} for {what} on this machine.")


def follow_job(page: str) -> Job | None:
    """Show progress of this page's job until it ends (page stays live); then the finished job, once.

    The loop only sleeps and updates the progress bar, so Streamlit streams each update to the
    browser; any widget interaction reruns the page, which picks the same job up again here. When
    the job ends the page reruns, drawing its Run buttons enabled again, and returns the job there."""
    job: Job | None = st.session_state.get(JOB_KEY)
    if job is not None and job.page == page:
        if not job.done:
            _show_progress(job)
        del st.session_state[JOB_KEY]
        st.session_state[FINISHED_KEY] = job
        st.rerun()
    finished: Job | None = st.session_state.get(FINISHED_KEY)
    if finished is None or finished.page != page:
        return None
    del st.session_state[FINISHED_KEY]
    if finished.error:
        st.error("Simulation cancelled." if finished.error == "cancelled" else f"Simulation stopped: {finished.error}")
    return finished


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
        if value is not None and key in PER_PAGE_FIGURES:
            value = value / run.rows_per_block
        row[name] = None if value is None else value * scale
    return row


def summary_table(runs: list[RunRecord]) -> pd.DataFrame:
    """One row per run; columns no run has (eviction figures of runs without a policy) are left out."""
    return pd.DataFrame([summary_row(r) for r in runs]).dropna(axis=1, how="all")


NAME_PX_PER_CHAR = 7.5       # the grid's 14 px sans-serif, generous
NAME_PAD_PX = 24


def name_width(labels) -> int:
    """Pixels for a column of run names that shows the longest whole (a grid cuts a cell at its width)."""
    return int(max((len(str(x)) for x in labels), default=10) * NAME_PX_PER_CHAR + NAME_PAD_PX)


def run_column(labels) -> dict:
    """The column config of a table's `run` column: pinned while the others scroll, wide enough for its names."""
    return {"run": st.column_config.TextColumn("run", pinned=True, width=name_width(labels))}


def summary_column_config(labels=()) -> dict:
    """Streamlit column formats of summary_table (the printf formats of SUMMARY_COLUMNS); the run
    column stays in place while the others scroll, as wide as its longest name."""
    formats = {name: st.column_config.NumberColumn(name, format=fmt.replace("{:,", "{:").replace("{:", "%")
                                                   .replace("}", "")) for name, _, fmt in SUMMARY_COLUMNS.values()}
    return {**run_column(labels or ["run"]), **formats}


def show_summary_metrics(run: RunRecord) -> None:
    s = run.summary
    cells = [
        ("Finished / rejected", f"{s['num_finished']} / {s['num_rejected']}"),
        ("Output throughput", _rate(s.get("throughput_output_tok_s"), "tok/s")),
        ("TTFT p50", fmt_seconds(s["ttft_p50_s"])), ("TTFT p99", fmt_seconds(s["ttft_p99_s"])),
        ("TPOT p50", fmt_seconds(s["tpot_p50_s"])), ("TPOT p99", fmt_seconds(s["tpot_p99_s"])),
        ("SLO attainment", fmt_share(s.get("slo_attainment"))),
        ("KV util mean", fmt_share(s.get("kv_util_mean"))), ("KV util max", fmt_share(s.get("kv_util_max"))),
        ("Fragmentation mean", fmt_share(s.get("fragmentation_mean"))),
        ("Preemptions", f"{s.get('preemptions', 0):,}"),
    ]
    if s.get("evicted_tokens") is not None:
        cells += [("Evicted tokens", f"{s['evicted_tokens']:,.0f}"),
                  ("Attention mass kept (mean)", fmt_share(s.get("attention_mass_retained_mean"))),
                  ("Compression ratio", _num(s.get("compression_ratio"), "{:.2f}x")),
                  ("Bytes moved by slots", fmt_bytes(s.get("bytes_moved"))),
                  ("Pages freed by eviction" if run.per_head else "Blocks freed by eviction",
                   _num(s.get("blocks_freed_by_eviction"), "{:,.0f}"))]
    for row in (cells[i:i + 4] for i in range(0, len(cells), 4)):
        for col, (label, value) in zip(st.columns(4), row, strict=False):   # the last row may fill fewer than 4 columns
            col.metric(label, value)


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _num(value, fmt: str) -> str:
    return "-" if _missing(value) else fmt.format(value)


def fmt_sig3(x: float) -> str:
    """At least three significant digits, never an exponent: 10.5, 0.0467, 175, 12,345."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _rate(value, unit: str) -> str:
    return "-" if _missing(value) else f"{fmt_sig3(value)} {unit}"


def fmt_seconds(seconds: float | None) -> str:
    """Three significant digits: 6.80 ms, 42.3 ms, 512 ms, 1.23 s, 12.3 s, 123 s."""
    if _missing(seconds):
        return "-"
    value, unit = (seconds * 1e3, "ms") if abs(seconds) < 1 else (seconds, "s")
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {unit}"


def fmt_share(x: float | None, sign: bool = False) -> str:
    """A fraction as a percentage with three significant digits below 10% (0.63%, 4.20%), else one
    decimal (66.2%); `sign` keeps + / - (an error's direction)."""
    if _missing(x):
        return "-"
    digits = 2 if abs(x) < 0.1 else 1
    return f"{x:+.{digits}%}" if sign else f"{x:.{digits}%}"


def fmt_bytes(n: float | None) -> str:
    if _missing(n):
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def summary_figures(summary: dict) -> pd.DataFrame:
    """summary.json as a readable table: one row per figure, its value with its unit."""
    rows = []
    for key, value in summary.items():
        if isinstance(value, (dict, list)):
            value = str(value)
        rows.append({"figure": key, "value": _figure(key, value)})
    return pd.DataFrame(rows)


# summary keys by unit (docs/outputs.md); vllm bench serve's keys keep its names: *_ms, duration, *_throughput
_SHARE_KEYS = ("kv_util_mean", "kv_util_max", "fragmentation_mean", "fragmentation_p99", "slo_attainment",
               "prefix_hit_rate", "prefix_hit_rate_preempted", "profile_step_mape")
_TOKEN_RATES = ("output_throughput", "total_token_throughput", "max_output_tokens_per_s")
_REQUEST_RATES = ("request_throughput", "request_goodput")


def _figure(key: str, value) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return "-" if value is None else str(value)
    if _missing(value):
        return "-"
    if key.endswith("_tok_s") or key in _TOKEN_RATES:
        return _rate(value, "tok/s")
    if key.endswith("_req_s") or key in _REQUEST_RATES:
        return _rate(value, "req/s")
    if key.endswith("_ms"):
        return f"{fmt_sig3(value)} ms"
    if key.endswith("_s") or key == "duration":
        return fmt_seconds(value)
    if key in _SHARE_KEYS or key.startswith("attention_mass"):
        return fmt_share(value)
    if key == "prediction_error":
        return fmt_share(value, sign=True)
    if key == "bytes_moved":
        return fmt_bytes(value)
    if isinstance(value, int) or float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.4g}"


def show_run_config(run: RunRecord, key: str) -> None:
    """What ran: the configuration's headline under every chart group of a run, its full config.yaml,
    the `kvsim simulate` command that reruns it and its directory as a zip."""
    st.caption(f"**{run.label}**: {config_headline(run)}")
    if partial_note(run):
        st.warning(partial_note(run))
    with st.expander(f"Configuration, CLI command and download of {run.label}"):
        if run.path is not None:
            st.code(cli_command(run.path, data_root(), run.summary), language="bash")
            st.download_button("Download the run directory (zip)", data=lambda d=run.path: run_zip(d),
                               file_name=f"{run.path.name}.zip", mime="application/zip", key=f"{key}_zip")
            st.caption(f"Run directory: {relative_path(run.path)} (under {data_root()}); link to it: "
                       f"`?run={relative_path(run.path)}` on any page")
        st.code(yaml.safe_dump(run.config, sort_keys=False) if run.config else "(no config.yaml)",
                language="yaml")


LOAD_CHOICE = "Load a run directory..."


def pick_run(prefix: str, label: str = "Results to show") -> RunRecord | None:
    """A run directory under the data root (the newest selected whenever a run was added; `?run=DIR`
    in the address selects DIR), or one typed in. The selection is written back to the address, so
    a reload or the link opened in another tab shows the same run."""
    runs = available_runs()
    options = list(runs) + [LOAD_CHOICE]
    key = f"{prefix}pick"
    _select_newest(key, users_latest(runs) or options[0])
    linked = run_from_link(runs)
    if linked is not None:
        runs = available_runs()
        options = list(runs) + [LOAD_CHOICE]
        st.session_state[key] = linked
    choice = st.selectbox(label, options, key=key)
    if choice != LOAD_CHOICE:
        try:
            record = get_run(choice, runs)
        except DataError as exc:      # a damaged run directory: the picker above still offers the others
            st.error(f"{exc}; pick another run")
            return None
        if record.path is not None:    # the address links to what is shown (not a link to follow again)
            st.query_params["run"] = st.session_state["_linked_run"] = relative_path(record.path)
        return record
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
    save_runs([record]) if record.path is None else None
    return record


def users_latest(runs: dict) -> str | None:
    """The newest run a user made on the dashboard (a run directory with the dashboard's label file,
    or one held in this session), not a directory another command wrote under the data root since (a
    cross-check's sim_recorded/, a sweep's runs): what a page opens on."""
    for label, where in runs.items():
        if isinstance(where, RunRecord) or (where / LABEL_FILE).exists():
            return label
    return None


def run_from_link(runs: dict) -> str | None:
    """`?run=DIR` in the page's address (DIR under the data root): the label of that run the first
    time this session sees the link, else None. A directory the listing does not reach is read and
    kept for the session."""
    text = st.query_params.get("run")
    if not text or st.session_state.get("_linked_run") == text:
        return None
    st.session_state["_linked_run"] = text
    try:
        d = resolve_user_path(text)
        for label, where in runs.items():
            if isinstance(where, Path) and where == d:
                return label
        record = load_run_dir(d)
    except DataError as exc:
        st.error(str(exc))
        return None
    record.path = None          # not in the listing: held in the session
    save_runs([record])
    return record.label


def _select_newest(key: str, newest: str) -> None:
    seen = f"{key}_newest"
    if st.session_state.get(seen) != newest:
        st.session_state[seen] = newest
        st.session_state[key] = newest
