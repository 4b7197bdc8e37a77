"""Fidelity: the cost model's predicted step time against measured step time, from a cross-check
directory (with the cross-check's own profile and figures) or any step log."""
import io
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from kvsim.dashboard import charts
from kvsim.dashboard.data import (Crosscheck, DataError, fidelity_table, is_crosscheck_dir, read_crosscheck, read_parquet,
                            resolve_user_path, step_kind)
from kvsim.dashboard.ui import available_runs, fmt_share, follow_job, get_run

DISK = "Cross-check directory or step log on disk"
UPLOAD = "Upload a step log (Parquet)"
TABLE_FORMATS = {c: st.column_config.NumberColumn(label, format=f) for c, label, f in (
    ("MAPE_%", "MAPE (%)", "%.1f"), ("median_APE_%", "median APE (%)", "%.1f"), ("p90_APE_%", "p90 APE (%)", "%.1f"),
    ("median_bias_%", "median bias (%)", "%+.1f"), ("predicted/measured", "predicted / measured", "%.3f"))}


SIGNED = "(simulated - measured) / measured: + means the simulator is slower than the real run"


def step_log_from_upload():
    upload = st.file_uploader("steps.parquet", type=["parquet"], key="fid_upload")
    if upload is None:
        return None, ""
    try:
        return pd.read_parquet(io.BytesIO(upload.getvalue())), upload.name
    except Exception:  # pyarrow raises several types for a non-Parquet file
        raise DataError(f"{upload.name}: not a readable Parquet file") from None


def source_on_disk():
    """A Crosscheck, or (step log, name); None while the path is empty. `?path=DIR` in the page's
    address fills the path in (a link to a cross-check)."""
    if "fid_path" not in st.session_state and st.query_params.get("path"):
        st.session_state["fid_path"] = st.query_params["path"]
    text = st.text_input("A `kvsim crosscheck` output directory, a steps.parquet, or a directory of step logs "
                         "(paths under the dashboard's data directory)", key="fid_path").strip()
    if not text:
        st.info("A cross-check directory holds report.md, crosscheck.json and step_times.parquet.")
        return None
    path = resolve_user_path(text)
    if path.name == "step_times.parquet" and is_crosscheck_dir(path.parent):
        path = path.parent   # the cross-check's own table: read with its figures
    if is_crosscheck_dir(path):
        return read_crosscheck(path)
    if path.is_dir():
        logs = sorted(p for p in path.rglob("*.parquet") if "step" in p.name)
        if not logs:
            raise DataError(f"{text}: no step log (*step*.parquet) and no cross-check result in this directory")
        path = st.selectbox("Step log file", logs, format_func=lambda p: str(p.relative_to(path.parent)), key="fid_log")
    if any(is_crosscheck_dir(parent) for parent in path.parents):
        st.info("This step log is part of a cross-check: its predicted_s comes from the profile the run itself used. "
                "Open the cross-check directory for the report's figures (the calibrated profile's predictions).")
    return read_parquet(path), text


def show_crosscheck(cc: Crosscheck) -> None:
    h, t = cc.figures.get("headline", {}), cc.figures.get("total_time", {})
    st.subheader("Cross-check: cost model with the calibrated profile on the replay's own steps")
    a, b, c, d = st.columns(4)
    a.metric("Steps compared", f"{cc.figures['step_errors']['all']['count']:,}")
    b.metric("Per-step time MAPE", f"{cc.figures['step_errors']['all']['mape']:.1%}")
    c.metric("Step time, model vs measured", f"{cc.model_vs_measured:+.1%}",
             help=f"summed step time: cost model on the replay's batches {t.get('model_on_replay_batches_s', 0):.2f} s, "
                  f"measured {t.get('measured_s', 0):.2f} s")
    d.metric("Throughput error", fmt_share(cc.signed_error("throughput_total_tok_s"), sign=True), help=SIGNED)
    a, b, c, d = st.columns(4)
    a.metric("TTFT p50 error", fmt_share(cc.signed_error("ttft", 50), sign=True), help=SIGNED)
    b.metric("TPOT p50 error", fmt_share(cc.signed_error("tpot", 50), sign=True), help=SIGNED)
    c.metric("E2E p50 error", fmt_share(cc.signed_error("e2e", 50), sign=True), help=SIGNED)
    identical = h.get("memory_identical")
    d.metric("Memory, recorded mode", "-" if identical is None else ("identical" if identical else "diverges"))
    context = cc.figures.get("context") or {}
    st.caption(f"Profile {context.get('profile', '?')}, model {context.get('model', '?')}, trace "
               f"{Path(str(context.get('trace', '?'))).name}, {context.get('repeats', 1)} replay(s), "
               f"{context.get('requests', '?')} requests. Figures as in report.md.")
    show_errors(cc.steps, cc.kind)
    report = cc.path / "report.md"
    if report.is_file():
        with st.expander("report.md"):
            st.markdown(report.read_text())


def show_step_log(steps: pd.DataFrame, name: str) -> None:
    missing = [c for c in ("duration_s", "predicted_s") if c not in steps.columns]
    if missing:
        raise DataError(f"{name}: missing column(s) {', '.join(missing)}; a step log needs duration_s and predicted_s")
    table = fidelity_table(steps)
    pred, meas = steps["predicted_s"].to_numpy(float), steps["duration_s"].to_numpy(float)
    if np.allclose(pred[np.isfinite(pred)], meas[np.isfinite(pred)]):
        st.info("This step log comes from the simulator: its step durations are the predictions, so the error is 0. "
                "Load a real-backend replay or a cross-check to measure the cost model.")
    overall = table.iloc[0]
    a, b, c, d = st.columns(4)
    a.metric("Steps compared", f"{int(overall['steps']):,}")
    b.metric("Per-step time MAPE", f"{overall['MAPE_%']:.1f}%")
    c.metric("p90 abs. error", f"{overall['p90_APE_%']:.1f}%")
    d.metric("Total predicted / measured", f"{overall['predicted/measured']:.3f}")
    show_errors(steps, step_kind(steps) if {"num_prefill_seqs", "num_decode_seqs"} <= set(steps.columns) else None)


def show_errors(steps: pd.DataFrame, kind: pd.Series | None) -> None:
    st.plotly_chart(charts.predicted_vs_measured(steps, kind), key="fid_scatter", config=charts.PLOT_CONFIG)
    st.subheader("Error by step kind and batch size")
    st.dataframe(fidelity_table(steps, kind=kind), hide_index=True, key="fid_table", column_config=TABLE_FORMATS)


st.title("Fidelity")
follow_job("Fidelity")
st.caption("The cost model's predicted step time against measured step time: a `kvsim crosscheck` result, or "
           "any step log with a measured `duration_s` and a predicted `predicted_s` (a real-backend replay).")
options = [DISK, UPLOAD] + [f"Run: {label}" for label in available_runs()]
source = st.selectbox("Source", options, key="fid_source")
try:
    if source == UPLOAD:
        found = step_log_from_upload()
    elif source.startswith("Run: "):
        name = source.removeprefix("Run: ")
        found = get_run(name).steps, name
    else:
        found = source_on_disk()
    if isinstance(found, Crosscheck):
        try:
            show_crosscheck(found)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:   # a hand-edited file: its text is not shown
            raise DataError(f"{found.path / 'crosscheck.json'}: a figure has an unexpected shape or type "
                            f"({type(exc).__name__}); expected the crosscheck.json `kvsim crosscheck` writes") from None
    elif found is not None and found[0] is not None:
        show_step_log(*found)
except DataError as exc:
    st.error(str(exc))
