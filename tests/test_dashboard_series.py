"""The dashboard's charts against the run's own summary.json (every plotted series that has a summary
figure integrates or averages to it), the time-series page on a trace whose load doubles halfway,
runs that persist as run directories (reload, links, the rerun command) and the forms' numbers."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import yaml
from streamlit.testing.v1 import AppTest

from plotly_json import APP, figure, open_page, series, trace_in  # tests/plotly_json.py

from kvsim.dashboard.browser import HALF_S, simulate_doubling_load
from kvsim.dashboard.data import DATA_ROOT_ENV, bin_steps, load_run_dir, time_series
from kvsim.dashboard.forms import parse_number
from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation

# per-head H2O with compaction: evicts (token, layer, KV head) entries, frees pages, moves bytes
PER_HEAD = {"trace": "sharegpt-8k-filtered", "gpu": "l4", "trace_options.max_requests": 24, "kv.policy": "h2o",
            "kv.budget": 128, "kv.layout": "per_head", "kv.slot_strategy": "compact", "kv.mode": "fast",
            "engine.num_gpu_blocks": 600}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A data root holding a per-head run and the doubling-load run, as `kvsim simulate --out` writes them."""
    root = tmp_path_factory.mktemp("data")
    run_simulation(load_config(None, PER_HEAD), root / "per-head")
    simulate_doubling_load(root)          # 2 req/s for 60 s, then 4 req/s: an L4 keeps up with the first half only
    return root


@pytest.fixture(autouse=True)
def data_root(root, monkeypatch):
    monkeypatch.setenv(DATA_ROOT_ENV, str(root))
    return root


def integral(x: np.ndarray, y: np.ndarray) -> float:
    """A per-second series over equal windows centred on x, integrated."""
    return float(np.nansum(y) * (x[1] - x[0]))


# ---- plotted == summary.json ---------------------------------------------------------------------
def test_memory_charts_add_up_to_the_summary(root):
    run = load_run_dir(root / "per-head")
    s, rows = run.summary, run.rows_per_block
    assert rows == 32 * 8 and s["evicted_tokens"] > 0 and s["bytes_moved"] > 0
    at = open_page("memory", "per-head")
    assert next(m.value for m in at.metric if m.label == "Evicted tokens") == f"{s['evicted_tokens']:,.0f}"
    evict = figure(at, "Eviction")
    assert "summed over layers and KV heads" in evict["layout"]["title"]["text"]
    x, tokens = series(evict, "tokens evicted / s (equivalents)")
    # tokens, as summary.json counts them: not the (token, layer, KV head) entries (256x as many)
    assert integral(x, tokens) == pytest.approx(s["evicted_tokens"], rel=1e-9)
    assert integral(x, tokens) == pytest.approx(s["evicted_token_rows"] / rows, rel=1e-9)
    x, blocks = series(evict, "blocks freed / s (equivalents)")
    assert integral(x, blocks) == pytest.approx(s["blocks_freed_by_eviction"] / rows, rel=1e-9)
    x, moved = series(figure(at, "Bytes copied"), "bytes moved / s")
    assert integral(x, moved) == pytest.approx(s["bytes_moved"], rel=1e-9)
    util = figure(at, "KV utilization")
    busy = bin_steps(run.steps, 200)["busy_s"].to_numpy()
    _, used = series(util, "pages used / pool")
    _, frag = series(util, "fragmentation")
    assert np.average(used, weights=busy) == pytest.approx(s["kv_util_mean"], rel=1e-9)
    assert np.average(frag, weights=busy) == pytest.approx(s["fragmentation_mean"], rel=1e-9)
    assert "policy=h2o, budget=128, layout=per_head, slot_strategy=compact" in at.caption[0].value


def test_simulate_throughput_adds_up_to_the_summary(root):
    s = load_run_dir(root / "doubling").summary
    at = open_page("simulate", "doubling")
    assert at.subheader[0].value == "Summary: doubling"
    x, out = series(figure(at, "Throughput over time"), "doubling: output")
    assert s["num_finished"] == s["num_requests"]
    assert integral(x, out) == pytest.approx(s["throughput_output_tok_s"] * s["makespan_s"], rel=1e-9)


def test_time_series_panels_add_up_to_the_summary(root):
    run = load_run_dir(root / "doubling")
    s = run.summary
    fig = figure(open_page("timeseries", "doubling"), "doubling over time")
    ts = time_series(run, 120)
    x, arrivals = series(fig, "arrivals / s")
    assert integral(x, arrivals) == pytest.approx(s["num_requests"])
    assert integral(x, series(fig, "finished / s")[1]) == pytest.approx(s["num_finished"])
    assert s["preemptions"] > 0 and integral(x, series(fig, "preemptions / s")[1]) == pytest.approx(s["preemptions"])
    busy = ts["busy_s"].to_numpy()
    assert np.average(series(fig, "GPU Cache Usage")[1], weights=busy) == pytest.approx(s["kv_util_mean"], rel=1e-9)
    assert np.average(series(fig, "internal fragmentation")[1], weights=busy) == pytest.approx(s["fragmentation_mean"],
                                                                                               rel=1e-9)
    batch = series(fig, "batch size")[1]
    steps = ts["steps"].to_numpy()
    assert np.average(np.nan_to_num(batch), weights=steps) == pytest.approx(s["batch_size_mean"], rel=1e-9)


# ---- the time-series page shows degradation under load ---------------------------------------------
def test_time_series_shows_the_run_degrading_when_the_load_doubles(root):
    at = open_page("timeseries", "doubling")
    fig = figure(at, "doubling over time")
    x, arrivals = series(fig, "arrivals / s")
    first, second = (x > 5) & (x < HALF_S - 5), (x > HALF_S + 15) & (x < 2 * HALF_S - 5)
    assert np.mean(arrivals[second]) == pytest.approx(2 * np.mean(arrivals[first]), rel=0.05)
    ttft = trace_in(fig, "Time To First Token Latency", "P99")  # in s: TTFT passes a second in the second half
    waiting = series(fig, "Num Waiting")[1]
    kv = series(fig, "GPU Cache Usage")[1]
    preempted = series(fig, "preemptions / s")[1]
    # first half: the L4 keeps up (sub-second TTFT, empty queue, no preemption)
    assert np.nanmax(ttft[first]) < 1.0 and waiting[first].max() < 1 and preempted[first].sum() == 0
    # second half: the queue and TTFT grow, the pool fills and requests are preempted
    assert np.nanmedian(ttft[second]) > 10 * np.nanmedian(ttft[first])
    assert waiting[second].max() > 20 and np.all(np.diff(waiting[second][::5]) > 0)
    assert kv[second].mean() > 0.9 > kv[first].mean()
    assert preempted[second].sum() > 0
    mfu, mbu = series(fig, "FLOPs utilisation (MFU)")[1], series(fig, "bandwidth utilisation (MBU)")[1]
    busy = ~np.isnan(mbu)
    assert np.all((mfu[busy] > 0) & (mfu[busy] < 1)) and np.all((mbu[busy] > 0.3) & (mbu[busy] <= 1))
    shares = [series(fig, name)[1] for name in ("GEMMs (linear layers, LM head)", "attention", "KV copies / moves",
                                                "all-reduce", "swap", "CPU overhead (not hidden)",
                                                "policy ops and other (not in the step log)")]
    np.testing.assert_allclose(np.sum(shares, axis=0)[busy], 1.0, rtol=1e-9)
    assert np.mean(shares[1][second]) > np.mean(shares[1][first])   # longer contexts: attention takes more
    panels = {a["text"] for a in fig["layout"]["annotations"]}
    assert {"Time To First Token Latency (vllm:time_to_first_token_seconds)", "Queue Time (vllm:request_queue_time_seconds)",
            "Prefix Cache Hit Rate (vllm:prefix_cache_hits / queries)"} <= panels
    axes = sorted((k for k in fig["layout"] if k.startswith("xaxis")), key=lambda k: int(k[5:] or 1))
    # zooming one panel zooms them all: every x axis follows one
    followed = {fig["layout"][k].get("matches") for k in axes} - {None}
    assert len(axes) >= len(panels) and len(followed) == 1     # a grid of two columns: one cell may be empty
    assert sum(fig["layout"][k].get("matches") is None for k in axes) == 1


# ---- runs persist --------------------------------------------------------------------------------
def test_a_run_survives_a_reload_opens_from_its_link_and_reruns_from_the_cli(root):
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.text_input(key="cfg_max_requests").set_value("30")
    at.text_input(key="cfg_num_gpu_blocks").set_value("400")
    at.text_input(key="sim_label").set_value("mine")
    at.button(key="sim_run").click().run()
    assert not at.exception and not at.error
    link = at.query_params["run"]
    assert link.startswith("dashboard-runs/") and (root / link / "config.yaml").is_file()
    reloaded = AppTest.from_file(APP, default_timeout=60)       # a reload: a new session, nothing in memory
    reloaded.run()
    assert reloaded.subheader[0].value == "Summary: mine"
    assert "per-head" in reloaded.selectbox(key="sim_pick").options      # CLI runs under the data root too
    other_tab = open_page("memory", "per-head")                          # a link opened in another tab
    assert other_tab.selectbox(key="mem_pick").value == "per-head"
    tab = open_page("memory", link)
    assert tab.selectbox(key="mem_pick").value == "mine"
    [command] = [c.value for c in tab.code if c.value.startswith("kvsim simulate")]
    assert command == f"kvsim simulate -c {root / link / 'config.yaml'} --out {link}-rerun"
    assert tab.get("download_button")
    config = yaml.safe_load((root / link / "config.yaml").read_text())
    rerun = run_simulation(load_config(root / link / "config.yaml", {})).summary
    saved = json.loads((root / link / "summary.json").read_text())
    assert config["trace_options"]["max_requests"] == 30 and saved["num_requests"] == 30
    assert {k: v for k, v in rerun.items() if k != "wall_s"} == {k: v for k, v in saved.items() if k != "wall_s"}


# ---- forms ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, integer, expected", [
    ("1e9", True, (1_000_000_000, None)), ("5e2", True, (500, None)), ("2.5", False, (2.5, None)),
    ("1_000", True, (1000, None)), (" 7 ", True, (7, None)), ("-3", True, (-3, None)),
    ("2.5", True, (None, "2.5 is not a whole number")),
    ("abc", False, (None, "'abc' is not a number (digits, a decimal point, or e.g. 1e9)")),
    ("inf", False, (None, "'inf' is not a finite number")), ("", True, (None, "enter a number")),
])
def test_numbers_are_parsed_as_numbers_or_refused_with_the_reason(text, integer, expected):
    assert parse_number(text, integer=integer) == expected


def test_form_reads_scientific_notation_and_checks_fields_against_each_other():
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.text_input(key="cfg_max_requests").set_value("1e2")
    at.text_input(key="cfg_rate_scale").set_value("5e-1").run()
    assert not at.error and not at.button(key="sim_run").disabled
    at.text_input(key="cfg_max_requests").set_value("2.5").run()
    assert "Max requests (first N): 2.5 is not a whole number" in [e.value for e in at.error]
    at.text_input(key="cfg_max_requests").set_value("100")
    at.text_input(key="cfg_tp").set_value("3").run()                       # 32 heads, 8 KV heads
    [message] = [e.value for e in at.error if e.value.startswith("Tensor parallel")]
    assert message.startswith("Tensor parallel: 3 does not split Llama-3.1-8B's 32 attention heads")
    assert "use one of 1, 2, 4, 8" in message and at.button(key="sim_run").disabled
    at.text_input(key="cfg_tp").set_value("1")
    at.selectbox(key="cfg_gpu").set_value("L4")
    at.text_input(key="cfg_num_gpu_blocks").set_value("1e5").run()
    [message] = [e.value for e in at.error]
    # as the simulator sizes it: 2,060 blocks of Llama-3.1-8B on an L4 (vLLM's defaults for the L4)
    assert message.startswith("KV pool (blocks): 100,000 blocks do not fit in L4's memory") and "at most 2,060" in message
    assert at.button(key="sim_run").disabled
    at.text_input(key="cfg_num_gpu_blocks").set_value("2060").run()
    assert not at.error and not at.button(key="sim_run").disabled


def test_eta_waits_until_it_means_something():
    from kvsim.dashboard.jobs import Job
    job = Job([("long", load_config(None, {"trace": "sharegpt-8k-filtered", "trace_options.max_requests": 3000}))])
    job.start()
    try:
        while job.progress is None or job.fraction == 0:
            time.sleep(0.01)
        assert job.elapsed_s < Job.ETA_AFTER_S and job.eta_s is None and "left" not in job.status_text()
    finally:
        job.cancel()
        job.wait(10)


def test_inter_token_percentiles_per_window_are_numpy_percentiles_of_that_window():
    """The ITL panels' p50/p90/p99 per window (a partition per window, not a sort of millions of gaps)
    equal numpy's linear percentiles of the window's gaps; a window without tokens has none."""
    from kvsim.dashboard.data import _quantiles_by_window
    rng = np.random.default_rng(7)
    window = rng.integers(0, 12, 5_000)
    window[window == 5] = 6
    gap = rng.lognormal(-4, 1, 5_000)
    got = _quantiles_by_window(window, gap, 12, 1e3)
    for w in range(12):
        mine = gap[window == w] * 1e3
        for q in (50, 90, 99):
            if len(mine):
                assert got[f"p{q}"][w] == pytest.approx(np.percentile(mine, q), rel=1e-12)
            else:
                assert np.isnan(got[f"p{q}"][w])
