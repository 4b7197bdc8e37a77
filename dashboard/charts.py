"""Plotly figures. Each takes one or more RunRecords (overlaid when several) or a prepared table."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .data import LATENCY_METRICS, POOL_STATES, RunRecord, bin_steps, latency_cdf, output_token_rate, pool_map

# Legends at the bottom of the figure, in a margin grown to hold them below the x-axis title (see
# _legend_below); the modebar upright on the right: neither covers a title.
_LAYOUT = dict(height=320, margin=dict(l=60, r=40, t=50, b=60), modebar=dict(orientation="v"),
               legend=dict(orientation="h", yref="container", yanchor="bottom", y=0, x=0, xanchor="left"))
_LEGEND_ROW_PX = 20
_LEGEND_CHARS_PER_ROW = 55
PLOT_CONFIG = {"displaylogo": False}
POOL_COLORS = ("#e8e8e8", "#9ecae1", "#fdae6b", "#3182bd")
POOL_LEGEND = ("free", "cached prefix", "empty / evicted slots", "live tokens")   # POOL_STATES, short


def _fig(title: str, x: str, y: str, **kw) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=dict(text=title, x=0, xanchor="left"), xaxis_title=x, yaxis_title=y,
                      **{**_LAYOUT, **kw})
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
    for run in runs:
        cdf = latency_cdf(run.requests, metric)
        fig.add_trace(go.Scatter(x=cdf["value_ms"], y=cdf["fraction"], mode="lines", name=run.label,
                                 line_shape="hv"))
    fig.update_yaxes(range=[0, 1.02])
    return _legend_below(fig)


def throughput_over_time(runs: list[RunRecord], bins: int = 200) -> go.Figure:
    fig = _fig("Throughput over time", "time (s)", "tokens / s")
    for run in runs:
        out = output_token_rate(run.requests, bins)
        fig.add_trace(go.Scatter(x=out["time_s"], y=out["output_tok_s"], mode="lines", name=f"{run.label}: output"))
        b = bin_steps(run.steps, bins)
        if len(b) and len(runs) == 1:
            fig.add_trace(go.Scatter(x=b["time_s"], y=b["prefill_tokens_per_s"], mode="lines",
                                     name=f"{run.label}: prefill", line=dict(dash="dot")))
    return _legend_below(fig)


def step_series(runs: list[RunRecord], columns: dict[str, str], title: str, y: str, bins: int = 200) -> go.Figure:
    """Binned step-log columns over time (duration-weighted means), one line per run x column."""
    fig = _fig(title, "time (s)", y)
    for run in runs:
        b = bin_steps(run.steps, bins)
        for col, name in columns.items():
            if col in b:
                label = name if len(runs) == 1 else f"{run.label}: {name}"
                fig.add_trace(go.Scatter(x=b["time_s"], y=b[col], mode="lines", name=label, line_shape="hv"))
    return _legend_below(fig)


def kv_utilization(runs: list[RunRecord], bins: int = 200) -> go.Figure:
    """Pool use as a fraction of the managed pool (per-head runs: (layer, KV head) pages of all rows
    against the pool's pages) and fragmentation (1 - live / allocated slots)."""
    fig = _fig("KV utilization and internal fragmentation", "time (s)", "fraction")
    for run in runs:
        b = bin_steps(run.steps, bins)
        if not len(b):
            continue
        prefix = "" if len(runs) == 1 else f"{run.label}: "
        fig.add_trace(go.Scatter(x=b["time_s"], y=b["blocks_used"] / max(run.pool_blocks, 1), mode="lines",
                                 name=f"{prefix}{'pages' if run.rows_per_block > 1 else 'blocks'} used / pool"))
        fig.add_trace(go.Scatter(x=b["time_s"], y=b["fragmentation"], mode="lines",
                                 name=f"{prefix}fragmentation", line=dict(dash="dot")))
    fig.update_yaxes(range=[0, 1.02])
    return _legend_below(fig)


def memory_map(run: RunRecord, bins: int = 200, rows: int = 120, zoom: bool = False) -> go.Figure:
    b = bin_steps(run.steps, bins)
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


def metric_bars(table: pd.DataFrame, label: str, metrics: list[str], title: str, y: str) -> go.Figure:
    fig = _fig(title, "", y)
    for m in metrics:
        if m in table:
            fig.add_trace(go.Bar(x=table[label].astype(str), y=table[m], name=m))
    fig.update_layout(barmode="group")
    return _legend_below(fig)


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
