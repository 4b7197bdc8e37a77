"""Time series: a run over simulated time as a vLLM operator's Grafana dashboard shows a server, plus
the cost model's utilisation and time breakdown per step; all panels share one zoomable time axis."""
import streamlit as st

from kvsim.dashboard import charts
from kvsim.dashboard.data import run_cost_model, time_series
from kvsim.dashboard.ui import follow_job, pick_run, show_run_config

st.title("Time series")
follow_job("Time series")
run = pick_run("ts_", "Run")
if run is None:
    st.stop()
show_run_config(run, "ts")
windows = st.slider("Time windows", min_value=20, max_value=400, value=120, step=10, key="ts_bins")
cost = run_cost_model(run)
ts = time_series(run, windows, cost)
width = float(ts["time_s"].diff().iloc[1]) if len(ts) > 1 else 0.0
st.caption(f"{windows} windows of {width:.3g} s of simulated time. Latency percentiles are taken over the "
           "requests observed in each window (TTFT when the first token came, TPOT and E2E when the request "
           "finished, queue time when it was first scheduled), as vLLM's histograms are; gaps are windows with "
           "none. Drag on any panel to zoom: every panel follows; double-click to reset.")
if cost is not None and run.summary.get("backend") == "real":
    st.info("A real-backend replay: the utilisation panels put the cost model's peak-rate seconds over the measured "
            "step time, and the time-by-term panel splits the model's prediction of each step (the replay's "
            "predicted_s, priced for the layers and dtype it ran): the terms add up to the prediction, so a stack "
            "above 1 means the model predicts the steps slower than they were measured, and the remainder is "
            "measured time the model does not explain.")
if cost is None:
    st.info("The run's cost model cannot be rebuilt from its config.yaml: the utilisation and time-breakdown "
            "panels are left out.")
st.plotly_chart(charts.time_series_figure(ts, f"{run.label} over time"), key="ts_figure",
                config=charts.PLOT_CONFIG)
st.caption("Utilisation: the seconds the steps' model FLOPs (linear layers, LM head, attention) and HBM traffic "
           "(weights, activations, KV reads, slot copies) take at the GPU's peak rates, over the steps' time "
           "(busy time only). Time by term: the cost model's terms for each step (sim/model/cost_model.py); the "
           "policy-operation and swap work is not in the step log and shows as the remainder.")
