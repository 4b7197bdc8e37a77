"""Cross-check report rendering: report.md, report.html (plotly charts) and crosscheck.json of a comparison.

Only `kvsim crosscheck` imports this module (it always writes the HTML page), so plotly is imported at
module level here; the comparison and the calibration do not load it.
"""
from __future__ import annotations

import html as html_mod
import json
import math
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvsim.sim.crosscheck.comparison import LATENCY_METRICS, CrosscheckResult, relative_error
from kvsim.sim.io.safe_io import atomic_output


def _pct(v: float) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:+.1%}"


def _num(v: float) -> str:
    if v is None or not math.isfinite(v):
        return "n/a"
    return f"{v:.4g}"


def markdown_report(res: CrosscheckResult) -> str:
    ctx = res.context
    lines = [f"# kvsim cross-check: {ctx.get('trace', '')}", ""]
    if ctx:
        lines += ["| setting | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in ctx.items()]
        lines.append("")
    lines += ["## Headline", "", *_headline_lines(res)]
    lines += _step_error_lines(res.step_errors)
    if res.repeats is not None:
        lines += _repeats_lines(res.repeats)
    lines += _figure_table_lines(res)
    lines += ["", "Charts: `report.html`.", ""]
    return "\n".join(lines)


def _headline_lines(res: CrosscheckResult) -> list[str]:
    h = res.headline()
    lines = [f"- per-step time MAPE: **{h['step_mape']:.1%}**",
             f"- TTFT p50 error: **{h['ttft_p50_error']:.1%}**, TPOT p50 error: **{h['tpot_p50_error']:.1%}**, "
             f"E2E p50 error: **{h['e2e_p50_error']:.1%}**",
             f"- throughput (total tok/s) error: **{h['throughput_error']:.1%}**"]
    if res.recorded is not None:
        lines += _recorded_lines(res.recorded)
    t = res.total_time
    if t:
        m, model, predicted = t["measured_s"], t["model_on_replay_batches_s"], t["predicted_simulation_s"]
        lines.append(f"- total step time: measured {m:.2f} s; cost model on the replay's own batches "
                     f"{model:.2f} s ({_pct(relative_error(model, m))}); predicted simulation {predicted:.2f} s "
                     f"({_pct(relative_error(predicted, m))}) — the difference between the last two is the "
                     f"simulation running other batches (its own policy decisions, block use: see Memory)")
    rep = res.repeats
    if rep is None:
        lines.append("- measured side: **1 replay** (step times of a single run; `--repeats N` takes the "
                     "per-step median of N)")
    else:
        lines.append(f"- measured side: **median of {rep['n']} replays** per step (identical schedules); "
                     f"relative spread (slowest - fastest) / median per step: median "
                     f"**{rep['spread_median']:.1%}**, p90 {rep['spread_p90']:.1%}; latencies and throughput "
                     f"from the recorded simulation fed the median step times")
    return lines


def _recorded_lines(r: dict) -> list[str]:
    """What recorded mode found: identical memory metrics or the first divergence, decisions replayed."""
    lines = []
    if r["identical"]:
        lines.append(f"- recorded mode: memory metrics **identical** over all {r['steps_compared']} steps "
                     f"({', '.join(r['columns'])})")
    else:
        d = r["first_divergence"]
        lines.append(f"- recorded mode: memory metrics **diverge** at step {d['step']}: {d['column']} "
                     f"real={d['real']} sim={d['sim']} (real {r['real_steps']} steps, sim {r['sim_steps']})")
    if "decisions" in r:
        lines.append(f"- recorded mode replayed {r['decisions_replayed']} recorded evictions from "
                     f"`{r['decisions']}` ({r['decisions_missing']} recorded entries not found live)")
    if "request_timings_identical" in r:
        lines.append(f"- recorded mode reproduces the replay's request timings (TTFT/TPOT/E2E): "
                     f"**{'identical' if r['request_timings_identical'] else 'NOT identical'}**")
    return lines


def _step_error_lines(step_errors: dict) -> list[str]:
    lines = ["", "## Per-step time (replay steps: cost model vs measured)", "",
             "| kind | steps | MAPE | median APE | p90 APE | median bias |", "|---|---:|---:|---:|---:|---:|"]
    for kind, e in step_errors.items():
        lines.append(f"| {kind} | {e['count']} | {e['mape']:.1%} | {e['median_ape']:.1%} | {e['p90_ape']:.1%} "
                     f"| {e['bias']:+.1%} |")
    return lines


def _repeats_lines(rep: dict) -> list[str]:
    """Spread over the repeats by step kind, and what each replay alone would have reported."""
    lines = ["", f"## Repeats ({rep['n']} replays)", "",
             "| kind | steps | median spread | p90 spread |", "|---|---:|---:|---:|"]
    for kind, e in rep["spread_by_kind"].items():
        lines.append(f"| {kind} | {e['count']} | {e['median']:.1%} | {e['p90']:.1%} |")
    lines += ["", "Each replay alone against the prediction (what a single replay would have reported):", "",
              "| replay | load avg 1m | measured step time (s) | shift vs median | step MAPE | TTFT p50 err "
              "| TPOT p50 err | throughput err |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rep["singles"]:
        lines.append(f"| `{r['replay']}` | {_num(r['loadavg_1m'])} | {r['measured_s']:.2f} | "
                     f"{r['shift_vs_median']:+.1%} | {r['step_mape']:.1%} | {r['ttft_p50_error']:.1%} | "
                     f"{r['tpot_p50_error']:.1%} | {r['throughput_error']:.1%} |")
    return lines


def _figure_table_lines(res: CrosscheckResult) -> list[str]:
    """Latency, throughput and memory tables: real against simulated."""
    lines = ["", "## Latency (finished requests)", "", "| metric | pct | real (s) | sim (s) | error |",
             "|---|---:|---:|---:|---:|"]
    for row in res.latency.itertuples():
        lines.append(f"| {row.metric} | p{row.percentile} | {_num(row.real)} | {_num(row.sim)} "
                     f"| {_pct(row.rel_error)} |")
    lines += ["", "## Throughput", "", "| metric | real | sim | error |", "|---|---:|---:|---:|"]
    for row in res.throughput.itertuples():
        lines.append(f"| {row.metric} | {_num(row.real)} | {_num(row.sim)} | {_pct(row.rel_error)} |")
    names = [c for c in res.memory.columns if c != "metric"]
    lines += ["", "## Memory", "", "| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for _, row in res.memory.iterrows():
        lines.append(f"| {row['metric']} | " + " | ".join(_num(row[n]) for n in names) + " |")
    return lines


def html_report(res: CrosscheckResult) -> str:
    figs = [_step_scatter(res.step_times), _step_times_over_replay(res), _latency_bars(res.latency),
            _memory_over_time(res.series)]
    body = "\n".join(f.to_html(full_html=False, include_plotlyjs="cdn" if i == 0 else False)
                     for i, f in enumerate(figs))
    md = html_mod.escape(markdown_report(res))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>kvsim cross-check</title></head>"
            f"<body style='font-family:sans-serif;max-width:1100px;margin:auto'>{body}"
            f"<h2>Figures</h2><pre>{md}</pre></body></html>")


def _step_scatter(t: pd.DataFrame) -> go.Figure:
    """Predicted against measured time of every replay step, by step kind, with the y = x line."""
    scatter = go.Figure()
    for kind in ("prefill", "decode", "mixed"):
        m = t[t["kind"] == kind]
        if len(m):
            scatter.add_trace(go.Scattergl(x=m["measured_s"] * 1e3, y=m["predicted_s"] * 1e3, mode="markers",
                                           name=kind, marker={"size": 4, "opacity": 0.6}))
    hi = float(max(t["measured_s"].max(), t["predicted_s"].max()) * 1e3) if len(t) else 1.0
    scatter.add_trace(go.Scatter(x=[0, hi], y=[0, hi], mode="lines", name="y = x",
                                 line={"dash": "dash", "color": "gray"}))
    scatter.update_layout(title="Per-step time: predicted vs measured (replay steps)",
                          xaxis_title="measured (ms)", yaxis_title="predicted (ms)")
    return scatter


def _step_times_over_replay(res: CrosscheckResult) -> go.Figure:
    """Measured (median, between the fastest and slowest repeat) and predicted step time over the replay."""
    t = res.step_times
    over = go.Figure()
    if res.repeat_steps is not None:
        reps = res.repeat_steps.filter(like="duration_")
        over.add_trace(go.Scattergl(x=t["time_s"], y=reps.min(axis=1) * 1e3, mode="lines", name="fastest repeat",
                                    line={"width": 0.5, "color": "lightgray"}))
        over.add_trace(go.Scattergl(x=t["time_s"], y=reps.max(axis=1) * 1e3, mode="lines", name="slowest repeat",
                                    line={"width": 0.5, "color": "gray"}))
    over.add_trace(go.Scattergl(x=t["time_s"], y=t["measured_s"] * 1e3, mode="lines",
                                name="measured" if res.repeat_steps is None else "measured (median)"))
    over.add_trace(go.Scattergl(x=t["time_s"], y=t["predicted_s"] * 1e3, mode="lines", name="predicted"))
    over.update_layout(title="Per-step time over the replay", xaxis_title="replay time (s)",
                       yaxis_title="step time (ms)")
    return over


def _latency_bars(latency: pd.DataFrame) -> go.Figure:
    lat = make_subplots(rows=1, cols=len(LATENCY_METRICS), subplot_titles=[m.upper() for m in LATENCY_METRICS])
    for i, metric in enumerate(LATENCY_METRICS, start=1):
        d = latency[latency["metric"] == metric]
        labels = [f"p{q}" for q in d["percentile"]]
        lat.add_trace(go.Bar(x=labels, y=d["real"], name="real", marker_color="#1f77b4", showlegend=i == 1), 1, i)
        lat.add_trace(go.Bar(x=labels, y=d["sim"], name="sim", marker_color="#ff7f0e", showlegend=i == 1), 1, i)
    lat.update_layout(title="Latency percentiles (s): real vs simulated", barmode="group")
    return lat


def _memory_over_time(series: dict[str, pd.DataFrame]) -> go.Figure:
    mem = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=["blocks used", "fragmentation"])
    for name, s in series.items():
        mem.add_trace(go.Scattergl(x=s["time_s"], y=s["blocks_used"], mode="lines", name=name, legendgroup=name),
                      1, 1)
        mem.add_trace(go.Scattergl(x=s["time_s"], y=s["fragmentation"], mode="lines", name=name, legendgroup=name,
                                   showlegend=False), 2, 1)
    mem.update_layout(title="Memory over time", xaxis2_title="time (s)")
    return mem


def write_report(res: CrosscheckResult, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, html = out / "report.md", out / "report.html"
    texts = {md: markdown_report(res), html: html_report(res), out / "crosscheck.json": json.dumps({
        "headline": res.headline(), "step_errors": res.step_errors, "recorded": res.recorded,
        "latency": res.latency.to_dict("records"), "throughput": res.throughput.to_dict("records"),
        "memory": res.memory.to_dict("records"), "context": res.context, "repeats": res.repeats,
        "total_time": res.total_time},
        indent=2, default=str)}
    for path, text in texts.items():
        with atomic_output(path) as tmp:
            tmp.write_text(text)
    tables = {"step_times.parquet": res.step_times, "repeat_steps.parquet": res.repeat_steps}
    for name, table in tables.items():
        if table is not None:
            with atomic_output(out / name) as tmp:
                table.to_parquet(tmp, index=False)
    return md, html
