"""Time series: a run over simulated time as a vLLM operator's Grafana dashboard shows a server, plus
the cost model's utilisation and time breakdown per step; all panels share one zoomable time axis."""
import streamlit as st

from kvsim.dashboard import charts
from kvsim.dashboard.data import length_heatmap, run_cost_model, time_edges, time_series
from kvsim.dashboard.fleet import handoff_series, is_fleet_run, replica_labels, replica_series
from kvsim.dashboard.ui import follow_job, pick_run, show_run_config

st.title("Time series")
follow_job("Time series")
run = pick_run("ts_", "Run")
if run is None:
    st.stop()
show_run_config(run, "ts")
windows = st.slider("Time windows", min_value=20, max_value=400, value=120, step=10, key="ts_bins")
cost = run.memo("cost_model", lambda: run_cost_model(run))
ts = run.memo(("time_series", windows), lambda: time_series(run, windows, cost))
heatmaps = run.memo(("length_heatmaps", windows), lambda: {
    column: length_heatmap(run.requests, column, time_edges(run, windows)) for column in ("prompt_tokens", "output_tokens")})
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
figure = run.memo(("time_series_figure", windows),       # 19 subplots: plotly takes longer to build than to send
                  lambda: charts.time_series_figure(ts, f"{run.label} over time", heatmaps))
st.plotly_chart(figure, key="ts_figure",
                config=charts.PLOT_CONFIG)
st.caption("Utilisation: the seconds the steps' model FLOPs (linear layers, LM head, attention) and HBM traffic "
           "(weights, activations, KV reads, slot copies) take at the GPU's peak rates, over the steps' time "
           "(busy time only). Time by term: the cost model's terms for each step (sim/model/cost_model.py); the "
           "policy-operation and swap work is not in the step log and shows as the remainder.")
if is_fleet_run(run):
    st.subheader("Per replica")
    labels = run.memo("replica_labels", lambda: replica_labels(run))
    per_replica = run.memo(("replica_series", windows), lambda: replica_series(run, time_edges(run, windows)))
    st.plotly_chart(run.memo(("replica_figure", windows), lambda: charts.panel_grid(
        per_replica, charts.replica_panels(labels), f"{run.label} per replica")), key="ts_replicas",
        config=charts.PLOT_CONFIG)
    st.caption("The panels above sum the replicas; here each replica has its line (the same colour on every "
               "panel). Router decisions: the requests sent to each replica per second, by arrival (a "
               "disaggregated request counts on its decode replica). Running, waiting and KV cache usage are "
               "duration-weighted means over each replica's steps (they add up to the fleet's panels); the "
               "prefix hit rate is over the prompt tokens each replica admitted in the window.")
if run.tiers is not None and len(run.tiers):
    st.subheader("KV offload tiers")
    st.plotly_chart(charts.tier_occupancy_figure(run.tiers, f"{run.label}: KV offload tiers over time"),
                    key="ts_tiers", config=charts.PLOT_CONFIG)
    st.caption("Blocks each tier holds (of `kv_offload.chunk_tokens` tokens), over its capacity: the CPU and the disk "
               "summed over the replicas, the remote store once (every replica shares it); one sample a second of "
               "simulated time (tiers.parquet). A tier that stays full evicts least recently used blocks.")
handoff = run.memo(("handoff_series", windows), lambda: handoff_series(run, time_edges(run, windows)))
if handoff is not None:
    st.subheader("Prefill/decode hand-off")
    st.plotly_chart(run.memo(("handoff_figure", windows), lambda: charts.panel_grid(
        handoff, charts.handoff_panels(), f"{run.label} KV hand-off over time")), key="ts_handoff",
        config=charts.PLOT_CONFIG)
    st.caption("The KV pulls of the disaggregated requests, by when each pull started (its prefill leg's end plus "
               "its wait for admission and the link): pulls and GB a second, and the mean wait and transfer of "
               "those pulls (requests.parquet's kv_wait_s, transfer_s).")
