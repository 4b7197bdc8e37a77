"""The dashboard in a real browser: serve it on loopback, run a small simulation in headless
Chromium (driven over the DevTools protocol) and check the rendered result."""
from __future__ import annotations

import pytest

from sim.config import load_config
from sim.simulate import run_simulation
from dashboard.browser import PLOTS_RENDERED, Browser, chromium_binary, run_simulation_in_browser, serve_dashboard

pytestmark = pytest.mark.skipif(chromium_binary() is None, reason="chromium is not installed")


def test_simulation_renders_in_chromium(tmp_path):
    with serve_dashboard() as url, Browser(1400, 1900) as browser:
        text = run_simulation_in_browser(browser, url)
        shot = browser.screenshot(tmp_path / "dashboard.png")
        charts = browser.eval(PLOTS_RENDERED)
        curves = browser.eval("[...document.querySelectorAll('.js-plotly-plot')].map(p => p.data.length)")
    assert "Summary: #1 azure-conv-2023 Llama-3.1-8B H100-SXM" in text
    expected = run_simulation(load_config(None, {"trace_options.max_requests": 200})).summary  # page defaults
    assert f"{expected['num_finished']} / {expected['num_rejected']}" == "200 / 0"
    assert "200 / 0" in text and f"{expected['throughput_output_tok_s']:.0f} out tok/s" in text
    assert "TTFT CDF" in text and "Queue length" in text
    assert charts >= 6 and all(n >= 1 for n in curves)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
