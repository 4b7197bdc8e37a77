"""Capacity: a sweep store (Parquet) or a rate sweep run here; capacity curve, cost, Pareto, best config."""
import itertools

import pandas as pd
import streamlit as st

from dashboard import charts
from dashboard.data import (DataError, add_cost_columns, best_under_slo, capacity_by_group, pareto_front,
                            read_parquet, sweep_table)
from dashboard.forms import config_form, parse_axis_values, with_value
from dashboard.ui import follow_job, start_job
from sim.catalog import list_gpus
from sim.config import ConfigError

st.title("Capacity")
source = st.radio("Data", ["Run a rate sweep here", "Load a sweep store (Parquet)"], horizontal=True, key="cap_source")
table: pd.DataFrame | None = None

if source == "Load a sweep store (Parquet)":
    path = st.text_input("Sweep store: a Parquet file or a directory of Parquet files", key="cap_path").strip()
    upload = st.file_uploader("...or upload a Parquet file", type=["parquet"], key="cap_upload")
    try:
        if upload is not None:
            import io
            try:
                table = pd.read_parquet(io.BytesIO(upload.getvalue()))
            except Exception as exc:  # pyarrow raises several types for a non-Parquet file
                raise DataError(f"{upload.name}: not a readable Parquet file ({exc})") from None
        elif path:
            table = read_parquet(path)
    except DataError as exc:
        st.error(str(exc))
    if table is None:
        st.info("A sweep store has one row per simulated configuration with its summary figures "
                "(throughput_*, goodput_req_s, slo_attainment, ttft_p99_s, ...) and the swept settings "
                "(gpu, tp, replicas, rate_scale, ...).")
else:
    with st.sidebar:
        st.header("Base configuration")
        base, error = config_form("cap_", max_requests=100)
    gpus = [g.name for g in list_gpus() if g.kind == "gpu"]
    a, b = st.columns(2)
    chosen_gpus = a.multiselect("GPUs", gpus, default=[base.gpu] if base and base.gpu in gpus else gpus[5:6],
                                key="cap_gpus")
    rates_text = b.text_input("Arrival-rate scales", value="0.5, 1, 2, 4", key="cap_rates")
    points, runs = [], []
    try:
        if error:
            raise ConfigError(error)
        rates = parse_axis_values("trace_options.rate_scale", rates_text)
        if not chosen_gpus:
            raise ConfigError("pick at least one GPU")
        for gpu, rate in itertools.product(chosen_gpus, rates):
            cfg = with_value(with_value(base, "gpu", gpu), "trace_options.rate_scale", rate)
            runs.append((f"{gpu} rate x{rate:g}", cfg))
            points.append({"gpu": gpu, "rate_scale": rate})
    except ConfigError as exc:
        st.error(str(exc))
        runs = []
    if st.button(f"Run {len(runs)} simulations", type="primary", disabled=not runs, key="cap_run"):
        start_job("cap_job", runs)
        st.session_state["cap_points"] = points
    records = follow_job("cap_job")
    if records:
        st.session_state["cap_table"] = sweep_table(records, st.session_state["cap_points"])
    table = st.session_state.get("cap_table")
    if table is None:
        st.info("Each point simulates the base configuration at one arrival-rate scale on one GPU.")

if table is None or not len(table):
    st.stop()
prices = {}
for g in list_gpus():
    for name in (g.name, *g.aliases):
        prices[name.lower()] = g.usd_per_hour
table = add_cost_columns(table, prices)
numeric = [c for c in table.columns if pd.api.types.is_numeric_dtype(table[c])]
categorical = [c for c in table.columns if c not in numeric and table[c].nunique() < 50]


def _pick(label, options, preferred, key):
    index = next((options.index(p) for p in preferred if p in options), 0)
    return st.selectbox(label, options, index=index, key=key)


a, b, c = st.columns(3)
load = _pick("Load axis", numeric, ["rate_scale", "rate", "request_rate", "qps"], "cap_x")
benefit = _pick("Benefit", numeric, ["goodput_req_s", "throughput_req_s", "throughput_output_tok_s"], "cap_y")
group = _pick("Group by", ["(none)"] + categorical, ["gpu", "config", "policy"], "cap_group")
group = None if group == "(none)" else group
target = st.slider("SLO attainment target", 0.5, 1.0, 0.99, 0.01, key="cap_target")

st.plotly_chart(charts.xy_lines(table, load, benefit, group, "Capacity curve"), key="cap_curve")
if "slo_attainment" in table:
    st.plotly_chart(charts.xy_lines(table, load, "slo_attainment", group, "SLO attainment"), key="cap_attain")
    st.subheader("Capacity under the SLO")
    st.dataframe(capacity_by_group(table, load, target, group), hide_index=True, key="cap_capacity")
if "usd_per_mtok" in table:
    st.plotly_chart(charts.xy_lines(table, load, "usd_per_mtok", group, "Cost per million tokens (USD)"),
                    key="cap_cost")
    feasible = table if "slo_attainment" not in table else table[table["slo_attainment"] >= target]
    if len(feasible):
        front = pareto_front(feasible, "usd_per_mtok", benefit)
        st.plotly_chart(charts.xy_lines(feasible, "usd_per_mtok", benefit, group,
                                        f"Pareto view (points meeting the SLO target {target:.0%})", front),
                        key="cap_pareto")
st.subheader("Best configuration under the SLO")
objective = "usd_per_mtok" if "usd_per_mtok" in table else benefit
try:
    best = best_under_slo(table, target, objective, minimize=objective == "usd_per_mtok")
except DataError as exc:
    st.warning(str(exc))
else:
    if len(best):
        st.success(f"Best: {best.iloc[0].get('run', best.index[0])} ({objective} = {best.iloc[0][objective]:.4g})")
        st.dataframe(best, hide_index=True, key="cap_best")
    else:
        st.warning(f"No configuration reaches SLO attainment {target:.0%}.")
with st.expander("All points"):
    st.dataframe(table, hide_index=True)
