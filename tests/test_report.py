"""kvsim report: the HTML page built from a sweep store and from a capacity search."""
from __future__ import annotations

import base64
import json
import re

import numpy as np

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsim.sim.planning.capacity import CapacitySearch, find_capacity, parse_slo
from kvsim.sim.config import load_config
from kvsim.sim.planning.report import build_report, pareto_front, series_by_group
from kvsim.sim.planning.sweep import SweepRunOptions, parse_spec, run_sweep

SMALL = {"trace_options.max_requests": 40, "engine.num_gpu_blocks": 1500}


def _values(arr) -> list:
    """A plotly trace array: a plain list, or numpy data as {'dtype', 'bdata' (base64)}."""
    if isinstance(arr, dict):
        return np.frombuffer(base64.b64decode(arr["bdata"]), dtype=arr["dtype"]).tolist()
    return list(arr)


def _figures(page: str) -> list[dict]:
    """The data of every plotly figure embedded in the page."""
    return [json.loads(m) for m in re.findall(r'Plotly\.newPlot\(\s*"[^"]+",\s*(\[.*?\]),\s*\{', page, re.S)]


@pytest.fixture(scope="module")
def sweep_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("sweep")
    spec = {"fixed": SMALL,
            "runs": [{"engine.block_size": b, "trace_options.rate_scale": r} for b in (16, 32) for r in (1, 4)]
            + [{"trace_options.rate": 5.0}]}   # fails at run time (rate needs a length-only trace)
    run_sweep(parse_spec(spec), store, SweepRunOptions(jobs=1), progress=False)
    return store


def test_sweep_report_has_every_chart_and_the_failed_run(sweep_store):
    path = build_report(sweep_store)
    page = path.read_text()
    for title in ("Throughput and goodput vs load", "Latency percentiles", "KV utilization and fragmentation",
                  "Capacity curve", "Cost vs p99 latency", "Failed runs"):
        assert f"<h2>{title}</h2>" in page
    assert page.count("plotly.js v") == 1   # the library is embedded once, not per chart
    assert "5 runs in the store: 4 ok, 1 failed" in page
    assert "TraceError" in page
    figures = _figures(page)
    assert len(figures) == 5
    throughput = figures[0]
    names = {t["name"] for t in throughput}
    assert any("block_size=16" in n for n in names) and any("block_size=32" in n for n in names)
    # lines are drawn against the load axis, one point per rate scale
    line = next(t for t in throughput if t["name"].startswith("block_size=16"))
    assert sorted(_values(line["x"])) == [1.0, 4.0]


def test_group_means_average_over_seeds():
    df = pd.DataFrame({"policy": ["a", "a", "a", "a", "b", "b"], "seed": [0, 1, 0, 1, 0, 0],
                       "trace_options.rate_scale": [1, 1, 2, 2, 1, 2],
                       "goodput_req_s": [1.0, 3.0, 4.0, 6.0, 7.0, 9.0]})
    series = dict(series_by_group(df, "trace_options.rate_scale", ["policy"]))
    assert list(series["policy=a"]["goodput_req_s"]) == [2.0, 5.0]
    assert list(series["policy=b"]["goodput_req_s"]) == [7.0, 9.0]


def test_pareto_front_keeps_only_undominated_points():
    pts = pd.DataFrame({"cost": [1, 2, 3, 4, 2, 5], "lat": [10, 5, 6, 1, 7, 1]})
    front = pareto_front(pts, "cost", "lat")
    assert list(zip(front["cost"], front["lat"])) == [(1, 10), (2, 5), (4, 1)]


def test_capacity_store_report_marks_the_answer(tmp_path):
    cfg = load_config(None, SMALL)
    result = find_capacity(cfg, parse_slo("ttft_p99<=1s"), CapacitySearch(max_evals=5), store=tmp_path)
    page = build_report(tmp_path, tmp_path / "cap.html").read_text()
    assert "Capacity search (ttft_p99\\u003c=1s)" in page   # '<' as plotly's JSON writes it
    assert f"max rate scale = {result.answer}" in page
    capacity_fig = _figures(page)[3]
    goodput = next(t for t in capacity_fig if t["name"].startswith("goodput"))
    assert _values(goodput["x"]) == list(result.curve["searched_value"])


def test_cli_report_errors_name_the_directory(tmp_path):
    from kvsim.sim.cli import app
    res = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2 and "no runs in this store" in res.output
    res = CliRunner().invoke(app, ["report", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "not a directory" in res.output
    # a simulate output is not a store: say so (it said 'no runs in this store ... run kvsim sweep first')
    from kvsim.sim.simulator.simulate import run_simulation
    run_simulation(load_config(None, {**SMALL, "trace_options.max_requests": 10}), tmp_path / "sim")
    res = CliRunner().invoke(app, ["report", str(tmp_path / "sim")])
    assert res.exit_code == 2 and "one run's output (kvsim simulate / replay), not a store" in res.output


@pytest.mark.parametrize("name, text, expected", [
    ("plan.json", "{", "plan.json: not valid JSON"),
    ("plan.json", "[1]", "plan.json: expected a JSON object with run_ids"),
    ("plan.json", '{"run_ids": 5}', "plan.json: run_ids: expected a list of run ids"),
    ("capacity.json", '{"slo": 5}', "capacity.json: mode: expected 'rate' or 'replicas'"),
    ("capacity.json", '{"mode": "rate", "slo": ["foo<=1"], "feasible": true}', "capacity.json: slo: "),
    ("capacity.json", '{"mode": "rate", "slo": ["ttft_p99<=1s"], "feasible": true, "answer": "x"}',
     "capacity.json: answer: expected a number or null"),
])
def test_cli_report_names_a_malformed_store_file(sweep_store, tmp_path, name, text, expected):
    """A store whose plan.json or capacity.json was cut short or edited: one error line naming the
    file and what it lacks (it used to be a KeyError/TypeError traceback, or a JSON message naming no file)."""
    import shutil
    from kvsim.sim.cli import app
    store = tmp_path / "store"
    shutil.copytree(sweep_store, store)
    (store / name).write_text(text)
    res = CliRunner().invoke(app, ["report", str(store)])
    assert res.exit_code == 2, res.output
    assert f"error: {store / name}: " in res.output and expected in res.output
