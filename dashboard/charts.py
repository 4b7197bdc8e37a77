"""Plotly figures. Each takes one or more RunRecords (overlaid when several) or a prepared table."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .data import (LATENCY_METRICS, POOL_STATES, TIME_TERMS, RunRecord, bin_steps, eviction_rates, latency_cdf,
                   output_token_rate, pool_map)

# Legends at the bottom of the figure, in a margin grown to hold them below the x-axis title (see
# _legend_below); the modebar upright on the right: neither covers a title.
_LAYOUT = dict(height=320, margin=dict(l=60, r=40, t=50, b=60), modebar=dict(orientation="v"),
               legend=dict(orientation="h", yref="container", yanchor="bottom", y=0, x=0, xanchor="left"))
_LEGEND_ROW_PX = 20
_LEGEND_CHARS_PER_ROW = 55
PLOT_CONFIG = {"displaylogo": False}
POOL_COLORS = ("#e8e8e8", "#9ecae1", "#fdae6b", "#3182bd")
POOL_LEGEND = ("free", "cached prefix", "empty / evicted slots", "live tokens")   # POOL_STATES, short
# A run's colour on every chart of a page: runs are coloured by their place in the page's selection
# (charts of several series per run tell the series apart by dash, not colour).
RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
              "#7f7f7f", "#bcbd22")
DASHES = ("solid", "dot", "dash", "dashdot", "longdash")
# A series' colour on every page: running and waiting, percentiles, prompt and generation tokens keep
# theirs wherever they are drawn (single-run charts; charts of several runs colour by run).
SERIES_COLORS = {"num_running": "#2ca02c", "num_waiting": "#ff7f0e", "P50": "#1f77b4", "P90": "#9467bd",
                 "P99": "#d62728", "prompt_tok_s": "#9467bd", "generation_tok_s": "#1f77b4",
                 "output_tok_s": "#1f77b4", "prefill_tokens_per_s": "#9467bd", "kv_usage": "#1f77b4",
                 "blocks_used": "#1f77b4", "fragmentation": "#8c564b"}


def series_color(column: str, i: int = 0) -> str:
    """The colour of a series (by its column, or its percentile), else the i-th run colour."""
    quantile = column.rsplit("_", 1)[-1].upper()
    return SERIES_COLORS.get(column) or SERIES_COLORS.get(quantile) or RUN_COLORS[i % len(RUN_COLORS)]


def run_colors(runs: list[RunRecord]) -> dict[str, str]:
    return {r.label: RUN_COLORS[i % len(RUN_COLORS)] for i, r in enumerate(runs)}


def _fig(title: str, x: str, y: str, **kw) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=dict(text=title, x=0, xanchor="left"), xaxis_title=x, yaxis_title=y,
                      **{**_LAYOUT, **kw})
    return fig


def binned(run: RunRecord, bins: int) -> pd.DataFrame:
    """The run's step log on `bins` time bins (data.bin_steps), computed once per run and bin count."""
    return run.memo(("bins", bins), lambda: bin_steps(run.steps, bins))


def _flat_zero(fig: go.Figure) -> go.Figure:
    """A chart whose series are all zero (nothing of the kind happened in the run) drawn on 0..1, said
    so in its title, not on plotly's -1..1 (a negative rate or count means nothing)."""
    ys = [np.asarray(t.y, dtype=float) for t in fig.data if t.y is not None]
    if ys and all(np.nansum(np.abs(y)) == 0 for y in ys):
        fig.update_yaxes(range=[0, 1])
        fig.update_layout(title_text=f"{fig.layout.title.text} (none in this run)")
    else:
        fig.update_yaxes(rangemode="tozero")
    return fig


def _legend_below(fig: go.Figure) -> go.Figure:
    """Room under the x-axis title for the legend's rows (estimated for a chart ~400 px wide)."""
    names = [str(t.name or "") for t in fig.data if t.showlegend is not False]
    if len(names) >= 2:
        rows = min(len(names), math.ceil(sum(len(n) + 6 for n in names) / _LEGEND_CHARS_PER_ROW))
        extra = _LEGEND_ROW_PX * rows
        fig.update_layout(height=fig.layout.height + extra, margin_b=fig.layout.margin.b + extra)
    return fig


def latency_cdfs(runs: list[RunRecord], metric: str) -> go.Figure:
    fig = _fig(f"{LATENCY_METRICS[metric]} CDF", f"{LATENCY_METRICS[metric]} (ms)", "fraction of requests")
    colors = run_colors(runs)
    for run in runs:
        cdf = latency_cdf(run.requests, metric)
        fig.add_trace(go.Scatter(x=cdf["value_ms"], y=cdf["fraction"], mode="lines", name=run.label,
                                 line_shape="hv", line=dict(color=colors[run.label])))
    fig.update_yaxes(range=[0, 1.02])
    return _legend_below(fig)


def throughput_over_time(runs: list[RunRecord], bins: int = 200) -> go.Figure:
    fig = _fig("Throughput over time", "time (s)", "tokens / s")
    colors = run_colors(runs)
    for run in runs:
        out = run.memo(("output_rate", bins), lambda r=run: output_token_rate(r.tokens().values, bins))
        fig.add_trace(go.Scatter(x=out["time_s"], y=out["output_tok_s"], mode="lines", name=f"{run.label}: output",
                                 line=dict(color=series_color("output_tok_s") if len(runs) == 1 else colors[run.label])))
        b = binned(run, bins)
        if len(b) and len(runs) == 1:
            fig.add_trace(go.Scatter(x=b["time_s"], y=b["prefill_tokens_per_s"], mode="lines",
                                     name=f"{run.label}: prefill",
                                     line=dict(dash="dot", color=series_color("prefill_tokens_per_s"))))
    return _legend_below(fig)


def step_series(runs: list[RunRecord], columns: dict[str, str], title: str, y: str, bins: int = 200) -> go.Figure:
    """Binned step-log columns over time (duration-weighted means), one line per run x column."""
    fig = _fig(title, "time (s)", y)
    colors = run_colors(runs)
    for run in runs:
        b = binned(run, bins)
        for i, (col, name) in enumerate(columns.items()):
            if col in b:
                label = name if len(runs) == 1 else f"{run.label}: {name}"
                line = dict(color=series_color(col, i)) if len(runs) == 1 else dict(color=colors[run.label],
                                                                                     dash=DASHES[i])
                fig.add_trace(go.Scatter(x=b["time_s"], y=b[col], mode="lines", name=label, line_shape="hv",
                                         line=line))
    return _legend_below(_flat_zero(fig))


def eviction_over_time(runs: list[RunRecord], bins: int = 200) -> go.Figure:
    """Tokens evicted and blocks freed per second, in the summary's units (per-head runs: (token,
    layer, KV head) entries and one-(layer, KV head) pages divided by layers x KV heads)."""
    per_head = any(r.per_head for r in runs)
    fig = _fig("Eviction / s" + (", summed over layers and KV heads" if per_head else ""), "time (s)",
               "token-equivalents / s" if per_head else "tokens / s")
    fig.update_layout(yaxis2=dict(title="block-equivalents / s" if per_head else "blocks / s", overlaying="y",
                                  side="right", rangemode="tozero", showgrid=False), yaxis_rangemode="tozero")
    colors = run_colors(runs)
    for run in runs:
        b = binned(run, bins)
        if not len(b):
            continue
        e = eviction_rates(b, run.rows_per_block)
        prefix = "" if len(runs) == 1 else f"{run.label}: "
        unit = " (equivalents)" if run.per_head else ""
        for i, (col, name, axis) in enumerate((("tokens_per_s", "tokens evicted / s", "y"),
                                                ("blocks_per_s", "blocks freed / s", "y2"))):
            color = RUN_COLORS[i] if len(runs) == 1 else colors[run.label]
            fig.add_trace(go.Scatter(x=e["time_s"], y=e[col], mode="lines", name=f"{prefix}{name}{unit}", yaxis=axis,
                                     line_shape="hv", line=dict(color=color, dash=DASHES[i] if len(runs) > 1 else "solid")))
    return _legend_below(_flat_zero(fig))


def kv_utilization(runs: list[RunRecord], bins: int = 200) -> go.Figure:
    """Pool use as a fraction of the managed pool (per-head runs: (layer, KV head) pages of all rows
    against the pool's pages) and fragmentation (1 - live / allocated slots)."""
    fig = _fig("KV utilization and internal fragmentation", "time (s)", "fraction")
    colors = run_colors(runs)
    for run in runs:
        b = binned(run, bins)
        if not len(b):
            continue
        prefix = "" if len(runs) == 1 else f"{run.label}: "
        one = len(runs) == 1
        fig.add_trace(go.Scatter(x=b["time_s"], y=b["blocks_used"] / max(run.pool_blocks, 1), mode="lines",
                                 name=f"{prefix}{'pages' if run.rows_per_block > 1 else 'blocks'} used / pool",
                                 line=dict(color=series_color("kv_usage") if one else colors[run.label])))
        fig.add_trace(go.Scatter(x=b["time_s"], y=b["fragmentation"], mode="lines", name=f"{prefix}fragmentation",
                                 line=dict(dash="dot", color=series_color("fragmentation") if one else colors[run.label])))
    fig.update_yaxes(range=[0, 1.02])
    return _legend_below(fig)


def memory_map(run: RunRecord, bins: int = 200, rows: int = 120, zoom: bool = False) -> go.Figure:
    b = binned(run, bins)
    per_row = run.rows_per_block
    codes, edges = pool_map(b, run.num_blocks_total, run.block_size, rows, zoom, pages_per_block=per_row)
    n = len(POOL_STATES)
    scale = []
    for i, color in enumerate(POOL_COLORS):
        scale += [[i / n, color], [(i + 1) / n, color]]
    fig = go.Figure(go.Heatmap(
        x=b["time_s"], y=0.5 * (edges[:-1] + edges[1:]), z=codes, zmin=-0.5, zmax=n - 0.5,
        colorscale=scale, customdata=np.array(POOL_STATES, dtype=object)[codes],
        hovertemplate="t=%{x:.2f}s block≈%{y:.0f}: %{customdata}<extra></extra>",
        colorbar=dict(tickvals=list(range(n)), ticktext=list(POOL_LEGEND), title="state")))
    title = "Block pool over time (blocks grouped by state)" if per_row == 1 else \
        f"Block pool over time: mean of the {per_row:,} (layer, KV head) rows, pages grouped by state"
    fig.update_layout(title=dict(text=title, x=0, xanchor="left"), xaxis_title="time (s)",
                      yaxis_title="blocks" if per_row == 1 else "pages per (layer, KV head) row",
                      **{**_LAYOUT, "height": 420, "margin": dict(l=60, r=60, t=50, b=50)})
    return fig


def metric_bars(table: pd.DataFrame, label: str, metrics: list[str], title: str, y: str,
                colors: dict[str, str] | None = None) -> go.Figure:
    """Grouped bars: one group per metric, one bar per run (in the run's colour)."""
    fig = _fig(title, "", y)
    metrics = [m for m in metrics if m in table]
    for i, row in enumerate(table.itertuples(index=False)):
        name = str(getattr(row, label) if hasattr(row, label) else table[label].iloc[i])
        fig.add_trace(go.Bar(x=metrics, y=[table[m].iloc[i] for m in metrics], name=name,
                             marker_color=(colors or {}).get(name, RUN_COLORS[i % len(RUN_COLORS)])))
    fig.update_layout(barmode="group")
    return _legend_below(fig)


# ---- the time-series page: vLLM's Grafana panels on one shared time axis (zoom one, all follow) ----
@dataclass(frozen=True)
class Panel:
    """One panel: its title (vLLM's Grafana panel name where vLLM has the panel, with the metric it
    plots), the y unit, the series [(column, legend name)] and how they are drawn."""
    title: str
    unit: str
    series: tuple[tuple[str, str], ...]
    kind: str = "lines"          # lines | stack | heatmap (series: the heatmap's name only)
    hover: str = ".3s"           # d3 format of the values in the hover label


def _pct(column: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{column}_p{q}", f"P{q}") for q in (50, 90, 99))


def latency_unit(ts: pd.DataFrame, column_ms: str) -> tuple[str, float]:
    """('ms', 1) or ('s', 1e-3): seconds once the panel's p99 passes a second (no '60k ms' ticks)."""
    top = np.nanmax(ts[f"{column_ms}_p99"].to_numpy(float)) if f"{column_ms}_p99" in ts else np.nan
    return ("s", 1e-3) if np.isfinite(top) and top >= 1000 else ("ms", 1.0)


def grafana_panels(ts: pd.DataFrame) -> list[Panel]:
    """The Time series page's panels, in vLLM's Grafana dashboard's order where vLLM has them, then
    kvsim's own (load, fragmentation, batch, the cost model's utilisation and time terms)."""
    finishes = tuple((c, c.removeprefix("finish:")) for c in ts.columns if c.startswith("finish:"))
    panels = [
        Panel("E2E Request Latency (vllm:e2e_request_latency_seconds)", "s", _pct("e2e_s")),
        Panel("Token Throughput (vllm:prompt_tokens, generation_tokens)", "tokens / s",
              (("prompt_tok_s", "Prompt Tokens/Sec"), ("generation_tok_s", "Generation Tokens/Sec"))),
        Panel("Time Per Output Token Latency (vllm:time_per_output_token_seconds)", "ms", _pct("tpot_ms")),
        Panel("Inter-Token Latency (vllm:inter_token_latency_seconds)", "ms", _pct("itl_ms")),
        Panel("Scheduler State (vllm:num_requests_running, num_requests_waiting)", "requests",
              (("num_running", "Num Running"), ("num_waiting", "Num Waiting")), hover=".1f"),
        Panel("Time To First Token Latency (vllm:time_to_first_token_seconds)", "ms", _pct("ttft_ms")),
        Panel("Cache Utilization (vllm:kv_cache_usage_perc)", "fraction",
              (("kv_usage", "GPU Cache Usage"), ("fragmentation", "internal fragmentation")), hover=".1%"),
        Panel("Prefix Cache Hit Rate (vllm:prefix_cache_hits / queries)", "fraction",
              (("prefix_hit_rate", "hit rate"),), hover=".1%"),
        Panel("Request Prompt Length (vllm:request_prompt_tokens)", "tokens", (("prompt_tokens", "requests"),),
              kind="heatmap"),
        Panel("Request Generation Length (vllm:request_generation_tokens)", "tokens",
              (("output_tokens", "requests"),), kind="heatmap"),
        Panel("Finish Reason (vllm:request_success)", "requests / s", finishes or (("finished_per_s", "finished"),)),
        Panel("Queue Time (vllm:request_queue_time_seconds)", "s", _pct("queue_s")),
        Panel("Requests Prefill and Decode Time (vllm:request_prefill_time_seconds, decode_time_seconds)", "s",
              (("prefill_s_mean", "Prefill"), ("decode_s_mean", "Decode"))),
        Panel("Preemptions (vllm:num_preemptions)", "per second", (("preemptions_per_s", "preemptions / s"),)),
        Panel("Load: arrivals and finishes", "requests / s",
              (("arrivals_per_s", "arrivals / s"), ("finished_per_s", "finished / s"))),
        Panel("Batch size (sequences per step)", "sequences", (("batch_size_per_step", "batch size"),), hover=".1f"),
        Panel("Batched tokens per step", "tokens", (("batched_tokens", "tokens per step"),), hover=".4s"),
    ]
    if "mfu" in ts:
        panels += [Panel("Model FLOPs and memory-bandwidth utilisation (cost model)", "fraction of peak",
                         (("mfu", "FLOPs utilisation (MFU)"), ("mbu", "bandwidth utilisation (MBU)")), hover=".1%"),
                   Panel("Step time by term (cost model)", "share of step time",
                         tuple((f"share_{t}", name) for t, name in TIME_TERMS.items()), kind="stack", hover=".1%")]
    for i, p in enumerate(panels):      # latency panels in seconds once they pass a second
        if p.unit == "ms":
            unit, scale = latency_unit(ts, p.series[0][0].rsplit("_p", 1)[0])
            if scale != 1.0:
                panels[i] = Panel(p.title, unit, p.series, p.kind, p.hover)
    return panels


PANEL_COLUMNS = 2
PANEL_HEIGHT_PX = 250


def time_series_figure(ts: pd.DataFrame, title: str, heatmaps: dict | None = None) -> go.Figure:
    """The panels of grafana_panels in a grid on one shared time axis, each with its legend under it.
    `heatmaps`: column -> (counts [bucket x window], bucket labels) of the heatmap panels."""
    panels = [p for p in grafana_panels(ts) if p.kind != "heatmap" or (heatmaps or {}).get(p.series[0][0])]
    return panel_grid(ts, panels, title, heatmaps)


def replica_panels(labels: dict[int, str]) -> list[Panel]:
    """The Time series page's per-replica panels (dashboard/fleet.py's replica_series columns): one line
    per replica, in the same colour on every panel."""
    def each(prefix: str) -> tuple[tuple[str, str], ...]:
        return tuple((f"{prefix}:{r}", name) for r, name in labels.items())
    return [Panel("Router decisions: requests routed to each replica", "requests / s", each("routed_per_s")),
            Panel("Num Running per replica (vllm:num_requests_running)", "requests", each("num_running"), hover=".1f"),
            Panel("Num Waiting per replica (vllm:num_requests_waiting)", "requests", each("num_waiting"), hover=".1f"),
            Panel("GPU Cache Usage per replica (vllm:kv_cache_usage_perc)", "fraction", each("kv_usage"),
                  hover=".1%"),
            Panel("Prefix Cache Hit Rate per replica (vllm:prefix_cache_hits / queries)", "fraction",
                  each("prefix_hit_rate"), hover=".1%")]


def handoff_panels() -> list[Panel]:
    """The Time series page's prefill-to-decode hand-off panels (dashboard/fleet.py's handoff_series)."""
    return [Panel("KV hand-off: pulls started per second", "pulls / s", (("transfers_per_s", "pulls / s"),)),
            Panel("KV hand-off: GB pulled per second (the link's load)", "GB / s", (("gb_per_s", "GB / s"),)),
            Panel("KV hand-off: TTFT legs of the pulls started (mean)", "ms",
                  (("kv_wait_ms", "KV wait"), ("transfer_ms", "transfer")), hover=".1f")]


def panel_grid(ts: pd.DataFrame, panels: list[Panel], title: str, heatmaps: dict | None = None) -> go.Figure:
    """`panels` over the columns of `ts` in a grid on one shared time axis. The grid's layout comes from
    plotly's make_subplots; the panels' axes, legends and titles are then set in its layout as plain
    dicts and the figure is assembled without plotly's per-property validation (the traces themselves
    are validated as they are made): validating every layout update took longer than the data (19
    panels). tests/test_dashboard_series.py checks the figure's JSON equals the validated build's."""
    rows = math.ceil(len(panels) / PANEL_COLUMNS)
    grid = make_subplots(rows=rows, cols=PANEL_COLUMNS, shared_xaxes="all", vertical_spacing=0.5 / rows,
                         horizontal_spacing=0.07, subplot_titles=[p.title for p in panels])
    layout = grid.layout.to_plotly_json()
    height = PANEL_HEIGHT_PX * rows + 120
    below = 22 / (height - 120)        # the legend's top: under the panel's tick labels (paper units)
    traces: list = []
    for n, panel in enumerate(panels):
        row, col = n // PANEL_COLUMNS + 1, n % PANEL_COLUMNS + 1
        suffix = "" if n == 0 else str(n + 1)         # make_subplots numbers the cells' axes row by row
        xaxis, yaxis = layout[f"xaxis{suffix}"], layout[f"yaxis{suffix}"]
        legend = f"legend{suffix}"
        where = dict(xaxis=f"x{suffix}", yaxis=f"y{suffix}")
        if panel.kind == "heatmap":
            traces.append(_heatmap_trace(ts, panel, heatmaps[panel.series[0][0]], where))
        else:
            traces.extend(_line_traces(ts, panel, legend, row, col, where))
        yaxis.update(title=dict(text=panel.unit), rangemode="tozero", exponentformat="none", separatethousands=True,
                     **({"range": [0, 1.05]} if panel.unit == "fraction" else {}))
        layout[legend] = dict(x=xaxis["domain"][0], y=yaxis["domain"][0] - below, xanchor="left", yanchor="top",
                              orientation="h", font=dict(size=10), bgcolor="rgba(0,0,0,0)")
    for key, axis in layout.items():
        if key.startswith("xaxis"):
            axis.update(hoverformat=".1f", ticksuffix=" s", showticklabels=True)
    layout.update(title=dict(text=title, x=0, xanchor="left"), height=height, margin=dict(l=70, r=30, t=80, b=40),
                  modebar=dict(orientation="v"), hovermode="x")
    for note in layout.get("annotations", []):
        note.setdefault("font", {})["size"] = 12
    return go.Figure(data=traces, layout=layout, _validate=False)


def _line_traces(ts: pd.DataFrame, panel: Panel, legend: str, row: int, col: int, where: dict) -> list[go.Scatter]:
    scale = 1e-3 if panel.unit == "s" and panel.series[0][0].endswith(("ms_p50", "ms_p90", "ms_p99")) else 1.0
    return [go.Scatter(
        x=ts["time_s"], y=ts[column] * scale, name=name, mode="lines", line_shape="hv", connectgaps=False,
        legend=legend, stackgroup=f"s{row}-{col}" if panel.kind == "stack" else None,
        line=dict(color=series_color(column, i)),
        hovertemplate=f"t=%{{x:.1f}} s: %{{y:{panel.hover}}} {'' if panel.hover.endswith('%') else panel.unit}"
                      f"<extra>{name}</extra>", **where)
        for i, (column, name) in enumerate(panel.series) if column in ts]


def _heatmap_trace(ts: pd.DataFrame, panel: Panel, heatmap, where: dict) -> go.Heatmap:
    counts, labels = heatmap
    return go.Heatmap(x=ts["time_s"], y=labels, z=np.where(counts > 0, counts, np.nan), showscale=False,
                      colorscale="YlOrRd", name=panel.series[0][1], showlegend=False,
                      hovertemplate="t=%{x:.1f} s, length %{y}: %{z:,.0f} requests finished<extra></extra>", **where)


COLUMN_TITLES = {   # table columns as axis titles
    "trace_options.rate_scale": "arrival-rate scale", "offered_rate_req_s": "offered rate (req/s)",
    "searched_value": "searched value", "replicas": "replicas", "goodput_req_s": "goodput (req/s)",
    "throughput_req_s": "throughput (req/s)", "throughput_output_tok_s": "output throughput (tok/s)",
    "throughput_total_tok_s": "total throughput (tok/s)", "usd_per_m_output_tok": "USD per million output tokens",
    "usd_per_hour": "USD per hour", "slo_attainment": "SLO attainment", "kv_util_mean": "KV utilization (mean)",
    "num_gpus": "GPUs",
}


def column_title(column: str) -> str:
    """'ttft_p99_s' -> 'TTFT p99 (s)', 'trace_options.rate_scale' -> 'arrival-rate scale'."""
    if column in COLUMN_TITLES:
        return COLUMN_TITLES[column]
    head, _, rest = column.partition("_")
    if head in ("ttft", "tpot", "e2e", "itl", "queueing") and rest.endswith("_s"):
        return f"{head.upper() if head != 'queueing' else 'queueing'} {rest[:-2].replace('_', ' ')} (s)"
    return column.rsplit(".", 1)[-1].replace("_", " ")


def xy_lines(df: pd.DataFrame, x: str, y: str, group: str | None, title: str, highlight: pd.Series | None = None) -> go.Figure:
    fig = _fig(title, column_title(x), column_title(y))
    parts = df.groupby(group, sort=True) if group else [(None, df)]
    for key, part in parts:
        part = part.sort_values(x)
        name = str(key[0] if isinstance(key, tuple) else key) if group else column_title(y)
        fig.add_trace(go.Scatter(x=part[x], y=part[y], mode="lines+markers", name=name))
    if highlight is not None and highlight.any():
        front = df[highlight].sort_values(x)
        fig.add_trace(go.Scatter(x=front[x], y=front[y], mode="lines+markers", name="Pareto front",
                                 line=dict(color="black", dash="dash"), marker=dict(size=11, symbol="circle-open")))
    return _legend_below(fig)


PASS_COLOR, FAIL_COLOR = "#2ca02c", "#d62728"


def slo_vs_load(df: pd.DataFrame, x: str, y: str, ok: pd.Series, group: str | None, title: str,
                limit: float | None = None, scale: float = 1.0, unit: str = "") -> go.Figure:
    """`y` against the load, each simulated point marked as meeting the SLO (green circle) or not (red
    cross), with the SLO's limit on `y` as a dashed line when the SLO has one."""
    fig = _fig(title, column_title(x), f"{column_title(y).split(' (')[0]} ({unit})" if unit else column_title(y))
    parts = df.groupby(group, sort=True) if group else [(None, df)]
    for key, part in parts:
        part = part.sort_values(x)
        name = str(key[0] if isinstance(key, tuple) else key) if group else column_title(y).split(" (")[0]
        good = ok.loc[part.index].to_numpy(bool)
        fig.add_trace(go.Scatter(
            x=part[x], y=part[y] * scale, mode="lines+markers", name=name, line=dict(color="#7f7f7f"),
            marker=dict(size=10, symbol=np.where(good, "circle", "x"), color=np.where(good, PASS_COLOR, FAIL_COLOR)),
            customdata=np.where(good, "meets the SLO", "fails the SLO"),
            hovertemplate=f"%{{x:.4g}}: %{{y:.4g}} {unit} (%{{customdata}})<extra>{name}</extra>"))
    for label, color, symbol in (("meets the SLO", PASS_COLOR, "circle"), ("fails the SLO", FAIL_COLOR, "x")):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label,
                                 marker=dict(size=10, symbol=symbol, color=color)))
    if limit is not None:
        fig.add_hline(y=limit * scale, line=dict(color=FAIL_COLOR, dash="dash"),
                      annotation_text=f"SLO {limit * scale:.4g} {unit}", annotation_position="top left")
    fig.update_yaxes(rangemode="tozero")
    return _legend_below(fig)


def predicted_vs_measured(steps: pd.DataFrame, kind: pd.Series | None = None, max_points: int = 20000) -> go.Figure:
    s = steps[np.isfinite(steps["predicted_s"]) & (steps["duration_s"] > 0)]
    if len(s) > max_points:   # even thinning keeps the shape and the chart responsive
        s = s.iloc[np.linspace(0, len(s) - 1, max_points).astype(int)]
    fig = _fig("Predicted vs measured step time", "measured (ms)", "predicted (ms)", height=420)
    groups = kind.loc[s.index].groupby(kind.loc[s.index]).groups if kind is not None else {"steps": s.index}
    for name, index in groups.items():
        part = s.loc[index]
        fig.add_trace(go.Scattergl(x=part["duration_s"] * 1e3, y=part["predicted_s"] * 1e3, mode="markers",
                                   name=str(name), marker=dict(size=6, opacity=0.7)))
    if len(s):
        lo = float(min(s["duration_s"].min(), s["predicted_s"].min())) * 1e3
        hi = float(max(s["duration_s"].max(), s["predicted_s"].max())) * 1e3
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="y = x", line=dict(color="black", dash="dash")))
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return _legend_below(fig)


def tier_occupancy_figure(tiers: pd.DataFrame, title: str) -> go.Figure:
    """The KV offload tiers' blocks held over time (tiers.parquet), each over its capacity."""
    fig = _fig(title, "time (s)", "share of the tier's capacity")
    for i, (name, rows) in enumerate(tiers.groupby("tier", sort=False)):
        capacity = rows["capacity_blocks"].to_numpy(float)
        fig.add_trace(go.Scatter(x=rows["time_s"], y=rows["blocks_held"] / capacity, mode="lines", line_shape="hv",
                                 name=f"{name} ({int(capacity[-1]):,} blocks)", line=dict(color=RUN_COLORS[i % len(RUN_COLORS)]),
                                 customdata=rows["blocks_held"],
                                 hovertemplate="t=%{x:.0f} s: %{y:.1%} (%{customdata:,} blocks)<extra></extra>"))
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%")
    return _legend_below(fig)
