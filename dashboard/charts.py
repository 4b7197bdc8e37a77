"""Plotly figures. Each takes one or more RunRecords (overlaid when several) or a prepared table."""
from __future__ import annotations

import math

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


def run_colors(runs: list[RunRecord]) -> dict[str, str]:
    return {r.label: RUN_COLORS[i % len(RUN_COLORS)] for i, r in enumerate(runs)}


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
        out = output_token_rate(run.requests, bins)
        fig.add_trace(go.Scatter(x=out["time_s"], y=out["output_tok_s"], mode="lines", name=f"{run.label}: output",
                                 line=dict(color=colors[run.label])))
        b = bin_steps(run.steps, bins)
        if len(b) and len(runs) == 1:
            fig.add_trace(go.Scatter(x=b["time_s"], y=b["prefill_tokens_per_s"], mode="lines",
                                     name=f"{run.label}: prefill", line=dict(dash="dot", color=RUN_COLORS[1])))
    return _legend_below(fig)


def step_series(runs: list[RunRecord], columns: dict[str, str], title: str, y: str, bins: int = 200) -> go.Figure:
    """Binned step-log columns over time (duration-weighted means), one line per run x column."""
    fig = _fig(title, "time (s)", y)
    colors = run_colors(runs)
    for run in runs:
        b = bin_steps(run.steps, bins)
        for i, (col, name) in enumerate(columns.items()):
            if col in b:
                label = name if len(runs) == 1 else f"{run.label}: {name}"
                line = dict(color=RUN_COLORS[i]) if len(runs) == 1 else dict(color=colors[run.label], dash=DASHES[i])
                fig.add_trace(go.Scatter(x=b["time_s"], y=b[col], mode="lines", name=label, line_shape="hv",
                                         line=line))
    return _legend_below(fig)


def eviction_over_time(runs: list[RunRecord], bins: int = 200) -> go.Figure:
    """Tokens evicted and blocks freed per second, in the summary's units (per-head runs: (token,
    layer, KV head) entries and one-(layer, KV head) pages divided by layers x KV heads)."""
    per_head = any(r.per_head for r in runs)
    fig = _fig("Eviction / s" + (", summed over layers and KV heads" if per_head else ""), "time (s)",
               "tokens or block-equivalents / s" if per_head else "per second")
    colors = run_colors(runs)
    for run in runs:
        b = bin_steps(run.steps, bins)
        if not len(b):
            continue
        e = eviction_rates(b, run.rows_per_block)
        prefix = "" if len(runs) == 1 else f"{run.label}: "
        unit = " (equivalents)" if run.per_head else ""
        for i, (col, name) in enumerate((("tokens_per_s", "tokens evicted / s"), ("blocks_per_s", "blocks freed / s"))):
            color = RUN_COLORS[i] if len(runs) == 1 else colors[run.label]
            fig.add_trace(go.Scatter(x=e["time_s"], y=e[col], mode="lines", name=f"{prefix}{name}{unit}",
                                     line_shape="hv", line=dict(color=color, dash=DASHES[i] if len(runs) > 1 else "solid")))
    return _legend_below(fig)


def kv_utilization(runs: list[RunRecord], bins: int = 200) -> go.Figure:
    """Pool use as a fraction of the managed pool (per-head runs: (layer, KV head) pages of all rows
    against the pool's pages) and fragmentation (1 - live / allocated slots)."""
    fig = _fig("KV utilization and internal fragmentation", "time (s)", "fraction")
    colors = run_colors(runs)
    for run in runs:
        b = bin_steps(run.steps, bins)
        if not len(b):
            continue
        prefix = "" if len(runs) == 1 else f"{run.label}: "
        one = len(runs) == 1
        fig.add_trace(go.Scatter(x=b["time_s"], y=b["blocks_used"] / max(run.pool_blocks, 1), mode="lines",
                                 name=f"{prefix}{'pages' if run.rows_per_block > 1 else 'blocks'} used / pool",
                                 line=dict(color=RUN_COLORS[0] if one else colors[run.label])))
        fig.add_trace(go.Scatter(x=b["time_s"], y=b["fragmentation"], mode="lines", name=f"{prefix}fragmentation",
                                 line=dict(dash="dot", color=RUN_COLORS[1] if one else colors[run.label])))
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


# ---- the time-series page: one figure of panels sharing the time axis (zoom one, all follow) -------
def _panels(has_cost: bool) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(title, y unit, [(column, series name)]) per panel."""
    pct = lambda base, unit: [(f"{base}_p{q}", f"p{q}") for q in (50, 90, 99)]   # noqa: E731
    panels = [
        ("Load: arrivals and finishes", "requests / s", [("arrivals_per_s", "arrivals / s"),
                                                          ("finished_per_s", "finished / s")]),
        ("TTFT percentiles (by first-token time)", "ms", pct("ttft_ms", "ms")),
        ("TPOT percentiles (by finish time)", "ms", pct("tpot_ms", "ms")),
        ("E2E latency percentiles (by finish time)", "s", pct("e2e_s", "s")),
        ("Queue time percentiles (by first schedule)", "s", pct("queue_s", "s")),
        ("Scheduler state: running and waiting requests", "requests", [("num_running", "running"),
                                                                       ("num_waiting", "waiting")]),
        ("KV cache usage and internal fragmentation", "fraction", [("kv_usage", "KV usage"),
                                                                   ("fragmentation", "fragmentation")]),
        ("Prefix-cache hit rate (prompt tokens admitted)", "fraction", [("prefix_hit_rate", "hit rate")]),
        ("Preemptions", "per second", [("preemptions_per_s", "preemptions / s")]),
        ("Batch size (sequences per step)", "sequences", [("batch_size_per_step", "batch size")]),
        ("Batched tokens per step", "tokens", [("batched_tokens", "tokens")]),
    ]
    if has_cost:
        panels += [("Model FLOPs and memory-bandwidth utilisation (cost model)", "fraction of peak",
                    [("mfu", "FLOPs utilisation (MFU)"), ("mbu", "bandwidth utilisation (MBU)")]),
                   ("Step time by term (cost model)", "share of step time",
                    [(f"share_{t}", name) for t, name in TIME_TERMS.items()])]
    return panels


def time_series_figure(ts: pd.DataFrame, title: str) -> go.Figure:
    """The time-series panels of `data.time_series`, stacked on one shared time axis."""
    panels = _panels("mfu" in ts)
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.35 / len(panels),
                        subplot_titles=[f"{t} ({unit})" for t, unit, _ in panels])
    for row, (panel, unit, series) in enumerate(panels, start=1):
        stacked = panel.startswith("Step time by term")
        for i, (col, name) in enumerate(series):
            if col not in ts:
                continue
            fig.add_trace(go.Scatter(
                x=ts["time_s"], y=ts[col], name=name, mode="lines", line_shape="hv", connectgaps=False,
                legendgroup=f"panel{row}", legendgrouptitle_text=panel.split(" (")[0] if i == 0 else None,
                stackgroup=f"s{row}" if stacked else None, line=dict(color=RUN_COLORS[i % len(RUN_COLORS)]),
                hovertemplate=f"%{{y:.4g}} {unit}<extra>{name}</extra>"), row=row, col=1)
        fig.update_yaxes(title_text=unit, row=row, col=1, rangemode="tozero")
    fig.update_xaxes(title_text="simulated time (s)", row=len(panels), col=1)
    fig.update_layout(title=dict(text=title, x=0, xanchor="left"), height=190 * len(panels) + 120,
                      margin=dict(l=70, r=40, t=80, b=50), modebar=dict(orientation="v"), hovermode="x unified",
                      legend=dict(groupclick="toggleitem", tracegroupgap=6))
    return fig


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
