"""kvsim serve's metric exposition (sim/serve/metrics.py) is vLLM's: its light histograms print exactly what
prometheus_client's Histogram prints for the same observations, under vLLM's names, buckets and labels."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram as PromHistogram, generate_latest

from kvsim.sim.core.request import Request
from kvsim.sim.serve.metrics import TTFT_BUCKETS, RequestMetrics, buckets_1_2_5


def _lines(text: bytes, name: str) -> list[str]:
    return [line for line in text.decode().splitlines() if line.startswith(name) and "_created" not in line]


def test_histogram_exposition_equals_prometheus_client():
    values = [0.0005, 0.001, 0.02, 0.0200001, 0.3, 7.5, 3000.0]      # on a bound, just above, past the last
    ours = RequestMetrics("m", 1000, replicas=1)
    for v in values:
        ours.ttft[0].observe(v)
    registry = CollectorRegistry()
    registry.register(ours)
    reference = CollectorRegistry()
    hist = PromHistogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         ["model_name", "engine"], buckets=TTFT_BUCKETS, registry=reference)
    for v in values:
        hist.labels("m", "0").observe(v)
    name = "vllm:time_to_first_token_seconds"
    assert _lines(generate_latest(registry), name) == _lines(generate_latest(reference), name)


def test_request_metrics_follow_vllm_definitions():
    m = RequestMetrics("m", 4096, replicas=2)
    req = Request(request_id=1, arrival_time=1.0, prompt_tokens=100, max_output_tokens=3, replica=1)
    req.first_scheduled_time = 1.25
    req.token_times.extend([1.5, 1.75, 2.25])
    m.tokens(req, 0, 2)
    m.tokens(req, 2, 3)
    m.finished(req, "length", 3)
    assert m.prompt_tokens == [0, 100] and m.generation_tokens == [0, 3] and m.success["length"] == [0, 1]
    assert m.ttft[1].sum == 0.5 and m.itl[1].sum == 0.75 and sum(m.itl[1].counts) == 2
    assert m.queue[1].sum == 0.25 and m.prefill[1].sum == 0.25 and m.decode[1].sum == 0.75
    assert m.e2e[1].sum == 1.25 and m.tpot[1].sum == 0.375 and m.inference[1].sum == 1.0
    assert sum(m.ttft[0].counts) == 0


def test_token_buckets_are_vllms_1_2_5():
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets_1_2_5(4096)[-1] == 2000


def test_serve_refuses_options_that_change_nothing_or_are_wrong(tmp_path):
    from typer.testing import CliRunner

    from kvsim.sim.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["serve", "--time-scale", "0"])
    assert r.exit_code == 2 and "--time-scale 0.0: expected a finite number > 0" in r.output
    r = runner.invoke(app, ["serve", "--stream-interval", "0"])
    assert r.exit_code == 2 and "--stream-interval 0: expected at least 1 token" in r.output
    config = tmp_path / "c.yaml"
    config.write_text("trace_options:\n  request_rate: 4\n")
    r = runner.invoke(app, ["serve", "--config", str(config)])
    assert r.exit_code == 2 and "trace_options: kvsim serve takes its requests from HTTP clients" in r.output


def test_serve_without_its_extra_says_what_to_install():
    import subprocess
    import sys

    blocker = ("import sys, importlib.abc\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] == 'prometheus_client':\n"
               "            raise ImportError(f'{name} is not installed', name=name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "from kvsim.sim.cli import app\n"
               "app(['serve'])\n")
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "kvsim serve needs prometheus_client: pip install 'kvsim[serve]'" in out.stderr
