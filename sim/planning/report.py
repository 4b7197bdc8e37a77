"""`kvsim report DIR`: one self-contained HTML page of plotly charts from a sweep (or capacity) store."""
from __future__ import annotations

import html
import math
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .capacity import parse_slo, read_capacity
from ..io.safe_io import atomic_output, file_starts_with
from ..config import SimConfig
from .sweep import config_columns, read_plan, read_store

LOAD_AXES = ("trace_options.rate_scale", "replicas", "engine.max_num_seqs")
REPLICATE_AXES = ("seed",)   # averaged over in the line charts
POLICY_HINTS = ("kv.policy", "policy")
# columns that are outputs or bookkeeping, never a sweep axis
_NOT_AXES = {"run_index", "run_id", "status", "error"}


def config_axes(df: pd.DataFrame, metric_columns: set[str]) -> list[str]:
    """Config columns that take more than one value in the store."""
    axes = []
    for col in df.columns:
        if col in _NOT_AXES or col in metric_columns:
            continue
        if df[col].astype(str).nunique(dropna=False) > 1:
            axes.append(col)
    return axes


# config keys a default config leaves out of its dump (so run ids stay as they were): still config
OPTIONAL_CONFIG_KEYS = {"step_variance", "trace_options.request_timeout"}


def _metric_columns(df: pd.DataFrame) -> set[str]:
    cfg_cols = set(config_columns(SimConfig().model_dump(mode="json"))) | OPTIONAL_CONFIG_KEYS
    return {c for c in df.columns if c not in cfg_cols and c not in _NOT_AXES}


def choose_load_axis(axes: list[str]) -> str | None:
    for name in LOAD_AXES:
        if name in axes:
            return name
    return None


def _group_label(row: pd.Series, keys: list[str]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={row[k]}" for k in keys) or "all runs"


def series_by_group(ok: pd.DataFrame, x: str, group_keys: list[str]) -> list[tuple[str, pd.DataFrame]]:
    """Mean over replicate axes (seeds) of every numeric column, per group and x value."""
    numeric = [c for c in ok.columns if pd.api.types.is_numeric_dtype(ok[c]) and c not in group_keys and c != x]
    out = []
    groups = ok.groupby(group_keys, dropna=False, sort=False) if group_keys else [((), ok)]
    for _key, part in groups:
        agg = part.groupby(x, sort=True)[numeric].mean().reset_index()
        label = _group_label(part.iloc[0], group_keys)
        out.append((label, agg))
    return out


def _line_figure(series, x: str, panels: list[tuple[str, list[tuple[str, str]]]], title: str,
                 y_scale: dict[str, float] | None = None) -> go.Figure:
    """panels: (panel title, [(column, trace name suffix)])."""
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[p[0] for p in panels])
    dashes = ["solid", "dash", "dot", "dashdot"]
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
               "#bcbd22", "#17becf"]
    shown: set[str] = set()
    for gi, (label, agg) in enumerate(series):
        color = palette[gi % len(palette)]
        for pi, (_, cols) in enumerate(panels, start=1):
            for ci, (col, suffix) in enumerate(cols):
                if col not in agg:
                    continue
                scale = (y_scale or {}).get(col, 1.0)
                name = f"{label} {suffix}".strip()
                fig.add_trace(go.Scatter(
                    x=agg[x], y=agg[col] * scale, mode="lines+markers", name=name, legendgroup=label,
                    showlegend=name not in shown,
                    line={"color": color, "dash": dashes[ci % len(dashes)]}), row=1, col=pi)
                shown.add(name)
            fig.update_xaxes(title_text=x, row=1, col=pi)
    fig.update_layout(title=title, height=420, legend={"font": {"size": 10}})
    return fig


def pareto_front(points: pd.DataFrame, cost: str, latency: str) -> pd.DataFrame:
    """Points not dominated in (lower cost, lower latency)."""
    pts = points.dropna(subset=[cost, latency]).sort_values([cost, latency], kind="stable")
    front, best = [], math.inf
    for idx, row in pts.iterrows():
        if row[latency] < best:
            front.append(idx)
            best = row[latency]
    return pts.loc[front]


def _pareto_figure(ok: pd.DataFrame, axes: list[str]) -> go.Figure:
    latency = "e2e_p99_s"
    fig = go.Figure()
    labels = ok.apply(lambda r: _group_label(r, axes), axis=1)
    fig.add_trace(go.Scatter(
        x=ok["usd_per_m_output_tok"], y=ok[latency] * 1e3, mode="markers", name="runs", text=labels,
        hovertemplate="%{text}<br>$%{x:.3f}/M tok<br>p99 E2E %{y:.0f} ms<extra></extra>",
        marker={"color": ok.get("num_gpus"), "colorscale": "Viridis", "showscale": True,
                "colorbar": {"title": "GPUs"}, "size": 9}))
    front = pareto_front(ok, "usd_per_m_output_tok", latency)
    fig.add_trace(go.Scatter(x=front["usd_per_m_output_tok"], y=front[latency] * 1e3, mode="lines",
                             name="Pareto front", line={"color": "black", "dash": "dash"}))
    fig.update_layout(title="Cost vs p99 end-to-end latency (lower-left is better)", height=460,
                      legend={"x": 0.01, "y": 0.99, "bgcolor": "rgba(255,255,255,0.7)"},
                      xaxis_title="$ per million output tokens", yaxis_title="p99 E2E latency (ms)",
                      xaxis_type="log", yaxis_type="log")
    return fig


def _capacity_figure(cap: dict, df: pd.DataFrame) -> go.Figure:
    rows = df.set_index("run_id").reindex(cap.get("curve_run_ids", [])).reset_index()
    x = "trace_options.rate_scale" if cap["mode"] == "rate" else "replicas"
    fig = make_subplots(rows=1, cols=2, subplot_titles=("throughput and goodput", "p99 latencies"))
    for col, name in (("throughput_req_s", "throughput"), ("goodput_req_s", "goodput")):
        fig.add_trace(go.Scatter(x=rows[x], y=rows[col], mode="lines+markers", name=f"{name} (req/s)"),
                      row=1, col=1)
    for col, name in (("ttft_p99_s", "TTFT p99"), ("tpot_p99_s", "TPOT p99"), ("e2e_p99_s", "E2E p99")):
        if col in rows:
            fig.add_trace(go.Scatter(x=rows[x], y=rows[col] * 1e3, mode="lines+markers", name=f"{name} (ms)"),
                          row=1, col=2)
    plotted = {"ttft_p99_s", "tpot_p99_s", "e2e_p99_s"}
    for c in parse_slo(",".join(cap["slo"])):
        if c.metric in plotted:
            limit_ms = c.limit * 1e3
            fig.add_hline(y=limit_ms, line_dash="dot", line_color="red", row=1, col=2)
            # on a log axis, annotations take log10 coordinates (shapes take data values)
            fig.add_annotation(y=math.log10(limit_ms), x=0, xref="x2 domain", yref="y2", text=f"SLO {c.text}",
                               showarrow=False, xanchor="left", yanchor="bottom", font={"color": "red"})
    if cap.get("answer") is not None:
        for c in (1, 2):
            fig.add_vline(x=cap["answer"], line_dash="dash", line_color="green", row=1, col=c)
    what = "max rate scale" if cap["mode"] == "rate" else "fewest replicas"
    fig.update_xaxes(title_text=x)
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(title=f"Capacity search ({', '.join(cap['slo'])}): {what} = {cap.get('answer')}",
                      height=420)
    return fig


def _derived_capacity_figure(series, x: str) -> go.Figure:
    fig = go.Figure()
    for label, agg in series:
        if "slo_attainment" in agg:
            fig.add_trace(go.Scatter(x=agg[x], y=agg["slo_attainment"], mode="lines+markers", name=label))
    fig.update_layout(title="Capacity curve: SLO attainment vs load (config's TTFT/TPOT SLO)", height=400,
                      xaxis_title=x, yaxis_title="fraction of requests within SLO", yaxis_range=[0, 1.05])
    return fig


GENERATOR = '<meta name="generator" content="kvsim report">'


def report_written_by_kvsim(path: str | Path) -> bool:
    """Whether `path` is a page `kvsim report` wrote (its generator tag): replaced without --overwrite."""
    return file_starts_with(Path(path), GENERATOR.encode(), within=512)


def build_report(store: str | Path, out: str | Path | None = None) -> Path:
    store = Path(store)
    df = read_store(store)
    if df.empty:
        if (store / "summary.json").is_file() and (store / "steps.parquet").is_file():
            raise ValueError(f"{store}: one run's output (kvsim simulate / replay), not a store; kvsim report draws "
                             "the stores of kvsim sweep, capacity and plan (--out); one run is drawn by the "
                             "dashboard's Memory and Time series pages")
        raise ValueError(f"{store}: no runs in this store (expected {store}/runs/*.parquet; run `kvsim sweep` first)")
    out = Path(out) if out else store / "report.html"
    metrics = _metric_columns(df)
    ok = df[df["status"] == "ok"].copy()
    axes = config_axes(df, metrics)
    ok_axes = config_axes(ok, metrics)   # a value that only failed runs have draws no line
    x = choose_load_axis(ok_axes)
    group_keys = [a for a in ok_axes if a != x and a not in REPLICATE_AXES]
    policy = next((a for a in POLICY_HINTS if a in group_keys), None)
    if policy:   # the policy first, so legends read "policy=..., budget=..."
        group_keys = [policy] + [a for a in group_keys if a != policy]
    figures: list[tuple[str, go.Figure]] = []
    if not ok.empty:
        if x is None:
            ok["run_index"] = ok["run_index"].astype(int)
            x = "run_index"
        series = series_by_group(ok, x, group_keys)
        figures.append(("Throughput and goodput vs load", _line_figure(series, x, [
            ("output tokens/s", [("throughput_output_tok_s", "")]),
            ("requests/s", [("throughput_req_s", "throughput"), ("goodput_req_s", "goodput"),
                            ("offered_rate_req_s", "offered"),
                            ("sustainable_rate_req_s", "sustainable (over capacity)")])],
            "Throughput and goodput vs load")))
        figures.append(("Latency percentiles", _line_figure(series, x, [
            ("TTFT (ms)", [("ttft_p50_s", "p50"), ("ttft_p90_s", "p90"), ("ttft_p99_s", "p99")]),
            ("TPOT (ms)", [("tpot_p50_s", "p50"), ("tpot_p90_s", "p90"), ("tpot_p99_s", "p99")]),
            ("E2E (ms)", [("e2e_p50_s", "p50"), ("e2e_p99_s", "p99")])],
            "Latency percentiles vs load", y_scale={c: 1e3 for c in metrics if c.endswith("_s")})))
        figures.append(("KV utilization and fragmentation", _line_figure(series, x, [
            ("KV utilization", [("kv_util_mean", "mean"), ("kv_util_max", "max")]),
            ("internal fragmentation", [("fragmentation_mean", "mean"), ("fragmentation_p99", "p99")]),
            ("preemptions", [("preemptions", "")])],
            "KV cache utilization and fragmentation vs load")))
        cap = read_capacity(store)
        if cap:
            figures.append(("Capacity curve", _capacity_figure(cap, df)))
        elif x != "run_index":
            figures.append(("Capacity curve", _derived_capacity_figure(series, x)))
        figures.append(("Cost vs p99 latency", _pareto_figure(ok, group_keys + ([x] if x != "run_index" else []))))
    out.parent.mkdir(parents=True, exist_ok=True)
    page = _page(store, df, ok, axes, figures)
    with atomic_output(out) as tmp:                 # never a 0-byte or cut page
        tmp.write_text(page)
    return out


def _page(store: Path, df: pd.DataFrame, ok: pd.DataFrame, axes: list[str], figures) -> str:
    parts = []
    for i, (title, fig) in enumerate(figures):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    failed = df[df["status"] != "ok"]
    cols = ["run_index", "run_id"] + axes + [c for c in ("throughput_output_tok_s", "goodput_req_s",
                                                         "ttft_p99_s", "tpot_p99_s", "num_gpus",
                                                         "usd_per_m_output_tok") if c in df]
    table = df[[c for c in cols if c in df]].to_html(index=False, float_format=lambda v: f"{v:.4g}",
                                                    classes="runs", border=0)
    fail_html = ""
    if len(failed):
        fail_html = "<h2>Failed runs</h2>" + failed[["run_index", "run_id"] + axes + ["error"]].to_html(
            index=False, border=0, classes="runs")
    plan = read_plan(store)
    missing = len(set(plan) - set(df["run_id"]))
    unreadable = len(df.attrs.get("unreadable", []))
    status = (f"{len(df)} runs in the store: {len(ok)} ok, {len(failed)} failed"
              + (f"; {missing} planned runs not run yet" if missing else "")
              + (f"; {unreadable} unreadable run files left out (the next sweep runs them again)"
                 if unreadable else ""))
    return f"""<!DOCTYPE html><html><head><meta charset="utf-8">{GENERATOR}<title>kvsim report: {html.escape(str(store))}</title>
<style>body{{font-family:sans-serif;margin:2em;}} table.runs{{border-collapse:collapse;font-size:12px}}
table.runs td,table.runs th{{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}}</style></head>
<body><h1>kvsim sweep report</h1><p>{html.escape(str(store))}: {html.escape(status)}.
Axes: {html.escape(', '.join(axes) or 'none')}.</p>
{''.join(parts)}{fail_html}<h2>Runs</h2>{table}</body></html>"""
