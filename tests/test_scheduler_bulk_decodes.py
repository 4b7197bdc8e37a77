"""The scheduler's bulk decode paths give the schedule of its request-by-request loop, to the bit.

`Scheduler._schedule_decodes` (every running request decodes and the pool supplies all their slots),
`Scheduler._bulk_decodes` (the requests before the first one that must preempt) and
`KVCacheManager.allocate_decodes` (one call for the batch, also with resumed requests and prefix
caching) must leave the pool, the requests and the step log as `allocate_slots(req, 1)` one request
after another does. The reference run turns every bulk path off (`_all_decode` answers False: each
step goes through `_schedule_running`'s per-request loop); both runs step one at a time (no decode
fast-forward) and check the KV invariants after every step.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from kvsim.sim.config import load_config
from kvsim.sim.core.scheduler import Scheduler
from kvsim.sim.simulator.simulate import run_simulation
from kvsim.traces import Trace
from test_fast_forward_property import assert_bit_identical, engine_configs, traces


def simulate(config: dict, trace: Trace, monkeypatch, bulk: bool):
    with monkeypatch.context() as m:
        if not bulk:
            m.setattr(Scheduler, "_all_decode", lambda self: False)
        return run_simulation(load_config(None, {**config, "fast_forward": False}), trace=trace)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(config=engine_configs(), trace=traces())
def test_bulk_decodes_equal_the_per_request_loop_for_every_feature_mix(config, trace, monkeypatch):
    assert_bit_identical(simulate(config, trace, monkeypatch, True), simulate(config, trace, monkeypatch, False))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bulk_prefix_then_preemption_under_a_full_pool(monkeypatch, async_scheduling):
    # 40 requests decoding long outputs in a pool far too small for them: steps where the pool runs out
    # part way through the batch (bulk prefix, then preemptions from the tail), resumed requests that
    # re-hit their own cached blocks, and async finishes beside them
    n = 40
    rng = np.random.default_rng(3)
    trace = Trace.from_columns(arrival_time_s=np.sort(rng.uniform(0, 0.5, n)),
                               prompt_tokens=rng.integers(20, 120, n), output_tokens=rng.integers(40, 200, n))
    config = {"model": "llama-3.1-8b", "gpu": "l4", "engine.block_size": 16, "engine.num_gpu_blocks": 120,
              "engine.max_num_seqs": 64, "engine.enable_prefix_caching": True,
              "engine.async_scheduling": async_scheduling, "kv.policy": "none", "check_invariants": True}
    stops = []
    original = Scheduler._bulk_decodes

    def spy(self, i, budget, scheduled):
        j, left = original(self, i, budget, scheduled)
        stops.append(j < len(self.running) and left > 0)       # stopped at a request that must preempt
        return j, left

    monkeypatch.setattr(Scheduler, "_bulk_decodes", spy)
    bulk = simulate(config, trace, monkeypatch, True)
    assert any(stops), "no step ran out of blocks part way through the batch"
    assert bulk.summary["preemptions"] > 0
    assert_bit_identical(bulk, simulate(config, trace, monkeypatch, False))
