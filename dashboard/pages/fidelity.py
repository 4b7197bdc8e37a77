"""Fidelity: the cost model's predicted step time against measured step time, from any step log."""
import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from dashboard import charts
from dashboard.data import DataError, fidelity_table, read_parquet, step_kind
from dashboard.ui import saved_runs

st.title("Fidelity")
st.caption("Load a step log that has both a measured `duration_s` and the cost model's `predicted_s` "
           "(a real-backend replay, or a cross-check report directory).")
options = ["Step log or report directory on disk", "Upload a step log (Parquet)"] + \
    [f"Session run: {label}" for label in reversed(saved_runs())]
source = st.selectbox("Step log", options, key="fid_source")
steps: pd.DataFrame | None = None
name = ""
try:
    if source == "Upload a step log (Parquet)":
        upload = st.file_uploader("steps.parquet", type=["parquet"], key="fid_upload")
        if upload is not None:
            name = upload.name
            try:
                steps = pd.read_parquet(io.BytesIO(upload.getvalue()))
            except Exception as exc:  # pyarrow raises several types for a non-Parquet file
                raise DataError(f"{upload.name}: not a readable Parquet file ({exc})") from None
    elif source.startswith("Session run: "):
        name = source.removeprefix("Session run: ")
        steps = saved_runs()[name].steps
    else:
        text = st.text_input("steps.parquet, or a directory holding step logs and a report", key="fid_path").strip()
        if text:
            path = Path(text).expanduser()
            if path.is_dir():
                logs = sorted(p for p in path.rglob("*.parquet") if "step" in p.name)
                for report in sorted(path.glob("*.json")):
                    with st.expander(f"Report: {report.name}"):
                        try:
                            st.json(json.loads(report.read_text()))
                        except json.JSONDecodeError as exc:
                            st.error(f"{report}:{exc.lineno}: not valid JSON ({exc.msg})")
                if not logs:
                    raise DataError(f"{path}: no step log (*step*.parquet) in this directory")
                path = st.selectbox("Step log file", logs, format_func=lambda p: str(p.relative_to(path.parent)),
                                    key="fid_log")
            steps = read_parquet(path)
            name = str(path)
except DataError as exc:
    st.error(str(exc))
    st.stop()
if steps is None:
    st.stop()
missing = [c for c in ("duration_s", "predicted_s") if c not in steps.columns]
if missing:
    st.error(f"{name}: missing column(s) {', '.join(missing)}; a step log needs duration_s and predicted_s")
    st.stop()
try:
    table = fidelity_table(steps)
except DataError as exc:
    st.error(f"{name}: {exc}")
    st.stop()
pred, meas = steps["predicted_s"].to_numpy(float), steps["duration_s"].to_numpy(float)
if np.allclose(pred[np.isfinite(pred)], meas[np.isfinite(pred)]):
    st.info("This step log comes from the simulator: its step durations are the predictions, so the error is 0. "
            "Load a real-backend replay to measure the cost model.")
overall = table.iloc[0]
a, b, c, d = st.columns(4)
a.metric("Steps compared", f"{int(overall['steps']):,}")
b.metric("Step-time MAPE", f"{overall['MAPE_%']:.1f}%")
c.metric("p90 abs. error", f"{overall['p90_APE_%']:.1f}%")
d.metric("Total predicted / measured", f"{overall['predicted/measured']:.3f}")
kind = step_kind(steps) if {"num_prefill_seqs", "num_decode_seqs"} <= set(steps.columns) else None
st.plotly_chart(charts.predicted_vs_measured(steps, kind), key="fid_scatter")
st.subheader("Error by step kind and batch size")
st.dataframe(table.round(3), hide_index=True, key="fid_table")
