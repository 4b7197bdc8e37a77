"""Simulator engine end to end: fast-forward equivalence, determinism, invariants, outputs, errors."""
import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from kvsim.sim.cli import app
from kvsim.sim.config import ConfigError, load_config, parse_duration
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import Trace
from kvsim.traces.synthetic import closed_batch


def sim(overrides, trace=None, out=None):
    return run_simulation(load_config(None, overrides), out, trace=trace)


def assert_same_results(a, b):
    pd.testing.assert_frame_equal(a.requests, b.requests)
    cols = [c for c in a.steps.columns if c != "predicted_s"]
    # replicas' rows interleave in emission order; each replica's sequence must match exactly
    sa, sb = (x.steps[cols].sort_values(["replica", "step"]).reset_index(drop=True) for x in (a, b))
    pd.testing.assert_frame_equal(sa, sb, check_dtype=False)


SCENARIOS = {
    "azure-unloaded": {"trace_options.max_requests": 150},
    "memory-pressure": {"trace_options.max_requests": 200, "engine.num_gpu_blocks": 500},
    "prefix-caching": {"trace": "mooncake-conversation", "trace_options.max_requests": 30,
                       "engine.num_gpu_blocks": 3000, "engine.enable_prefix_caching": True},
    "two-replicas": {"trace_options.max_requests": 150, "replicas": 2, "router": "least_outstanding",
                     "trace_options.rate_scale": 4.0},
    "l4-queueing": {"trace_options.max_requests": 200, "gpu": "l4"},
    "swap": {"trace_options.max_requests": 150, "engine.num_gpu_blocks": 700, "engine.preemption_mode": "swap",
             "engine.swap_space_gib": 0.05},
    # issue 19: the first swap preemption with prefix caching made the two disagree from step 8 on
    "prefix-caching-swap": {"trace": "mooncake-conversation", "trace_options.max_requests": 300, "gpu": "l4",
                            "engine.num_gpu_blocks": 3000, "engine.enable_prefix_caching": True,
                            "engine.preemption_mode": "swap"},
    "seq-limit": {"trace_options.max_requests": 150, "engine.max_num_seqs": 8, "trace_options.rate_scale": 3.0},
    "tp-70b": {"trace_options.max_requests": 100, "model": "llama-3.1-70b", "gpu": "a100-80gb", "tp": 4},
    "sync-no-prefix-caching": {"trace_options.max_requests": 200, "engine.num_gpu_blocks": 500,
                               "engine.async_scheduling": False, "engine.enable_prefix_caching": False},
    "async-offline-defaults": {"trace_options.max_requests": 200, "engine.num_gpu_blocks": 600,
                               "engine.entry_point": "offline", "engine.long_prefill_token_threshold": 256},
    "arrivals-by-step": {"trace_options.max_requests": 120, "trace_options.arrival_unit": "step",
                         "engine.num_gpu_blocks": 500},
    "cpu-padded-profile": {"trace_options.max_requests": 8, "model": "smollm2-135m", "gpu": "cpu-2core",
                           "profile": "cpu-smollm2", "engine.num_gpu_blocks": 400},
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_fast_forward_gives_identical_results_to_stepping(name):
    over = SCENARIOS[name]
    fast = sim({**over, "fast_forward": True})
    slow = sim({**over, "fast_forward": False})
    assert_same_results(fast, slow)
    assert fast.summary["num_finished"] + fast.summary["num_rejected"] == len(fast.requests)


@pytest.mark.parametrize("name", ["two-replicas", "memory-pressure", "fast-eviction-two-replicas"])
def test_clock_moved_without_events_gives_the_results_of_a_timeout_per_step(name, monkeypatch):
    # a replica moves simpy's clock itself when nothing else is due before its step ends
    from kvsim.sim.engine import loop as engine
    over = SCENARIOS.get(name) or {"trace": "sharegpt-8k-filtered", "trace_options.max_requests": 60, "gpu": "l4",
                                   "replicas": 2, "router": "least_outstanding", "kv.policy": "h2o",
                                   "kv.budget": 128, "kv.layout": "per_head", "kv.mode": "fast"}
    advanced = sim(over)
    real_init = engine.EngineClock.__init__
    monkeypatch.setattr(engine.EngineClock, "__init__", lambda self: real_init(self, event_per_step=True))
    assert_same_results(advanced, sim(over))


def test_engine_clock_moves_only_when_nothing_is_due_before():
    from kvsim.sim.engine.loop import EngineClock
    clock = EngineClock()
    clock.timeout(2.0)
    assert clock.advance_to(1.5) and clock.now == 1.5
    assert not clock.advance_to(2.0) and clock.now == 1.5      # a tie: the pending event goes first
    clock.step()
    assert clock.now == 2.0
    assert not EngineClock(event_per_step=True).advance_to(1.0)


@pytest.mark.parametrize("model,gpu,tp", [("llama-3.1-8b", "h100", 1), ("llama-3.1-70b", "a100-80gb", 4),
                                          ("qwen2.5-32b", "l4", 2), ("smollm2-135m", "cpu-2core", 1)])
def test_decode_run_pricing_is_bit_identical_to_step_pricing(model, gpu, tp):
    from kvsim.sim.model.cost_model import CostModel
    from kvsim.sim.core.step import BatchShape

    cost = CostModel(model, gpu, tp=tp)
    rng = np.random.default_rng(0)
    seqs = rng.integers(1, 256, 64).astype(np.float64)
    kv_read = seqs * rng.integers(1, 8000, 64)
    entries = np.ceil(kv_read / 16)
    run = cost.predict_decode(seqs, kv_read, entries)
    for i in range(64):
        step = cost.predict(BatchShape(num_seqs=int(seqs[i]), num_decode_tokens=int(seqs[i]),
                                       kv_tokens_read=int(kv_read[i]), block_table_entries=int(entries[i])))
        assert run[i] == step            # exact: the fast-forward must price steps as stepping does


def test_memory_pressure_preempts_and_conserves_tokens():
    r = sim({**SCENARIOS["memory-pressure"], "check_invariants": True})
    assert r.summary["preemptions"] > 0
    done = r.requests[r.requests.status == "finished"]
    assert len(done) == 200
    assert (done.output_tokens == [len(t) for t in done.token_times_s]).all()
    last = r.steps.iloc[-1]
    assert last.blocks_used == 0 and last.blocks_free == 499     # every block free at the end (one is null)


def test_same_seed_same_results_bit_for_bit(tmp_path):
    over = {"trace_options.max_requests": 150, "engine.num_gpu_blocks": 600}
    a = sim(over, out=tmp_path / "a")
    b = sim(over, out=tmp_path / "b")
    assert_same_results(a, b)
    for f in ("requests.parquet", "steps.parquet"):
        assert pd.read_parquet(tmp_path / "a" / f).equals(pd.read_parquet(tmp_path / "b" / f))


def test_closed_batch_is_limited_by_max_num_seqs_and_finishes_together():
    trace = closed_batch(16, prompt_tokens=256, output_tokens=32)
    r = sim({"engine.max_num_seqs": 8, "engine.num_gpu_blocks": 4000}, trace=trace)
    assert r.steps.batch_size.max() == 8
    first_wave = r.requests.nsmallest(8, "request_id")
    assert first_wave.finish_s.nunique() == 1                    # same start, same length, same end
    assert (r.requests.queueing_s.iloc[8:] > 0).all()


def test_requests_that_can_never_fit_are_rejected_in_the_results():
    trace = Trace.from_columns(arrival_time_s=np.array([0.0, 0.1]), prompt_tokens=np.array([100, 5000]),
                               output_tokens=np.array([10, 10]))
    r = sim({"engine.num_gpu_blocks": 64, "engine.block_size": 16}, trace=trace)
    rej = r.requests[r.requests.status == "rejected"]
    assert rej.request_id.tolist() == [1]
    assert "whole KV pool holds 1008 tokens" in rej.reject_reason.iloc[0]     # 63 blocks: one is the null block
    assert r.summary["num_rejected"] == 1 and r.summary["num_finished"] == 1


def test_latency_metrics_are_consistent():
    r = sim({"trace_options.max_requests": 100})
    d = r.requests
    assert (d.ttft_s >= d.queueing_s).all() and (d.e2e_s >= d.ttft_s).all()
    np.testing.assert_allclose(d.first_token_s, [t[0] for t in d.token_times_s])
    s = r.summary
    assert s["ttft_p50_s"] <= s["ttft_p90_s"] <= s["ttft_p99_s"]
    assert 0 < s["kv_util_mean"] <= s["kv_util_max"] <= 1
    assert s["throughput_output_tok_s"] == pytest.approx(d.output_tokens.sum() / s["makespan_s"])


def test_cli_simulate_writes_outputs(tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["simulate", "--trace", "azure-conv-2023", "--model", "llama-3.1-8b",
                                   "--gpu", "h100", "--max-requests", "50", "-o", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    for f in ("requests.parquet", "steps.parquet", "summary.json", "config.yaml"):
        assert (out / f).exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_finished"] == 50 and summary["num_gpu_blocks"] > 10_000
    again = CliRunner().invoke(app, ["simulate", "-c", str(out / "config.yaml"), "-o", str(tmp_path / "r2"), "-q"])
    assert again.exit_code == 0
    assert json.loads((tmp_path / "r2" / "summary.json").read_text())["num_steps"] == summary["num_steps"]


@pytest.mark.parametrize("args, message", [
    (["--num-gpu-blocks", "0"], "engine.num_gpu_blocks"),
    (["--block-size", "24"], "power of two"),
    (["--model", "llama-9"], "unknown model 'llama-9'"),
    (["--gpu", "h900"], "unknown gpu"),
    (["--slo-ttft", "2"], "not a duration with a unit"),
    (["--set", "engine.bogus=1"], "engine.bogus"),
    (["--router", "random"], "router"),
    (["--policy", "pyramidkv"], "needs kv.layout=per_head"),
    (["--policy", "snapkv", "--set", "kv.params.kernel_size=4"], "kernel_size"),
])
def test_bad_configs_fail_with_a_clear_message(args, message, tmp_path):
    res = CliRunner().invoke(app, ["simulate", "--max-requests", "5", "-o", str(tmp_path), "-q", *args])
    assert res.exit_code == 2
    assert message in res.output


def test_duration_parsing():
    assert parse_duration("100ms") == pytest.approx(0.1)
    assert parse_duration("2s") == 2.0
    with pytest.raises(ConfigError):
        parse_duration("100")


def test_mooncake_hash_ids_drive_prefix_hits():
    over = {"trace": "mooncake-conversation", "trace_options.max_requests": 120, "engine.num_gpu_blocks": 20000}
    cached = sim(over)                                           # prefix caching is on by default
    plain = sim({**over, "engine.enable_prefix_caching": False})
    assert cached.summary["prefix_hit_rate"] > 0.02 and plain.summary["prefix_hit_rate"] == 0
    assert cached.requests.cached_tokens.sum() > 0
    # served prefixes are not recomputed: less prefill work, earlier first tokens
    assert cached.steps.prefill_tokens.sum() < plain.steps.prefill_tokens.sum()
    assert cached.summary["ttft_p50_s"] < plain.summary["ttft_p50_s"]


def test_a_config_error_states_the_value_once():
    """A check whose message already says what it got is not followed by a second '(got ...)'."""
    from pydantic import ValidationError

    from kvsim.sim.config import EngineConfig, validation_message
    with pytest.raises(ValidationError) as exc:
        EngineConfig(block_size=7)
    message = validation_message(exc.value)
    assert message.count("got 7") == 1 and "power of two" in message
    with pytest.raises(ValidationError) as exc:
        EngineConfig(max_num_seqs=-3)
    assert "(got -3)" in validation_message(exc.value)          # pydantic's own checks still say it
