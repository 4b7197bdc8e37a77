"""Simulate: one trace on one model/GPU/engine config, with latency, throughput and queue charts."""
import streamlit as st

from kvsim.dashboard import charts
from kvsim.dashboard.forms import config_form
from kvsim.dashboard.ui import follow_job, pick_run, run_button, saved_runs, show_summary_metrics, start_job

st.title("Simulate")
with st.sidebar:
    st.header("Configuration")
    cfg, error = config_form("sim_")
if error:
    st.error(error)
label = st.text_input("Run label", value="", placeholder="auto", key="sim_label")
if run_button("Run simulation", "sim_run", "Simulate", blocked=cfg is None):
    name = label.strip() or f"#{len(saved_runs()) + 1} {cfg.trace.rsplit('/', 1)[-1]} {cfg.model} {cfg.gpu}"
    start_job("Simulate", [(name, cfg)])
follow_job("Simulate")

if not saved_runs():
    st.info("Pick a trace and a configuration in the sidebar, then run a simulation.")
    st.stop()
run = pick_run("sim_")
if run is None:
    st.stop()
st.subheader(f"Summary: {run.label}")
show_summary_metrics(run)
with st.expander("All summary figures"):
    st.dataframe({k: [str(v)] for k, v in run.summary.items()}, hide_index=True)
cols = st.columns(3)
for col, metric in zip(cols, ("ttft_s", "tpot_s", "e2e_s")):
    col.plotly_chart(charts.latency_cdfs([run], metric), key=f"sim_cdf_{metric}", config=charts.PLOT_CONFIG)
st.plotly_chart(charts.throughput_over_time([run]), key="sim_throughput", config=charts.PLOT_CONFIG)
a, b = st.columns(2)
a.plotly_chart(charts.step_series([run], {"num_waiting": "waiting", "num_running": "running"},
                                  "Queue length", "requests"), key="sim_queue", config=charts.PLOT_CONFIG)
b.plotly_chart(charts.step_series([run], {"batch_size": "batch size"}, "Batch size", "sequences per step"),
               key="sim_batch", config=charts.PLOT_CONFIG)
