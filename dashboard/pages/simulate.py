"""Simulate: one trace on one model/GPU/engine config, with latency, throughput and queue charts."""
import streamlit as st

from kvsim.dashboard import charts
from kvsim.dashboard.fleet import fleet_view
from kvsim.dashboard.forms import BASE, config_form, label_for
from kvsim.dashboard.ui import (available_runs, fast_mode_hint, follow_job, pick_run, run_button, show_run_config,
                                show_summary_metrics, start_job, summary_figures)

st.title("Simulate")
with st.sidebar:
    st.header("Base configuration")
    cfg, error = config_form(BASE)
if error:
    st.error(error)
label = st.text_input("Run label", value="", placeholder="auto: what differs from the default configuration",
                      key="sim_label")
fast_mode_hint([cfg], "sim")
if run_button("Run simulation", "sim_run", "Simulate", blocked=cfg is None):
    start_job("Simulate", [(label.strip() or label_for(cfg), cfg)])
follow_job("Simulate")

if not available_runs():
    st.info("Pick a trace and a configuration in the sidebar, then run a simulation. Every run is kept as a "
            "run directory under the data directory (listed here after a reload).")
    st.stop()
run = pick_run("sim_")
if run is None:
    st.stop()
st.subheader(f"Summary: {run.label}")
show_run_config(run, "sim")
show_summary_metrics(run)
fleet = fleet_view(run)
if fleet is not None:
    st.subheader("Fleet")
    for title, table, key in (("Replicas", fleet.replicas, "sim_fleet_replicas"), ("Pools", fleet.pools, "sim_fleet_pools"),
                              ("Prefill/decode hand-off: TTFT legs and the link", fleet.handoff, "sim_fleet_handoff"),
                              ("CPU offload tier (vLLM's OffloadingConnector)", fleet.offload, "sim_fleet_offload")):
        if table is not None:
            st.caption(title)
            st.dataframe(table, hide_index=True, key=key)
with st.expander("All summary figures"):
    st.dataframe(summary_figures(run.summary), hide_index=True, key="sim_figures")
cols = st.columns(3)
for col, metric in zip(cols, ("ttft_s", "tpot_s", "e2e_s"), strict=True):
    col.plotly_chart(charts.latency_cdfs([run], metric), key=f"sim_cdf_{metric}", config=charts.PLOT_CONFIG)
st.plotly_chart(charts.throughput_over_time([run]), key="sim_throughput", config=charts.PLOT_CONFIG)
a, b = st.columns(2)
a.plotly_chart(charts.step_series([run], {"num_running": "Num Running", "num_waiting": "Num Waiting"},
                                  "Scheduler State: running and waiting requests", "requests"), key="sim_queue",
               config=charts.PLOT_CONFIG)
b.plotly_chart(charts.step_series([run], {"batch_size": "batch size"}, "Batch size", "sequences per step"),
               key="sim_batch", config=charts.PLOT_CONFIG)
st.caption("Latency, load, KV usage, prefix hits, preemptions and the cost model's utilisation per time window: "
           "the Time series page.")
