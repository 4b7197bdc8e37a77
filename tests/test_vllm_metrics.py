"""summary.json and the printed report in `vllm bench serve`'s vocabulary (names, units, statistics)."""
import math

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.results.metrics import REQUEST_COLUMNS
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.sim.results.vllm_metrics import bench_metrics, report_lines


def table(rows):
    """A request table (sim.results.metrics.request_table's columns) from (sent, token times, prompt, status)."""
    out = []
    for i, (sent, times, prompt, status) in enumerate(rows):
        t = np.array(times, dtype=float)
        done = status == "finished"
        out.append({"request_id": i, "status": status, "arrival_s": sent, "prompt_tokens": prompt,
                    "output_tokens": len(t), "token_times_s": t,
                    "first_token_s": t[0] if len(t) else math.nan, "finish_s": t[-1] if done else math.nan})
    df = pd.DataFrame(out)
    df["ttft_s"] = df["first_token_s"] - df["arrival_s"]
    df["e2e_s"] = df["finish_s"] - df["arrival_s"]
    n = df["output_tokens"].astype(float)
    df["tpot_s"] = np.where(n > 1, (df["finish_s"] - df["first_token_s"]) / (n - 1), math.nan)
    return df


ROWS = [(0.0, [0.1, 0.2, 0.4], 10, "finished"),       # ttft 100 ms, itl 100/200, tpot 150, e2el 400
        (0.3, [1.0], 20, "finished"),                 # ttft 700, one token: no tpot, no itl
        (1.0, [1.3, 1.4, 1.5, 1.9], 30, "finished"),  # ttft 300, itl 100/100/400, tpot 200, e2el 900
        (1.2, [], 99999, "rejected")]


def test_hand_computed_bench_metrics():
    m = bench_metrics(table(ROWS), start_s=0.0, percentiles=(50, 99.9), slo_ttft_s=0.4, slo_tpot_s=None)
    assert m["duration"] == 1.9 and m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(3 / 1.9)
    assert m["output_throughput"] == pytest.approx(8 / 1.9)
    assert m["total_token_throughput"] == pytest.approx(68 / 1.9)
    assert m["request_goodput"] == pytest.approx(2 / 1.9)                 # ttft 100 and 300 ms within 400
    assert m["mean_ttft_ms"] == pytest.approx(1100 / 3) and m["median_ttft_ms"] == pytest.approx(300)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 700, 300]))     # population std, as numpy/vLLM
    assert m["mean_tpot_ms"] == pytest.approx(175)                         # one-token request left out
    itl = [100, 200, 100, 100, 400]
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itl)) and m["median_itl_ms"] == pytest.approx(100)
    assert m["p99.9_itl_ms"] == pytest.approx(np.percentile(itl, 99.9))
    assert m["p50_e2el_ms"] == pytest.approx(700) and m["mean_e2el_ms"] == pytest.approx(2000 / 3)
    assert m["max_concurrent_requests"] == 2              # [0, .4) and [.3, 1) overlap; [1, 1.9) starts as one ends
    assert m["max_output_tokens_per_s"] == 5              # second [1, 2): tokens at 1.0, 1.3, 1.4, 1.5, 1.9


def test_report_lines_follow_vllm_layout():
    s = bench_metrics(table(ROWS), start_s=0.0, percentiles=(99,))
    lines = report_lines(s)
    assert lines[0] == "============ Serving Benchmark Result ============" and lines[-1] == "=" * 50
    assert "Successful requests:                     3         " in lines
    assert any(line.startswith("P99 ITL (ms):") for line in lines)
    assert "----------------End-to-end Latency----------------" in lines


def test_run_summary_carries_vllm_keys_consistent_with_kvsim_keys(tmp_path):
    cfg = load_config(None, {"trace_options.max_requests": 200, "metric_percentiles": "50,90,99"})
    s = run_simulation(cfg).summary
    for q in (50, 90, 99):
        for vllm, own in (("ttft", "ttft"), ("tpot", "tpot"), ("e2el", "e2e"), ("itl", "itl")):
            assert s[f"p{q}_{vllm}_ms"] == pytest.approx(1e3 * s[f"{own}_p{q}_s"], rel=1e-12)
    assert s["median_ttft_ms"] == s["p50_ttft_ms"] and s["mean_ttft_ms"] == pytest.approx(1e3 * s["ttft_mean_s"])
    assert s["completed"] == s["num_finished"] == 200
    # the shipped traces start at t=0: vLLM's duration is kvsim's makespan
    assert s["duration"] == s["makespan_s"] and s["request_throughput"] == pytest.approx(s["throughput_req_s"])


def test_request_rate_duration_counts_from_the_benchmark_start():
    s = run_simulation(load_config(None, {"trace": "sharegpt-8k-filtered", "trace_options.max_requests": 30,
                                          "trace_options.request_rate": 1.0})).summary
    assert s["duration"] > s["makespan_s"]                 # the first request waited one gap after t=0
    assert s["request_rate"] == 1.0 and s["burstiness"] == 1.0 and "max_concurrency" not in s


@pytest.mark.parametrize("value", ["50,x", "101", [], "-1"])
def test_bad_metric_percentiles(value):
    with pytest.raises(ConfigError, match="metric_percentiles"):
        load_config(None, {"metric_percentiles": value})


def test_cli_prints_the_vllm_report(tmp_path):
    r = CliRunner().invoke(app, ["simulate", "--max-requests", "30", "--max-concurrency", "4",
                                 "--metric-percentiles", "90,99", "-o", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    for line in ("Serving Benchmark Result", "Maximum request concurrency:", "P90 TTFT (ms):", "P99 E2EL (ms):",
                 "Total generated tokens:"):
        assert line in r.output
    assert "client_queue_s" not in REQUEST_COLUMNS        # only with a concurrency limit (test_load_options)
