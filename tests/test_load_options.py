"""Load options as `vllm bench serve` applies them: --request-rate/--burstiness arrivals for traces without
arrival times, and --max-concurrency (closed loop: an asyncio semaphore of C permits, FIFO)."""
import json
import math

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.config import ConfigError, load_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import Trace
from kvsim.traces.arrivals import vllm_bench_arrivals


def sim(overrides, trace=None, out=None):
    return run_simulation(load_config(None, overrides), out, trace=trace)


def batch(n, prompt, output):
    """n requests at t=0 (a length-only workload) with the given lengths (scalars or arrays)."""
    return Trace.from_columns(arrival_time_s=np.zeros(n), prompt_tokens=np.broadcast_to(prompt, n).copy(),
                              output_tokens=np.broadcast_to(output, n).copy(), name="batch")


def varied(n=60, seed=1):
    rng = np.random.default_rng(seed)
    return batch(n, rng.integers(20, 900, n), rng.integers(1, 200, n))


# ---- arrivals ------------------------------------------------------------------------------------
def test_request_rate_arrivals_end_at_n_over_rate_and_are_seeded():
    t = vllm_bench_arrivals(500, 16.0, 1.0, seed=3)
    assert t[-1] == pytest.approx(500 / 16.0, rel=1e-12)      # vLLM rescales the sum to N / R
    assert t[0] > 0 and np.all(np.diff(t) >= 0)                # the first request waits a gap too
    np.testing.assert_array_equal(t, vllm_bench_arrivals(500, 16.0, 1.0, seed=3))
    assert not np.array_equal(t, vllm_bench_arrivals(500, 16.0, 1.0, seed=4))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_gaps_coefficient_of_variation(burstiness):
    gaps = np.diff(np.r_[0.0, vllm_bench_arrivals(200_000, 10.0, burstiness, seed=0)])
    assert gaps.mean() == pytest.approx(0.1, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.02)


def test_infinite_rate_sends_everything_at_once_and_infinite_burstiness_is_regular():
    assert not vllm_bench_arrivals(7, math.inf).any()
    np.testing.assert_allclose(vllm_bench_arrivals(4, 2.0, math.inf), [0.5, 1.0, 1.5, 2.0])


def test_request_rate_applies_to_a_length_only_trace_run():
    res = sim({"trace": "sharegpt-8k-filtered", "trace_options.max_requests": 40,
               "trace_options.request_rate": 2.0, "trace_options.burstiness": 0.5, "seed": 7})
    arrivals = res.requests["arrival_s"].to_numpy()
    np.testing.assert_allclose(arrivals, vllm_bench_arrivals(40, 2.0, 0.5, seed=7))
    assert arrivals[-1] == pytest.approx(20.0)


def test_request_rate_is_refused_for_a_trace_with_arrival_times():
    with pytest.raises(ConfigError, match="has its own arrival times.*rate_scale"):
        sim({"trace_options.max_requests": 20, "trace_options.request_rate": 5.0})


@pytest.mark.parametrize("over, match", [
    ({"trace_options.burstiness": 2.0}, "burstiness 2 has no effect without request_rate"),
    ({"trace_options.request_rate": 2.0, "trace_options.rate": 2.0}, "request_rate and rate both"),
    ({"trace_options.max_concurrency": 0}, "max_concurrency"),
    ({"trace_options.max_concurrency": 4, "trace_options.arrival_unit": "step"}, "arrival_unit: time"),
])
def test_contradictory_load_options_are_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, over)


# ---- closed loop ---------------------------------------------------------------------------------
def in_flight_at(req: pd.DataFrame, t: float) -> int:
    return int(((req["arrival_s"] <= t) & (t < req["finish_s"])).sum())


@pytest.mark.parametrize("c", [1, 4, 16])
def test_closed_loop_sends_the_next_request_when_one_finishes(c):
    """All queued at t=0 (rate inf): the first C are sent at once, then request C+k is sent exactly when
    the (k+1)-th of the earlier ones finishes (FIFO semaphore), so C are in flight until the queue empties."""
    req = sim({"trace_options.max_concurrency": c}, trace=varied()).requests
    assert (req["status"] == "finished").all()
    sent, finish = req["arrival_s"].to_numpy(), req["finish_s"].to_numpy()
    assert not sent[:c].any()
    np.testing.assert_array_equal(sent[c:], np.sort(finish)[:len(req) - c])
    np.testing.assert_array_equal(req["client_arrival_s"].to_numpy(), 0.0)
    np.testing.assert_array_equal(req["client_queue_s"].to_numpy(), sent)
    for t in sent[c:]:
        assert in_flight_at(req, t) == c
    assert max(in_flight_at(req, t) for t in sent) <= c


def test_concurrency_one_runs_requests_back_to_back_at_single_request_latency():
    trace = varied(12)
    req = sim({"trace_options.max_concurrency": 1}, trace=trace).requests
    np.testing.assert_array_equal(req["arrival_s"].to_numpy()[1:], req["finish_s"].to_numpy()[:-1])
    alone = sim({}, trace=trace.head(1)).requests          # the first request, served alone
    assert req["e2e_s"].iloc[0] == alone["e2e_s"].iloc[0]


def test_closed_loop_latency_is_measured_from_the_send_time():
    """Open loop (everything at t=0) queues inside the engine; the closed loop queues in the client, where
    vLLM's TTFT does not count it."""
    trace = batch(64, 512, 64)
    open_loop = sim({"engine.max_num_seqs": 8}, trace=trace).requests
    closed = sim({"trace_options.max_concurrency": 8}, trace=trace).requests
    assert closed["ttft_s"].max() < 0.2 * open_loop["ttft_s"].max()
    assert closed["client_queue_s"].max() > 0.5 * open_loop["ttft_s"].max()


def test_rate_and_concurrency_together_limit_both():
    n, c = 80, 3
    res = sim({"trace": "sharegpt-8k-filtered", "trace_options.max_requests": n, "trace_options.request_rate": 4.0,
               "trace_options.max_concurrency": c, "seed": 2})
    req = res.requests
    drawn = vllm_bench_arrivals(n, 4.0, 1.0, seed=2)
    np.testing.assert_allclose(req["client_arrival_s"].to_numpy(), drawn)
    sent, finish = req["arrival_s"].to_numpy(), req["finish_s"].to_numpy()
    assert np.all(sent >= drawn)
    waited = sent > drawn
    assert waited.any() and not waited.all()                 # both limits bind somewhere in this run
    for i in np.flatnonzero(waited):                         # sent the moment a slot freed, with C in flight
        assert sent[i] in set(finish[:i])
        assert in_flight_at(req, sent[i]) == c
    assert max(in_flight_at(req, t) for t in sent) <= c


def test_closed_loop_across_replicas_keeps_the_limit():
    req = sim({"trace_options.max_concurrency": 6, "replicas": 2, "router": "least_outstanding"},
              trace=varied(50)).requests
    sent = req["arrival_s"].to_numpy()
    np.testing.assert_array_equal(sent[6:], np.sort(req["finish_s"].to_numpy())[:len(req) - 6])
    assert set(req["replica"]) == {0, 1}


def test_a_rejected_request_frees_its_slot():
    trace = batch(5, [100, 50_000, 200, 300, 120], [20, 10, 30, 5, 7])
    req = sim({"trace_options.max_concurrency": 1, "engine.max_model_len": 4096}, trace=trace).requests
    assert list(req["status"]) == ["finished", "rejected", "finished", "finished", "finished"]
    # the rejected one is answered at once: the next request goes out at the same instant
    assert req["arrival_s"].iloc[1] == req["arrival_s"].iloc[2] == req["finish_s"].iloc[0]


@pytest.mark.parametrize("over", [{"trace_options.max_concurrency": 5},
                                  {"trace_options.max_concurrency": 5, "engine.async_scheduling": False},
                                  {"trace_options.max_concurrency": 2, "engine.num_gpu_blocks": 120}])
def test_closed_loop_fast_forward_is_identical_to_stepping(over):
    trace = varied(40, seed=5)
    fast = sim({**over, "fast_forward": True}, trace=trace)
    slow = sim({**over, "fast_forward": False}, trace=trace)
    pd.testing.assert_frame_equal(fast.requests, slow.requests)


def test_cli_load_options(tmp_path):
    csv = tmp_path / "lengths.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{100 + i},{10 + i}\n" for i in range(30)))
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["simulate", "--trace", str(csv), "--request-rate", "5", "--burstiness", "2",
                                 "--max-concurrency", "4", "--seed", "1", "-q", "-o", str(out)])
    assert r.exit_code == 0, r.output
    req = pd.read_parquet(out / "requests.parquet")
    np.testing.assert_allclose(req["client_arrival_s"], vllm_bench_arrivals(30, 5.0, 2.0, seed=1))
    r = CliRunner().invoke(app, ["simulate", "--trace", str(csv), "--burstiness", "2", "-q", "-o", str(out)])
    assert r.exit_code == 2 and "burstiness 2 has no effect without request_rate" in r.output


def test_cli_infinite_request_rate_and_burstiness_are_accepted_as_documented(tmp_path):
    """`--request-rate inf` (vllm bench serve's default) and `burstiness: .inf` were refused as non-finite."""
    csv = tmp_path / "lengths.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{100 + i},{10 + i}\n" for i in range(6)))
    r = CliRunner().invoke(app, ["simulate", "--trace", str(csv), "--request-rate", "inf", "-q", "-o",
                                 str(tmp_path / "inf")])
    assert r.exit_code == 0, r.output
    assert not pd.read_parquet(tmp_path / "inf" / "requests.parquet")["arrival_s"].any()
    summary = json.loads((tmp_path / "inf" / "summary.json").read_text())
    assert summary["request_rate"] == "inf" and "request_rate" not in summary.get("null_reasons", {})
    r = CliRunner().invoke(app, ["simulate", "--trace", str(csv), "--request-rate", "2", "--set",
                                 "trace_options.burstiness=.inf", "-q", "-o", str(tmp_path / "regular")])
    assert r.exit_code == 0, r.output
    arrivals = pd.read_parquet(tmp_path / "regular" / "requests.parquet")["arrival_s"]
    np.testing.assert_allclose(arrivals, [0.5, 1.0, 1.5, 2.0, 2.5, 3.0])
    for bad in ("nan", "-inf"):
        r = CliRunner().invoke(app, ["simulate", "--trace", str(csv), "--request-rate", bad, "-q", "-o",
                                     str(tmp_path / "bad")])
        assert r.exit_code == 2 and "trace_options.request_rate" in r.output


def test_a_trace_without_arrival_times_run_as_one_batch_says_so(tmp_path):
    csv = tmp_path / "lengths.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens\n100,10\n200,20\n")
    r = CliRunner().invoke(app, ["simulate", "--trace", str(csv), "-q", "-o", str(tmp_path / "a")])
    assert r.exit_code == 0 and "note: all 2 requests arrive at t=0" in r.output
    r = CliRunner().invoke(app, ["simulate", "--trace", str(csv), "--max-concurrency", "1", "-q", "-o",
                                 str(tmp_path / "b")])
    assert r.exit_code == 0 and "note:" not in r.output


@pytest.mark.parametrize("window, match", [
    ({"trace_options.start_s": 1e5}, r"no request of 'azure-conv-2023' arrives in \[100000, inf\) s; its arrivals "
                                     r"span 0 to 3501.72 s"),
    ({"trace_options.start_s": 10.0, "trace_options.end_s": 10.001}, r"arrives in \[10, 10.001\) s"),
    ({"trace_options.start_s": 100.0, "trace_options.end_s": 50.0}, "end_s .50. must be greater than"),
])
def test_a_window_without_requests_is_refused_not_run_as_an_empty_result(window, match):
    """Was: exit 0 with num_requests 0 and every metric null, as if the run had answered something."""
    with pytest.raises(ConfigError, match=match):
        sim({"trace": "azure-conv-2023", **window})
