"""The dashboard's token times kept flat (requests.parquet's list column read as values + offsets, not
one array per request) and the time-series grid built as plain dicts without plotly's per-update
validation: the tables and figures must equal the previous implementation's (kept here as the
reference: per-request arrays concatenated; the grid built with plotly's validated update calls)."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import plotly.io as pio
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from plotly.subplots import make_subplots

from kvsim.dashboard import charts
from kvsim.dashboard.data import (DataError, RunRecord, TokenTimes, load_run_dir, output_token_rate, read_requests,
                                  run_cost_model, time_edges, time_series, window_of)
from kvsim.dashboard.data import length_heatmap as heatmap
from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation

SMALL = {"trace": "sharegpt-8k-filtered", "gpu": "l4", "trace_options.max_requests": 40,
         "engine.num_gpu_blocks": 400}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("flat") / "small"
    run_simulation(load_config(None, SMALL), d)
    return d


# ---- the previous implementation, as the reference ------------------------------------------------
def previous_token_arrays(requests: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    lists = [np.asarray(t, dtype=float) for t in requests["token_times_s"] if t is not None and len(t)]
    if not lists:
        return np.zeros(0), np.zeros(0)
    times = np.concatenate(lists)
    gaps = np.diff(times, prepend=np.nan)
    starts = np.cumsum([0] + [len(t) for t in lists[:-1]])
    gaps[starts] = np.nan
    return times, gaps


def previous_output_token_rate(requests: pd.DataFrame, num_bins: int = 200) -> pd.DataFrame:
    times, _ = previous_token_arrays(requests)
    lo, hi = float(times.min()), float(times.max())
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, num_bins + 1)
    counts = np.bincount(window_of(times, edges), minlength=num_bins)
    return pd.DataFrame({"time_s": 0.5 * (edges[:-1] + edges[1:]), "output_tok_s": counts / np.diff(edges)})


def previous_panel_grid(ts, panels, title, heatmaps=None):
    rows = math.ceil(len(panels) / charts.PANEL_COLUMNS)
    fig = make_subplots(rows=rows, cols=charts.PANEL_COLUMNS, shared_xaxes="all", vertical_spacing=0.5 / rows,
                        horizontal_spacing=0.07, subplot_titles=[p.title for p in panels])
    height = charts.PANEL_HEIGHT_PX * rows + 120
    below = 22 / (height - 120)
    layout: dict = {}
    traces: list = []
    for n, panel in enumerate(panels):
        row, col = n // charts.PANEL_COLUMNS + 1, n % charts.PANEL_COLUMNS + 1
        axis = fig.get_subplot(row, col)
        legend = "legend" if n == 0 else f"legend{n + 1}"
        where = dict(xaxis=axis.xaxis.plotly_name.replace("axis", ""), yaxis=axis.yaxis.plotly_name.replace("axis", ""))
        if panel.kind == "heatmap":
            traces.append(charts._heatmap_trace(ts, panel, heatmaps[panel.series[0][0]], where))
        else:
            traces.extend(charts._line_traces(ts, panel, legend, row, col, where))
        layout[axis.yaxis.plotly_name] = dict(
            title_text=panel.unit, rangemode="tozero", exponentformat="none", separatethousands=True,
            **({"range": [0, 1.05]} if panel.unit == "fraction" else {}))
        layout[legend] = dict(x=axis.xaxis.domain[0], y=axis.yaxis.domain[0] - below, xanchor="left", yanchor="top",
                              orientation="h", font=dict(size=10), bgcolor="rgba(0,0,0,0)")
    fig.add_traces(traces)
    fig.update_layout(**layout)
    fig.update_xaxes(hoverformat=".1f", ticksuffix=" s", showticklabels=True)
    fig.update_layout(title=dict(text=title, x=0, xanchor="left"), height=height,
                      margin=dict(l=70, r=30, t=80, b=40), modebar=dict(orientation="v"), hovermode="x")
    fig.update_annotations(font_size=12)
    return fig


def as_sent(fig) -> dict:
    """The figure as streamlit sends it to the browser (plotly.io.to_json, no validation), parsed."""
    return json.loads(pio.to_json(fig, validate=False))


# ---- tests -----------------------------------------------------------------------------------------
def test_flat_token_times_equal_the_per_request_arrays(run_dir):
    run = load_run_dir(run_dir)
    column = pd.read_parquet(run_dir / "requests.parquet")["token_times_s"]
    assert "token_times_s" not in run.requests           # kept flat, not as one array per row
    tokens = run.tokens()
    assert len(tokens.offsets) == len(run.requests) + 1 and tokens.values.size > 1000
    for i in (0, 7, len(column) - 1):
        assert np.array_equal(tokens.values[tokens.offsets[i]:tokens.offsets[i + 1]], column.iloc[i])
    times, gaps = previous_token_arrays(column.to_frame())
    assert np.array_equal(tokens.values, times)
    assert np.array_equal(tokens.gaps(), gaps, equal_nan=True)
    pd.testing.assert_frame_equal(output_token_rate(tokens.values, 200), previous_output_token_rate(column.to_frame()),
                                  check_exact=True)
    # a record made in memory (its requests with the per-request column) gives the same flat times
    in_memory = RunRecord("mem", run.summary, pd.read_parquet(run_dir / "requests.parquet"), run.steps)
    assert np.array_equal(in_memory.tokens().values, tokens.values)
    assert np.array_equal(in_memory.tokens().offsets, tokens.offsets)


def test_arrow_lists_with_nulls_slices_and_chunks_read_as_the_column_does():
    rows = [[0.5, 0.75], None, [], [1.0], [2.0, 3.0, 4.5]]
    chunked = pa.chunked_array([pa.array(rows[:2], pa.list_(pa.float64())),
                                pa.array(rows, pa.list_(pa.float64())).slice(2)])
    for array in (chunked, pa.array(rows, pa.large_list(pa.float32())), pa.chunked_array([], pa.list_(pa.float64()))):
        flat = TokenTimes.from_arrow(array)
        want = TokenTimes.from_column(array.to_pylist())
        assert np.array_equal(flat.offsets, want.offsets) and np.array_equal(flat.values, want.values)
        assert flat.values.dtype == np.float64
    flat = TokenTimes.from_arrow(chunked)
    assert flat.offsets.tolist() == [0, 2, 2, 2, 3, 6]
    assert np.array_equal(flat.gaps(), [np.nan, 0.25, np.nan, np.nan, 1.0, 1.5], equal_nan=True)


def test_a_requests_file_whose_token_times_are_not_lists_of_numbers_is_refused(tmp_path):
    pq.write_table(pa.table({"request_id": [0, 1], "token_times_s": ["a", "b"]}), tmp_path / "requests.parquet")
    with pytest.raises(DataError, match=r"requests\.parquet: column token_times_s is string; expected a list"):
        read_requests(tmp_path / "requests.parquet")
    pq.write_table(pa.table({"request_id": [0, 1]}), tmp_path / "requests.parquet")
    requests, tokens = read_requests(tmp_path / "requests.parquet")
    assert tokens is None and list(requests.columns) == ["request_id"]


def test_time_series_table_and_figure_equal_the_previous_implementations(run_dir):
    run = load_run_dir(run_dir)
    cost = run_cost_model(run)
    ts = time_series(run, 60, cost)
    # the previous table: token times from the per-request column, concatenated
    previous = RunRecord("mem", run.summary, pd.read_parquet(run_dir / "requests.parquet"), run.steps, run.config)
    edges = time_edges(previous, 60)
    times, gaps = previous_token_arrays(previous.requests)
    previous._memo["token_gaps"] = gaps       # the gaps the table takes: the previous implementation's
    assert np.array_equal(previous.tokens().values, times)
    pd.testing.assert_frame_equal(ts, time_series(previous, 60, cost), check_exact=True)
    assert np.nansum(ts["itl_ms_p50"]) > 0 and ts["generation_tok_s"].sum() > 0
    expected_tokens = np.bincount(window_of(times, edges), minlength=60) / np.diff(edges)
    assert np.array_equal(ts["generation_tok_s"].to_numpy(), expected_tokens)
    heatmaps = {c: heatmap(run.requests, c, edges) for c in ("prompt_tokens", "output_tokens")}
    panels = [p for p in charts.grafana_panels(ts) if p.kind != "heatmap" or heatmaps.get(p.series[0][0])]
    new = charts.time_series_figure(ts, "small over time", heatmaps)
    assert as_sent(new) == as_sent(previous_panel_grid(ts, panels, "small over time", heatmaps))
    assert len(new.data) > 30 and sum(t.type == "heatmap" for t in new.data) == 2
    # the per-replica grid (a panel list of another length: an odd one leaves an empty cell)
    two = [charts.Panel("a", "fraction", (("kv_usage", "use"),)), charts.Panel("b", "s", (("e2e_s_p50", "P50"),)),
           charts.Panel("c", "ms", (("itl_ms_p99", "P99"),))]
    assert as_sent(charts.panel_grid(ts, two, "t")) == as_sent(previous_panel_grid(ts, two, "t"))


def test_binned_steps_of_several_replicas_sum_each_replicas_own():
    """bin_steps takes each replica's rows by position: on a shuffled two-replica log with a non-default
    index, a state column binned over the fleet equals the sum of each replica's own binning."""
    rng = np.random.default_rng(3)
    n = 600
    steps = pd.DataFrame({"replica": rng.integers(0, 2, n), "time_s": np.sort(rng.uniform(0, 50, n)),
                          "duration_s": rng.uniform(0.01, 0.2, n), "num_running": rng.integers(0, 30, n),
                          "blocks_used": rng.integers(0, 900, n), "prefill_tokens": rng.integers(0, 512, n)},
                         index=rng.permutation(np.arange(10, 10 + n)))
    from kvsim.dashboard.data import bin_steps
    span = (0.0, float((steps["time_s"] + steps["duration_s"]).max()))
    fleet = bin_steps(steps, 40, span)
    each = [bin_steps(steps[steps["replica"] == r], 40, span) for r in (0, 1)]
    for column in ("num_running", "blocks_used"):
        assert np.allclose(fleet[column], each[0][column] + each[1][column], rtol=1e-12)
    assert fleet["prefill_tokens"].sum() == steps["prefill_tokens"].sum()
    assert not np.allclose(each[0]["num_running"], each[1]["num_running"])
