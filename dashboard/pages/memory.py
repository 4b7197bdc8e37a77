"""Memory: KV utilization, internal fragmentation, a map of the block pool, data moved by slots."""
import streamlit as st

from kvsim.dashboard import charts
from kvsim.dashboard.ui import fmt_bytes, fmt_share, follow_job, pick_run, show_run_config

st.title("Memory")
follow_job("Memory")
run = pick_run("mem_", "Run")
if run is None:
    st.stop()
show_run_config(run, "mem")
if not len(run.steps):
    st.warning(f"{run.label}: the run has no step log.")
    st.stop()
bins = st.slider("Time bins", min_value=20, max_value=600, value=200, step=20, key="mem_bins")
s, per_row = run.summary, run.rows_per_block
a, b, c, d, e, f = st.columns(6)       # one figure a tile: "92.3% / 100.0%" does not fit a quarter of the page
a.metric(f"KV pool (blocks of {run.block_size} tokens)", f"{run.num_blocks_total:,}",
         help=None if per_row == 1 else f"per (layer, KV head) row; {run.pool_blocks:,} pages in all")
b.metric("KV util mean", fmt_share(s.get("kv_util_mean")))
c.metric("KV util max", fmt_share(s.get("kv_util_max")))
d.metric("Fragmentation mean", fmt_share(s.get("fragmentation_mean")))
e.metric("Fragmentation p99", fmt_share(s.get("fragmentation_p99")))
f.metric("Data moved by slots", fmt_bytes(run.steps["bytes_moved"].sum()))
if "evicted_tokens" in s:
    a, b, c, d = st.columns(4)
    a.metric("Evicted tokens", f"{s['evicted_tokens']:,.0f}",
             help="summed over layers and KV heads as summary.json's evicted_tokens (per-head runs: "
                  "(token, layer, KV head) entries / (layers x KV heads))")
    freed = s.get("blocks_freed_by_eviction", 0)
    b.metric("Blocks freed by eviction", f"{freed / per_row:,.0f}",
             help=None if per_row == 1 else f"block-equivalents: {freed:,} one-(layer, KV head) pages / {per_row}")
    if per_row > 1:
        c.metric("(layer, KV head) entries evicted", f"{s.get('evicted_token_rows', 0):,}",
                 help="per-(layer, KV head) view: each token evicted from one head of one layer counts once")
        d.metric("Pages freed by eviction", f"{freed:,}", help="per-(layer, KV head) pages")
if per_row > 1:
    st.info(f"Per-head layout: the pool is {run.pool_blocks:,} pages of one (layer, KV head) each "
            f"({run.pool_blocks // per_row:,} usable blocks x {per_row:,} rows; one of the "
            f"{run.num_blocks_total:,} blocks is vLLM's null block). Utilization counts the pages of all rows "
            f"against all pages; the pool map shows the mean row (pages and slots divided by {per_row:,}).")
st.plotly_chart(charts.kv_utilization([run], bins), key="mem_util", config=charts.PLOT_CONFIG)
zoom = st.checkbox("Zoom the pool map to the blocks ever in use", value=True, key="mem_zoom")
st.plotly_chart(charts.memory_map(run, bins, zoom=zoom), key="mem_map", config=charts.PLOT_CONFIG)
st.caption("The step log records pool counts per step, not the state of each block, so each column shows the "
           "pool grouped by state: live tokens (in block-equivalents), then the empty or evicted slots of "
           "allocated blocks (the fragmentation), then free blocks still caching a prefix, then free blocks.")
a, b = st.columns(2)
a.plotly_chart(charts.step_series([run], {"bytes_moved_per_s": "bytes moved / s"},
                                  "Bytes copied / moved by the slot strategy", "bytes / s", bins),
               key="mem_bytes", config=charts.PLOT_CONFIG)
b.plotly_chart(charts.eviction_over_time([run], bins), key="mem_evict", config=charts.PLOT_CONFIG)
