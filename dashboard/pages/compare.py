"""Compare: the same trace under several values of one config axis, side by side."""
import pandas as pd
import streamlit as st

from kvsim.dashboard import charts
from kvsim.dashboard.data import config_headline, partial_note, used_config
from kvsim.dashboard.forms import BASE, config_axes, config_form, gui_message, parse_axis_values, with_value
from kvsim.dashboard.ui import (available_runs, follow_job, get_runs, run_button, start_job, summary_column_config,
                                summary_table)
from kvsim.sim.config import ConfigError

EVICTION_BARS = [("evicted tokens", "Evicted tokens", "tokens (summed over layers and KV heads)"),
                 ("block-equivalents freed", "Blocks freed by eviction", "block-equivalents"),
                 ("MiB moved by slots", "Data moved by the slot strategy", "MiB"),
                 ("fragmentation mean", "Internal fragmentation (mean)", "fraction of allocated slots")]


def config_table(records) -> pd.DataFrame:
    """The configuration keys on which the runs differ, one row per run (the run column first); the
    KV pool as each run used it (a pool sized from memory shows its block count, not None)."""
    flat = [used_config(r) for r in records]
    keys = sorted({k for f in flat for k in f})
    varying = [k for k in keys if len({str(f.get(k)) for f in flat}) > 1]
    return pd.DataFrame([{"run": r.label, **{k: str(f.get(k)) for k in varying}} for r, f in zip(records, flat, strict=True)])


st.title("Compare")
with st.sidebar:
    st.header("Base configuration")
    base, error = config_form(BASE)
axes = config_axes(base)
axis = st.selectbox("Vary (each run is the base configuration with this key changed)", list(axes), key="cmp_axis",
                    index=list(axes).index("engine.block_size") if "engine.block_size" in axes else 0)
choices = axes[axis]
values, axis_error = [], None
if choices is not None:
    values = st.multiselect("Values", choices, default=choices[: min(4, len(choices))], key=f"cmp_values_{axis}")
    if not values:
        axis_error = "pick at least one value to compare"
else:
    text = st.text_input("Values (comma-separated)", key=f"cmp_text_{axis}",
                         value={"engine.block_size": "8, 16, 32", "engine.max_num_seqs": "16, 64, 256"}.get(axis, ""))
    try:
        values = parse_axis_values(axis, text)
    except ConfigError as exc:
        axis_error = gui_message(str(exc))
runs = []
if base is not None and not axis_error:
    try:
        runs = [(f"{axis}={v}", with_value(base, axis, v)) for v in values]
    except ConfigError as exc:
        axis_error = gui_message(str(exc))
for message in (error, axis_error):
    if message:
        st.error(message)
if run_button(f"Run {len(runs)} simulation{'' if len(runs) == 1 else 's'}", "cmp_run", "Compare", blocked=not runs):
    start_job("Compare", runs)
job = follow_job("Compare")
available = available_runs()
if job is not None:   # show what just ran
    st.session_state["cmp_selected"] = [r.label for r in job.records]
if "cmp_selected" in st.session_state:
    st.session_state["cmp_selected"] = [x for x in st.session_state["cmp_selected"] if x in available]
selected = st.multiselect("Runs to compare", list(available), key="cmp_selected")
records = get_runs(selected, available)
if not records:
    st.info("Choose an axis and values, run them, or select earlier runs to compare.")
    st.stop()
colors = charts.run_colors(records)
for note in filter(None, map(partial_note, records)):
    st.warning(note)
differs = config_table(records)
st.caption("Each run keeps its colour on every chart of this page. Common to the runs: "
           + config_headline(records[0], omit=tuple(differs.columns)))
if len(differs.columns) > 1:
    st.dataframe(differs, hide_index=True, key="cmp_config",
                 column_config={"run": st.column_config.TextColumn("run", pinned=True)})
table = summary_table(records)
st.dataframe(table, hide_index=True, key="cmp_table", column_config=summary_column_config())
a, b = st.columns(2)
a.plotly_chart(charts.metric_bars(table, "run", ["TTFT p50 ms", "TTFT p99 ms"], "TTFT by configuration", "ms",
                                  colors), key="cmp_ttft_bars", config=charts.PLOT_CONFIG)
b.plotly_chart(charts.metric_bars(table, "run", ["TPOT p50 ms", "TPOT p99 ms"], "TPOT by configuration", "ms",
                                  colors), key="cmp_tpot_bars", config=charts.PLOT_CONFIG)
shown = [(col, title, unit) for col, title, unit in EVICTION_BARS if col in table]
if "evicted tokens" in table:
    for (col, title, unit), slot in zip(shown, st.columns(len(shown)), strict=True):
        slot.plotly_chart(charts.metric_bars(table, "run", [col], title, unit, colors), key=f"cmp_bar_{col}",
                          config=charts.PLOT_CONFIG)
cols = st.columns(3)
for col, metric in zip(cols, ("ttft_s", "tpot_s", "e2e_s"), strict=True):
    col.plotly_chart(charts.latency_cdfs(records, metric), key=f"cmp_cdf_{metric}", config=charts.PLOT_CONFIG)
a, b = st.columns(2)
a.plotly_chart(charts.throughput_over_time(records), key="cmp_throughput", config=charts.PLOT_CONFIG)
b.plotly_chart(charts.kv_utilization(records), key="cmp_util", config=charts.PLOT_CONFIG)
a, b = st.columns(2)
a.plotly_chart(charts.step_series(records, {"num_waiting": "waiting"}, "Queue length", "requests"), key="cmp_queue",
               config=charts.PLOT_CONFIG)
b.plotly_chart(charts.step_series(records, {"bytes_moved_per_s": "bytes moved / s"}, "Bytes moved by slots",
                                  "bytes / s"), key="cmp_bytes", config=charts.PLOT_CONFIG)
if "evicted tokens" in table:
    st.plotly_chart(charts.eviction_over_time(records), key="cmp_evict", config=charts.PLOT_CONFIG)
