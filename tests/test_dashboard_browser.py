"""The dashboard in a real browser: serve it on loopback with a data directory holding a per-head
eviction run and a small real cross-check, use all five pages in headless Chromium (driven over the
DevTools protocol) and check what they render. KVSIM_SCREENSHOTS=docs/img keeps the screenshots
(docs/dashboard.md shows them)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvsim.dashboard.browser import (Browser, cancel_in_browser, chromium_binary, reopen_run, serve_dashboard,
                                     simulate_doubling_load, tour)
from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation

pytestmark = pytest.mark.skipif(chromium_binary() is None, reason="chromium is not installed")

PER_HEAD = {"trace": "sharegpt-8k-filtered", "gpu": "l4", "trace_options.max_requests": 100, "kv.policy": "h2o",
            "kv.budget": 128, "kv.layout": "per_head", "kv.slot_strategy": "slot_reuse", "kv.mode": "fast"}
PAGES = ("simulate", "memory", "timeseries", "compare", "capacity", "fidelity")


def plotted(browser: Browser, title: str) -> list[dict]:
    """The traces of the chart titled `title` as the browser holds them (x, y, z as plain lists)."""
    return browser.eval(
        "(() => { const p = [...document.querySelectorAll('.js-plotly-plot')].find(p => "
        f"(p.layout.title.text || '').includes({title!r})); return p ? p._fullData.map(t => ({{name: t.name, "
        "x: Array.from(t.x || []), y: Array.from(t.y || []), z: t.z ? Array.from(t.z, r => Array.from(r)) : null})) : null; })()")


def test_all_pages_in_chromium(tmp_path, small_crosscheck):
    root = tmp_path / "data"
    shutil.copytree(small_crosscheck, root / "cc")
    per_head = run_simulation(load_config(None, PER_HEAD), root / "per-head")
    series = simulate_doubling_load(root)
    shots = Path(os.environ.get("KVSIM_SCREENSHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    seen = {}
    with serve_dashboard(data_root=root) as url, Browser(1400, 1400) as browser:
        def inspect(page: str) -> None:
            seen[page] = browser.text()
            if page == "simulate":
                seen["reopened"] = reopen_run(browser)
            if page == "memory":
                seen["used"] = plotted(browser, "KV utilization")[0]["y"]
                seen["pool"] = plotted(browser, "Block pool over time")[0]["z"]
                seen["evicted"] = plotted(browser, "Eviction")[0]
        seconds = tour(browser, url, "per-head", "cc", shots, inspect=inspect, series_dir=series)
        cancel_s = cancel_in_browser(browser, url, 19_366)      # the whole Azure conversation trace
        cancelled = browser.text()
    memory, fidelity, used, pool = seen["memory"], seen["fidelity"], seen["used"], seen["pool"]
    # Memory: the per-head run against its (layer, KV head) pages, the map as fragmented as the run
    s = per_head.summary
    blocks = s["num_gpu_blocks"]                              # one of them is vLLM's null block
    assert f"Per-head layout: the pool is {(blocks - 1) * 256:,} pages" in memory and f"{blocks:,} x 16" in memory
    assert f"{s['fragmentation_mean']:.1%}" in memory and s["fragmentation_mean"] > 0.5
    assert 0.5 < max(used) <= s["kv_util_max"] + 1e-9 <= 1
    live = sum(row.count(3) for row in pool)
    allocated = live + sum(row.count(2) for row in pool)
    assert 1 - live / allocated == pytest.approx(s["fragmentation_mean"], abs=0.1)
    # Fidelity: the cross-check's own figures
    report = (small_crosscheck / "report.md").read_text()
    mape = report.split("per-step time MAPE: **")[1].split("**")[0]
    assert "Cross-check: cost model with the calibrated profile" in fidelity and mape in fidelity
    for page in PAGES:
        png = (shots / f"{page}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < len(png) < 400_000
    # the run is a run directory: its link survives a reload and opens in a new tab (a new session)
    label = "azure-conv-2023 Llama-3.1-8B H100-SXM: max_requests=100"
    reopened = seen["reopened"]
    assert f"Summary: {label}" in seen["simulate"] and "100 / 0" in seen["simulate"]
    assert "run=dashboard-runs" in reopened["link"] and reopened["summary"] == f"Summary: {label}"
    for text in (reopened["reloaded"], reopened["new_tab"]):
        assert f"Summary: {label}" in text and "100 / 0" in text and "Configuration, CLI command and download" in text
    # tokens evicted in the summary's units (not the 256x (token, layer, KV head) entries)
    x, rate = seen["evicted"]["x"], seen["evicted"]["y"]
    assert sum(rate) * (x[1] - x[0]) == pytest.approx(s["evicted_tokens"], rel=1e-6)
    assert "Evicted tokens" in memory and f"{s['evicted_tokens']:,.0f}" in memory
    assert "policy=h2o, budget=128, layout=per_head, slot_strategy=slot_reuse" in memory
    assert "Latency percentiles are taken" in seen["timeseries"] and "trace=doubling.jsonl" in seen["timeseries"]
    assert "TTFT by configuration" in seen["compare"] and "engine.block_size=32" in seen["compare"]
    assert "Best configuration under the SLO" in seen["capacity"] and "queue draining" in seen["capacity"]
    assert set(seconds) == set(PAGES) and all(0 < t < 60 for t in seconds.values())
    # Cancel stopped the run (no result of it kept). The simulation stops within a step (< 1 s: the job
    # tests); on screen it takes a rerun of the page, 0.3-1.3 s here, more when the machine is busy
    assert "Simulation cancelled." in cancelled and cancel_s < 5.0
    # every finished run is a run directory (Simulate's, Compare's three); the cancelled one left none
    assert len(list((root / "dashboard-runs").glob("*/config.yaml"))) == 1 + 3
    print("time to result:", {page: round(t, 1) for page, t in seconds.items()}, "cancel:", round(cancel_s, 2),
          "reload:", round(reopened["reload_s"], 1), "new tab:", round(reopened["new_tab_s"], 1))
