"""Decode runs that admit arrivals (sim/engine/bulk/admitting_runs.py) give bit-identical results to stepping.

The general fast-forward property test (test_fast_forward_property.py) draws every feature mix, where
runs that admit arrivals are rare (several replicas, bursts, shared prefixes). Here the draws stay
where they happen: one replica, arrivals landing while requests decode, bursts that wait for budget,
prompts around the token budget and the chunk cap, pools that run short, outputs capped at
max_model_len, prefix caching and async scheduling on and off, FCFS and priority queues, and
requests with shared prefix ids (never admitted in a run).
"""
import os

import numpy as np
import pandas as pd
from hypothesis import HealthCheck, given, settings, strategies as st

from kvsim.sim.engine.bulk import admitting_runs
from kvsim.sim.config import load_config
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import Trace

from test_fast_forward_property import assert_bit_identical


@st.composite
def traces(draw) -> Trace:
    n = draw(st.integers(2, 40))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.004, 0.01, 0.03, 0.08, 0.4]), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 120), min_size=n, max_size=n))
    columns = dict(arrival_time_s=np.cumsum(gaps), prompt_tokens=np.array(prompts), output_tokens=np.array(outputs),
                   priority=np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), dtype=np.int64))
    if draw(st.booleans()) and draw(st.booleans()):       # some requests share prefixes
        shared = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        columns["prefix_hash_ids"] = [list(range(-(-p // 32))) if s else [10_000 + i] for i, (p, s)
                                      in enumerate(zip(prompts, shared))]
        columns["prefix_block_tokens"] = 32
    return Trace.from_columns(**columns)


@st.composite
def engine_configs(draw) -> dict:
    block_size = draw(st.sampled_from([4, 16]))
    return {
        "model": "llama-3.1-8b", "gpu": draw(st.sampled_from(["a100-80gb", "h100"])),
        "engine.block_size": block_size,
        "engine.num_gpu_blocks": draw(st.sampled_from([24, 64, 400, 4000])) * 16 // block_size,
        "engine.max_num_seqs": draw(st.sampled_from([3, 8, 64])),
        "engine.max_num_batched_tokens": draw(st.sampled_from([128, 512, 8192])),
        "engine.long_prefill_token_threshold": draw(st.sampled_from([0, 0, 100])),
        "engine.max_model_len": draw(st.sampled_from([None, None, 200])),
        "engine.enable_chunked_prefill": draw(st.booleans()),
        "engine.enable_prefix_caching": draw(st.booleans()),
        "engine.async_scheduling": draw(st.booleans()),
        "engine.preemption_mode": draw(st.sampled_from(["recompute", "swap"])),
        "engine.scheduling_policy": draw(st.sampled_from(["fcfs", "fcfs", "priority"])),
        "kv.policy": "none",
        "check_invariants": True,
    }


def simulate(config: dict, trace: Trace, fast_forward: bool):
    config = {k: v for k, v in config.items() if v is not None}
    return run_simulation(load_config(None, {**config, "fast_forward": fast_forward}), trace=trace)


EXAMPLES = int(os.environ.get("KVSIM_PROPERTY_EXAMPLES", 60))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("KVSIM_PROPERTY_RANDOM"),
          database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(config=engine_configs(), trace=traces())
def test_runs_that_admit_arrivals_equal_stepping(config, trace):
    assert_bit_identical(simulate(config, trace, fast_forward=True), simulate(config, trace, fast_forward=False))


def _count_admissions(monkeypatch) -> list:
    admitted = []
    plan = admitting_runs.plan_admitting

    def counting(*args):
        run = plan(*args)
        admitted.append(len(run.admissions) if run is not None else 0)
        return run
    monkeypatch.setattr("kvsim.sim.engine.loop.plan_admitting", counting)
    return admitted


def test_a_steady_stream_of_arrivals_is_admitted_inside_few_runs(monkeypatch):
    """Arrivals every 30 ms beside long decodes: the runs admit them (stepping's results), not one
    run per arrival gap."""
    admitted = _count_admissions(monkeypatch)
    n = 200
    trace = Trace.from_columns(arrival_time_s=np.arange(n) * 0.03, prompt_tokens=np.full(n, 300),
                               output_tokens=np.full(n, 200))
    config = {"model": "llama-3.1-8b", "gpu": "h100"}
    fast = simulate(config, trace, fast_forward=True)
    assert sum(admitted) > 0.9 * n and len([a for a in admitted if a]) < n / 10
    assert_bit_identical(fast, simulate(config, trace, fast_forward=False))
    steps = fast.steps
    mixed = steps[steps.num_prefill_seqs > 0]
    assert len(mixed) == n and (mixed.prefill_tokens == 300).all()


def test_requests_with_shared_prefixes_are_not_admitted_in_a_run(monkeypatch):
    """A prompt that may hit the prefix cache is admitted by the scheduler's own step."""
    admitted = _count_admissions(monkeypatch)
    n = 40
    trace = Trace.from_columns(arrival_time_s=np.arange(n) * 0.03, prompt_tokens=np.full(n, 64),
                               output_tokens=np.full(n, 100), prefix_hash_ids=[[1, 2]] * n, prefix_block_tokens=32)
    config = {"model": "llama-3.1-8b", "gpu": "h100"}
    fast = simulate(config, trace, fast_forward=True)
    assert sum(admitted) == 0
    pd.testing.assert_frame_equal(fast.requests, simulate(config, trace, fast_forward=False).requests)
