"""Near saturation: the over-capacity detector (sim/results/saturation.py) and client timeouts (--request-timeout)."""
import math

import numpy as np
import pandas as pd
import pytest

from kvsim.sim.config import ConfigError, SimConfig, load_config
from kvsim.sim.core.kv_manager import KVCacheManager
from kvsim.sim.core.request import Request, RequestStatus
from kvsim.sim.core.scheduler import Scheduler, SchedulerConfig
from kvsim.sim.results.saturation import saturation
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces.synthetic import closed_batch


# ---- Scheduler.abort ---------------------------------------------------------------------------
def _scheduler(policy="fcfs", blocks=100):
    return Scheduler(SchedulerConfig(max_model_len=10_000, policy=policy), KVCacheManager(blocks, 4))


def _req(i, prompt=10, output=5, priority=0):
    return Request(request_id=i, arrival_time=float(i), prompt_tokens=prompt, max_output_tokens=output,
                   priority=priority)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_abort_takes_a_waiting_request_out_of_the_queue(policy):
    s = _scheduler(policy)
    reqs = [_req(i, priority=i % 2) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    assert s.abort(reqs[1], 5.0)
    assert reqs[1].status == RequestStatus.ABORTED and reqs[1].is_finished
    assert [r.request_id for r in s.waiting] == [0, 2] and s.aborted == [reqs[1]]
    assert not s.abort(reqs[1], 6.0)             # once


def test_abort_frees_a_running_request_blocks_and_keeps_its_tokens():
    s = _scheduler()
    a, b = _req(0), _req(1)
    s.add_request(a)
    s.add_request(b)
    s.update(s.schedule(), 1.0)
    free_before = s.kv.pool.num_free_blocks
    held = len(s.kv.req_blocks[a])
    assert s.abort(a, 2.0)
    assert a not in s.running and s.kv.pool.num_free_blocks == free_before + held
    assert a.num_output_tokens == 1 and list(a.token_times) == [1.0]
    out = s.schedule()                           # the other one goes on alone
    assert [x.request for x in out.scheduled] == [b]


def test_abort_leaves_a_finished_request_alone():
    s = _scheduler()
    r = _req(0, output=1)
    s.add_request(r)
    s.update(s.schedule(), 1.0)
    assert r.status == RequestStatus.FINISHED and not s.abort(r, 2.0) and not s.aborted


# ---- the detector on hand-built tables ---------------------------------------------------------
def _table(arrivals, starts, finishes, status=None):
    n = len(arrivals)
    return pd.DataFrame({"status": status or ["finished"] * n, "arrival_s": arrivals,
                         "queueing_s": np.asarray(starts) - np.asarray(arrivals), "finish_s": finishes})


def test_a_server_slower_than_the_arrivals_is_over_capacity_at_its_service_rate():
    # 10 req/s offered to a single server that completes 5 req/s
    arrivals = np.arange(400) / 10.0
    finishes = 0.2 * np.arange(1, 401)
    s = saturation(_table(arrivals, finishes - 0.2, finishes))
    assert s["overloaded"] and s["offered_rate_req_s"] == pytest.approx(10.0)
    assert s["sustainable_rate_req_s"] == pytest.approx(5.0, rel=0.02)
    assert s["queue_growth_req_s"] == pytest.approx(5.0, rel=0.05)


def test_a_server_faster_than_the_arrivals_keeps_up():
    arrivals = np.arange(400) / 10.0
    s = saturation(_table(arrivals, arrivals, arrivals + 0.05))
    assert s["overloaded"] is False and s["sustainable_rate_req_s"] is None
    assert s["waiting_at_last_arrival"] == 0


def test_too_few_requests_or_no_arrival_window_is_not_judged():
    assert saturation(_table([0.0] * 50, [0.0] * 50, [1.0] * 50))["overloaded"] is None
    assert saturation(_table([0.0, 1.0], [0.0, 1.0], [1.0, 2.0]))["overloaded"] is None


# ---- in simulations ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("sat") / "batch.jsonl"
    closed_batch(500, 400, 60).save(path)
    return path


def simulate(trace, rate, wrap_kv=None, **options):
    opts = {"request_rate": rate, **options.pop("trace_options", {})}
    cfg = SimConfig.model_validate({"trace": str(trace), "model": "qwen2.5-0.5b", "gpu": "l4",
                                    "engine": {"max_num_seqs": 16}, "trace_options": opts, **options})
    return run_simulation(cfg, None, wrap_kv=wrap_kv)


@pytest.fixture(scope="module")
def capacity(trace):
    """The engine's service rate on this workload, measured far over capacity."""
    flood = simulate(trace, 400.0)
    assert flood.summary["overloaded"]
    return flood.summary["sustainable_rate_req_s"]


def test_the_detector_splits_runs_at_the_engines_capacity(trace, capacity):
    below = simulate(trace, 0.85 * capacity).summary
    above = simulate(trace, 1.2 * capacity).summary
    assert below["overloaded"] is False and below["waiting_at_last_arrival"] < 16
    assert above["overloaded"] is True
    assert above["sustainable_rate_req_s"] == pytest.approx(capacity, rel=0.10)
    assert above["throughput_req_s"] < above["offered_rate_req_s"]


def test_a_client_timeout_aborts_requests_and_counts_them_failed(trace, capacity):
    kvs = []
    run = simulate(trace, 2 * capacity, lambda kv, ex: kvs.append(kv) or (kv, ex),
                   trace_options={"request_timeout": 3.0}, check_invariants=True)
    df, s = run.requests, run.summary
    aborted = df[df["status"] == "aborted"]
    assert len(aborted) > 50 and s["num_aborted"] == len(aborted)
    assert s["failed"] == len(aborted) and s["completed"] == s["num_finished"] == len(df) - len(aborted)
    assert aborted["reject_reason"].str.startswith("client timeout").all()
    done = df[df["status"] == "finished"]
    assert (done["e2e_s"] <= 3.0 + 0.2).all()      # none finished past the timeout (plus a step)
    assert math.isnan(s["mean_ttft_ms"]) is False and s["overloaded"]
    # nothing is left holding blocks at the end
    assert kvs[0].pool.num_used_blocks == 0 and not kvs[0].req_blocks


def test_timeouts_give_the_same_run_stepped_or_fast_forwarded(trace, capacity):
    fast = simulate(trace, 1.5 * capacity, trace_options={"request_timeout": 2.5})
    stepped = simulate(trace, 1.5 * capacity, trace_options={"request_timeout": 2.5}, fast_forward=False)
    assert (fast.requests["status"] == "aborted").sum() > 0
    pd.testing.assert_frame_equal(fast.requests, stepped.requests)
    pd.testing.assert_frame_equal(fast.steps, stepped.steps)


def test_a_closed_loop_client_sends_the_next_request_when_one_times_out(trace):
    run = simulate(trace, float("inf"), trace_options={"max_concurrency": 32, "request_timeout": 0.5})
    s = run.summary
    assert s["num_aborted"] > 0 and s["num_finished"] + s["num_aborted"] == 500


def test_a_request_timeout_needs_time_arrivals():
    with pytest.raises(ConfigError, match="request_timeout needs arrival_unit: time"):
        load_config(None, {"trace_options.request_timeout": 5.0, "trace_options.arrival_unit": "step"})


def test_a_session_cut_short_by_a_rejected_turn_is_judged_on_the_turns_it_sent(tmp_path):
    """A turn that can never fit is rejected, and its session's later turns are never sent (no arrival
    time): the detector judges the requests that were sent instead of failing the run's summary."""
    sets = {"trace": "synthetic-sessions", "trace_options.sessions": {}, "engine.num_gpu_blocks": 400,
            "trace_options.synthetic_sessions.sessions": 30, "trace_options.synthetic_sessions.turns": "fixed:4",
            "trace_options.synthetic_sessions.first_tokens": "uniform:1000,7000",
            "trace_options.synthetic_sessions.user_tokens": "fixed:100",
            "trace_options.synthetic_sessions.output_tokens": "fixed:50",
            "trace_options.synthetic_sessions.think_time_s": 0.0}
    s = run_simulation(load_config(None, sets), tmp_path / "run").summary
    assert s["num_rejected"] > 0 and s["num_unfinished"] > 0           # turns after a rejected one: never sent
    assert s["overloaded"] is not None and s["offered_rate_req_s"] > 0
